#!/usr/bin/env bash
# Fill .whl/ with what the GPU image lacks for benchmarks/gpu_suite.sh (Python 3.12, x86-64), and print
# the sizes (the device tool carries at most 64 MiB of working tree). The image already has torch,
# transformers, accelerate, pandas, pyarrow, xxhash, pyyaml, typer, rich, tensorboard, ninja, psutil,
# msgpack, einops, py-cpuinfo, mpmath, sympy (the device tool's list of the GPU image's packages).
#   benchmarks/gpu_wheels.sh            # then: run(..., carry=[".whl"]) with benchmarks/gpu_suite.sh
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl  # ignored by .gitignore: it travels only when named in carry
PY=${PY:-.venv/bin/python}
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
BIN="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d .whl"
# pure-Python or binary wheels, pinned to what this tree is tested with
$PY -m pip download -q $BIN \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
  pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2 hjson==3.1.0
# DeepSpeed ships only an sdist: build a pure-Python wheel here (no ops: DS_BUILD_OPS=0)
if ! ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
  DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
fi
# stapo itself is not a wheel here: gpu_suite.sh installs the tree it runs from (pip install --no-deps .)
rm -f .whl/stapo-*.whl
ls -l .whl | awk 'NR>1 {printf "%8.2f MiB  %s\n", $5/1048576, $9}'
du -sh .whl
