#!/usr/bin/env bash
# For the next GPU lease (about 4 minutes on one H200 and 16 cores; root, for the emulated cluster). From the project
# root there: bash .device-carry/run.sh bash benchmarks/device/p3-real-gap.sh   (results under $OUT, else results/)
#
# Why: on 2026-12-04 (benchmarks/device/2026-12-04) p3's exchange alone took 0.219 s on the real CUDA path at
# 2 hosts x 2, ResNet-50, 10 Gbit/s: 1.9x its emulation (0.118 s) and 1.6x wfbp's real 0.136 s. Two leads, each
# answered by one comparison here, all contenders interleaved in each run:
#  - four processes time-slicing the one GPU (no MPS), p3's many small copies back between the others' kernels:
#    2 ranks (2 hosts x 1) against 4 (2 hosts x 2);
#  - the slice-by-slice copies back: p3's auto slice (1.81 MiB there) against 4 MiB slices (p3@1048576/auto).
# Then a timeline of p3's real training steps, 4 ranks, to read where the time goes (python -m jobs: the box
# has no `mpitrain` script).
set -uo pipefail
out=${OUT:-results/p3-real-gap}; mkdir -p "$out"
common=(--device cuda --batch-size 32 --bandwidths 10gbit --models resnet50-224 --rounds 3 --batches 2 --iters 2
        --warmup 1 --timeout 200 --strategies wfbp,p3,p3@1048576/auto,ddp)
python -m jobs.bench.strategies "${common[@]}" --hosts 2 --ranks-per-host 2 --json "$out/p3-real-2x2.json"
python -m jobs.bench.strategies "${common[@]}" --hosts 2 --ranks-per-host 1 --json "$out/p3-real-2x1.json"
python -m jobs cluster up --hosts 2 --bandwidth 10gbit --ranks-per-host 2
python -m jobs cluster run -n 4 -- python -m jobs train --device cuda --model resnet50-224 --data synthetic --strategy p3 \
    --batch-size 32 --max-steps 8 --epochs 1 --timeline "$out/p3-real-timeline.json" --no-progress
python -m jobs cluster down
