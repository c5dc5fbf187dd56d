"""Training prompts: load a source, clean it, template it, split it, and write it down.

A *source* (``data.source``) is one of:

- ``arithmetic``: the built-in seeded generator (``data.arithmetic``): ``What is 3 + 4?`` or short
  word problems, integer answers; the CPU demo and the tests train on it;
- a name of a copy shipped with stapo (:data:`OFFLINE_SOURCES`: ``dapo_math_17k``, ``gsm8k``,
  ``math500``, ``aime24``, ``aime25``, ``amc23``, ``minerva_math``, ``olympiadbench``), read from
  ``stapo/evals/data`` unless ``data.data_dir`` or ``$STAPO_DATA_DIR`` names another folder;
- a local ``.jsonl`` / ``.json`` / ``.parquet`` file, read with ``data.problem_field`` and
  ``data.answer_field`` (parquet needs ``pyarrow``);
- a prepared data dir (written by :func:`prepare_data` / ``stapo prepare``), read back as is;
- ``hf:<dataset id>[:<config>][@<split>]``: the Hugging Face hub through ``datasets`` when a hub is
  reachable (split defaults to ``train``).

The pipeline (:func:`load_prompts`), in order, with a count after each step::

    load -> normalize answers -> dedupe (exact problem text) -> english_only (drop CJK)
         -> template -> length filter (tokenized, with chat template; only with a tokenizer)
         -> seeded shuffle -> validation split (first val_size) -> limit (training prompts)

Why this order: dedupe and language filters depend only on the problem, so they run before the
(costly) tokenization; the split is taken after filtering so validation prompts are usable ones,
and before ``limit`` so that limiting training data never changes the validation set.

A :class:`PromptRecord` holds the *templated user message* (``prompt``), before any chat template;
the chat template belongs to the tokenizer and is applied at encode time by :func:`encode_prompt`.

Usage::

    train, val = load_prompts(cfg.data, tokenizer)
    ids = encode_prompt(tokenizer, train[0].prompt, chat_template=cfg.data.chat_template)
    prepare_data(cfg.data, Path("prepared/gsm8k"), tokenizer)   # train.jsonl, val.jsonl, manifest.json
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stapo import __version__
from stapo.core.config import ArithmeticData, DataConfig

__all__ = [
    "DAPO_CONTENT_SHA256",
    "MANIFEST",
    "OFFLINE_SOURCES",
    "TEMPLATES",
    "DataError",
    "check_source",
    "convert_dapo_hub_rows",
    "dapo_content_sha256",
    "data_cache_dir",
    "PromptRecord",
    "encode_prompt",
    "encode_prompts",
    "generate_arithmetic",
    "get_template",
    "load_prompts",
    "normalize_answer",
    "prepare_data",
    "rebuild_dapo_math_17k",
    "register_template",
    "render_prompt",
    "resolve_data_dir",
    "resolve_data_path",
    "shipped_data_dir",
]

MANIFEST = "manifest.json"
_FORMAT = "stapo-prompts/1"
_PROGRESS_MIN = 2000  # show a progress bar from this many rows on


class DataError(ValueError):
    """A data source or setting that cannot be used; the message names the field (``data.xxx``)."""


@dataclass(frozen=True)
class PromptRecord:
    """One training or validation prompt.

    ``prompt`` is the templated user message (e.g. the DAPO wrapper around the problem), before any
    chat template; ``answer`` is the gold answer for the verifier; ``source`` names where it came from.
    """

    id: str
    prompt: str
    answer: str
    source: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class _Raw:
    """A problem before templating."""

    id: str
    problem: str
    answer: str
    source: str


# ----------------------------------------------------------------------------- templates

TEMPLATES: dict[str, Callable[[str], str]] = {}


def register_template(name: str) -> Callable[[Callable[[str], str]], Callable[[str], str]]:
    """Register a prompt template ``fn(problem) -> user message`` under ``name`` (once)."""

    def deco(fn: Callable[[str], str]) -> Callable[[str], str]:
        if name in TEMPLATES:
            raise ValueError(f"prompt template {name!r} is already registered")
        TEMPLATES[name] = fn
        return fn

    return deco


def get_template(name: str) -> Callable[[str], str]:
    """The template registered as ``name``; a miss lists the valid names."""
    try:
        return TEMPLATES[name]
    except KeyError:
        raise DataError(
            f"data.template: unknown template {name!r}; valid: {', '.join(sorted(TEMPLATES))}"
        ) from None


@register_template("dapo")
def _dapo(problem: str) -> str:
    """DAPO-Math-17k's own wrapper: the last line must be ``Answer: $Answer``."""
    return (
        "Solve the following math problem step by step. The last line of your response should be of the "
        "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
        f"{problem}\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )


@register_template("boxed")
def _boxed(problem: str) -> str:
    """The Qwen2.5-Math / DeepSeek-R1 style: reason, then ``\\boxed{}`` the answer."""
    return f"{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


@register_template("short")
def _short(problem: str) -> str:
    """The CPU demo's: a small model answers with the number alone, so responses stay short."""
    return f"{problem}\nAnswer with only the final number."


@register_template("none")
def _none(problem: str) -> str:
    """The problem text as is."""
    return problem


# ----------------------------------------------------------------------------- encoding


def render_prompt(tokenizer: Any, prompt: str, *, chat_template: bool) -> tuple[str, bool]:
    """The text the model sees, and whether the tokenizer should add its own special tokens.

    With a chat template the rendered text already holds every special token (so encode it with
    ``add_special_tokens=False``); without one the tokenizer adds its usual bos/eos.
    """
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return text, False
    return prompt, True


def encode_prompt(tokenizer: Any, prompt: str, *, chat_template: bool) -> list[int]:
    """Token ids of one prompt: chat template (with the generation prompt) when asked and available."""
    text, add_special = render_prompt(tokenizer, prompt, chat_template=chat_template)
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


def encode_prompts(
    tokenizer: Any, prompts: Sequence[str], *, chat_template: bool, batch_size: int = 1000
) -> list[list[int]]:
    """:func:`encode_prompt` over many prompts, in batches (same ids, much faster on fast tokenizers)."""
    out: list[list[int]] = []
    batches = range(0, len(prompts), batch_size)
    for start in _progress(
        batches, total=len(batches), label="tokenizing", show=len(prompts) >= _PROGRESS_MIN
    ):
        chunk = [
            render_prompt(tokenizer, p, chat_template=chat_template)
            for p in prompts[start : start + batch_size]
        ]
        add_special = chunk[0][1] if chunk else True
        enc = tokenizer([t for t, _ in chunk], add_special_tokens=add_special)["input_ids"]
        out.extend(list(ids) for ids in enc)
    return out


# ----------------------------------------------------------------------------- answers


_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_LEADING_ZEROS = re.compile(r"^0+(\d+)$")
_DOLLAR_WRAPPED = re.compile(r"^\$([^$]+)\$$")


def normalize_answer(answer: str) -> str:
    """Undo the answer-format quirks of the offline benchmark copies (see their README).

    ``2,125`` -> ``2125`` (GSM8K thousands separators), ``025`` -> ``25`` (AIME zero padding),
    ``$2n$`` -> ``2n`` (OlympiadBench's math delimiters around a single expression). Anything else is
    kept as is (trimmed): the verifier, not the loader, decides equivalence.
    """
    a = answer.strip()
    if _THOUSANDS.match(a):
        a = a.replace(",", "")
    m = _LEADING_ZEROS.match(a)
    if m:
        a = m.group(1)
    m = _DOLLAR_WRAPPED.match(a)
    if m:
        a = m.group(1).strip()
    return a


# ----------------------------------------------------------------------------- arithmetic


_NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Mia"]
_ITEMS = ["apples", "marbles", "stickers", "coins", "books", "shells"]
_OP_WORDS = {"+": "add {n}", "-": "subtract {n}", "*": "multiply by {n}"}


def _eval_precedence(nums: list[int], ops: list[str]) -> int:
    """Value of ``n0 op0 n1 op1 ...`` with the usual precedence (``*`` before ``+``/``-``)."""
    terms, signs, cur = [], [], nums[0]
    for op, n in zip(ops, nums[1:], strict=True):
        if op == "*":
            cur *= n
        else:
            terms.append(cur)
            signs.append(op)
            cur = n
    terms.append(cur)
    total = terms[0]
    for sign, t in zip(signs, terms[1:], strict=True):
        total = total + t if sign == "+" else total - t
    return total


def _word_problem(rng: random.Random, nums: list[int], ops: list[str]) -> tuple[str, int]:
    """A short word problem and its answer. One operation: a story; several: step-by-step (left to right)."""
    if len(ops) == 1:
        a, b = nums
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        op = ops[0]
        if op == "+":
            tmpl = rng.choice(
                [
                    "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
                    "There are {a} {item} in a box and {b} {item} on the table. How many {item} are there in all?",
                ]
            )
            return tmpl.format(name=name, item=item, a=a, b=b), a + b
        if op == "-":
            a, b = max(a, b), min(a, b)  # a story never gives away more than there is
            tmpl = rng.choice(
                [
                    "{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?",
                    "A jar holds {a} {item}. {name} takes out {b}. How many {item} are still in the jar?",
                ]
            )
            return tmpl.format(name=name, item=item, a=a, b=b), a - b
        tmpl = rng.choice(
            [
                "{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have?",
                "There are {a} rows of {item} with {b} {item} in each row. How many {item} are there?",
            ]
        )
        return tmpl.format(name=name, item=item, a=a, b=b), a * b
    value = nums[0]
    steps = []
    for op, n in zip(ops, nums[1:], strict=True):
        steps.append(_OP_WORDS[op].format(n=n))
        value = value + n if op == "+" else value - n if op == "-" else value * n
    text = f"Start with {nums[0]}. " + ", then ".join(
        s.capitalize() if i == 0 else s for i, s in enumerate(steps)
    )
    return text + ". What number do you get?", value


def generate_arithmetic(cfg: ArithmeticData, *, seed: int) -> list[_Raw]:
    """``cfg.num_problems`` distinct problems, deterministic from ``seed``, answers as integer strings.

    Bare problems read ``What is 3 + 4 * 2?`` (usual precedence); word problems use a few story
    templates for one operation and a left-to-right "Start with ..., then ..." phrasing for several.
    Problems are drawn without repetition; when the space is smaller than ``num_problems`` (one-digit
    addition has 100 problems) the generator stops at the space size instead of repeating.
    """
    rng = random.Random(f"stapo-arithmetic-{seed}")
    lo = 0 if cfg.digits == 1 else 10 ** (cfg.digits - 1)
    values = range(lo, 10**cfg.digits)
    ops_set = list(dict.fromkeys(cfg.ops))
    space = len(values) ** (cfg.num_ops + 1) * len(ops_set) ** cfg.num_ops
    out: list[_Raw] = []
    if not cfg.word_problems and space <= 2 * cfg.num_problems:
        # a small space: enumerate it and take a seeded sample (rejection sampling would crawl)
        combos = list(
            itertools.product(
                itertools.product(values, repeat=cfg.num_ops + 1),
                itertools.product(ops_set, repeat=cfg.num_ops),
            )
        )
        rng.shuffle(combos)
        if cfg.answer_range is not None:
            lo, hi = cfg.answer_range
            combos = [(n, o) for n, o in combos if lo <= _eval_precedence(list(n), list(o)) <= hi]
        for nums, ops in combos[: cfg.num_problems]:
            out.append(_bare_problem(len(out), list(nums), list(ops)))
        return out
    seen: set[str] = set()
    attempts, max_attempts = 0, 50 * cfg.num_problems
    while len(out) < cfg.num_problems and attempts < max_attempts:
        attempts += 1
        nums = [rng.choice(values) for _ in range(cfg.num_ops + 1)]
        ops = [rng.choice(cfg.ops) for _ in range(cfg.num_ops)]
        if cfg.word_problems:
            problem, value = _word_problem(rng, nums, ops)
            raw = _Raw(id=f"arithmetic-{len(out)}", problem=problem, answer=str(value), source="arithmetic")
        else:
            raw = _bare_problem(len(out), nums, ops)
            if cfg.answer_range is not None and not cfg.answer_range[0] <= int(raw.answer) <= cfg.answer_range[1]:
                continue
        if raw.problem in seen:
            continue
        seen.add(raw.problem)
        out.append(raw)
    return out


def _bare_problem(index: int, nums: list[int], ops: list[str]) -> _Raw:
    expr = " ".join(str(nums[0]) if i == 0 else f"{ops[i - 1]} {nums[i]}" for i in range(len(nums)))
    value = _eval_precedence(nums, ops)
    return _Raw(id=f"arithmetic-{index}", problem=f"What is {expr}?", answer=str(value), source="arithmetic")


# ----------------------------------------------------------------------------- sources

# name -> file in the data dir (the shipped copies: stapo/evals/data, see its README for sources,
# licenses, counts and answer formats)
OFFLINE_SOURCES: dict[str, str] = {
    "dapo_math_17k": "dapo_math_17k.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
    "math500": "math500.jsonl",
    "aime24": "aime24.jsonl",
    "aime25": "aime25.jsonl",
    "amc23": "amc23.jsonl",
    "minerva_math": "minerva_math.jsonl",
    "olympiadbench": "olympiadbench.jsonl",
}
DATA_DIR_ENV = "STAPO_DATA_DIR"


def shipped_data_dir() -> Path:
    """The folder of the data shipped inside stapo (package data of ``stapo.evals.data``).

    The benchmarks and DAPO-Math-17k ship with the project (as the field's eval harnesses ship their
    benchmark files), so a clone or a wheel needs nothing beside it. The folder is where the
    installed ``stapo.evals`` package lives, so it works from any working directory, editable or
    not; it is located by the import system's spec (``importlib.util.find_spec``), which runs none
    of that package's code: ``stapo.core`` depends on the shipped files, not on the evals layer
    above it (tests/unit/test_import_layers.py). ``stapo.evals.benchmarks`` reads its data through here.
    """
    spec = importlib.util.find_spec("stapo.evals")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the stapo.evals package is not installed: its data folder ships the named sources; "
                        f"set {DATA_DIR_ENV} or data.data_dir to a folder with the same files")
    return Path(next(iter(spec.submodule_search_locations))).resolve() / "data"


