"""`stapo prepare`: turn a data source into a prepared prompt dir (train.jsonl, val.jsonl, manifest.json).

    stapo prepare --out prepared/arith                                   # the built-in arithmetic set
    stapo prepare dapo_math_17k --template dapo --tokenizer Qwen/Qwen3-8B-Base   # -> prepared/dapo_math_17k
    stapo prepare --source gsm8k --template boxed --out prepared/gsm8k
    stapo prepare --source dapo_math_17k --template dapo --set data.english_only=true \\
        --tokenizer Qwen/Qwen3-1.7B-Base --set data.max_prompt_tokens=1024 --out prepared/dapo
    stapo prepare --source my.jsonl --set data.problem_field=question --out prepared/mine

The named sets (``dapo_math_17k``, the benchmarks) ship with stapo (``stapo/evals/data``), so this
runs offline; ``data.data_dir`` / ``$STAPO_DATA_DIR`` point it at another copy.

Thin: builds the config (``--config`` file, ``--set`` overrides, then SOURCE / ``--source`` /
``--template``),
loads the tokenizer when one is named (for the length filter), and calls
:func:`stapo.core.task.data.prepare_data`. Train on the result with ``--set data.source=prepared/gsm8k``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stapo.cli.common import CLIError, ConfigOpt, SetOpt, resolve_config_path

DAPO_HUB_REPO = "BytedTsinghua-SIA/DAPO-Math-17k"  # = stapo.core.task.data.DAPO_HUB_REPO (not imported: --help stays fast)


def command(
    source_arg: Annotated[
        str | None,
        typer.Argument(
            metavar="SOURCE",
            help="The data source, same as --source (e.g. dapo_math_17k); default: data.source of the config.",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            metavar="DIR",
            help="Folder to write (created; a previous prepared dir is replaced). Default: prepared/<source>.",
        ),
    ] = None,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    source: Annotated[
        str | None,
        typer.Option(
            help="arithmetic | dapo_math_17k | gsm8k | math500 | aime24 | aime25 | amc23 | minerva_math | "
            "olympiadbench | a .jsonl/.parquet file | a prepared dir | hf:<id> or hf:<id>:<config>@<split> "
            "(sets data.source)."
        ),
    ] = None,
    template: Annotated[
        str | None, typer.Option(help="Prompt template: dapo | boxed | short | none (sets data.template).")
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="Tokenizer for the data.max_prompt_tokens length filter (HF id, path, tiny-random, "
            "demo:smollm2-135m-instruct). Without it no length filter runs."
        ),
    ] = None,
    rebuild: Annotated[
        bool,
        typer.Option(
            "--rebuild",
            help="dapo_math_17k only: rebuild dapo_math_17k.jsonl from the Hugging Face original "
            f"({DAPO_HUB_REPO}, downloaded, or --from FILE) with the shipped copy's deduplication, check it "
            "against the shipped copy's checksum, and write it to --out (default ~/.cache/stapo/data).",
        ),
    ] = False,
    from_file: Annotated[
        Path | None,
        typer.Option("--from", help="With --rebuild: a local copy of the hub's file (.parquet, or .jsonl rows)."),
    ] = None,
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="With --rebuild: require the shipped copy's checksum.")
    ] = True,
) -> None:
    """Load, dedupe, filter, template and split a data source; write it to --out with a manifest.

    Examples:

    \b
      stapo prepare --out prepared/arith          # the built-in arithmetic set
      stapo prepare dapo_math_17k --template dapo --tokenizer Qwen/Qwen3-8B-Base --out prepared/dapo
      stapo prepare --source gsm8k --template boxed --out prepared/gsm8k
      stapo prepare --source my.jsonl --set data.problem_field=question --out prepared/mine
    """
    from rich.console import Console
    from rich.table import Table

    from stapo.core.config import ConfigError, config_from_dict, load_config
    from stapo.core.task.data import DataError, prepare_data

    if source_arg is not None and source is not None and source_arg != source:
        raise CLIError(f"SOURCE {source_arg!r} and --source {source!r} disagree; give one")
    source = source if source is not None else source_arg
    if rebuild or from_file is not None:
        _rebuild(source, out, from_file, verify)
        return
    if config is not None:
        config = resolve_config_path(config)
    try:
        cfg = load_config(config, overrides or [])
        if source is not None or template is not None or tokenizer is not None:
            data = cfg.model_dump()
            if source is not None:
                data["data"]["source"] = source
            if template is not None:
                data["data"]["template"] = template
            if tokenizer is not None:
                data["model"]["tokenizer"] = tokenizer
            cfg = config_from_dict(data)
    except ConfigError as err:
        raise CLIError(str(err)) from None

    tok = None
    if tokenizer is not None:
        from stapo.core.trainer.models import ModelLoadError, load_tokenizer

        try:
            tok = load_tokenizer(cfg.model)
        except ModelLoadError as err:
            raise CLIError(f"--tokenizer {tokenizer}: {err}") from None

    if out is None:
        out = Path("prepared") / _dir_name(cfg.data.source)
    try:
        path = prepare_data(cfg.data, out, tok, tokenizer_name=tokenizer)
    except DataError as err:
        raise CLIError(str(err)) from None

    import json

    manifest = json.loads((path / "manifest.json").read_text())
    table = Table(title=f"stapo prepare: {cfg.data.source} -> {path}", show_header=True)
    table.add_column("step")
    table.add_column("prompts", justify="right")
    for step, n in manifest["counts"].items():
        table.add_row(step.replace("_", " "), str(n))
    console = Console()
    console.print(table)
    console.print(
        f"template={manifest['template']}  tokenizer={manifest['tokenizer'] or '(none: no length filter)'}  "
        f"seed={manifest['seed']}  answers normalized={manifest['answers_normalized']}"
    )
    for name, info in manifest["files"].items():
        console.print(f"  {name}: {info['rows']} rows  sha256 {info['sha256'][:16]}…")
    if (warning := split_warning(manifest, cfg.data.val_size)) is not None:
        typer.echo(f"warning: {warning}", err=True)


def split_warning(manifest: dict, val_size: int) -> str | None:
    """A line when validation holds out more prompts than are left to train on (a small file with
    the default ``data.val_size``), None otherwise."""
    rows = {name.split(".")[0]: info["rows"] for name, info in manifest["files"].items()}
    train, val = rows.get("train", 0), rows.get("val", 0)
    if val <= train:
        return None
    return (f"data.val_size={val_size} held out {val} of {train + val} prompts for validation, leaving {train} to "
            f"train on; --set data.val_size=N (e.g. {max(1, (train + val) // 10)}) keeps more for training")


def _dir_name(source: str) -> str:
    """A folder name for ``prepared/<source>``: a file's stem, an ``hf:`` id with ``/`` and ``:`` made safe."""
    name = Path(source).stem if ("/" in source or "." in source) and not source.startswith("hf:") else source
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "data"


def _rebuild(source: str | None, out: Path | None, from_file: Path | None, verify: bool) -> None:
    """``--rebuild``: the hub's DAPO-Math-17k -> dapo_math_17k.jsonl, checked against the shipped copy."""
    from rich.console import Console

    from stapo.core.task.data import DataError, rebuild_dapo_math_17k

    if source != "dapo_math_17k":
        raise CLIError(f"--rebuild works for dapo_math_17k only (got {source!r}); the benchmarks ship with stapo")
    console = Console()
    console.print(f"rebuilding dapo_math_17k from {from_file or DAPO_HUB_REPO + ' (download)'} ...")
    try:
        path, rows, digest = rebuild_dapo_math_17k(out, source=from_file, verify=verify)
    except DataError as err:
        raise CLIError(str(err)) from None
    console.print(f"{path}: {rows} rows, content sha256 {digest[:16]}…" + (" (matches the shipped copy)" if verify else ""))
    console.print(f"train on it with --set data.source={path}, or put it in the folder STAPO_DATA_DIR names")
