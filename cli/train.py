"""`stapo train`: run (or resume) RL training from a config.

    stapo train                                   # the CPU demo (configs/demo.yaml)
    stapo train --config configs/tiny.yaml --set trainer.max_steps=3 --run-dir runs/tiny
    stapo train --config stapo --set model.name_or_path=Qwen/Qwen3-1.7B-Base   # a preset by name
    stapo train --run-dir runs/tiny --resume      # continue from the last checkpoint

The command only builds and validates the config (so a bad config fails before any model loads)
and calls :func:`stapo.core.loop.train`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from stapo.cli.common import CLIError, ConfigOpt, SetOpt, resolve_config_path


def command(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    run_dir: Annotated[
        Path | None, typer.Option("--run-dir", "-o", help="Run folder (default: runs/<algorithm>-<time>).")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in --run-dir from its last checkpoint.")
    ] = False,
) -> None:
    """Train a policy with STAPO or a baseline (GRPO, DAPO, 20-Entropy, JustRL, STARE, Lp-Reg, GSPO, ...).

    `--config NAME` picks a preset (`stapo recipes` lists them with their papers; `stapo recipes diff
    dapo stapo` shows what two differ in), `--set a.b=c` overrides any field.

    With no arguments it runs the CPU demo: SmolLM2-135M-Instruct learning single-digit addition
    (needs `make demo-model` once). Writes config.yaml, metrics.jsonl, TensorBoard events, token
    dumps, checkpoints and the final HF-format policy into the run dir.
    """
    from stapo.core.config import ConfigError, load_config

    overrides = list(set_ or [])
    try:
        if resume:
            if run_dir is None:
                raise CLIError("--resume needs --run-dir pointing at an existing run")
            saved = run_dir / "config.yaml"
            if config is None and not saved.is_file():
                raise CLIError(f"{run_dir} has no config.yaml to resume from")
            path = resolve_config_path(config) if config is not None else saved
        else:
            path = resolve_config_path(config)
        cfg = load_config(path, overrides)
    except ConfigError as err:
        raise CLIError(str(err)) from None
    if run_dir is None:
        run_dir = Path("runs") / f"{cfg.algorithm.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise CLIError(f"{run_dir} already holds a run; pass --resume to continue it or pick another --run-dir")

    from stapo.core.loop import train
    from stapo.core.rewards import RewardError

    typer.echo(f"run dir: {run_dir}  (config: {path})")
    try:
        result = train(cfg, run_dir, resume=resume, log=typer.echo)
    except RewardError as err:
        raise CLIError(f"training stopped: {err}") from None
    typer.echo(
        f"done: {result.steps} steps in {result.wall_s:.0f}s; validation accuracy "
        f"{_fmt(result.val_before)} -> {_fmt(result.val_after)}; run dir {result.run_dir}"
    )


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
