#!/usr/bin/env bash
# Every CUDA check and GPU measurement stapo needs, in one command that ends inside 540 s on one H200
# (wheel install included), everything under $OUT (default runs/gpu_suite): suite.log (this output),
# results.json (every part's figures and verdict), parts.log (the parts' own logs).
#
#   benchmarks/gpu_wheels.sh                  # here, first: .whl/ with what the GPU machine lacks
#   benchmarks/gpu_suite.sh                   # on the GPU machine (device tool: carry [".whl"])
#   benchmarks/gpu_suite.sh --budget-s 300 --parts "train_resume checks"   # less time, a subset
#   benchmarks/gpu_suite.sh --dry-run         # here: the same wheels installed for real, tiny shapes on the CPU
#
# Parts run in priority order against the budget, each skipped when what is left is less than its cost
# (benchmarks/gpu_suite.py lists them and their costs). On the GPU machine the carried wheels and stapo
# itself (a wheel built from this tree) go into /tmp/site, first on PYTHONPATH. The dry run installs the
# very wheels the device gets (built by gpu_wheels.sh into $WORK/whl) into an empty folder with Python
# 3.12 (the device's) and imports every carried module and stapo's torch-free modules from there; this
# machine has torch only for the venv's Python 3.11, so the parts then run on a bare Python 3.11 whose
# path holds the same wheels (cp311 builds of the binary ones) and a stand-in for the device's own
# packages (the venv's copies, the device's versions where known and fetchable): a wheel missing from
# the carried set fails here, not on the device.
{  # read whole before it runs: an edit to this file during a run cannot change the run
set -u
cd "$(dirname "$0")/.."
DRY=0
BUDGET=540
PARTS=${PARTS:-}
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1; shift ;;
    --budget-s) BUDGET=$2; shift 2 ;;
    --parts) PARTS=$2; shift 2 ;;
    *) echo "usage: benchmarks/gpu_suite.sh [--dry-run] [--budget-s S] [--parts \"a b\"]" >&2; exit 2 ;;
  esac
done
T0=$SECONDS
OUT=${OUT:-runs/gpu_suite}
WORK=${WORK:-/tmp/stapo-gpu-suite}
mkdir -p "$OUT" "$WORK"
exec > >(tee "$OUT/suite.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
EXTRAS=train  # + bench (TRL) when the TRL part is asked for
case " ${PARTS//,/ } " in *" vs_trl "*) EXTRAS=train,bench ;; esac
pip_target() {  # pip_target PYTHON DIR WHEEL...: a fresh folder holding exactly these wheels
  local py=$1 dir=$2; shift 2
  rm -rf "$dir" && "$py" -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir --target "$dir" "$@"
}
say() { echo "== $* ($((SECONDS - T0)) s)"; }
if [ $DRY = 1 ]; then
  BUILD_PY=${PY:-.venv/bin/python}
  # the device's Python minor: pyenv's newest 3.12, else python3.12 on PATH (or $PY312)
  PY312=${PY312:-$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -1)}
  PY312=${PY312:-$(command -v python3.12)}
  [ -x "$PY312" ] || { echo "--dry-run needs a Python 3.12 (the device's): set PY312"; exit 1; }
  say "carried wheels, as for the device"
  PY=$BUILD_PY benchmarks/gpu_wheels.sh --dest "$WORK/whl" --extras "$EXTRAS" || exit 1
  rm -rf "$WORK/stapo" && "$BUILD_PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$WORK/stapo" . || exit 1
  say "installed with $("$PY312" -V 2>&1) into an empty folder"
  pip_target "$PY312" "$WORK/site312" "$WORK"/whl/*.whl "$WORK"/stapo/*.whl || exit 1
  say "device stand-in"
  nice -n 10 "$BUILD_PY" benchmarks/gpu_wheels.py standin --dest "$WORK/standin" --carried "$WORK/whl" \
    --py311 "$WORK/whl311" --extras "$EXTRAS" || exit 1
  PYTHONPATH="$WORK/site312:$WORK/standin" "$PY312" -s benchmarks/gpu_wheels.py imports --carried "$WORK/whl" \
    --standin "$WORK/standin" || exit 1
  say "the same set on a bare Python 3.11 (this machine's torch)"
  rm -rf "$WORK/py311" && "$("$BUILD_PY" -c 'import sys; print(sys._base_executable)')" -m venv --without-pip "$WORK/py311"
  pip_target "$BUILD_PY" "$WORK/site311" "$WORK"/whl311/*.whl "$WORK"/stapo/*.whl || exit 1
  PY=$WORK/py311/bin/python
  export PYTHONPATH="$WORK/site311:$WORK/standin"
else
  PY=${PY:-python3}
  [ -n "$(ls .whl/*.whl 2>/dev/null)" ] || { echo "no wheels in .whl/: run benchmarks/gpu_wheels.sh first, then carry .whl"; exit 1; }
  say "install"
  rm -rf "$WORK/stapo" && "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$WORK/stapo" . || exit 1
  pip_target "$PY" /tmp/site .whl/*.whl "$WORK"/stapo/*.whl || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
fi
"$PY" benchmarks/gpu_wheels.py check --extras "$EXTRAS"
say "parts"
"$PY" benchmarks/gpu_suite.py --out "$OUT" --work "$WORK" --budget-s $((BUDGET - (SECONDS - T0))) \
  ${PARTS:+--parts "$PARTS"} $([ $DRY = 1 ] && echo --dry-run)
status=$?
say "done, exit $status; results in $OUT"
exit $status
}
