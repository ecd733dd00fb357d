#!/bin/bash
# p3 against torch DDP on the emulated 4 hosts x 2 at 1 Gbit/s (ResNet-50 224, V100 model, batch 64): the hosts' TCP
# on the machine's BBR (A) against Linux's default CUBIC (B), alternated three times, ROUNDS rounds each. New
# namespaces take the root namespace's congestion control, so B sets it there for the run and puts it back after.
# As root: bash run.sh [ROUNDS]; then python summary.py.
set -u
ROUNDS=${1:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.." && { [ -f .venv/bin/activate ] && . .venv/bin/activate || true; }
BEFORE=$(sysctl -n net.ipv4.tcp_congestion_control)
trap 'sysctl -qw net.ipv4.tcp_congestion_control="$BEFORE"' EXIT
sysctl -qw net.ipv4.tcp_allowed_congestion_control="reno bbr cubic"
for i in 1 2 3; do
  for v in A B; do
    if [ $v = B ]; then cc=cubic; else cc=bbr; fi
    sysctl -qw net.ipv4.tcp_congestion_control=$cc
    mpitrain bench strategies --compute emulated:v100 --models resnet50-224 --batch-size 64 --hosts 4 \
      --ranks-per-host 2 --bandwidths 1gbit --strategies p3,ddp --rounds "$ROUNDS" --batches 2 --iters 2 --warmup 1 \
      --json "$HERE/p3-ddp-4x2-$v$i.json" || exit 1
  done
done
