#!/usr/bin/env bash
# Issue 27 target 5's 8-rank column on the box's 16 cores, 2026-11-27: command AO at 8 ranks, 1 Gbit/s, dense strategies.
exec > >(tee -a $OUT/log) 2>&1
T0=$(date +%s); el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
el grid8
timeout 245 python -m jobs simulate --validate --compute emulated:v100 --models resnet50-224 --batch-size 64 --ranks 8 \
    --bandwidths 1gbit --carry-at 1gbit --calibration benchmarks/claims/validation-grid-pipelines-calibration.json \
    --strategies allreduce,wfbp,p3,hybcomm --rounds 2 --batches 2 --iters 1 --warmup 1 \
    --json $OUT/validation-grid-resnet50-v100-8r-1gbit-box.json 2>&1 | tail -n 60
el done
