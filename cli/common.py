"""Shared pieces of the command line: the one user-facing error type, typed option aliases, and
the checks that run before a command writes anything.

Every command module raises :class:`CLIError` for mistakes a user can fix (a bad path, a bad
``--set``); :func:`stapo.cli.main.main` prints it in one line and exits with status 2, without a
traceback. Library errors that are user mistakes (``stapo.core.config.ConfigError``) are turned
into a ``CLIError`` by the command that called the library; ``main`` turns the rest into a short
message too (the traceback is behind ``--debug``).

The checks that run before a model loads (inputs, launch, memory plan, run dir, resume) are the
library's (``stapo.core.train.prepare``); :func:`prepare_errors` turns their refusals into these
one-line errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from stapo.core.lazy import KNOWN_NOISE, quiet_known_noise

if TYPE_CHECKING:
    from rich.console import Console


class CLIError(Exception):
    """A user mistake: printed as one red line, exit status 2."""


class JobError(CLIError):
    """A mistake in what every rank of a launch was given alike (the config, its inputs, the launch's
    size): under a launcher only each node's first rank prints it (:func:`stapo.cli.main.main`), so
    an 8-rank launch shows it once, not eight times."""


ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", metavar="NAME|FILE", help="A preset name (tiny, stapo, grpo, ...: `stapo recipes`) or a YAML config file. Default: the command's preset."),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override one config field, repeatable: --set trainer.max_steps=10 --set algorithm.s2t.tau_p=0.02 (all fields: docs/config.md)",
    ),
]


WIDE = 160
"""Columns of rich output when stdout is not a terminal (a pipe, a log file): tables are not cut at
rich's 80-column fallback. A terminal keeps its own width."""


def console() -> Console:
    """The rich console of a command's output: the terminal's width, or :data:`WIDE` off a terminal."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else WIDE)


__all__ = ["KNOWN_NOISE", "quiet_known_noise"]  # (with the rest: re-exported for the commands)


def not_built(name: str) -> None:
    """Commands not built yet say so and exit non-zero."""
    raise CLIError(f"`stapo {name}` is not built yet in this version of stapo.")


def resolve_config_path(config: Path | None, default: str = "demo", *, what: str = "config") -> Path:
    """A file path, or the name of a preset shipped in `configs/` (demo, tiny, stapo, grpo, ...).

    ``what`` names the option in the error (``recipe`` for ``--recipe``), which offers the closest
    preset names (``did you mean stapo?``) before the full list."""
    import difflib

    from stapo.configs import preset_names, preset_path

    if config is not None and config.is_file():
        return config
    name = str(config) if config is not None else default
    preset = preset_path(name[:-5] if name.endswith(".yaml") else name)
    if preset is None:
        close = difflib.get_close_matches(name.removesuffix(".yaml"), preset_names(), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise CLIError(f"{what} {name!r} is neither a file nor a preset; {hint}presets: {', '.join(preset_names())}")
    return preset


@contextlib.contextmanager
def prepare_errors() -> Iterator[None]:
    """A run's refusal (``stapo.core.train.prepare.PrepareError``) as this command line's one line: a
    :class:`JobError` when every rank meets it alike, else a :class:`CLIError`."""
    from stapo.core.train.prepare import PrepareError

    try:
        yield
    except PrepareError as err:
        raise (JobError if err.job_wide else CLIError)(str(err)) from None


class _BelowError:
    """A ``logging`` filter that keeps errors only (ranks other than 0: rank 0 shows the warnings)."""

    def filter(self, record: object) -> bool:
        return record.levelno >= 40  # type: ignore[attr-defined]  # logging.ERROR


# Libraries whose warnings every rank repeats alike (by logger name); on ranks other than 0 only their
# errors show. transformers reads its verbosity from the environment instead (TRANSFORMERS_VERBOSITY).
PER_RANK_NOISE = ("DeepSpeed", "torch.distributed", "huggingface_hub")


@contextlib.contextmanager
def quiet_job_noise(environ: MutableMapping[str, str], *, terminal: bool) -> Iterator[None]:
    """Around a command, before any library loads: one copy of each warning per job, and no
    progress bars in a log. Everything it changes is put back on exit (a command run in-process).

    Under a launcher every rank imports the same libraries and warns alike (FutureWarnings,
    DeepSpeed's accelerator probe): ranks other than 0 keep errors only, so a 2-rank log carries one
    copy. Off a terminal (a log file, a pipe, a batch job) progress bars are redrawn as lines of
    carriage returns: tqdm's (transformers' loading and saving bars, huggingface_hub's, DeepSpeed's)
    are turned off through their environment switches; a terminal keeps them.
    """
    import logging
    import warnings

    added: dict[str, str] = {}
    if not terminal:
        added["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers and huggingface_hub read it
        added["TQDM_DISABLE"] = "1"  # every other tqdm bar (tqdm >= 4.66 reads TQDM_* defaults)
    rank0 = int(environ.get("RANK") or 0) == 0
    if not rank0:
        added["TRANSFORMERS_VERBOSITY"] = "error"
    added = {k: v for k, v in added.items() if k not in environ}
    environ.update(added)
    filters = [] if rank0 else [(logging.getLogger(name), _BelowError()) for name in PER_RANK_NOISE]
    for logger, f in filters:
        logger.addFilter(f)  # type: ignore[arg-type]
    try:
        with warnings.catch_warnings():
            if not rank0:
                warnings.simplefilter("ignore")
            yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)  # type: ignore[arg-type]
        for key in added:
            environ.pop(key, None)
