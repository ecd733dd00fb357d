#!/usr/bin/env bash
# Issue 29 on the box, 2026-11-27: the gpu tests on today's code and the findings' job-level reproducers.
exec > >(tee -a $OUT/log) 2>&1
mkdir -p /tmp/g29; trap 'tar czf $OUT/runs.tgz -C /tmp g29' EXIT
T0=$(date +%s); el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
el start; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
el tests
( timeout 150 mpiexec -n 4 python -m mpi4py -m pytest -m "gpu and mpi" -p no:cacheprovider -q --timeout 120 -rfE \
   > $OUT/tests-mpi.log 2>&1; echo "mpi rc=$?" >> $OUT/tests-mpi.log ) &
P1=$!
timeout 170 python -m pytest -m "gpu and not mpi" -p no:cacheprovider -q --timeout 150 -n 4 -rfE > $OUT/tests-serial.log 2>&1
echo "serial rc=$?" >> $OUT/tests-serial.log
wait $P1
tail -n 8 $OUT/tests-serial.log; grep -a "passed\|failed\|FAILED\|rc=" $OUT/tests-mpi.log | sort | uniq -c | head -20
T="--device cuda --data synthetic --epochs 1 --max-steps 4 --no-progress"
run() { local n=$1; shift; el "$*"; timeout 60 "$@" > /tmp/g29/$n.log 2>&1; echo "rc=$?"; grep -a -v "^\s*$" /tmp/g29/$n.log | tail -n 6; }
run topk mpiexec -n 4 python -m jobs train $T --model resnet50 --batch-size 32 --strategy topk
run hiertopk-pto mpiexec -n 4 python -m jobs train $T --model resnet50 --batch-size 32 --strategy hier-topk --pto --optimizer adam
run hybcomm-sfb mpiexec -n 4 python -m jobs train $T --model vgg19-22k --batch-size 16 --strategy hybcomm --hybcomm-force sfb
run lstm-flush mpiexec -n 4 python -m jobs train $T --model char-lstm --parallel pipeline --pipeline-mode flush --microbatches 4
run lstm-stash mpiexec -n 4 python -m jobs train $T --model char-lstm --parallel pipeline --pipeline-mode stash --microbatches 4
run pto-cap mpiexec -n 2 python .device-carry/pto_capturable.py allreduce
el done
