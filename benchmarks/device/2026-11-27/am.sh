#!/usr/bin/env bash
# Issue 27 target 3 cross-check on the box's 16 cores, 2026-11-27: command AM (emulated V100), 2x2 and 4x2, 1 Gbit/s.
exec > >(tee -a $OUT/log) 2>&1
T0=$(date +%s); el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
for h in 4 2; do
  el "AM ${h}x2"
  timeout 200 python -m jobs.bench --compute emulated:v100 --models resnet50-224 --bandwidths 1gbit --hosts $h \
    --ranks-per-host 2 --strategies allreduce,topk,hier-topk --density 0.001 --rounds 5 --batches 2 --iters 1 \
    --warmup 1 --json $OUT/mstopk-resnet50-224-v100-${h}x2-1gbit-box.json 2>&1 | grep -a "^| \|rror\|arning" | head -20
  python -m jobs.cluster down >/dev/null 2>&1
done
el done
