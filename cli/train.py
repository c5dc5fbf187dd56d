"""`stapo train`: run (or resume) RL training from a config.

    stapo train --config tiny                     # a tiny random model: seconds on a CPU
    stapo train                                   # the CPU demo (configs/demo.yaml)
    stapo train --config tiny --set trainer.max_steps=3 --run-dir runs/tiny
    stapo train --config stapo --set model.name_or_path=Qwen/Qwen3-1.7B-Base   # a preset by name
    stapo train --run-dir runs/tiny --resume      # continue from the last checkpoint

The command builds and validates the config and checks its inputs (model path, data source) before
it writes anything, so a mistake fails in a second with a one-line message and no run dir left
behind; then it takes the run dir's lock and trains: ``train(Run.build(cfg, run_dir))``
(:mod:`stapo.core.train.run`, :func:`stapo.core.train.loop.train`; the run dir's rules: :mod:`stapo.core.train.rundir`). Ctrl-C, or SIGTERM after a checkpoint of the step in flight,
stops the run and prints the last checkpoint and the exact command that resumes it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from stapo.cli.common import (
    CLIError,
    ConfigOpt,
    JobError,
    SetOpt,
    check_inputs,
    check_launch,
    quiet_known_noise,
    resolve_config_path,
)
from stapo.cli.train_plan import plan_at_start, print_plan

if TYPE_CHECKING:
    from stapo.core.config import Config
    from stapo.core.train.loop import TrainResult
    from stapo.core.train.plan import Plan
    from stapo.core.train.rundir import RunDirOwner



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
    from stapo.core.config import ConfigError, load_config

    overrides = list(set_ or [])
    if fresh and not resume:
        raise CLIError("--fresh goes with --resume (it says what to do when the run dir has no checkpoint)")
    if allow_changes and not resume:
        raise CLIError("--allow-changes goes with --resume (it lets a resume change how the run trains)")
    resumed: _Resumed | None = None
    if (as_json or world_size is not None) and not plan:
        raise CLIError("--json and --world-size go with --plan (they shape the memory plan's output)")
    try:
        if resume:
            if run_dir is None:
                raise CLIError("--resume needs --run-dir pointing at an existing run")
            _check_not_busy(run_dir)  # a run still writing it: say so first
            saved = run_dir / "config.yaml"
            if config is None and not saved.is_file() and not fresh:
                raise CLIError(f"{run_dir} has no config.yaml to resume from; is it a run dir? (--fresh starts one)")
            path = saved if config is None and saved.is_file() else resolve_config_path(config)
        else:
            path = resolve_config_path(config)
        if recipe is not None:
            base = load_config(path).rollout.max_new_tokens
            overrides = method_overrides(resolve_config_path(Path(recipe), what="recipe"), base) + overrides
        if resume and (resumed := _Resumed.of(run_dir)) is not None:
            cfg = resumed.config(None if config is None else path, overrides, allow_changes)
        else:
            cfg = load_config(path, overrides)
    except ConfigError as err:
        raise JobError(f"--recipe {recipe}: {err}" if recipe and "invalid config" in str(err) else str(err)) from None
    say = typer.echo if os.environ.get("RANK", "0") == "0" else _silent  # start-up lines once per job
    asked = [o.split("=", 1)[1].strip() for o in set_ or [] if o.split("=", 1)[0].strip() == "algorithm.name"]
    if (wrong := name_mismatch(cfg, asked[-1] if asked else None)) is not None:
        raise JobError(wrong)
    if plan:
        print_plan(cfg, world_size, card_gib, as_json)
        return
    from stapo.core.train.rundir import RunDirBusy, default_run_dir, holds_run, owned

    if run_dir is None:  # under a launcher each rank names one; rank 0's is used (stapo.core.train.rundir)
        run_dir = default_run_dir(cfg.algorithm.name)
    check_inputs(cfg)
    check_launch(cfg)
    cfg, memory_plan = plan_at_start(cfg, card_gib)
    quiet_known_noise(cfg.trainer.backend)
    with contextlib.ExitStack() as stack:
        try:
            owner = stack.enter_context(owned(run_dir))
        except RunDirBusy as err:
            raise CLIError(str(err)) from None
        if owner.previous:
            typer.echo(f"note: {run_dir}: taking over the lock of a run that is no longer running ({owner.previous})",
                       err=True)
        if not resume and holds_run(run_dir):
            raise CLIError(f"{run_dir} already holds a run; pass --resume to continue it or pick another --run-dir")
        if resume and _check_resumable(run_dir, fresh, cfg.trainer.max_steps, say):
            return
        if resume and owner.rank0:
            _record_resume(run_dir, resumed, cfg, say)
        _train(cfg, memory_plan, path, run_dir, resume, owner, say)


def run_training(cfg: Config, run_dir: Path, *, resume: bool, log: Callable[[str], None], plan: Plan | None) -> TrainResult:
    """The library call `stapo train` makes once its checks pass: build the run (with the memory plan
    printed at start, so the run is not planned twice) and train it. The one seam of this command:
    CLI tests stand a recorder in for it to see the config that reached the library."""
    from stapo.core.train.loop import train
    from stapo.core.train.run import Run

    return train(Run.build(cfg, run_dir, log=log, plan=plan), resume=resume)


def _train(cfg: Config, plan: Plan | None, path: Path, run_dir: Path, resume: bool, owner: RunDirOwner,
           say: Callable[..., None]) -> None:
    """Run the loop; on a failure before the first step, remove what this command wrote."""
    from stapo.core.task.rewards import RewardError
    from stapo.core.train.rundir import SharedDirError, stop_report

    say(f"run dir: {run_dir}  (config: {path})")  # rank 0's: the other ranks take its name (agree_run_dir)
    try:
        result = run_training(cfg, run_dir, resume=resume, log=say, plan=plan)
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


# The keys that decide which objective runs: token weighting, per-token loss, advantage, and the
# layers (our choice); with them every string or boolean option of the chosen weighting's section
# (S2T's mode, 20-Entropy's side...), so a recipe that differs from another by a mode needs no entry
# here. A config labelled with a recipe's name must agree with that recipe on them. Recipes that
# differ only in numbers (grpo and justrl: the clip range) are not told apart by this check:
# `stapo recipes diff` shows those.
_TW = "algorithm.token_weighting"
SIGNATURE_KEYS = (
    _TW, "algorithm.policy_loss", "algorithm.advantage", "algorithm.lp_reg.enabled",
    "algorithm.deep_grpo.enabled", "data.sampler", "rollout.async.enabled",
)


def method_overrides(recipe: Path, max_new_tokens: int | None = None) -> list[str]:
    """``--set`` overrides that give a config the recipe's values of every method key.

    Method keys are those :func:`stapo.core.fairness.classify` puts in the ``method`` group (the
    objective and its layers), so the recipe's batch, lengths, reward scale, schedule, model and
    backend are left out: ``--config tiny --recipe grpo`` is GRPO at the tiny config's scale.
    One method key is a length: DAPO's overlong buffer (in tokens) keeps its share of the response
    budget on a config whose ``rollout.max_new_tokens`` is ``max_new_tokens`` (at least 1 token).
    """
    from stapo.core.config import load_config
    from stapo.core.fairness import classify, flatten

    cfg = load_config(recipe)
    data = flatten(cfg.model_dump(mode="json", by_alias=True))
    if max_new_tokens is not None:
        share = cfg.algorithm.overlong.buffer / cfg.rollout.max_new_tokens
        data["algorithm.overlong.buffer"] = min(max_new_tokens, max(1, round(share * max_new_tokens)))
    return [f"{key}={_flow(value)}" for key, value in data.items() if classify(key) == "method"]


def _flow(value: object) -> str:
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _signature(flat: dict[str, object]) -> dict[str, object]:
    """The values of a flattened config that say which method runs (:data:`SIGNATURE_KEYS` + modes)."""
    weighting = flat.get("algorithm.token_weighting")
    section = f"algorithm.{weighting}."
    if not any(k.startswith(section) for k in flat):
        section = "algorithm.weighting_options."  # a weighting registered outside stapo
    modes = {k: v for k, v in flat.items() if k.startswith(section) and isinstance(v, str | bool)}
    return {**{k: flat.get(k) for k in SIGNATURE_KEYS}, **modes}


def _recipes() -> dict[str, Config]:
    """The shipped recipes by name: presets whose algorithm.name is their own name (not demo, tiny)."""
    from stapo.configs import preset_names, preset_path
    from stapo.core.config import load_config

    found = {name: load_config(preset_path(name)) for name in preset_names()}
    return {name: cfg for name, cfg in found.items() if cfg.algorithm.name == name}


def name_mismatch(cfg: Config, asked: str | None = None) -> str | None:
    """One line when ``algorithm.name`` does not name the method that runs (None: it does).

    ``algorithm.name`` says which recipe a run follows; reports and `stapo compare` go by it. A shipped
    recipe's name must agree with that recipe on the method's signature (:func:`_signature`). A name
    no recipe has is a new method's: set with ``--set`` (``asked``) on a config whose method is a
    shipped recipe's, it is a relabel (``stapoo``) and refused too. The fix named is ``--recipe``,
    which takes a recipe's method keys and its name together.
    """
    from stapo.core.fairness import flatten

    def signature(c: Config) -> dict[str, object]:
        return _signature(flatten(c.model_dump(mode="json", by_alias=True)))

    name, recipes, ours = cfg.algorithm.name, _recipes(), signature(cfg)
    same = [r for r, rc in recipes.items() if signature(rc) == ours]
    also = f" (recipes with this config's method: {', '.join(same)})" if same else ""
    if name not in recipes:
        if asked is None or not same:
            return None  # a config file's own name, or a method no recipe has
        return (f"--set algorithm.name={name}: no recipe is called {name}, and this config runs a shipped recipe's "
                f"method{also}; the name says which recipe ran: `--recipe NAME` runs a recipe's method under its name")
    theirs = signature(recipes[name])
    keys = sorted(set(ours) | set(theirs)) if ours == theirs or ours.get(_TW) == theirs.get(_TW) else SIGNATURE_KEYS
    diffs = [f"{k}={ours.get(k)!r} (the {name} recipe: {theirs.get(k)!r})" for k in keys if ours.get(k) != theirs.get(k)]
    if not diffs:
        return None
    named = f"; this config's method is {' / '.join(same)}'s: --set algorithm.name={same[0]} names it so" if same else ""
    return (f"algorithm.name={name}, but {'; '.join(diffs)}: the run would be reported as {name}. "
            f"`--recipe {name}` runs the {name} recipe's method{named}")


def _check_resumable(run_dir: Path, fresh: bool, max_steps: int, say: Callable[..., None]) -> bool:
    """``--resume`` needs a checkpoint; ``--fresh`` starts a run dir without one over, and says so
    (``say``: rank 0 only under a launcher). True: the run has finished (its last checkpoint is
    ``trainer.max_steps``), said so, nothing to do."""
    from stapo.core.train.checkpoint import checkpoint_step, latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        if checkpoint_step(ckpt) < max_steps:
            return False
        say(
            f"{run_dir} has finished: its last checkpoint is step {checkpoint_step(ckpt)} of trainer.max_steps="
            f"{max_steps}; nothing to do (to train further: --resume --set trainer.max_steps=N)"
        )
        return True
    if not fresh:
        raise CLIError(
            f"{run_dir} has no checkpoint to resume from (one is written every checkpoint.every steps and "
            "at the end); add --fresh to start it over from step 0"
        )
    say(f"{run_dir} has no checkpoint: starting over from step 0 (--fresh)")
    return False


class _Resumed:
    """A run dir with a checkpoint that ``--resume`` continues: the config it goes on with and the
    check that a resume changes nothing the run learns unless ``--allow-changes`` says so."""

    def __init__(self, run_dir: Path, step: int) -> None:
        from stapo.core.train.rundir import resume_config_data

        self.run_dir, self.step = run_dir, step
        self.data = resume_config_data(run_dir, step)  # config.yaml + the recorded changes

    @classmethod
    def of(cls, run_dir: Path) -> _Resumed | None:
        from stapo.core.train.checkpoint import checkpoint_step, latest_checkpoint

        ckpt = latest_checkpoint(run_dir)
        if ckpt is None or not (run_dir / "config.yaml").is_file():
            return None
        return cls(run_dir, checkpoint_step(ckpt))

    def config(self, path: Path | None, overrides: list[str], allow_changes: bool) -> Config:
        """The resumed config: the run's own with ``overrides`` (or ``path``'s, when --config names one).
        Refused in one line naming every changed key that is not bookkeeping, without ``allow_changes``;
        a change the resumed run could not use (``FIXED_AT_START``) is refused with why, with it too."""
        from stapo.core.config import apply_overrides, config_from_dict, load_config
        from stapo.core.train.rundir import BOOKKEEPING_KEYS, config_changes, unappliable_changes

        cfg = load_config(path, overrides) if path is not None else config_from_dict(apply_overrides(self.data, overrides))
        new = cfg.model_dump(mode="json", by_alias=True)
        changed = [c for c in config_changes(self.data, new) if not c.bookkeeping]
        if fixed := unappliable_changes(changed, new):
            raise CLIError(f"--resume cannot change {self.run_dir} from step {self.step + 1}: {'; '.join(fixed)}")
        if changed and not allow_changes:
            free = ", ".join(k.rstrip(".") for k in BOOKKEEPING_KEYS[:4])
            raise CLIError(
                f"--resume would change how {self.run_dir} trains from step {self.step + 1}: "
                f"{'; '.join(map(str, changed))}. Add --allow-changes to go on with them (config.yaml keeps the "
                f"run's first config; config_changes.jsonl records them), or drop them ({free}... need no flag)"
            )
        return cfg


def _record_resume(run_dir: Path, resumed: _Resumed | None, cfg: Config, say: Callable[..., None]) -> None:
    """Rank 0, under the lock: write the resume's changes to the run's record and say them. A resume
    that starts over (no checkpoint, --fresh) drops the record with the old run."""
    from stapo.core.train.rundir import CHANGES_NAME, record_config_changes

    if resumed is None:
        (run_dir / CHANGES_NAME).unlink(missing_ok=True)
        return
    changes = record_config_changes(run_dir, resumed.step, cfg.model_dump(mode="json", by_alias=True))
    if changes:
        say(f"resuming with changes from step {resumed.step + 1} (recorded in {run_dir / CHANGES_NAME}): "
            + "; ".join(map(str, changes)))


def _check_not_busy(run_dir: Path) -> None:
    from stapo.core.train.rundir import RunDirBusy, check_not_busy

    try:
        check_not_busy(run_dir)
    except RunDirBusy as err:
        raise CLIError(str(err)) from None


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

