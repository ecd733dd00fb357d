#!/bin/bash
# allreduce,wfbp on 8 emulated hosts x 1: the default UCX socket buffers (A) against UCX_TCP_SNDBUF=512kb (B),
# alternated three times; the JSON lands beside this script (allreduce-wfbp-A1.json ...), read by summary.py. As root.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.." && { [ -f .venv/bin/activate ] && . .venv/bin/activate || true; }
for i in 1 2 3; do
  for v in A B; do
    if [ $v = B ]; then export UCX_TCP_SNDBUF=512kb; else unset UCX_TCP_SNDBUF; fi
    mpitrain bench strategies --compute emulated:v100 --models resnet50-224 --batch-size 64 --hosts 8 \
      --bandwidths 1gbit,10gbit --carry-at 1gbit --strategies allreduce,wfbp --rounds 1 --batches 2 --iters 2 \
      --warmup 1 --json "$HERE/allreduce-wfbp-$v$i.json" || exit 1
  done
done