def resolve_data_path(path: str | os.PathLike[str] | None) -> Path:
    """The data folder to read: ``path`` when given (``~`` expanded; relative to the working
    directory), else ``$STAPO_DATA_DIR`` when set, else :func:`shipped_data_dir`.

    Why this order: an explicit setting (``--data-dir``, ``data.data_dir``) is the most specific;
    the environment variable is a machine-wide default (an offline copy, a mounted volume); the
    shipped copies need no configuration at all.
    """
    chosen = path if path not in (None, "") else os.environ.get(DATA_DIR_ENV) or None
    if chosen is None:
        return shipped_data_dir()
    return Path(chosen).expanduser()


def resolve_data_dir(data_cfg: DataConfig) -> Path:
    """``data.data_dir`` resolved by :func:`resolve_data_path`."""
    return resolve_data_path(data_cfg.data_dir)


def _progress(it: Iterable[Any], *, total: int | None, label: str, show: bool) -> Iterator[Any]:
    """A rich progress bar for long sources (transient, so logs stay clean); plain iteration otherwise."""
    if not show:
        yield from it
        return
    from rich.progress import track

    yield from track(it, total=total, description=label, transient=True)


# Field names other data sets use for the problem and the answer, for the fix a missing field suggests.
_FIELD_NAMES = {
    "problem_field": ("problem", "question", "prompt", "query", "input", "instruction", "text"),
    "answer_field": ("answer", "solution", "final_answer", "target", "output", "label", "ground_truth"),
}


