# syntax=docker/dockerfile:1
# stapo images. Two targets:
#   docker build --target verifier -t stapo-verifier .     # the math-verification service, no torch
#   docker build --target trainer  -t stapo-trainer  .     # CUDA learner: torch + vllm + deepspeed
#
# The verifier image installs the package with --no-deps plus the service's own requirement list,
# requirements/verifier.txt: pyproject's dependencies include torch/transformers for training, which
# the service never imports (tests/service check that no torch import is on the service path).
# `make test-verifier` installs the same list, so the verifier's tests run against what the image has.
#
# Every stage that installs the project copies every folder pyproject.toml maps to a package
# ([tool.setuptools] package-dir); tests/unit/test_self_contained.py checks it, since neither target
# is built by the test suite. The data the project reads (benchmarks, DAPO-Math-17k) ships inside
# the package (evals/data), so neither image needs a data volume.

ARG PYTHON_VERSION=3.11

# --------------------------------------------------------------------------- verifier
FROM python:${PYTHON_VERSION}-slim AS verifier

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # The container is the network boundary, so the service binds all interfaces inside it; being
    # non-loopback, `stapo verifier serve` refuses to start without a token: run the image with
    # -e STAPO_VERIFIER_TOKEN=... (compose.yaml requires one), or pass --allow-unauthenticated
    # explicitly for a private network.
    STAPO_VERIFIER_HOST=0.0.0.0 \
    STAPO_VERIFIER_PORT=8000

WORKDIR /opt/stapo
COPY requirements/verifier.txt ./requirements/verifier.txt
RUN pip install -r requirements/verifier.txt
COPY pyproject.toml README.md ./
COPY stapo_pkg ./stapo_pkg
COPY cli ./cli
COPY core ./core
COPY evals ./evals
COPY verifier_service ./verifier_service
COPY configs ./configs
RUN pip install --no-deps . && python -c "import stapo.verifier_service.server.app, sys; assert 'torch' not in sys.modules" \
    && rm -rf build

RUN useradd --system --uid 10001 --create-home stapo
USER stapo
EXPOSE 8000
# /readyz, not /healthz: the container is healthy only while the pool can grade (a process that
# answers but whose workers cannot start is unhealthy, so orchestrators restart or route around it).
# /readyz never needs the token.
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('STAPO_VERIFIER_PORT', '8000'), timeout=2)"
# Workers default to one per CPU the container may use; set STAPO_VERIFIER_WORKERS to pin it.
CMD ["stapo", "verifier", "serve"]

# --------------------------------------------------------------------------- trainer
# The learner: CUDA, torch (pulled by vllm at the version it pins), vllm for rollouts, deepspeed for
# ZeRO. The entrypoint is `stapo`; a launcher replaces it (docs/gpu.md has every scale), e.g. 8 GPUs:
#   docker run --gpus all --shm-size 16g --entrypoint deepspeed stapo-trainer --num_gpus 8 --no_local_rank --module stapo.cli.main train --config stapo --run-dir /runs/stapo The data ships in the package; /runs and
# /data (outputs of `stapo prepare`) are volumes owned by the unprivileged user.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 AS trainer

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/opt/hf-cache

RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
WORKDIR /opt/stapo
COPY pyproject.toml README.md ./
COPY stapo_pkg ./stapo_pkg
COPY cli ./cli
COPY core ./core
COPY evals ./evals
COPY verifier_service ./verifier_service
COPY configs ./configs
# vllm first: it pins the CUDA torch build the rest must share.
RUN pip install "vllm>=0.32,<0.34" && pip install ".[train,vllm]" && rm -rf build
RUN useradd --create-home --uid 10001 stapo && mkdir -p /runs /data /opt/hf-cache && chown stapo /runs /data /opt/hf-cache
USER stapo
VOLUME ["/runs", "/data"]
ENTRYPOINT ["stapo"]
CMD ["--help"]
