"""`stapo compare`: put training runs and eval results side by side (tables, curves, HTML report).

    stapo compare runs/grpo_eval runs/stapo_eval runs/grpo runs/stapo --out reports/cmp

The first dir is the baseline; every other run's numbers carry a delta against it. Several seeds of
one method (``--group``, or runs of one recipe that differ only in the seed) are summarised as a
mean with a 95% t interval, and each method's paired per-seed difference against the first. Runs whose
``config.yaml`` differ in more than the method (batch, length, grader, reward scale, sampler,
schedule, seed, ...) get a warning in the tables and the report. Writes
``compare.json``, ``curves/*.png`` and a self-contained ``report.html`` under ``--out``, prints
the accuracy and training tables at the console's width, and ends with the conclusion: per metric,
which method is ahead, by how much, its paired 95% interval and whether it excludes 0. See
:mod:`stapo.evals.compare`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stapo.cli.common import CLIError


def command(
    runs: Annotated[
        list[Path],
        typer.Argument(metavar="RUN", help="Training run dirs and/or eval output dirs; the first one is the baseline."),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", metavar="DIR", help="Folder for compare.json, curves/*.png, report.html.")] = Path(
        "compare_report"
    ),
    label: Annotated[
        list[str] | None,
        typer.Option("--label", "-l", metavar="NAME", help="Display name per run, repeatable, in the order of RUNS (default: dir names)."),
    ] = None,
    group: Annotated[
        list[str] | None,
        typer.Option("--group", "-g", metavar="METHOD",
                     help="Method of each run, repeatable, in the order of RUNS: runs of one method are its seeds "
                          "(mean, 95% t interval, paired difference vs the first method). Default: seeds of one "
                          "recipe group by themselves."),
    ] = None,
) -> None:
    """Compare runs: per-benchmark accuracy with deltas vs the first run, training curves, an HTML report.

    Examples:

    \b
      stapo compare runs/grpo_eval runs/stapo_eval --out reports/evals     # accuracy tables with deltas
      stapo compare runs/grpo runs/stapo -l GRPO -l STAPO --out reports/cmp # training curves
      stapo compare runs/grpo-s0 runs/grpo-s1 runs/stapo-s0 runs/stapo-s1 -g GRPO -g GRPO -g STAPO -g STAPO
    """
    from rich.console import Console

    from stapo.evals.compare import compare_runs, conclusion_text, terminal_tables

    console = Console()
    try:
        report = compare_runs(runs, out_dir=out, labels=label or None, groups=group or None)
    except (FileNotFoundError, ValueError) as err:
        raise CLIError(str(err)) from None
    for table in terminal_tables(report, width=console.width):
        console.print(table)
    console.print(f"report: {out / 'report.html'}  ({len(report['curves'])} curve plots)")
    if report["config_check"]["warning"]:  # after the tables, where a reader looks last
        console.print(report["config_check"]["warning"], style="bold red", markup=False, soft_wrap=True)
    text = conclusion_text(report, width=console.width)
    if text:
        console.print(text, style="bold", markup=False, soft_wrap=True)
