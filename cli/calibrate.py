"""`stapo calibrate`: what the paper's S2T rule silences on your model and prompts, and the mechanism.

    stapo calibrate --config tiny --limit 8 --out runs/calib-tiny
    stapo calibrate --config demo --limit 8 --entropy-step --out runs/calib-demo

Samples with the configured rollout engine, grades with the configured grader, teacher-forces p, H
and sum pi^2 in the training dtype, applies the registered ``s2t`` weighting per optimizer
mini-batch and prints the silenced rate per (tau_p, q), the paper's taxonomy of A > 0 tokens with
their gradient norms, the silenced set's gradient share beside a random same-size set, and a reading.
Writes ``calibration.json`` and ``calibration.png`` under ``--out``. See :mod:`stapo.core.train.calibrate`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from stapo.cli.common import CLIError, ConfigOpt, SetOpt, check_inputs, quiet_known_noise, resolve_config_path


def command(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    out: Annotated[Path, typer.Option("--out", "-o", metavar="DIR", help="Folder for calibration.json and calibration.png.")] = Path(
        "calibration"
    ),
    limit: Annotated[int, typer.Option("--limit", "-n", metavar="N", help="Prompts to sample (each gives rollout.n responses).")] = 64,
    tau_p: Annotated[
        list[float] | None,
        typer.Option("--tau-p", metavar="P", help="tau_p values of the grid (candidates have p < tau_p), repeatable "
                     "(default: 0.0005 0.001 0.002 0.005 0.01; the paper's is 0.002)."),
    ] = None,
    q: Annotated[
        list[float] | None,
        typer.Option("--q", metavar="Q", help="q values of the grid (tau_h^(q) is the q-th quantile of each mini-batch's "
                     "candidates' entropies), repeatable (default: 0.5 0.75 0.9; the paper's is 0.75)."),
    ] = None,
    entropy_step: Annotated[
        bool,
        typer.Option("--entropy-step", help="Also measure, per mini-batch, the entropy change of one SGD step on the "
                     "baseline objective restricted to the silenced tokens vs a random same-size set of candidates "
                     "(first order; one backward per set per micro-batch)."),
    ] = False,
) -> None:
    """Measure what the paper's S2T rule silences on the configured model and prompts, and why.

    The taxonomy, gradient shares, entropy step and figure use the config's own rule
    (algorithm.s2t.tau_p and .q; the paper's 0.002 and 0.75 in the STAPO recipes), which is always
    in the grid, marked c.

    Examples:

    \b
      stapo calibrate --config tiny --limit 8 --out runs/calib-tiny
      stapo calibrate --config tiny --limit 8 --tau-p 0.05 --tau-p 0.1 --q 0.5 --entropy-step --out runs/calib-tiny
      stapo calibrate --config demo --limit 8 --out runs/calib-demo   # the demo model
    """
    from stapo.core.config import ConfigError, load_config

    try:
        cfg = load_config(resolve_config_path(config), list(set_ or []))
    except ConfigError as err:
        raise CLIError(str(err)) from None
    if limit < 1:
        raise CLIError(f"--limit must be >= 1 prompt, got {limit}")
    for p in tau_p or []:
        if not 0 < p <= 1:
            raise CLIError(f"--tau-p must be a probability in (0, 1], got {p}")
    for x in q or []:
        if not 0 <= x <= 1:
            raise CLIError(f"--q must be in [0, 1], got {x}")
    check_inputs(cfg)
    quiet_known_noise(cfg.trainer.backend)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from stapo.core.train.calibrate import DEFAULT_Q, DEFAULT_TAU_P, analyse, collect, write_outputs

    console = Console()
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("sample, grade, teacher-force", total=None)

        def progress(_phase: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        sample = collect(cfg, limit=limit, entropy_step=entropy_step, progress=progress, log=console.print)
    s2t = cfg.algorithm.s2t
    result = analyse(sample, tau_ps=tau_p or DEFAULT_TAU_P, qs=q or DEFAULT_Q, tau_p=s2t.tau_p, q=s2t.q)
    paths = write_outputs(result, sample, out)
    for item in terminal_tables(result):
        console.print(item)
    console.print(f"wrote {paths['json']} and {paths['png']}")


def terminal_tables(result: dict) -> list:
    """The grids (rows tau_p, columns q), the taxonomy, the gradient shares and the reading as rich renderables."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    s, tax = result["sample"], result["taxonomy"]
    head = Text(
        f"{s['responses']} responses ({s['kept']} in the update's population, {s['correct']} correct), "
        f"{s['tokens']} response tokens from {s['model']} ({s['dtype']}), {s['minibatches']} optimizer mini-batch(es): "
        f"the rule's population. Smallest measurable rate: {result['resolution'] or float('nan'):.1e}."
    )
    rows = result["grid"]
    tps = sorted({r["tau_p"] for r in rows})
    qs = sorted({r["q"] for r in rows})
    out: list = [head]
    for key, what in (("rate", "with A > 0: what the update silences"),
                      ("rate_before_adv", "before the A > 0 condition (every token taken as A > 0)")):
        t = Table(title=f"silenced fraction of response tokens, {what}", box=box.SIMPLE_HEAD, padding=(0, 1),
                  pad_edge=False, caption=f"rows tau_p, columns q; c: the config's rule; the paper reports mostly "
                  f"< {result['paper_rate']:g}")
        t.add_column("tau_p \\ q", no_wrap=True)
        for x in qs:
            t.add_column(f"q {x:g}", justify="right", no_wrap=True)
        for tp in tps:
            cells = []
            for x in qs:
                r = next(r for r in rows if r["tau_p"] == tp and r["q"] == x)
                cells.append(_rate(r[key]) + ("c" if r["configured"] else ""))
            t.add_row(f"{tp:g}", *cells)
        out.append(t)
    t = Table(title=f"A > 0 tokens by probability (tau_p {tax['tau_p']:g}) x entropy (each mini-batch's tau_h^({tax['q']:g}))",
              box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
              caption="gradient norm w.r.t. the logits, exact: |A| sqrt(1 - 2p + sum pi^2); low/low is the paper's "
                      "spurious quadrant")
    for col in ("probability", "entropy", "tokens", "share", "mean grad norm"):
        t.add_column(col, justify="right" if col in ("tokens", "share", "mean grad norm") else "left", no_wrap=True)
    for c in tax["cells"]:
        t.add_row(c["probability"], c["entropy"], str(c["count"]), _pct(c["share_of_positive"]), _num(c["mean_grad_norm"]))
    out.append(t)
    t = Table(title="share of the batches' gradient norm (sum over every response token)", box=box.SIMPLE_HEAD,
              padding=(0, 1), pad_edge=False)
    for col in ("set", "tokens", "mean grad norm", "share of sum of norms", "share of squared norm"):
        t.add_column(col, justify="left" if col == "set" else "right", no_wrap=True)
    for name, label in (("silenced", "silenced (the rule)"), ("random", "random same-size candidates")):
        v = tax["sets"][name]
        t.add_row(label, str(v["count"]), _num(v["mean_grad_norm"]), _pct(v["share"]), _pct(v["share_sq"]))
    out.append(t)
    es = result.get("entropy_step")
    if es:
        t = Table(title=f"entropy change of one SGD step per set, first order, summed over {es['minibatches']} mini-batch(es)",
                  box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
                  caption=f"dH/d(eta) = -<grad H, grad L_S>; at lr {es['lr']:g}: the change in nats")
        for col in ("set", "dH/d(eta)", "at lr"):
            t.add_column(col, justify="left" if col == "set" else "right", no_wrap=True)
        for name in ("silenced", "random", "all"):
            t.add_row(name, f"{es['rate_sum'][name]:+.4g}", f"{es['delta_at_lr'][name]:+.3g}")
        out.append(t)
    out.append(Text(result["reading"], style="bold"))
    return out


def _rate(x: float) -> str:
    """A rate in 6 characters at most: 0, 1.6e-2."""
    if not x:
        return "0"
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e)}"


def _pct(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.2f}%"


def _num(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3g}"
