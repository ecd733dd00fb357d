#!/usr/bin/env bash
# The session's GPU checks, in one go (run through run.sh): calibration, profiles, mstopk, gpu tests.
R=/tmp/res; mkdir -p $R/prof; exec > >(tee -a $OUT/log) 2>&1
pack() { tar czf $OUT/res.tgz -C /tmp res; }
trap pack EXIT
T0=$(date +%s); el() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
el start; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc
python -c 'import mpi4py.MPI as M; print(M.Get_library_version()[:60])'
el calib; timeout 150 python .device-carry/calib.py $R/calib.jsonl
el profiles
export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1
for mb in resnet50-224:32 vgg19-224:32 transformer-big:64 vgg19-22k-224:32 fc-heavy:64 char-lstm:64; do
  m=${mb%%:*}; b=${mb##*:}
  timeout 60 python -m jobs.simulate --take-profile --device cuda --model $m --batch-size $b \
     --out $R/prof/$m-b$b-h100-tf32.json --timeout 55 2>&1 | tail -4
done
unset TORCH_ALLOW_TF32_CUBLAS_OVERRIDE
el mstopk; timeout 90 python -m jobs.bench.mstopk --device cuda --json $R/mstopk-cuda.json 2>&1 | tail -25
pack
el tests
( timeout 170 mpiexec -n 4 python -m mpi4py -m pytest -m "gpu and mpi" -p no:cacheprovider -q --timeout 120 -rfE \
    > $R/tests-mpi.log 2>&1; echo "mpi rc=$?" >> $R/tests-mpi.log ) &
timeout 200 python -m pytest -m "gpu and not mpi" -p no:cacheprovider -q --timeout 180 -n 4 -rfE > $R/tests-serial.log 2>&1
echo "serial rc=$?" >> $R/tests-serial.log
wait
tail -40 $R/tests-serial.log; tail -30 $R/tests-mpi.log
el done
