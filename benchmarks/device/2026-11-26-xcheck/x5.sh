#!/usr/bin/env bash
R=/tmp/res5; mkdir -p $R; exec > >(tee -a $R/log) 2>&1
pack() { tar czf $OUT/res5.tgz -C /tmp res5; }
trap pack EXIT
T0=$(date +%s); el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1
P=.device-carry/prof
B="python -m jobs bench strategies --local --hosts 1 --ranks-per-host 1 --rounds 3 --batches 4 --iters 2 --warmup 2 --timeout 100"
el real transformer
timeout 110 $B --device cuda --models transformer-big --batch-size 64 --strategies allreduce,wfbp,p3,ddp --json $R/real-tf.json 2>&1 | grep "^| transformer\|rror" | head -4
pack
el emulated transformer
timeout 100 $B --models transformer-big --batch-size 64 --strategies allreduce,wfbp,p3,ddp --compute emulated:$P/transformer-big-b64-h100-tf32.json --json $R/emu-tf.json 2>&1 | grep "^| transformer\|rror\|bound by" | head -6
pack
el emulated vgg warning
timeout 60 $B --models vgg19-224 --batch-size 32 --strategies p3 --rounds 1 --compute emulated:$P/vgg19-224-b32-h100-tf32.json --json $R/emu-vgg-p3.json 2>&1 | grep "^| vgg\|rror\|bound by" | head -4
el done