def _field_fix(row: dict[str, Any], field: str, cfg_field: str) -> str:
    """``--set data.problem_field=question`` when a present field looks like the one asked for (a
    usual name for it, or a close spelling); otherwise the option with a placeholder."""
    import difflib

    present = [k for k in row if isinstance(k, str)]
    usual = [k for k in _FIELD_NAMES.get(cfg_field, ()) if k in present]
    guess = usual or difflib.get_close_matches(field, present, n=1, cutoff=0.6)
    return f"--set data.{cfg_field}={guess[0] if guess else 'FIELD'}"


def _row_value(row: dict[str, Any], field: str, cfg_field: str, where: str) -> str:
    if field not in row:
        raise DataError(
            f"data.{cfg_field}: field {field!r} not found in {where}; fields present: {', '.join(sorted(row))}; "
            f"{_field_fix(row, field, cfg_field)} names the one to read"
        )
    value = row[field]
    if value is None:
        raise DataError(f"data.{cfg_field}: field {field!r} is null in {where}")
    return str(value)


def _rows_to_raw(
    rows: Iterable[dict[str, Any]], *, problem_field: str, answer_field: str, source: str, origin: str
) -> list[_Raw]:
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{origin} row {i}: expected a JSON object, got {type(row).__name__}")
        where = f"{origin} row {i}"
        problem = _row_value(row, problem_field, "problem_field", where).strip()
        answer = _row_value(row, answer_field, "answer_field", where).strip()
        rid = str(row.get("id", i))
        out.append(_Raw(id=f"{source}-{rid}", problem=problem, answer=answer, source=source))
    return out


