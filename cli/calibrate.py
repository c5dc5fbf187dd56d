"""`stapo calibrate`: will S2T do anything on your model and prompts, and what its tokens carry.

    stapo calibrate --config tiny --limit 8 --out runs/calib-tiny
    stapo calibrate --config demo --limit 8 --out runs/calib-demo

Samples with the configured rollout engine, grades with the configured grader, teacher-forces p, H
and sum pi^2 in the training dtype (one forward), applies the registered ``s2t`` weighting per
optimizer mini-batch and prints first the answer (silenced tokens per mini-batch, per step and per
run at the configured batch size), then the silenced rate per (tau_p, q), the paper's taxonomy of
A > 0 tokens with their gradient norms, the silenced set against two random controls taken as exact
expectations (as many candidates, as many A > 0 tokens), and the rest of the reading.
Writes ``calibration.json`` and ``calibration.png`` under ``--out``. See :mod:`stapo.core.train.calibrate`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from stapo.cli.common import (
    CLIError,
    ConfigOpt,
    SetOpt,
    prepare_errors,
    quiet_known_noise,
    resolve_config_path,
)


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
) -> None:
    """Will S2T do anything on the configured model and prompts? Its silenced tokens per mini-batch,
    step and run at the configured batch size, and what those tokens carry.

    The counts, taxonomy, gradient shares and figure use the config's own rule (algorithm.s2t.tau_p
    and .q; the paper's 0.002 and 0.75 in the STAPO recipes), which is always in the grid, marked c.
    A run is trainer.max_steps steps (--set trainer.max_steps=N for another length).

    Examples:

    \b
      stapo calibrate --config tiny --limit 8 --out runs/calib-tiny
      stapo calibrate --config tiny --limit 8 --tau-p 0.05 --tau-p 0.1 --q 0.5 --out runs/calib-tiny
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
    from stapo.core.train.prepare import check_inputs

    with prepare_errors():
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

        sample = collect(cfg, limit=limit, progress=progress, log=console.print)
    s2t = cfg.algorithm.s2t
    result = analyse(sample, tau_ps=tau_p or DEFAULT_TAU_P, qs=q or DEFAULT_Q, tau_p=s2t.tau_p, q=s2t.q)
    paths = write_outputs(result, sample, out)
    for item in terminal_tables(result):
        console.print(item)
    console.print(f"wrote {paths['json']} and {paths['png']}")


def terminal_tables(result: dict) -> list:
    """The answer (silenced tokens per mini-batch, step and run), the grids (rows tau_p, columns q),
    the taxonomy, the sets against the exact random controls and the rest of the reading, as rich
    renderables that fit 80 columns."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    s, tax, rule = result["sample"], result["taxonomy"], result["rule"]
    head = Text(
        f"{s['responses']} responses ({s['kept']} in the update's population, {s['correct']} correct), "
        f"{s['tokens']} response tokens from {s['model']} ({s['dtype']}), {s['minibatches']} optimizer mini-batch(es): "
        f"the rule's population. Smallest measurable rate: {result['resolution'] or float('nan'):.1e}. "
        f"The rule: {rule['name']}."
    )
    out: list = [head, Text(result["answer"], style="bold")]
    rows = result["grid"]
    tps = sorted({r["tau_p"] for r in rows})
    qs = sorted({r["q"] for r in rows})
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
    t = Table(title=f"A > 0 tokens by probability (tau_p {tax['tau_p']:g}) x entropy (below the q {tax['q']:g} quantile "
                    "of each mini-batch's A > 0 entropies)",
              box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
              caption="gradient norm w.r.t. the logits, exact: |A| sqrt(1 - 2p + sum pi^2); x A>0: over the A > 0 "
                      "tokens' mean; low/low is the paper's spurious quadrant")
    for col in ("p", "H", "tokens", "share", "mean norm", "x A>0"):
        t.add_column(col, justify="left" if col in ("p", "H") else "right", no_wrap=True)
    for c in tax["cells"]:
        t.add_row(c["probability"], c["entropy"], str(c["count"]), _pct(c["share_of_positive"]),
                  _num(c["mean_grad_norm"]), _num(c["vs_positive_mean"]))
    out.append(t)
    t = Table(title="the silenced set against random sets of the same size (exact expectations, no draw)",
              box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
              caption="E\\[.]: per mini-batch, k/N times the population's sum (k silenced, N the population); "
                      "share: of the sum of every token's norm; norm^2: of the squared norm of the whole gradient")
    for col in ("set", "tokens", "mean norm", "x A>0", "share", "norm^2"):
        t.add_column(col, justify="left" if col == "set" else "right", no_wrap=True)
    for name, label in (("silenced", "silenced (the rule)"), ("random_candidates", "E[random candidates]"),
                        ("random_positive", "E[random A > 0 tokens]"), ("candidates", "all candidates"),
                        ("positive", "all A > 0 tokens")):
        v = tax["sets"][name]
        t.add_row(Text(label), _count(v["count"]), _num(v["mean_grad_norm"]), _num(v["vs_positive_mean"]), _pct(v["share"]),
                  _pct(v["share_sq"]))
    out.append(t)
    out.append(Text(result["reading"].removeprefix(result["answer"]).strip()))
    return out


def _count(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3g}"


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
