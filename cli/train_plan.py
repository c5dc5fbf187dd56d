"""`stapo train --plan`: the memory plan of a config (stapo.core.train.plan; docs/gpu.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from stapo.core.config import Config


def print_plan(cfg: Config, world_size: int | None, card: float | None, as_json: bool) -> None:
    """``--plan``: the memory plan at ``world_size`` ranks (default: the launcher's WORLD_SIZE, or 1).
    Exits 1 when it does not fit (``fix`` in ``--json`` lists the ``--set`` overrides that fit it), so
    a script can gate a launch on it."""
    import json

    from stapo.core.train.prepare import memory_plan

    result = memory_plan(cfg, world_size, card)
    typer.echo(json.dumps(result.to_json()) if as_json else "\n".join(result.report()))
    if not result.fits:
        raise typer.Exit(1)
