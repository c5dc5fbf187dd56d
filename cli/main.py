"""The ``stapo`` command line: a thin typer app that builds configs and calls the library.

    stapo prepare   data sets -> normalized prompt files
    stapo train     the RL loop (STAPO, GRPO, DAPO, 20-Entropy, JustRL, ...)
    stapo eval      benchmarks: avg@k, pass@k, maj@k
    stapo compare   runs side by side: tables, curves, HTML report
    stapo verifier  serve | bench: the math-verification service
    stapo inspect   the tokens a mask silenced, in context
    stapo recipes   the shipped recipes and their sources; `recipes diff A B`

Each command lives in its own module (``cli/<name>.py``) and imports heavy libraries (torch,
transformers, vllm, deepspeed) only inside the command body, so ``stapo --help`` stays fast.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

from stapo import __version__
from stapo.cli import compare, evaluate, inspect, prepare, recipes, train, verifier
from stapo.cli.common import CLIError

app = typer.Typer(
    name="stapo",
    help="STAPO and its baselines for RL with verifiable math rewards, plus a math-verification service.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"stapo {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """STAPO: silence spurious tokens, train stably. Run `stapo COMMAND --help` for each command."""


app.command("prepare")(prepare.command)
app.command("train")(train.command)
app.command("eval")(evaluate.command)
app.command("compare")(compare.command)
app.command("inspect")(inspect.command)
app.add_typer(verifier.app, name="verifier")
app.add_typer(recipes.app, name="recipes")


def main() -> None:
    """Entry point: run the app, turning a :class:`CLIError` into one line and exit status 2."""
    try:
        app()
    except CLIError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}")
        sys.exit(2)


if __name__ == "__main__":
    main()
