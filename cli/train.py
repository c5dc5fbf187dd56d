"""`stapo train`: run (or resume) RL training from a config.

    stapo train --config tiny                     # a tiny random model: seconds on a CPU
    stapo train                                   # the CPU demo (configs/demo.yaml)
    stapo train --config tiny --set trainer.max_steps=3 --run-dir runs/tiny
    stapo train --config stapo --set model.name_or_path=Qwen/Qwen3-1.7B-Base   # a preset by name
    stapo train --run-dir runs/tiny --resume      # continue from the last checkpoint

The command is: options -> the config (:func:`stapo.core.train.prepare.run_config`) -> the run's
preparation (:func:`stapo.core.train.prepare.prepare`: every check before a model loads, the memory
plan, the run dir's lock, a resume's change check and record) -> ``train(Run.build(...))``
(:mod:`stapo.core.train.run`, :func:`stapo.core.train.loop.train`) -> each refusal as one line. A
mistake fails in a second with a one-line message and no run dir left behind. Ctrl-C, or SIGTERM after
a checkpoint of the step in flight, stops the run and prints the last checkpoint and the exact command
that resumes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from stapo.cli.common import CLIError, ConfigOpt, JobError, SetOpt, prepare_errors, resolve_config_path
from stapo.cli.train_plan import print_plan

if TYPE_CHECKING:
    from stapo.core.train.loop import TrainResult
    from stapo.core.train.prepare import Prepared


def command(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    run_dir: Annotated[
        Path | None, typer.Option("--run-dir", "-o", metavar="DIR", help="Run folder (default: runs/<algorithm>-<time>).")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in --run-dir from its last checkpoint.")
    ] = False,
    recipe: Annotated[
        str | None,
        typer.Option(
            "--recipe",
            "-r",
            metavar="NAME",
            help="Run this recipe's method (its algorithm.* keys and layers: the `method` keys of "
            "stapo.core.fairness) on --config's model, data, batch, lengths, reward scale, schedule and "
            "backend. E.g. --config tiny --recipe grpo. --set still wins.",
        ),
    ] = None,
    allow_changes: Annotated[
        bool,
        typer.Option(
            "--allow-changes",
            help="With --resume: go on with --set / --config values that change how the run trains (lr, method, "
            "batch, lengths...). Without it such a resume is refused; config.yaml keeps the run's first config "
            "and config_changes.jsonl records each change from the step it takes effect; the resumed run uses the "
            "new values from that step (the LR rebased on the restored schedule). A change a checkpoint fixes (the "
            "model, the backend, the ZeRO stage) is refused, naming why.",
        ),
    ] = False,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="With --resume: when --run-dir has no checkpoint yet, start it over from step 0 "
            "(without it, --resume refuses).",
        ),
    ] = False,
    plan: Annotated[
        bool, typer.Option("--plan", help="Print the per-GPU memory plan of the config and exit (docs/gpu.md).")
    ] = False,
    world_size: Annotated[
        int | None, typer.Option("--world-size", min=1, help="--plan: ranks to plan for (default: the launch's).")
    ] = None,
    card_gib: Annotated[
        float | None, typer.Option("--card-gib", min=0.1, help="GPU memory in GiB (default: trainer.gpu_memory_gib, "
                                   "the GPU's own, or 80).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="--plan: one JSON object.")] = False,
) -> None:
    """Train a policy with STAPO or a baseline (GRPO, DAPO, 20-Entropy, JustRL, STARE, Lp-Reg, GSPO, ...).

    `--config NAME` picks a preset (`stapo recipes` lists them with their papers; `stapo recipes diff
    dapo stapo` shows what two differ in), `--set a.b=c` overrides any field.

    With no arguments it runs the CPU demo: SmolLM2-135M-Instruct learning single-digit addition
    (needs `make demo-model` once). Writes config.yaml, metrics.jsonl, TensorBoard events, token
    dumps, checkpoints and (checkpoint.export_hf, off in the demo) the final HF-format policy, final/,
    into the run dir.

    Examples:

    \b
      stapo train --config tiny                      # a tiny random model, seconds on a CPU
      stapo train --config tiny --recipe grpo        # GRPO's method on the tiny model
      stapo train --config stapo --set model.name_or_path=Qwen/Qwen3-1.7B-Base --run-dir runs/stapo
      stapo train --run-dir runs/stapo --resume      # continue from the last checkpoint
    """
    from stapo.core.config import ConfigError
    from stapo.core.train.prepare import check_free, prepare, run_config
    from stapo.core.train.rundir import default_run_dir

    if fresh and not resume:
        raise CLIError("--fresh goes with --resume (it says what to do when the run dir has no checkpoint)")
    if allow_changes and not resume:
        raise CLIError("--allow-changes goes with --resume (it lets a resume change how the run trains)")
    if (as_json or world_size is not None) and not plan:
        raise CLIError("--json and --world-size go with --plan (they shape the memory plan's output)")
    if resume and run_dir is None:
        raise CLIError("--resume needs --run-dir pointing at an existing run")
    if resume:
        with prepare_errors():
            check_free(run_dir)  # a run still writing it: say so before looking for its config
    saved = run_dir / "config.yaml" if resume and run_dir is not None else None
    if saved is not None and config is None and not saved.is_file() and not fresh:
        raise CLIError(f"{run_dir} has no config.yaml to resume from; is it a run dir? (--fresh starts one)")
    own = saved is not None and config is None and saved.is_file()  # the run's own config goes on
    path = saved if own else resolve_config_path(config)
    asked = [o.split("=", 1)[1].strip() for o in set_ or [] if o.split("=", 1)[0].strip() == "algorithm.name"]
    say = typer.echo if os.environ.get("RANK", "0") == "0" else _silent  # start-up lines once per job
    with prepare_errors():
        try:
            cfg = run_config(None if own else path, list(set_ or []), resume_dir=run_dir if resume else None,
                             recipe=None if recipe is None else resolve_config_path(Path(recipe), what="recipe"),
                             asked_name=asked[-1] if asked else None)
        except ConfigError as err:
            raise JobError(f"--recipe {recipe}: {err}" if recipe and "invalid config" in str(err) else str(err)) from None
        if plan:
            print_plan(cfg, world_size, card_gib, as_json)
            return
        # under a launcher each rank names a default run dir; rank 0's is used (stapo.core.train.rundir)
        run_dir = run_dir or default_run_dir(cfg.algorithm.name)
        with prepare(cfg, run_dir, resume=resume, allow_changes=allow_changes, fresh=fresh, card=card_gib, log=say,
                     note=lambda line: typer.echo(line, err=True)) as prepared:
            if not prepared.finished:
                _train(prepared, path, say)


def run_training(prepared: Prepared, *, log: Callable[[str], None]) -> TrainResult:
    """The library call `stapo train` makes once the run is prepared: build the run (with the memory
    plan and the lock its preparation holds) and train it. The one seam of this command: CLI tests
    stand a recorder in for it to see the config that reached the library."""
    from stapo.core.train.loop import train
    from stapo.core.train.run import Run

    return train(Run.build(prepared.cfg, prepared.run_dir, log=log, prepared=prepared), resume=bool(prepared.resume))


def _train(prepared: Prepared, path: Path, say: Callable[..., None]) -> None:
    """Run the loop; on a failure before the first step, remove what this command wrote."""
    from stapo.core.task.rewards import RewardError
    from stapo.core.train.rundir import SharedDirError, stop_report

    cfg, run_dir, owner = prepared.cfg, prepared.run_dir, prepared.owner
    say(f"run dir: {run_dir}  (config: {path})")  # rank 0's: the other ranks take its name (agree_run_dir)
    try:
        result = run_training(prepared, log=say)
    except KeyboardInterrupt as err:  # Ctrl-C, and SIGTERM (stapo.core.train.rundir.Stopped)
        _quiet_grader_shutdown()
        owner.clean_up(keep_config=True)
        if owner.rank0:  # (another rank's run_dir may be its own default name, not the run's)
            typer.echo("", err=True)
            for line in stop_report(run_dir, err, cfg.trainer.max_steps, cfg.checkpoint.every):
                typer.echo(line, err=True)
        raise typer.Exit(getattr(err, "exit_code", 130)) from None
    except RewardError as err:
        owner.clean_up()
        raise CLIError(f"training stopped: {err}") from None
    except SharedDirError as err:
        owner.clean_up()
        raise CLIError(str(err)) from None
    except BaseException:
        _quiet_grader_shutdown()
        owner.clean_up()
        raise
    say(
        f"done: {result.steps} steps in {result.wall_s:.0f}s; validation accuracy "
        f"{_fmt(result.val_before)} -> {_fmt(result.val_after)}; run dir {result.run_dir}"
    )


def _quiet_grader_shutdown() -> None:
    """The run is over: the grader pool's workers stop with the process, and a pool that the
    interrupted start-up never closed would report each as "lost: crash; replacing it". That is
    shutdown, not a crash: its warnings are silenced from here on (errors still show)."""
    import logging

    logging.getLogger("stapo.verifier_service.server.pool").setLevel(logging.ERROR)


def _silent(message: str = "", **_: object) -> None:
    """Ranks other than 0 under a launcher: rank 0 prints the job's start-up and progress lines."""


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"

