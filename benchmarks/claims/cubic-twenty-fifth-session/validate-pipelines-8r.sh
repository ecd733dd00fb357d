#!/bin/bash
# The 8-rank pipeline grid of target 5 with the emulated hosts on CUBIC: the root namespace's default set for the
# run (new namespaces take it; `jobs.simulate --validate` has no --congestion-control) and put back after. As root.
cd "$(dirname "$0")/../../.." && . .venv/bin/activate
BEFORE=$(sysctl -n net.ipv4.tcp_congestion_control); ALLOWED=$(sysctl -n net.ipv4.tcp_allowed_congestion_control)
trap 'sysctl -qw net.ipv4.tcp_congestion_control="$BEFORE"; sysctl -qw net.ipv4.tcp_allowed_congestion_control="$ALLOWED"' EXIT
sysctl -qw net.ipv4.tcp_allowed_congestion_control="reno bbr cubic"
sysctl -qw net.ipv4.tcp_congestion_control=cubic
python -m jobs.simulate --validate --compute emulated:1080ti --compute-scale 10 --bandwidths 100mbit,250mbit,1gbit \
  --ranks 8 --models vgg19 --pipeline-models vgg19 \
  --strategies pipeline-flush,pipeline-vanilla,pipeline-stash,pipeline-spectrain --rounds 5 --batches 4 --iters 1 \
  --warmup 1 --baseline pipeline-flush \
  --json benchmarks/claims/validation-grid-pipelines-vgg19-8r-twenty-fifth-session-cubic.json
