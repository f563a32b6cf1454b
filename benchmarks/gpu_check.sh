#!/usr/bin/env bash
# The device checks, in one run within a time budget (GPU_CHECK_BUDGET_S, default 540 s):
#   throughput  benchmarks/gpu_throughput.py, one process on one GPU: pipe.step's stage programs
#               against the model without us, eager and Inductor, the paper's 1.5B GPT and a 1B
#               Llama in bf16 (tokens/s, MFU, per-action gaps, kernel tables); each part under
#               its own timeout, the report from whatever finished.
#   nccl        where there are 2 GPUs or more: benchmarks/gpu_check.py over 2 (and 4) NCCL ranks,
#               the pipeline's gradients against eager for 1f1b, zb-h1, zb-auto and a V, then
#               benchmarks/gpu_pipelines.py, step times paired against torch's schedules; 300 s a part.
#   refusal     two NCCL ranks on one GPU must be refused at once, naming both (one GPU only).
#   profile     benchmarks/gpu_profile.py (the 1.5B model's per-stage F, I, W) and the demo.
# GPU_CHECK_PARTS chooses (default: "throughput nccl"; GPU_THROUGHPUT_MODELS the throughput part's
# models, default both); a part that cannot run says why.
# Results go to $OUT (default benchmarks/results); the parts' logs beside them.
#
#   bash benchmarks/gpu_check.sh                       # on the GPU machine
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh  # dry run on the CPU: tiny models, every path
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PY=${PY:-python}
PARTS=${GPU_CHECK_PARTS:-throughput nccl}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
START=$SECONDS
status=0
left() { echo $((BUDGET - (SECONDS - START))); }
# run_part NAME LIMIT CMD...: CMD under min(LIMIT, time left); a part with under 20 s left is skipped
run_part() {
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  [ "$budget" -lt "$limit" ] && limit=$budget
  if [ "$limit" -lt 20 ]; then echo "== $name: skipped, ${budget} s of the budget left"; return 0; fi
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$@"
  local rc=$?
  [ $rc -eq 124 ] && echo "== $name: stopped at its ${limit} s limit"
  [ $rc -ne 0 ] && status=1
  echo "== $name: exit $rc after $((SECONDS - START)) s"
}
if [ "$DEVICE" = cpu ]; then GPUS=0; TINY=(--device cpu --tiny); else
  GPUS=$($PY -c "import torch; print(torch.cuda.device_count())"); TINY=(); fi
echo "GPUs: $GPUS; parts: $PARTS; budget ${BUDGET} s"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"

case " $PARTS " in *" throughput "*)
  rm -f "$OUT/gpu_throughput.jsonl" "$OUT/gpu_throughput.log" "$OUT/gpu_kernels.txt"
  for compiler in eager inductor; do
    for model in ${GPU_THROUGHPUT_MODELS:-gpt-1.5b llama-1b}; do
      run_part "throughput $model $compiler" 240 \
        $PY benchmarks/gpu_throughput.py --model $model --compiler $compiler --out "$OUT" "${TINY[@]}" \
        >> "$OUT/gpu_throughput.log" 2>&1
      tail -2 "$OUT/gpu_throughput.log"
    done
  done
  $PY benchmarks/gpu_throughput.py --report "$OUT" | tee "$OUT/gpu_throughput.md" || status=1
esac

case " $PARTS " in *" nccl "*)
  if [ "$GPUS" -ge 2 ] || [ "$DEVICE" = cpu ]; then
    # the dry run: 2 gloo ranks on the CPU through the same scripts (tiny models)
    [ "$DEVICE" = cpu ] && RANKS=(2) || RANKS=(2 4)
    for ranks in "${RANKS[@]}"; do
      if [ "$DEVICE" != cpu ] && [ "$GPUS" -lt $ranks ]; then
        echo "== nccl $ranks ranks: skipped, $GPUS GPUs (NCCL needs a GPU per rank)"; continue
      fi
      run_part "nccl $ranks ranks: gradients against eager" 300 \
        $PY -m torch.distributed.run --standalone --nproc-per-node $ranks benchmarks/gpu_check.py \
        --device "$DEVICE" --out "$OUT/gpu_check_${ranks}.json"
      run_part "nccl $ranks ranks: step times against torch's schedules" 300 \
        $PY -m torch.distributed.run --standalone --nproc-per-node $ranks benchmarks/gpu_pipelines.py \
        --device "$DEVICE" --out "$OUT/gpu_pipelines_${ranks}.json"
    done
  else
    echo "== nccl: skipped: $GPUS GPU(s); the 2- and 4-rank NCCL pipelines need a GPU per rank"
  fi
esac

case " $PARTS " in *" refusal "*)
  if [ "$GPUS" -eq 1 ]; then
    echo "== two NCCL ranks on one GPU (must be refused at once, naming both)"
    timeout 120 $PY -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gpu_check.py \
      --out "$OUT/gpu_check_shared.json" >"$OUT/gpu_check_shared.log" 2>&1
    shared=$?
    if [ $shared -eq 124 ]; then
      echo "two ranks on one GPU: no answer within 120 s (a hang)"; status=1
    elif [ $shared -ne 0 ] && grep -q "both use the CUDA device" "$OUT/gpu_check_shared.log"; then
      echo "two ranks on one GPU: refused, naming both ranks:"; grep -m1 "both use the CUDA device" "$OUT/gpu_check_shared.log"
    else
      echo "two ranks on one GPU: exit $shared without the pipeline's refusal (see gpu_check_shared.log)"; status=1
    fi
  else
    echo "== refusal: skipped: it needs exactly one GPU ($GPUS here)"
  fi
esac

case " $PARTS " in *" profile "*)
  run_part "gpu_profile" 300 $PY benchmarks/gpu_profile.py
  cp benchmarks/results/gpu_profile.json benchmarks/results/gpu_profile.md "$OUT"/ 2>/dev/null || true
  run_part "demo" 300 $PY -m zbcompile.cli demo --rounds 3 --out "$OUT/demo_gpu"
esac
echo "gpu_check: exit $status after $((SECONDS - START)) s"
exit $status
