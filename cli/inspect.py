"""`stapo inspect`: the tokens a mask silenced, in context, and the token phase diagram of a step.

    stapo inspect runs/stapo                 # newest dump, report in runs/stapo/inspect/step_N/
    stapo inspect runs/stapo --step 12 --out /tmp/insp

Reads ``RUN/dumps/step_NNNNNN.json`` (written by `stapo train` every ``logging.dump_tokens_every``
steps), prints the silenced tokens with their context, probability, entropy, advantage and top
alternatives, the phase table (share of tokens and of gradient norm per p x H x A-sign cell) and
how Theorem 3.1's gradient-norm form compares with the measured norm; writes ``inspect.html``,
``inspect.json`` and two PNGs. See :mod:`stapo.evals.inspect`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stapo.cli.common import CLIError
from stapo.cli.common import console as make_console


def command(
    run: Annotated[Path, typer.Argument(metavar="RUN", help="Training run dir (with dumps/), or one dump file.")],
    step: Annotated[int | None, typer.Option("--step", metavar="N", help="Step of the dump (default: the newest).")] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", metavar="DIR", help="Report folder (default: RUN/inspect/step_N).")
    ] = None,
    rows: Annotated[int, typer.Option("--rows", metavar="N", help="Silenced tokens shown in the terminal.")] = 20,
) -> None:
    """Show silenced tokens in context and the token phase diagram from a run's token dumps.

    Examples:

    \b
      stapo inspect runs/stapo                    # newest dump, report in runs/stapo/inspect/step_N/
      stapo inspect runs/stapo --step 12 --out /tmp/insp
      stapo inspect runs/stapo/dumps/step_000012.json
    """
    from stapo.evals.inspect import inspect_run, load_dump, terminal_tables

    console = make_console()  # a pipe or a log file is not cut at 80 columns
    try:
        dump = load_dump(run, step)
        base = run.parent.parent if run.is_file() else run
        out_dir = out if out is not None else base / "inspect" / f"step_{int(dump['step']):06d}"
        report = inspect_run(run, step=step, out_dir=out_dir)
    except (FileNotFoundError, ValueError) as err:
        raise CLIError(str(err)) from None
    for item in terminal_tables(report, max_rows=rows):
        console.print(item)
    console.print(f"report: {out_dir / 'inspect.html'}")
