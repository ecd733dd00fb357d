#!/bin/bash
# Where p3's exchange spends the CPU on the emulated 4 hosts x 2 at 1 Gbit/s: ResNet-50 224's gradient (auto's
# settings there: 1.24 MiB slices, credit 4, 1 ms relaxed poll, node pushes paced at 240 MB/s), the exchange alone
# (benchmarks/claims/p3_exchange_alone.py), ranks 0 and 1 (one host) sampled by py-spy with native frames.
# As root, with py-spy installed (pip install py-spy): bash run.sh; then python summary.py /tmp/p3-spy-0.txt
# (this session's samples: p3-spy-{0,1}.txt.gz here)
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.." && { [ -f .venv/bin/activate ] && . .venv/bin/activate || true; }
cat > /tmp/p3-spy.sh <<'SH'
#!/bin/bash
if [ "${PMI_RANK:-}" = "0" ] || [ "${PMI_RANK:-}" = "1" ]; then
  exec py-spy record --native --idle -r 200 -f raw -o "/tmp/p3-spy-$PMI_RANK.txt" -- "$@"
fi
exec "$@"
SH
chmod +x /tmp/p3-spy.sh
mpitrain cluster up --hosts 4 --bandwidth 1gbit --ranks-per-host 2
mpitrain cluster run -n 8 -- env NODES=1 MODEL=resnet50-224 RELAXED=0.001 STEPS=8 LOCAL_RATE=240000000 \
  /tmp/p3-spy.sh python benchmarks/claims/p3_exchange_alone.py 324608 4
mpitrain cluster down
