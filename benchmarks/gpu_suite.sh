#!/usr/bin/env bash
# One command: every CUDA check and GPU benchmark, results under $OUT (default runs/gpu_suite).
#
#   benchmarks/gpu_suite.sh              # on the GPU machine (see docs/training-backends.md, "GPU checklist")
#   benchmarks/gpu_suite.sh --dry-run    # here, on the CPU, tiny shapes: proves the script end to end
#   PARTS="checks tokenstats" benchmarks/gpu_suite.sh    # a subset (checks tokenstats model vs_trl)
#
# Parts, each logging to $OUT/<part>.log, each allowed to fail without stopping the others:
#   checks      benchmarks/gpu_checks.py: fused loss / chunked stats fp32+bf16 vs naive, torch backend bf16
#               autocast step, DeepSpeed ZeRO-0/3 on one GPU vs the torch backend, HF generation on CUDA
#   tokenstats  benchmarks/tokenstats.py --device cuda --dtype bfloat16 at vocab 151,936
#   model       a random Qwen3-1.7B-shaped model (bf16) + tokenizer, written to $MODEL_DIR
#   vs_trl      benchmarks/vs_trl.py on it: stapo vs TRL GRPOTrainer vs stapo with S2T off, 16 prompts x 8
#               samples, 512 new tokens forced, one optimizer step per batch, no KL, HF generation both
# Wheels: if .whl/ exists (benchmarks/gpu_wheels.sh fills it), they are installed into /tmp/site first.
set -u
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-runs/gpu_suite}
mkdir -p "$OUT"
PY=${PY:-python3}
[ -x .venv/bin/python ] && [ $DRY = 1 ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && [ $DRY = 0 ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || { echo "wheel install failed"; exit 1; }
  # stapo itself: its folders map to stapo.* through pyproject's package-dir, so install it (no deps)
  $PY -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . || exit 1
fi
PARTS=${PARTS:-"checks tokenstats model vs_trl"}
if [ $DRY = 1 ]; then
  DEV=cpu; ARCH=tiny-qwen3; TOK_ARGS="--tokens 256 --hidden 64 --vocab 151936 --repeats 1 --device cpu --dtype float32"
  VS_ARGS="--device cpu --dtype float32 --prompts 2 --n 2 --max-new-tokens 8 --micro 2 --steps 2 --rounds 1"
  CHECK_ARGS="--dry-run"
else
  DEV=cuda; ARCH=qwen3-1.7b; TOK_ARGS="--tokens 16384 --hidden 2048 --vocab 151936 --device cuda --dtype bfloat16"
  VS_ARGS="--device cuda --dtype bfloat16 --prompts 16 --n 8 --max-new-tokens 512 --micro 8 --steps 3 --rounds 1 --gradient-checkpointing"
  CHECK_ARGS="--device cuda"
fi
MODEL_DIR=${MODEL_DIR:-/tmp/stapo-$ARCH-random}
status=0
run() {  # run NAME CMD...: log to $OUT/NAME.log, keep going on failure
  local name=$1; shift
  echo "== $name: $*" | tee "$OUT/$name.log"
  local t0=$SECONDS
  "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
  tail -n 40 "$OUT/$name.log" | grep -E '^\||"ok"|FAILED|Error|error' | tail -n 25
  [ $rc = 0 ] || status=1
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi";
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)";
  $PY -c "import trl; print('trl', trl.__version__)" 2>&1 | tail -1;
  $PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1; } > "$OUT/machine.txt"
cat "$OUT/machine.txt"
for part in $PARTS; do
  case $part in
    checks)     run checks $PY benchmarks/gpu_checks.py $CHECK_ARGS --out "$OUT/gpu_checks.json" ;;
    tokenstats) run tokenstats $PY benchmarks/tokenstats.py $TOK_ARGS ;;
    model)      run model $PY benchmarks/make_random_model.py --arch $ARCH --out "$MODEL_DIR" ;;
    vs_trl)     run vs_trl $PY benchmarks/vs_trl.py $VS_ARGS --model "$MODEL_DIR" --force-length \
                  --sides stapo,trl,stapo-none --json "$OUT/vs_trl.json" ;;
    *) echo "unknown part $part (checks tokenstats model vs_trl)"; status=1 ;;
  esac
done
echo "gpu_suite: done, exit $status; results in $OUT"
exit $status