def _not_text(path: Path, err: UnicodeDecodeError, offset: int | None = None) -> DataError:
    """The error for a data file that is not UTF-8 text (often a binary file given by mistake)."""
    at = f" at offset {offset + err.start}" if offset is not None else ""
    return DataError(
        f"data.source: {path} is not UTF-8 text (byte 0x{err.object[err.start]:02x}{at}); "
        "give a .jsonl/.json file of UTF-8 text, or a .parquet file"
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
    except UnicodeDecodeError as err:
        raise _not_text(path, err) from None
    return rows


def _read_local(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise _not_text(path, err) from None
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise DataError(f"data.source: {path} must hold a JSON list of objects (or {{'data': [...]}})")
        return data
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(
                f"data.source: reading {path.name} needs pyarrow (pip install pyarrow), or convert it to JSONL"
            ) from None
        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types (ArrowInvalid, OSError) for a bad file
            raise DataError(f"data.source: {path} is not a readable Parquet file ({err})") from None
    raise DataError(
        f"data.source: {path} has an unsupported extension {suffix!r}; use .jsonl, .json or .parquet"
    )


def _load_hf(spec: str, data_cfg: DataConfig) -> list[_Raw]:
    """``hf:<id>[:<config>][@<split>]`` through ``datasets`` (imported only here)."""
    body = spec[len("hf:") :]
    body, _, split = body.partition("@")
    name, _, config = body.partition(":")
    if not name:
        raise DataError(f"data.source: {spec!r} names no dataset; use hf:<id>[:<config>][@<split>]")
    try:
        import datasets
    except ImportError:
        raise DataError(f"data.source={spec!r} needs the `datasets` package (pip install datasets)") from None
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as err:  # the hub raises many types; all mean "could not get it"
        raise DataError(
            f"data.source={spec!r}: could not load from the Hugging Face hub ({type(err).__name__}: {err}). "
            "Is the hub reachable? Shipped with stapo (no hub needed): " + ", ".join(OFFLINE_SOURCES)
        ) from err
    rows = _progress(ds, total=len(ds), label=f"reading {name}", show=len(ds) >= _PROGRESS_MIN)
    return _rows_to_raw(
        rows,
        problem_field=data_cfg.problem_field,
        answer_field=data_cfg.answer_field,
        source=name,
        origin=spec,
    )


def _is_path_source(source: str) -> bool:
    """Whether ``source`` names a file or folder (not the generator, an offline copy or the hub)."""
    return source != "arithmetic" and source not in OFFLINE_SOURCES and not source.startswith("hf:")


def _is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def _load_raw(data_cfg: DataConfig) -> tuple[list[_Raw], str]:
    """Problems of a (non-prepared) source, and a description of where they came from."""
    source = data_cfg.source
    if source == "arithmetic":
        return generate_arithmetic(data_cfg.arithmetic, seed=data_cfg.seed), "arithmetic (built-in generator)"
    if source.startswith("hf:"):
        return _load_hf(source, data_cfg), source
    if source in OFFLINE_SOURCES:
        data_dir = resolve_data_dir(data_cfg)
        path = data_dir / OFFLINE_SOURCES[source]
        if not path.is_file():
            raise DataError(
                f"data.source={source!r}: {path} not found; data.data_dir (now {data_cfg.data_dir!r}) or "
                f"${DATA_DIR_ENV} must name a folder with {OFFLINE_SOURCES[source]}, or leave both unset "
                "to read the copies shipped with stapo"
            )
        rows = _read_jsonl(path)
        return _rows_to_raw(
            rows, problem_field="problem", answer_field="answer", source=source, origin=str(path)
        ), str(path)
    path = Path(source).expanduser()
    if path.is_file():
        rows = _read_local(path)
        return _rows_to_raw(
            rows,
            problem_field=data_cfg.problem_field,
            answer_field=data_cfg.answer_field,
            source=path.stem,
            origin=str(path),
        ), str(path.resolve())
    raise _missing_source(source)


def _missing_source(source: str) -> DataError:
    """The error for a path source that is not a file: a folder, a missing file, or an unknown name."""
    path = Path(source).expanduser()
    if path.is_dir():
        return DataError(f"data.source: {path} is a folder without {MANIFEST}; is it a `stapo prepare` output?")
    if path.suffix.lower() in _FILE_SUFFIXES or "/" in source or os.sep in source:
        return DataError(f"data.source: file not found: {path} (from {Path.cwd()})")
    return DataError(
        f"data.source: unknown source {source!r}; valid: arithmetic, {', '.join(OFFLINE_SOURCES)}, "
        "a .jsonl/.json/.parquet file, a prepared data dir, or hf:<dataset id>"
    )


_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_CHECK_CHUNK = 1 << 20


def check_source(data_cfg: DataConfig) -> None:
    """Fail now, with the message loading would give, when ``data.source`` cannot be read.

    Cheap next to a model load: the name resolves, a shipped copy is there, a local file exists and
    is UTF-8 text (JSON/JSONL) or starts like Parquet, and a JSON/JSONL file parses (a bad line named
    by its number) with ``data.problem_field`` / ``data.answer_field`` in every row. ``stapo train`` calls it before it writes
    anything, so a typo in a path fails before a run dir, a model load and a grader pool.
    """
    get_template(data_cfg.template)
    source = data_cfg.source
    if source == "arithmetic" or source.startswith("hf:"):
        return
    if source in OFFLINE_SOURCES:
        path = resolve_data_dir(data_cfg) / OFFLINE_SOURCES[source]
        if not path.is_file():
            _load_raw(data_cfg)  # raises the not-found message with its fix
        return
    path = Path(source).expanduser()
    if _is_prepared(path):
        return
    if not path.is_file():
        raise _missing_source(source)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        with path.open("rb") as f:
            if f.read(4) != b"PAR1":
                raise DataError(f"data.source: {path} is not a Parquet file (it does not start with PAR1)")
        return
    if suffix not in _FILE_SUFFIXES:
        _read_local(path)  # raises the unsupported-extension message
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHECK_CHUNK):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                raise _not_text(path, err, offset) from None
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:
            raise _not_text(path, err, offset) from None
    # every row parsed and its two fields read, as loading will (a bad line is named by its number)
    _rows_to_raw(_read_local(path), problem_field=data_cfg.problem_field, answer_field=data_cfg.answer_field,
                 source=path.stem, origin=str(path))


# ----------------------------------------------------------------------------- pipeline

_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef\uac00-\ud7af]")


