"""`stapo calibrate`: the S2T silenced rate on your model and prompts, for a grid of thresholds.

    stapo calibrate --config tiny --limit 8 --out runs/calib-tiny
    stapo calibrate --set rollout.max_new_tokens=256 --limit 32 --out runs/calib-demo

Samples with the configured rollout engine, grades with the configured grader, teacher-forces p and
H in the training dtype and prints, per (tau_p, tau_h), the fraction of response tokens S2T silences
(before and after the advantage condition), marking the paper's band (1e-5..1e-3) and the cell
nearest ``--target``. Writes ``calibration.json`` and ``calibration.png`` under ``--out``. See
:mod:`stapo.core.calibrate`.
"""

from __future__ import annotations

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
    target: Annotated[float, typer.Option("--target", metavar="RATE", help="Silenced rate to aim at; the nearest cell is marked.")] = 1e-4,
    tau_p: Annotated[
        list[float] | None, typer.Option("--tau-p", metavar="P", help="tau_p values of the grid, repeatable (default: 1e-4 .. 0.1).")
    ] = None,
    tau_h_quantile: Annotated[
        list[float] | None,
        typer.Option("--tau-h-quantile", metavar="Q", help="tau_h quantiles of the grid, repeatable (default: 0.01 .. 0.8)."),
    ] = None,
    tau_h: Annotated[
        list[float] | None,
        typer.Option("--tau-h", metavar="NATS", help="Absolute tau_h values of the grid, repeatable (default: 0.01, 0.1, 1)."),
    ] = None,
) -> None:
    """Measure how many tokens S2T would silence on the configured model and prompts.

    The run's own setting (algorithm.s2t) is always in the grid, marked (cfg).

    Examples:

    \b
      stapo calibrate --config tiny --limit 8 --out runs/calib-tiny
      stapo calibrate --config tiny --limit 8 --tau-p 0.05 --tau-p 0.1 --tau-h-quantile 0.5 --out runs/calib-tiny
      stapo calibrate --set rollout.max_new_tokens=256 --limit 32 --out runs/calib-demo   # the demo model
    """
    from stapo.core.config import ConfigError, load_config

    try:
        cfg = load_config(resolve_config_path(config), list(set_ or []))
    except ConfigError as err:
        raise CLIError(str(err)) from None
    if limit < 1:
        raise CLIError(f"--limit must be >= 1 prompt, got {limit}")
    if not target > 0:
        raise CLIError(f"--target must be a rate > 0, got {target}")
    for p in tau_p or []:
        if not 0 < p <= 1:
            raise CLIError(f"--tau-p must be a probability in (0, 1], got {p}")
    for q in tau_h_quantile or []:
        if not 0 <= q <= 1:
            raise CLIError(f"--tau-h-quantile must be in [0, 1], got {q}")
    for h in tau_h or []:
        if h < 0:
            raise CLIError(f"--tau-h must be >= 0 nats, got {h}")
    check_inputs(cfg)
    quiet_known_noise(cfg.trainer.backend)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from stapo.core.calibrate import DEFAULT_TAU_H, DEFAULT_TAU_P, calibration_grid, collect, write_outputs

    console = Console()
    s2t = cfg.algorithm.s2t
    configured = None
    if s2t.target_rate is None:
        configured = (s2t.tau_p, "quantile", s2t.tau_h_quantile) if s2t.tau_h_quantile is not None else (
            s2t.tau_p, "absolute", s2t.tau_h)
    grid_h = [("quantile", q) for q in tau_h_quantile or []] + [("absolute", h) for h in tau_h or []]
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("sample, grade, teacher-force", total=None)

        def progress(_phase: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        sample = collect(cfg, limit=limit, progress=progress, log=console.print)
    result = calibration_grid(sample, tau_ps=tau_p or DEFAULT_TAU_P, tau_hs=grid_h or DEFAULT_TAU_H,
                              target=target, configured=configured)
    paths = write_outputs(result, out)
    for item in terminal_tables(result):
        console.print(item)
    console.print(f"wrote {paths['json']} and {paths['png']}")


def terminal_tables(result: dict) -> list:
    """The entropy summary and the grid (rows tau_p, columns tau_h) as rich renderables."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    st, s = result["stats"], result["sample"]
    qs = ", ".join(f"q{k}={v:.3g}" for k, v in st["entropy_quantiles"].items())
    head = Text(
        f"{s['responses']} responses ({s['kept']} in the update's population, {s['correct']} correct), "
        f"{st['tokens']} response tokens from {s['model']} ({s['dtype']}). Entropy (nats): {qs}; "
        f"H < 0.01: {100 * st['share_entropy_below_0.01']:.2f}%, p < 0.01: {100 * st['share_p_below_0.01']:.2f}%, "
        f"A > 0: {100 * st['share_positive_advantage']:.1f}% of tokens. Smallest measurable rate: "
        f"{result['resolution'] or float('nan'):.1e}."
    )
    rows = result["grid"]
    tps = sorted({r["tau_p"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    band = f"{result['band'][0]:g}..{result['band'][1]:g}"
    out: list = [head]
    judged = result.get("judged_on", "rate")
    if judged != "rate":
        out.append(Text("No sampled token has A > 0 (every group all right or all wrong), so the update would "
                        "silence nothing here; the band and target marks are on the rates before the advantage "
                        "condition (what S2T silences once a group has mixed rewards: times the share of tokens "
                        "with A > 0).", style="bold yellow"))
    for key, what in (("rate", "with A > 0: what the update silences"), ("rate_before_adv", "before the advantage condition")):
        t = Table(title=f"silenced fraction of response tokens, {what}", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
                  caption=f"bold: in the paper's band {band}; *: nearest {result['target']:g}; c: the config's setting"
                  if key == judged else None)
        t.add_column("tau_h", no_wrap=True)
        for tp in tps:
            t.add_column(f"{tp:g}", justify="right", no_wrap=True)
        for lab in labels:
            cells = []
            for tp in tps:
                r = next((r for r in rows if r["tau_p"] == tp and r["label"] == lab), None)
                if r is None:
                    cells.append("")
                    continue
                txt = _rate(r[key]) + (("*" if r["nearest_target"] else "") + ("c" if r["configured"] else "")
                                       if key == judged else "")
                cells.append(f"[bold]{txt}[/]" if key == judged and r["in_band"] else txt)
            t.add_row(lab, *cells)
        out.append(t)
    return out


def _rate(x: float) -> str:
    """A rate in 6 characters at most: 0, 1.6e-2."""
    if not x:
        return "0"
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e)}"
