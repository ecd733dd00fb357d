#!/bin/bash
# A/B: p3's step agreement left in flight (new, 16th pass) against waited in step() (old: d9f84d4), alternating.
# NEW: a checkout with .venv (make setup); OLD: `git worktree add OLD d9f84d4`; OUT: where the JSON goes.
set -u
mkdir -p "$OUT"
. "$NEW"/.venv/bin/activate
cd /tmp
for i in 1 2 3; do
  for tree in new old; do
    if [ $tree = old ]; then export PYTHONPATH="$OLD"; else export PYTHONPATH="$NEW"; fi
    rm -f /dev/shm/mpich_shm_* 2>/dev/null
    python -m jobs bench strategies --compute emulated:v100 --models resnet50-224 --bandwidths 2.5gbit,10gbit \
      --carry-at 1gbit --hosts 4 --rounds 1 --strategies p3,ddp --batches 2 --iters 1 --warmup 1 \
      --json "$OUT"/$tree-$i.json > "$OUT"/$tree-$i.log 2>&1
    echo "$tree $i rc=$?" >> "$OUT"/done
  done
done