def _length_filter(records: list[PromptRecord], tokenizer: Any, data_cfg: DataConfig) -> list[PromptRecord]:
    if tokenizer is None:
        return records
    lengths = encode_prompts(tokenizer, [r.prompt for r in records], chat_template=data_cfg.chat_template)
    return [r for r, ids in zip(records, lengths, strict=True) if len(ids) <= data_cfg.max_prompt_tokens]


def _split(
    records: list[PromptRecord], data_cfg: DataConfig
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Seeded shuffle, the first ``val_size`` for validation, at most ``limit`` of the rest for training."""
    if not records:
        raise DataError(f"data.source={data_cfg.source!r}: no prompts left after filtering")
    if data_cfg.val_size >= len(records):
        raise DataError(
            f"data.val_size={data_cfg.val_size} leaves no training prompts: only {len(records)} prompts remain "
            "after filtering; lower data.val_size or use a larger source"
        )
    order = list(records)
    random.Random(data_cfg.seed).shuffle(order)
    val, train = order[: data_cfg.val_size], order[data_cfg.val_size :]
    if data_cfg.limit is not None:
        train = train[: data_cfg.limit]
    return train, val


def _build(
    data_cfg: DataConfig, tokenizer: Any | None
) -> tuple[list[PromptRecord], list[PromptRecord], dict[str, Any]]:
    """The whole pipeline; also returns the counts and facts that go into the manifest."""
    get_template(data_cfg.template)  # fail on a bad name before loading anything
    if _is_path_source(data_cfg.source) and _is_prepared(Path(data_cfg.source).expanduser()):
        return _load_prepared(Path(data_cfg.source).expanduser(), data_cfg, tokenizer)
    raw, origin = _load_raw(data_cfg)
    counts: dict[str, int] = {"loaded": len(raw)}

    normalized = [_Raw(r.id, r.problem, normalize_answer(r.answer), r.source) for r in raw]
    n_changed = sum(a.answer != b.answer for a, b in zip(raw, normalized, strict=True))
    raw = [r for r in normalized if r.problem and r.answer]
    counts["after_empty_filter"] = len(raw)

    seen: set[str] = set()
    deduped = []
    for r in raw:
        if r.problem not in seen:
            seen.add(r.problem)
            deduped.append(r)
    counts["after_dedupe"] = len(deduped)

    if data_cfg.english_only:
        deduped = [r for r in deduped if not _CJK.search(r.problem)]
    counts["after_english_only"] = len(deduped)

    template = get_template(data_cfg.template)
    records = [
        PromptRecord(id=r.id, prompt=template(r.problem), answer=r.answer, source=r.source) for r in deduped
    ]
    records = _length_filter(records, tokenizer, data_cfg)
    counts["after_length_filter"] = len(records)

    train, val = _split(records, data_cfg)
    counts["train"], counts["val"] = len(train), len(val)
    info = {"origin": origin, "counts": counts, "answers_normalized": n_changed, "prepared_from": None}
    return train, val, info


def _read_records(path: Path) -> list[PromptRecord]:
    out = []
    for i, row in enumerate(_read_jsonl(path)):
        try:
            out.append(
                PromptRecord(
                    id=str(row["id"]), prompt=row["prompt"], answer=str(row["answer"]), source=row["source"]
                )
            )
        except (KeyError, TypeError):
            raise DataError(f"{path} row {i}: expected keys id, prompt, answer, source") from None
    return out


def _load_prepared(
    path: Path, data_cfg: DataConfig, tokenizer: Any | None
) -> tuple[list[PromptRecord], list[PromptRecord], dict[str, Any]]:
    """A `stapo prepare` dir: its split as written (prompts already templated, no re-templating).

    ``limit`` still caps training prompts, ``val_size`` can only shrink the stored validation set,
    and with a tokenizer the length filter runs again (the dir may have been prepared for another).
    """
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != _FORMAT:
        raise DataError(
            f"data.source: {path / MANIFEST} has format {manifest.get('format')!r}, expected {_FORMAT!r}"
        )
    train = _read_records(path / "train.jsonl")
    val = _read_records(path / "val.jsonl")
    counts = {"loaded": len(train) + len(val)}
    train, val = _length_filter(train, tokenizer, data_cfg), _length_filter(val, tokenizer, data_cfg)
    counts["after_length_filter"] = len(train) + len(val)
    val = val[: data_cfg.val_size]
    if data_cfg.limit is not None:
        train = train[: data_cfg.limit]
    counts["train"], counts["val"] = len(train), len(val)
    info = {
        "origin": str(path.resolve()),
        "counts": counts,
        "answers_normalized": 0,
        "prepared_from": manifest,
    }
    return train, val, info


def load_prompts(
    data_cfg: DataConfig, tokenizer: Any | None = None
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """``(train, val)`` prompt records of ``data.source`` after the pipeline in the module docstring.

    Deterministic: the same config (and tokenizer) always gives the same records in the same order.
    """
    train, val, _ = _build(data_cfg, tokenizer)
    return train, val


# ----------------------------------------------------------------------------- DAPO-Math-17k from the hub

DAPO_HUB_REPO = "BytedTsinghua-SIA/DAPO-Math-17k"
DAPO_HUB_FILE = "data/dapo-math-17k.parquet"
# sha256 over the rows' (problem, answer) pairs of the shipped dapo_math_17k.jsonl, one
# ``json.dumps([problem, answer], ensure_ascii=False)`` line per row (see :func:`dapo_content_sha256`):
# a rebuild from the hub must give the same rows in the same order.
DAPO_CONTENT_SHA256 = "c892019e882386f63ac90d17904a32f3a9b6da54bee752c1925a051fad1f3d73"
# An extra Chinese instruction 20 original rows carry just before the English suffix (evals/data/README.md).
_DAPO_CN_INSTRUCTION = (
    "\n让我们一步一步地思考。请以“Answer: \\boxed{<final_answer>}”的格式输出最终答案。"
    "如果是选择题，请按顺序输出正确的选项，不带任何标点或空格。对于其他类型的问题，请只输出最终答案的数值。"
)


def data_cache_dir() -> Path:
    """Where rebuilt data sets are written by default: ``$XDG_CACHE_HOME/stapo/data`` (``~/.cache/...``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "stapo" / "data"


def dapo_content_sha256(rows: Iterable[dict[str, Any]]) -> str:
    """Checksum of the (problem, answer) pairs in order; ids and the ``source`` field do not count."""
    h = hashlib.sha256()
    for r in rows:
        h.update((json.dumps([r["problem"], r["answer"]], ensure_ascii=False) + "\n").encode("utf-8"))
    return h.hexdigest()


def convert_dapo_hub_rows(rows: Iterable[dict[str, Any]], *, origin: str = DAPO_HUB_REPO) -> list[dict[str, str]]:
    """The hub's DAPO-Math-17k rows -> the shipped format ``{"id", "problem", "answer", "source"}``.

    The hub file repeats every prompt about 100 times (DAPO issues #15/#36). As in
    open-r1/DAPO-Math-17k-Processed, rows are deduplicated on the exact prompt string, first
    occurrence wins, in order; then the DAPO template (:func:`_dapo`) and the Chinese instruction
    some rows carry are removed and the problem is trimmed. ``answer`` is
    ``reward_model.ground_truth``; ``id`` is the 0-based row index of the result.
    """
    prefix, suffix = _dapo("\0").split("\0")
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    for i, row in enumerate(rows):
        where = f"{origin} row {i}"
        try:
            prompt = row["prompt"]
            message = prompt[0] if isinstance(prompt, list | tuple) else json.loads(prompt)[0]
            content, answer = message["content"], row["reward_model"]["ground_truth"]
        except (KeyError, IndexError, TypeError, ValueError):
            raise DataError(
                f"{where}: not in the hub's DAPO-Math-17k format (prompt=[{{role, content}}], "
                "reward_model={ground_truth})"
            ) from None
        if not isinstance(content, str) or answer is None:
            raise DataError(f"{where}: prompt[0].content must be text and reward_model.ground_truth set")
        if content in seen:
            continue
        seen.add(content)
        problem = content.removeprefix(prefix).removesuffix(suffix)
        problem = problem.removesuffix(_DAPO_CN_INSTRUCTION).strip()
        out.append({"id": str(len(out)), "problem": problem, "answer": str(answer).strip(), "source": origin})
    return out


def _download_dapo_hub() -> Path:
    """The hub's parquet file through ``huggingface_hub`` (its own cache), or a DataError saying why not."""
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(DAPO_HUB_REPO, DAPO_HUB_FILE, repo_type="dataset"))
    except Exception as err:  # the hub raises many types; all mean "could not get it"
        raise DataError(
            f"could not download {DAPO_HUB_REPO}/{DAPO_HUB_FILE} ({type(err).__name__}: {err}). Offline, give "
            "a local copy of that file with --from FILE; training needs neither (the copy shipped with stapo "
            "is read by default)"
        ) from err


def rebuild_dapo_math_17k(
    out_dir: Path | str | None = None, *, source: Path | str | None = None, verify: bool = True
) -> tuple[Path, int, str]:
    """Rebuild ``dapo_math_17k.jsonl`` from the hub's file: download it (``source=None``) or read a
    local copy (.parquet as on the hub, or .jsonl/.json rows of the same shape), convert it with
    :func:`convert_dapo_hub_rows`, check the result against :data:`DAPO_CONTENT_SHA256` (the shipped
    copy), and write it atomically to ``out_dir/dapo_math_17k.jsonl`` (default :func:`data_cache_dir`).

    Returns ``(path, rows, content sha256)``. A mismatch is an error (nothing written) unless
    ``verify=False``: training on a different set than the recipes were checked on should be a choice.
    """
    path = _download_dapo_hub() if source is None else Path(source).expanduser()
    if not path.is_file():
        raise DataError(f"--from {path}: no such file")
    rows = convert_dapo_hub_rows(_read_local(path), origin=DAPO_HUB_REPO if source is None else path.name)
    digest = dapo_content_sha256(rows)
    if verify and digest != DAPO_CONTENT_SHA256:
        raise DataError(
            f"{path}: {len(rows)} distinct prompts, content sha256 {digest[:16]}… differs from the shipped "
            f"copy's {DAPO_CONTENT_SHA256[:16]}… (17917 rows). Not written; pass --no-verify to keep it anyway"
        )
    out = Path(out_dir).expanduser() if out_dir is not None else data_cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    target = out / OFFLINE_SOURCES["dapo_math_17k"]
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=out)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give what a plain open() would
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target, len(rows), digest


