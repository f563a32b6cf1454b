#!/usr/bin/env bash
# The device checks of the CUDA path, in one run (a few minutes on one GPU):
#   1. benchmarks/gpu_check.py: pipeline gradients against eager on CUDA, no synchronize in a step
#      (NCCL over 2 ranks where there are 2 GPUs; one process on the GPU otherwise);
#   2. benchmarks/gpu_profile.py: the paper's 1.5B model's F, I, W per stage, timed with CUDA events;
#   3. the demo's measurement (zb-auto against 1F1B; on NCCL where there are 2 GPUs).
# With one GPU, two NCCL ranks are also started on it: the pipeline must refuse them at once with
# an error naming both ranks (a hang, or an error from inside NCCL, fails the check).
# Results go to $OUT (default benchmarks/results); the logs beside them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PY=${PY:-python}
mkdir -p "$OUT"
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $GPUS"
status=0
if [ "$GPUS" -ge 2 ]; then
  $PY -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log" || status=1
else
  $PY benchmarks/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log" || status=1
  timeout 120 $PY -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gpu_check.py \
    --out "$OUT/gpu_check_shared.json" >"$OUT/gpu_check_shared.log" 2>&1
  shared=$?
  if [ $shared -eq 124 ]; then
    echo "two ranks on one GPU: no answer within 120 s (a hang)"; status=1
  elif [ $shared -ne 0 ] && grep -q "both use the CUDA device" "$OUT/gpu_check_shared.log"; then
    echo "two ranks on one GPU: refused, naming both ranks:"
    grep -m1 "both use the CUDA device" "$OUT/gpu_check_shared.log"
  else
    echo "two ranks on one GPU: exit $shared without the pipeline's refusal (see gpu_check_shared.log)"; status=1
  fi
fi
timeout 300 $PY benchmarks/gpu_profile.py 2>&1 | tail -40 | tee "$OUT/gpu_profile.log" || status=1
cp benchmarks/results/gpu_profile.json benchmarks/results/gpu_profile.md "$OUT"/ 2>/dev/null || true
timeout 300 $PY -m zbcompile.cli demo --rounds 3 --out "$OUT/demo_gpu" 2>&1 | tail -30 | tee "$OUT/demo_gpu.log" || status=1
exit $status
