"""`stapo recipes`: the shipped recipes, one line each with their source, and resolved diffs.

    stapo recipes                      # name, what it is, the paper / code it follows
    stapo recipes diff dapo stapo      # every resolved field that differs (defaults included)
    stapo recipes diff grpo configs/my.yaml --set algorithm.kl_coef=0.04
    stapo recipes matched              # every recipe's frame (batch, mini-batches, lengths, model) vs stapo's
    stapo recipes matched justrl stapo --out runs/matched   # same budget, grader, schedule, seed

A recipe's description and source are the ``# Recipe:`` and ``# Source:`` lines at the top of its
YAML (configs/<name>.yaml), so the file stays the one place that says what it is. The diff compares
the *validated* configs, so a value a file leaves at its default still shows when the other sets it.
``matched`` writes two configs that differ in their method keys only (:mod:`stapo.core.fairness`):
the shipped recipes keep their sources' own budgets, and a comparison that should isolate the
method runs the matched pair instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer

from stapo.cli.common import CLIError, SetOpt, resolve_config_path
from stapo.core.fairness import LAYER_KEYS, LAYER_RECIPES, flatten, owned_by

__all__ = ["LAYER_KEYS", "LAYER_RECIPES", "flatten", "owned_by", "layer_drift", "resolved_diff", "recipe_header"]

app = typer.Typer(
    help="The shipped recipes (STAPO and its baselines) and what differs between two of them.",
    invoke_without_command=True,
    no_args_is_help=False,
)


LABEL_KEYS = ("algorithm.name",)


def layer_drift(name: str, base: Path, recipe: Path) -> list[tuple[str, Any, Any]]:
    """The differences between ``base`` (stapo) and the layer recipe ``name`` that its layers do not own
    (``LAYER_KEYS`` / ``LAYER_RECIPES`` in :mod:`stapo.core.fairness`)."""
    if name not in LAYER_RECIPES:
        raise KeyError(f"{name}: not a declared layer recipe; add it to LAYER_RECIPES in stapo.core.fairness")
    owned = LABEL_KEYS + tuple(k for layer in LAYER_RECIPES[name] for k in LAYER_KEYS[layer])
    return [row for row in resolved_diff(base, recipe) if not owned_by(row[0], owned)]


def recipe_header(path: Path) -> dict[str, str]:
    """``{"recipe": ..., "source": ...}`` from the ``# Recipe:`` / ``# Source:`` comment lines
    (falls back to the file's first comment line for presets without them). A field wrapped over
    several comment lines is read whole (:func:`_continues`)."""
    out: dict[str, str] = {}
    first = ""
    comments = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        comments.append(line.lstrip("#").strip())
    key = None
    for text in comments:
        first = first or text
        if key is not None and _continues(out[key], text):
            out[key] = f"{out[key]} {text}"
            continue
        key = None
        for name in ("Recipe", "Source"):
            if text.startswith(f"{name}:"):
                key = name.lower()
                out[key] = text[len(name) + 1 :].strip()
    out.setdefault("recipe", first)
    out.setdefault("source", "")
    return out


_LABELLED = re.compile(r"^[A-Z][\w -]*: ")
"""A comment line that opens a labelled note of its own (``Source: ...``, ``Run: ...``, ``Provenance of each value: ...``)."""


def _continues(text: str, line: str) -> bool:
    """Whether comment ``line`` goes on with the field read so far: an open parenthesis, a sentence
    cut mid-way whose next line starts in lower case, or one cut after a word or a comma (whatever
    its next line starts with: a name such as JustRL). A finished sentence, or a closing parenthesis,
    ends the field; the next note is not part of it."""
    if text.count("(") > text.count(")"):
        return True
    if not line or text.endswith((".", "!", "?", ":")) or _LABELLED.match(line):
        return False
    return not line[0].isupper() or text[-1].isalnum() or text.endswith(",")  # "runs it on" / "JustRL's ..."


def _wrapped(text: str, indent: int, then: int) -> str:
    """``text`` indented by ``indent`` (its later lines by ``then``) and wrapped at word boundaries to
    the terminal's width (:data:`stapo.cli.common.WIDE` off a terminal), never cut: a long source
    reads whole on an 80-column terminal."""
    import shutil
    import textwrap

    from stapo.cli.common import WIDE

    columns = max(shutil.get_terminal_size((WIDE, 24)).columns, then + 40)
    return textwrap.fill(text, width=columns, initial_indent=" " * indent, subsequent_indent=" " * then,
                         break_long_words=False, break_on_hyphens=False)


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
        typer.echo(_wrapped(f"{name:<{width}}  {h['recipe']}", indent=0, then=width + 2))
        if h["source"]:
            typer.echo(_wrapped(f"source: {h['source']}", indent=width + 4, then=width + 12))
    typer.echo("\n" + _wrapped("`stapo recipes diff A B` shows what differs; `stapo train --config NAME` runs one.",
                               indent=0, then=0))


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


def budget(cfg: Any) -> dict[str, int]:
    """A run's sampling budget: prompts x samples x response length x steps (the most tokens it can generate)."""
    r = cfg.rollout
    out = {"prompts_per_step": r.prompts_per_step, "n": r.n, "max_new_tokens": r.max_new_tokens,
           "max_steps": cfg.trainer.max_steps}
    out["max_tokens"] = out["prompts_per_step"] * out["n"] * out["max_new_tokens"] * out["max_steps"]
    return out


def matched_configs(ref: Path, other: Path, overrides: list[str]) -> tuple[Any, Any, list[str]]:
    """(reference config, other config matched to it, the --set overrides that matched it).

    The other recipe takes the reference's value for every confound key (:mod:`stapo.core.fairness`:
    batch, response length, grader, reward scale, sampling, schedule, seed, model, data, eval), so
    the two differ in method and execution keys only. ``overrides`` apply to both first."""
    from stapo.core.config import load_config
    from stapo.core.fairness import config_differences, matched_overrides

    cfg_ref = load_config(ref, overrides)
    cfg_other = load_config(other, overrides)
    dump = lambda c: c.model_dump(mode="json", by_alias=True)  # noqa: E731
    extra = matched_overrides(dump(cfg_ref), dump(cfg_other))
    matched = load_config(other, [*overrides, *extra])
    left = [d.key for d in config_differences(dump(cfg_ref), dump(matched)) if d.confound]
    if left:  # cannot happen unless a validator rewrites a value; say so rather than claim a match
        raise ValueError(f"matching left confounds: {', '.join(left)}")
    return cfg_ref, matched, extra


def frame_report() -> tuple[list[str], list[str]]:
    """(lines of the frame table of every shipped recipe but the CPU presets, names of the recipes
    in ``SHARED_FRAME`` whose frame differs from stapo's). Each line names the frame keys that
    differ from stapo's."""
    from stapo.configs import preset_names, preset_path
    from stapo.core.config import load_config
    from stapo.core.fairness import FRAME_KEYS, SHARED_FRAME, frame_differences, frame_of

    dumps = {n: load_config(preset_path(n)).model_dump(mode="json", by_alias=True)
             for n in preset_names() if n not in ("tiny", "demo")}
    ref = dumps["stapo"]
    rows = [["recipe", *(k.rsplit(".", 1)[1] for k in FRAME_KEYS), "frame"]]
    notes, broken = [""], []
    for name, dump in dumps.items():
        diff = {k for k, _, _ in frame_differences(ref, dump)}
        rows.append([name, *(f"{v}{'*' if k in diff else ''}" for k, v in frame_of(dump).items()),
                     "shared" if name in SHARED_FRAME else "own sources"])
        notes.append("  differs: " + ", ".join(k for k in FRAME_KEYS if k in diff) if diff else "")
        if diff and name in SHARED_FRAME:
            broken.append(name)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + note
             for r, note in zip(rows, notes, strict=True)]
    lines.append("(* = differs from stapo's frame)")
    return lines, broken


