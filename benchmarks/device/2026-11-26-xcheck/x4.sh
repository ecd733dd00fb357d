#!/usr/bin/env bash
R=/tmp/res4; mkdir -p $R; exec > >(tee -a $R/log) 2>&1
pack() { tar czf $OUT/res4.tgz -C /tmp res4; }
trap pack EXIT
T0=$(date +%s); el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1
P=.device-carry/prof
B="python -m jobs bench strategies --local --hosts 1 --ranks-per-host 1 --strategies allreduce,wfbp,p3 --rounds 3 --batches 4 --iters 2 --warmup 2 --timeout 150"
for round in 1 2; do
el real $round
timeout 170 $B --device cuda --models vgg19-224,resnet50-224 --batch-size 32 --json $R/real-b32-$round.json 2>&1 | grep "^| \|devices\|rror" | head -12
pack
el emulated $round
for m in vgg19-224 resnet50-224; do
  timeout 100 $B --models $m --batch-size 32 --compute emulated:$P/$m-b32-h100-tf32.json --json $R/emu-$m-$round.json 2>&1 | grep "^| $m\|rror" | head -4
done
pack
done
el done
