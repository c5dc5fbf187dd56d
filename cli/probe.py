"""`stapo probe`: does the paper's rule point one update in a better direction? Paired batches, a stated verdict.

    stapo probe init --config tiny --batches 3 --out runs/probe-tiny
    stapo probe init runs/demo/checkpoints/step_000004 --config demo --batches 15 --out runs/probe

For each checkpoint, on fresh rollout batches (each one population of the rule), the first-order
change of a held-out objective J_val and of the batch's entropy under four update directions:
A (every token), B (S2T), C (as many candidates silenced at random), D (the complementary
high-entropy candidates silenced); paired B - C and B - A with 95% t intervals and Wilcoxon p.
See :mod:`stapo.core.train.probe` for the algebra and what it cannot say.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from stapo.cli.common import (
    CLIError,
    ConfigOpt,
    SetOpt,
    console,
    prepare_errors,
    quiet_known_noise,
    resolve_config_path,
)

if TYPE_CHECKING:
    from stapo.core.train.probe import Target

INIT = "init"


def command(
    checkpoints: Annotated[
        list[Path] | None,
        typer.Argument(metavar="CHECKPOINT", show_default=False, help="Checkpoint folders (RUN/checkpoints/step_N), run folders "
                       "(their last checkpoint) or `init` (the config's model before any step, no optimizer state). "
                       "Default: init."),
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    batches: Annotated[int, typer.Option("--batches", "-b", metavar="N", help="Fresh rollout batches per checkpoint.")] = 15,
    prompts: Annotated[
        int | None,
        typer.Option("--prompts", "-p", metavar="P", help="Prompts per batch (x rollout.n responses); a batch should "
                     "hold >= 10 candidates. Default: rollout.prompts_per_step."),
    ] = None,
    val_prompts: Annotated[int, typer.Option("--val-prompts", metavar="V", help="Held-out prompts of J_val.")] = 40,
    check: Annotated[
        int, typer.Option("--check", metavar="K", help="Batches per checkpoint whose first-order prediction is checked "
                          "against real SGD steps (arms A and B).")
    ] = 1,
    device: Annotated[
        str | None, typer.Option("--device", metavar="DEV", help="auto, cpu, cuda or cuda:N (default: trainer.device).")
    ] = None,
    out: Annotated[Path, typer.Option("--out", "-o", metavar="DIR", help="Folder for probe.json.")] = Path("probe"),
    pool: Annotated[
        list[Path] | None,
        typer.Option("--pool", metavar="JSON", help="Instead of probing: pool the batches of earlier probe.json files "
                     "(probes of different checkpoints run side by side), repeatable; writes the pooled probe.json."),
    ] = None,
) -> None:
    """Measure whether S2T's silencing points one update at a checkpoint in a better direction.

    Per batch (one population of the rule: one optimizer mini-batch) and per arm, the first-order
    change of J_val (mean log-probability of the gold answer + end-of-sequence over held-out
    prompts) and of the batch's mean entropy, for an SGD step and for an Adam step preconditioned
    by the checkpoint's saved second moments. Arms: A every token, B S2T, C as many candidates
    silenced at random (exact expectation), D the candidates S2T keeps silenced instead. The
    verdict (stated before the batches run) reads the pooled B - C contrasts: holds if J_val rises
    and H falls (95% intervals excluding 0), refuted if either interval is on the wrong side.

    What it cannot say: one update's direction, not what a run of many updates does (the late-run
    stability the paper reports), and only on this model, these prompts and lengths.

    Examples:

    \b
      stapo probe init --config tiny --batches 3 --out runs/probe-tiny
      stapo probe runs/demo --batches 15 --prompts 32 --out runs/probe-demo
      stapo probe init runs/x/checkpoints/step_000004 --config demo --device cuda
      stapo probe --pool runs/p0/probe.json --pool runs/p4/probe.json --out runs/pooled
    """
    from stapo.core.config import ConfigError, load_config

    if pool:
        pool_files(pool, out)
        return
    if batches < 1:
        raise CLIError(f"--batches must be >= 1, got {batches}")
    if prompts is not None and prompts < 1:
        raise CLIError(f"--prompts must be >= 1, got {prompts}")
    if val_prompts < 1:
        raise CLIError(f"--val-prompts must be >= 1, got {val_prompts}")
    if not 0 <= check <= batches:
        raise CLIError(f"--check must be between 0 and --batches ({batches}), got {check}")
    targets = resolve_targets([str(c) for c in checkpoints or [INIT]])
    if config is None:
        first = next((t.path for t in targets if t.path is not None), None)
        if first is None:
            raise CLIError("`init` alone needs --config (the model and prompts to probe)")
        config_path = first / "config.yaml"
    else:
        config_path = resolve_config_path(config)
    overrides = list(set_ or [])
    if prompts is not None:
        overrides.append(f"rollout.prompts_per_step={prompts}")
    if device is not None:
        overrides.append(f"trainer.device={device}")
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as err:
        raise CLIError(str(err)) from None
    if cfg.trainer.backend != "torch":
        raise CLIError(f"stapo probe runs on one device with the torch backend; got trainer.backend={cfg.trainer.backend} "
                       "(--set trainer.backend=torch)")
    from stapo.core.train.prepare import check_engine_and_device, check_inputs

    with prepare_errors():
        check_inputs(cfg)
        check_engine_and_device(cfg)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CLIError(f"--out {out}: {err.strerror}") from None
    quiet_known_noise(cfg.trainer.backend)

    from tqdm import tqdm

    from stapo.core.train.probe import VERDICT_RULE, probe

    con = console()
    for line in textwrap.wrap(f"verdict rule (stated before any batch runs): {VERDICT_RULE}", 80):
        con.print(line, highlight=False)

    def progress(it: Any, total: int, label: str) -> Any:
        return tqdm(it, total=total, desc=f"probe {label}", unit="batch")

    path = out / "probe.json"

    def write(result: dict[str, Any]) -> None:
        path.write_text(json.dumps(result, indent=2, allow_nan=True))

    result = probe(cfg, targets, batches=batches, check=check, val_prompts=val_prompts, log=con.print,
                   progress=progress, partial=write)
    write(result)
    for line in table(result):
        con.print(line, highlight=False)
    con.print(f"wrote {path}")


def pool_files(files: list[Path], out: Path) -> None:
    """One report over the batches of several probe.json files (each checkpoint in one file only)."""
    from stapo.core.train.probe import pooled

    results = []
    for f in files:
        try:
            results.append(json.loads(Path(f).read_text()))
        except (OSError, ValueError) as err:
            raise CLIError(f"--pool {f}: not a readable probe.json ({err})") from None
        if "batches" not in results[-1]:
            raise CLIError(f"--pool {f}: no `batches` (not a probe.json)")
    try:
        result = pooled(results)
    except ValueError as err:
        raise CLIError(str(err)) from None
    out.mkdir(parents=True, exist_ok=True)
    path = out / "probe.json"
    path.write_text(json.dumps(result, indent=2, allow_nan=True))
    con = console()
    for line in table(result):
        con.print(line, highlight=False)
    con.print(f"wrote {path}")


def resolve_targets(args: list[str]) -> list[Target]:
    """The checkpoints to probe, checked before anything loads; ``init`` first (it is the model the
    backend loads), then the checkpoints in the order given."""
    from stapo.core.train.checkpoint import checkpoint_step, latest_checkpoint
    from stapo.core.train.probe import Target

    out = []
    for a in args:
        if a == INIT:
            out.append(Target("init", None, 0))
            continue
        p = Path(a)
        if not p.is_dir():
            raise CLIError(f"checkpoint {a}: no such folder (give RUN/checkpoints/step_N, a run folder or `init`)")
        if not (p / "meta.json").is_file():
            last = latest_checkpoint(p)
            if last is None:
                raise CLIError(f"checkpoint {a}: neither a checkpoint (no meta.json) nor a run folder with checkpoints/")
            p = last
        if not (p / "trainer" / "trainer_state.pt").is_file():
            raise CLIError(f"checkpoint {p}: no trainer/trainer_state.pt (stapo probe reads the torch backend's state)")
        out.append(Target(f"step {checkpoint_step(p)}", p, checkpoint_step(p)))
    labels = [t.label for t in out]
    if len(set(labels)) != len(labels):
        raise CLIError(f"the same checkpoint twice: {', '.join(labels)}")
    return sorted(out, key=lambda t: t.path is not None)


def table(result: dict[str, Any]) -> list[str]:
    """The contrasts as plain lines within 80 columns, then the checks and the verdict."""
    rows = result["contrasts"]
    lines = [f"{'where':<9}{'contrast':<9}{'metric':<7}{'step':<5}{'mean':>9} {'95% CI':>22} {'p':>6} "
             f"{'share':>6} {'n':>3}"]
    for r in rows:
        if not r["n"]:
            continue
        lo, hi = r["ci95"]
        ci = f"[{_g(lo)}, {_g(hi)}]"
        share = _share(r["share_of_baseline"])
        p = "-" if not math.isfinite(r["wilcoxon_p"]) else f"{r['wilcoxon_p']:.3f}"
        lines.append(f"{r['checkpoint'][:8]:<9}{r['name']:<9}{r['metric']:<7}{r['precond']:<5}{_g(r['mean']):>9} "
                     f"{ci:>22} {p:>6} {share:>6} {r['n']:>3}")
    lines += textwrap.wrap("mean: paired per-batch difference of first-order changes at the config's lr; "
                           "share: of the baseline step's own change", 80)
    few = sum(b["candidates"] < 10 for b in result["batches"])
    lines.append(f"batches: {len(result['batches'])}; candidates per batch "
                 f"{min(b['candidates'] for b in result['batches'])}-{max(b['candidates'] for b in result['batches'])}, "
                 f"{few} with fewer than 10")
    if result["checks"]:
        bad = [c for c in result["checks"] if not (c["J_val"]["agrees"] and c["H"]["agrees"])]
        worst = _worst_check(result["checks"])
        lines.append(f"linearization: {len(result['checks']) - len(bad)}/{len(result['checks'])} SGD steps agree "
                     "with the first-order prediction"
                     + ("" if worst is None else f" (largest error {100 * worst:.1f}% of the baseline step's change)"))
    lines += textwrap.wrap(f"verdict: {result['verdict']} ({result['rule']})", 80)
    return lines


def _worst_check(checks: list[dict[str, Any]]) -> float | None:
    """The largest |measured - predicted| of the linearization checks over the scale the agreement rule
    judged it at (each row's ``scale``: the larger of the arm's and arm A's predicted change, so an arm
    whose own change is near 0, B on J_val say, is not judged against its own size). None when no row
    carries its scale (a probe.json written before rows recorded it)."""
    errs = [abs(c[m]["measured"] - c[m]["predicted"]) / max(c[m]["scale"], 1e-12)
            for c in checks for m in ("J_val", "H") if "scale" in c[m]]
    return max(errs) if errs else None


def _share(x: float) -> str:
    """A share of the baseline's own change in 6 columns: a percentage, a multiple from 10x, powers of ten
    from 1000x."""
    if not math.isfinite(x):
        return "-"
    if abs(x) < 10:
        return f"{100 * x:+.0f}%"
    return f"{x:+.0f}x" if abs(x) < 1000 else f"{x:+.0e}"


def _g(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:+.2e}"
