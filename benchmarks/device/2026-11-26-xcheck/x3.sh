#!/usr/bin/env bash
# This session's GPU checks (run through run.sh): H100 profiles with their copy rate, one rank real vs emulated, gpu tests.
R=/tmp/res; mkdir -p $R/prof; exec > >(tee -a $R/log) 2>&1
pack() { tar czf $OUT/res.tgz -C /tmp res; }
trap pack EXIT
T0=$(date +%s); el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
el start; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc; git log --oneline -1 2>/dev/null
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1
el profiles
for mb in vgg19-224:32 resnet50-224:32 transformer-big:64; do
  m=${mb%%:*}; b=${mb##*:}
  timeout 70 python -m jobs.simulate --take-profile --device cuda --model $m --batch-size $b \
     --out $R/prof/$m-b$b-h100-tf32.json --timeout 65 2>&1 | tail -2
  python -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], 'step', d['step_s'], 'copy_gbs', d.get('copy_gbs'))" $R/prof/$m-b$b-h100-tf32.json
done
pack
el real
B="python -m jobs.bench strategies --local --hosts 1 --ranks-per-host 1 --strategies allreduce,wfbp,p3 --rounds 3 --batches 4 --iters 2 --warmup 2 --timeout 150"
timeout 170 $B --device cuda --models vgg19-224,resnet50-224 --batch-size 32 --json $R/real-b32.json 2>&1 | grep "^| \|devices\|Error\|error" | head -12
pack
el emulated
for m in vgg19-224 resnet50-224; do
  timeout 100 $B --models $m --batch-size 32 --compute emulated:$R/prof/$m-b32-h100-tf32.json --json $R/emu-$m.json 2>&1 | grep "^| $m\|Error\|error" | head -4
done
pack
el tests
timeout 130 python -m pytest -m "gpu and not mpi" -p no:cacheprovider -q --timeout 120 -n 4 -rfE > $R/tests-serial.log 2>&1
echo "serial rc=$?" >> $R/tests-serial.log; tail -8 $R/tests-serial.log
el done
