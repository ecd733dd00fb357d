#!/usr/bin/env bash
# gpu-check on the box, its folder tarred into $OUT.
set -o pipefail
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/nvidia-smi.txt 2>&1
uname -a >> $OUT/nvidia-smi.txt; nproc >> $OUT/nvidia-smi.txt
if command -v make >/dev/null; then
  make gpu-check GPU_CHECK_DIR=/tmp/gc GPU_CHECK_ARGS="--budget 480" 2>&1 | tee $OUT/gpu-check.log
else
  echo "no make here: python -m jobs.gpu_check.main" | tee $OUT/gpu-check.log
  python -m jobs.gpu_check.main --out /tmp/gc --budget 480 2>&1 | tee -a $OUT/gpu-check.log
fi
echo "gpu-check rc=$?" | tee -a $OUT/gpu-check.log
tar czf $OUT/gc.tgz -C /tmp gc; cp /tmp/gc/report.md $OUT/ 2>/dev/null; true
