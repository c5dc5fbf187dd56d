#!/usr/bin/env bash
# Fill a folder (default .whl/, ignored by git: it travels only when named in the device tool's carry)
# with the wheels the GPU machine lacks for stapo and benchmarks/gpu_suite.sh, and print their sizes and
# total (at most 64 MiB less the working tree, which the device tool copies too). What to carry is decided from pyproject.toml's requirements (stapo, the
# `train` extra, and `bench` for the TRL side-by-side) against the machine's package list, following
# each carried wheel's own requirements: benchmarks/gpu_wheels.py says how. Downloads and the DeepSpeed
# build (DS_BUILD_OPS=0: pure Python, no op compiled) land once in a cache outside git
# ($STAPO_WHEEL_CACHE, default ~/.cache/stapo-gpu-wheels), niced.
#
#   benchmarks/gpu_wheels.sh                          # .whl/ for the device: run(..., carry=[".whl"])
#   benchmarks/gpu_wheels.sh --extras train,bench     # also TRL and its needs, for the TRL part (--parts vs_trl)
set -eu
cd "$(dirname "$0")/.."
DEST=.whl
EXTRAS=train
while [ $# -gt 0 ]; do
  case $1 in
    --dest) DEST=$2; shift 2 ;;
    --extras) EXTRAS=$2; shift 2 ;;
    *) echo "usage: benchmarks/gpu_wheels.sh [--dest DIR] [--extras train[,bench]]" >&2; exit 2 ;;
  esac
done
PY=${PY:-.venv/bin/python}
exec nice -n 10 "$PY" benchmarks/gpu_wheels.py fetch --dest "$DEST" --extras "$EXTRAS"
