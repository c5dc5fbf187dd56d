"""`stapo train --plan` and the memory check `stapo train` runs at start (stapo.core.train.plan; docs/gpu.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from stapo.cli.common import CLIError, JobError

if TYPE_CHECKING:
    from stapo.core.config import Config
    from stapo.core.train.plan import Plan


def print_plan(cfg: Config, world_size: int | None, card: float | None, as_json: bool) -> None:
    """``--plan``: the memory plan at ``world_size`` ranks (default: the launcher's WORLD_SIZE, or 1).
    Exits 1 when it does not fit (``fix`` in ``--json`` lists the ``--set`` overrides that fit it), so
    a script can gate a launch on it."""
    import json
    import os

    from stapo.core.train.plan import PlanError, card_gib, plan_run

    ranks = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        result = plan_run(cfg, ranks, card_gib(cfg, card))
    except PlanError as err:
        raise CLIError(str(err)) from None
    typer.echo(json.dumps(result.to_json()) if as_json else "\n".join(result.report()))
    if not result.fits:
        raise typer.Exit(1)


def plan_at_start(cfg: Config, card: float | None) -> tuple[Config, Plan | None]:
    """On a GPU: refuse a config that cannot fit, print the plan's line (rank 0), resolve the update's
    path. Returns the config and the plan (None on a CPU), which the run is built with."""
    import os

    from stapo.core.train.plan import PlanError
    from stapo.core.train.plan import plan_at_start as plan_launch

    try:
        cfg2, result = plan_launch(cfg, int(os.environ.get("WORLD_SIZE", "1")), card)
    except PlanError as err:
        raise JobError(str(err)) from None
    if os.environ.get("RANK", "0") == "0":
        typer.echo(result.line() if result else "memory plan: skipped (CPU run; `stapo train --plan` plans a GPU run)")
    return cfg2, result
