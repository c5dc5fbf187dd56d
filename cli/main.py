"""The ``stapo`` command line: a thin typer app that builds configs and calls the library.

    stapo prepare   data sets -> normalized prompt files
    stapo train     the RL loop (STAPO, GRPO, DAPO, 20-Entropy, JustRL, ...)
    stapo eval      benchmarks: avg@k, pass@k, maj@k
    stapo compare   runs side by side: tables, curves, HTML report
    stapo verifier  serve | bench: the math-verification service
    stapo inspect   the tokens a mask silenced, in context
    stapo calibrate will S2T silence anything on your model: tokens per mini-batch, step and run; their norms
    stapo probe     whether S2T points one update in a better direction: paired batches, a stated verdict
    stapo recipes   the shipped recipes and their sources; `recipes diff A B`
    stapo rollout   serve: a vLLM server for rollout.engine=vllm_server

Each command lives in its own module (``cli/<name>.py``) and imports heavy libraries (torch,
transformers, vllm, deepspeed) only inside the command body, so ``stapo --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Mapping
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from stapo import __version__
from stapo.cli import calibrate, compare, evaluate, inspect, prepare, probe, recipes, rollout, train, verifier
from stapo.cli.common import CLIError, JobError, quiet_job_noise

app = typer.Typer(
    name="stapo",
    help="STAPO and its baselines for RL with verifiable math rewards, plus a math-verification service.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: the rich panels label every flag `<bool>` (`--help <bool>`)
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
    debug: Annotated[
        bool,
        typer.Option("--debug", help="Show the full traceback of an error (also after the command, or STAPO_DEBUG=1)."),
    ] = False,
) -> None:
    """STAPO: silence spurious tokens, train stably. Run `stapo COMMAND --help` for each command.

    Start here: `stapo train --config tiny` (a tiny random model, seconds on a CPU), then
    `stapo inspect runs/<run>` and `stapo recipes`.
    """


app.command("prepare")(prepare.command)
app.command("train")(train.command)
app.command("eval")(evaluate.command)
app.command("compare")(compare.command)
app.command("inspect")(inspect.command)
app.command("calibrate")(calibrate.command)
app.command("probe")(probe.command)
app.add_typer(verifier.app, name="verifier")
app.add_typer(recipes.app, name="recipes")
app.add_typer(rollout.app, name="rollout")


# Library errors that are a user's to fix: their message alone says what is wrong (no traceback).
JOB_ERROR_GRACE_S = 30.0
"""How long a rank that does not print a :class:`JobError` waits for the launcher to end it."""
_USER_ERRORS = ("ConfigError", "DataError", "ModelLoadError", "RewardError", "EvalStateError")


def _error(message: str) -> None:
    """One red ``error:`` line (more lines only when the message has them), never re-wrapped."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}")


def _rank_label(environ: Mapping[str, str]) -> str:
    """``"rank 3/8 on gpu-node-2: "`` under a launcher (WORLD_SIZE > 1), else ``""``: a rank's own
    failure says which process on which machine failed."""
    if int(environ.get("WORLD_SIZE") or 1) <= 1:
        return ""
    import socket

    return f"rank {environ.get('RANK', '?')}/{environ['WORLD_SIZE']} on {socket.gethostname()}: "


def main() -> None:
    """Entry point: run the app; errors become a short message (traceback only with ``--debug``).

    A :class:`CLIError` (a mistake the user can fix) exits 2; a library's user error (bad config,
    unreadable data, a model that does not load) exits 2 with its message; anything else exits 1
    with its type and message and a hint to rerun with ``--debug``. ``--debug`` is taken out of the
    arguments wherever it stands, so ``stapo train ... --debug`` works as well as ``stapo --debug train``.
    Under a launcher (``WORLD_SIZE`` > 1) a :class:`JobError` (what every rank was given alike) is
    printed by each node's first rank only; any other failure names its rank and host.
    """
    debug = "--debug" in sys.argv[1:] or os.environ.get("STAPO_DEBUG", "") not in ("", "0")
    sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if a != "--debug")]
    where = _rank_label(os.environ)
    try:
        with quiet_job_noise(os.environ, terminal=sys.stderr.isatty()):  # before any library loads
            app()
    except JobError as err:  # the same on every rank: each node's first rank says it
        if debug:
            traceback.print_exc()
        if os.environ.get("LOCAL_RANK", "0") == "0":
            _error(str(err))
        else:
            # The launcher ends every rank once one exits: a quiet rank that went first could end the
            # node's first rank before its line is out. The quiet ones wait to be ended (bounded).
            time.sleep(JOB_ERROR_GRACE_S)
        sys.exit(2)
    except CLIError as err:
        if debug:
            traceback.print_exc()
        _error(where + str(err))
        sys.exit(2)
    except Exception as err:  # the boundary: nothing reaches the user as a bare traceback
        if debug:
            traceback.print_exc()
            sys.exit(1)
        if type(err).__name__ in _USER_ERRORS or isinstance(err, (FileNotFoundError, PermissionError)):
            _error(where + str(err).strip())
            sys.exit(2)
        _error(f"{where}{type(err).__name__}: {str(err).strip() or '(no message)'}")
        Console(stderr=True, soft_wrap=True).print(
            "  unexpected; rerun with --debug for the traceback (and report it if it looks like a stapo bug)"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