# ----------------------------------------------------------------------------- prepare


def _write_jsonl(path: Path, records: Sequence[PromptRecord]) -> str:
    """Write records as JSON Lines and return the file's sha256."""
    h = hashlib.sha256()
    with path.open("wb") as f:
        for r in records:
            line = (json.dumps(r.to_dict(), ensure_ascii=False) + "\n").encode("utf-8")
            h.update(line)
            f.write(line)
    return h.hexdigest()


def _tokenizer_name(tokenizer: Any | None) -> str | None:
    if tokenizer is None:
        return None
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def _chmod_like_mkdir(path: Path) -> None:
    """mkdtemp makes 0700 folders; a prepared dir should get the permissions a plain mkdir gives."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


def prepare_data(
    data_cfg: DataConfig,
    out_dir: Path | str,
    tokenizer: Any | None = None,
    *,
    tokenizer_name: str | None = None,
) -> Path:
    """Run the pipeline and write ``train.jsonl``, ``val.jsonl`` and ``manifest.json`` to ``out_dir``.

    Atomic: everything is written to a temp folder beside ``out_dir`` and renamed into place, so a
    reader never sees a half-written dir. An existing ``out_dir`` is replaced only when it is an
    earlier prepared dir (has a manifest) or empty; any other folder is left alone with an error.
    ``tokenizer_name`` is what the manifest records (default: the tokenizer's ``name_or_path``).
    """
    out = Path(out_dir).expanduser()
    if out.exists() and not (out.is_dir() and (_is_prepared(out) or not any(out.iterdir()))):
        raise DataError(f"--out {out}: exists and is not a prepared data dir; pick a new or empty folder")
    if out.resolve() == Path(data_cfg.source).expanduser().resolve():
        raise DataError(f"--out {out}: is also data.source; write the prepared data to another folder")
    train, val, info = _build(data_cfg, tokenizer)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    _chmod_like_mkdir(tmp)
    try:
        files = {
            "train.jsonl": {"sha256": _write_jsonl(tmp / "train.jsonl", train), "rows": len(train)},
            "val.jsonl": {"sha256": _write_jsonl(tmp / "val.jsonl", val), "rows": len(val)},
        }
        manifest = {
            "format": _FORMAT,
            "source": data_cfg.source,
            "origin": info["origin"],
            "template": info["prepared_from"]["template"] if info["prepared_from"] else data_cfg.template,
            "chat_template": data_cfg.chat_template,
            "tokenizer": tokenizer_name or _tokenizer_name(tokenizer),
            "max_prompt_tokens": data_cfg.max_prompt_tokens if tokenizer is not None else None,
            "seed": data_cfg.seed,
            "counts": info["counts"],
            "answers_normalized": info["answers_normalized"],
            "files": files,
            "data_config": data_cfg.model_dump(mode="json"),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "stapo_version": __version__,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
