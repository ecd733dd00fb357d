#!/bin/bash
# STRATEGIES on emulated hosts: the default UCX socket buffers (A) against UCX_TCP_SNDBUF=512kb (B), alternated three
# times, ROUNDS rounds each; the JSON lands beside this script (NAME-A1.json ...), read by summary.py. As root:
#   bash run.sh p3,ddp 2 p3-ddp-8x1                  (8 hosts x 1, 1 and 10 Gbit/s carried at 1: the default cluster)
#   bash run.sh allreduce,wfbp 1 allreduce-wfbp-8x1
#   bash run.sh p3,ddp 2 p3-ddp-4x2 --hosts 4 --ranks-per-host 2 --bandwidths 1gbit
set -u
STRATEGIES=$1 ROUNDS=$2 NAME=$3
shift 3
CLUSTER=("$@")
[ ${#CLUSTER[@]} -gt 0 ] || CLUSTER=(--hosts 8 --bandwidths 1gbit,10gbit --carry-at 1gbit)
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.." && { [ -f .venv/bin/activate ] && . .venv/bin/activate || true; }
for i in 1 2 3; do
  for v in A B; do
    if [ $v = B ]; then export UCX_TCP_SNDBUF=512kb; else unset UCX_TCP_SNDBUF; fi
    mpitrain bench strategies --compute emulated:v100 --models resnet50-224 --batch-size 64 "${CLUSTER[@]}" \
      --strategies "$STRATEGIES" --rounds "$ROUNDS" --batches 2 --iters 2 --warmup 1 --json "$HERE/$NAME-$v$i.json" \
      || exit 1
  done
done
