"""`stapo recipes`: the shipped recipes, one line each with their source, and resolved diffs.

    stapo recipes                      # name, what it is, the paper / code it follows
    stapo recipes diff dapo stapo      # every resolved field that differs (defaults included)
    stapo recipes diff grpo configs/my.yaml --set algorithm.kl_coef=0.04

A recipe's description and source are the ``# Recipe:`` and ``# Source:`` lines at the top of its
YAML (configs/<name>.yaml), so the file stays the one place that says what it is. The diff compares
the *validated* configs, so a value a file leaves at its default still shows when the other sets it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from stapo.cli.common import CLIError, SetOpt, resolve_config_path

app = typer.Typer(
    help="The shipped recipes (STAPO and its baselines) and what differs between two of them.",
    invoke_without_command=True,
    no_args_is_help=False,
)


def recipe_header(path: Path) -> dict[str, str]:
    """``{"recipe": ..., "source": ...}`` from the ``# Recipe:`` / ``# Source:`` comment lines
    (falls back to the file's first comment line for presets without them)."""
    out: dict[str, str] = {}
    first = ""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        first = first or text
        for key in ("Recipe", "Source"):
            if text.startswith(f"{key}:"):
                out[key.lower()] = text[len(key) + 1 :].strip()
    out.setdefault("recipe", first)
    out.setdefault("source", "")
    return out


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": value} (lists stay values)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flatten(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
    return out


def resolved_diff(a: Path, b: Path, overrides_b: list[str] | None = None) -> list[tuple[str, Any, Any]]:
    """(field, value in a, value in b) for every field whose validated values differ, sorted by field."""
    from stapo.core.config import load_config

    fa = flatten(load_config(a).model_dump(mode="json", by_alias=True))
    fb = flatten(load_config(b, overrides_b or []).model_dump(mode="json", by_alias=True))
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


@app.callback()
def _list(ctx: typer.Context) -> None:
    """List the recipes: name, what it is, and the paper or code it follows."""
    if ctx.invoked_subcommand is not None:
        return
    from stapo.configs import preset_names, preset_path

    rows = []
    for name in preset_names():
        path = preset_path(name)
        assert path is not None
        rows.append((name, recipe_header(path)))
    width = max(len(n) for n, _ in rows)
    for name, h in rows:
        typer.echo(f"{name:<{width}}  {h['recipe']}")
        if h["source"]:
            typer.echo(f"{'':<{width}}    source: {h['source']}")
    typer.echo("\n`stapo recipes diff A B` shows what differs; `stapo train --config NAME` runs one.")


@app.command("diff")
def diff(
    a: Annotated[str, typer.Argument(help="First recipe: a preset name (dapo) or a YAML path.")],
    b: Annotated[str, typer.Argument(help="Second recipe: a preset name (stapo) or a YAML path.")],
    set_: SetOpt = None,
) -> None:
    """Every resolved config field that differs between recipe A and recipe B (B with --set applied)."""
    from stapo.core.config import ConfigError

    try:
        rows = resolved_diff(resolve_config_path(Path(a)), resolve_config_path(Path(b)), list(set_ or []))
    except ConfigError as err:
        raise CLIError(str(err)) from None
    if not rows:
        typer.echo(f"{a} and {b} resolve to the same config")
        return
    width = max(len(k) for k, _, _ in rows)
    typer.echo(f"{'field':<{width}}  {a} -> {b}")
    for key, va, vb in rows:
        typer.echo(f"{key:<{width}}  {va!r} -> {vb!r}")