@app.command("matched")
def matched(
    a: Annotated[str | None, typer.Argument(
        help="Reference recipe (its budget, grader, schedule, seed... are kept). None: the frame of every recipe.")] = None,
    b: Annotated[str | None, typer.Argument(help="Recipe to match to A (keeps its method keys only).")] = None,
    match_to: Annotated[
        str, typer.Option("--match-to", help="Which recipe's non-method values both get: `a` (default) or `b`.")
    ] = "a",
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Folder to write the two matched configs to (<name>.yaml each).")
    ] = None,
    set_: SetOpt = None,
) -> None:
    """Two recipes with the same budget (prompts x samples x response length x steps), grader, reward scale,
    sampling, schedule and seed, so that comparing them measures the method alone.

    The shipped recipes keep their sources' values; this writes matched copies. --set applies to both
    (e.g. --set trainer.max_steps=100 to match a shorter run). Without recipes: every shipped recipe's
    frame (model, batch, mini-batches, lengths) beside stapo's, naming the keys that differ; it fails
    when a recipe meant to share stapo's frame does not."""
    from stapo.core.config import ConfigError, save_config
    from stapo.core.fairness import config_differences

    if a is None or b is None:
        if a is not None:
            raise CLIError("give two recipes (A B) to match, or none to see every recipe's frame")
        lines, broken = frame_report()
        for line in lines:
            typer.echo(line)
        if broken:
            raise CLIError(f"meant to share stapo's frame but differ: {', '.join(broken)}")
        typer.echo("[shared] recipes share stapo's frame; [own sources] keep their papers' frames: "
                   "`stapo recipes matched stapo NAME --out DIR` writes a pair with one frame.")
        return

    if match_to not in ("a", "b"):
        raise CLIError(f"--match-to must be `a` or `b`, got {match_to!r}")
    names = [Path(x).name.removesuffix(".yaml") for x in (a, b)]
    if names[0] == names[1]:
        names = [f"{names[0]}-a", f"{names[1]}-b"]
    paths = [resolve_config_path(Path(a)), resolve_config_path(Path(b))]
    order = (0, 1) if match_to == "a" else (1, 0)
    try:
        ref, other, extra = matched_configs(paths[order[0]], paths[order[1]], list(set_ or []))
    except (ConfigError, ValueError) as err:
        raise CLIError(f"cannot match {names[order[1]]} to {names[order[0]]}: {err}") from None
    cfgs = {names[order[0]]: ref, names[order[1]]: other}
    typer.echo(f"{names[order[1]]} matched to {names[order[0]]} ({len(extra)} values changed):")
    for item in extra:
        typer.echo(f"  --set {item}")
    typer.echo("budget (prompts x samples x response length x steps = max generated tokens):")
    for name, c in cfgs.items():
        bud = budget(c)
        typer.echo(f"  {name}: {bud['prompts_per_step']} x {bud['n']} x {bud['max_new_tokens']} x {bud['max_steps']}"
                   f" = {bud['max_tokens']:,}; grader {c.reward.mode}, reward {c.reward.scale.correct:g}/"
                   f"{c.reward.scale.wrong:g}")
    diffs = config_differences(ref.model_dump(mode="json", by_alias=True), other.model_dump(mode="json", by_alias=True))
    typer.echo("what still differs (the method): " + ", ".join(d.key for d in diffs if d.group == "method"))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for name, c in cfgs.items():
            save_config(c, out / f"{name}.yaml")
            typer.echo(f"wrote {out / f'{name}.yaml'}  (stapo train --config {out / f'{name}.yaml'})")
