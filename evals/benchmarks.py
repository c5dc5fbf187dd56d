"""Benchmark registry and loaders for `stapo eval`: AIME24/25, AMC23, MATH500, Minerva, OlympiadBench, GSM8K.

Each benchmark is a JSONL file with rows ``{"id", "problem", "answer", ...}``. The files ship inside
stapo (``stapo/evals/data``, with their sources, licenses and checksums in its README), so
``stapo eval`` needs no data configuration; ``--data-dir``, ``data.data_dir`` or ``$STAPO_DATA_DIR``
name another folder with the same file names (see :func:`resolve_data_dir`).
A :class:`BenchmarkSpec` says which file names to look for, the default number of samples per
problem (the paper's protocol: avg@32 for AIME24/25 and AMC23, avg@4 for the others), and how to
clean the gold answer of the source's format quirks before grading:

- AIME24 keeps 3-digit zero padding (``025``): integers lose leading zeros;
- OlympiadBench wraps many answers in ``$...$``: the delimiters are stripped (as Qwen2.5-Math eval does);
- GSM8K has thousands separators (``2,125``): they are removed.

The raw answer is kept in ``EvalProblem.raw_answer`` so nothing is lost.

Custom benchmarks: ``custom:PATH.jsonl`` reads any JSONL file, with an optional field mapping after
``#``: ``custom:data/my.jsonl#problem=question,answer=final,id=uid`` (defaults: ``problem``,
``answer``, ``id``; a missing id becomes the 0-based row index). Its name in results is the file's
stem, and its default k is 4.

Usage::

    problems = load_benchmark("aime24", limit=4)            # the shipped copy
    problems = load_benchmark("aime24", data_dir="my/data")  # another folder with aime24.jsonl
    get_benchmark("gsm8k").default_k   # 4
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "BENCHMARKS",
    "BenchmarkSpec",
    "EvalProblem",
    "register_benchmark",
    "get_benchmark",
    "benchmark_names",
    "load_benchmark",
    "parse_benchmark_arg",
    "resolve_data_dir",
    "default_k",
]


@dataclass(frozen=True)
class EvalProblem:
    """One benchmark problem: ``answer`` is the cleaned gold answer the grader sees."""

    benchmark: str
    id: str
    problem: str
    answer: str
    raw_answer: str


@dataclass(frozen=True)
class BenchmarkSpec:
    """Where a benchmark's file is and how to read it."""

    name: str
    files: tuple[str, ...]
    default_k: int
    clean_answer: Callable[[str], str] = field(default=lambda s: s.strip())
    description: str = ""


BENCHMARKS: dict[str, BenchmarkSpec] = {}


def register_benchmark(spec: BenchmarkSpec) -> BenchmarkSpec:
    """Add a benchmark; registering a name twice is an error (the second must not silently win)."""
    if spec.name in BENCHMARKS:
        raise ValueError(f"benchmark {spec.name!r} is already registered")
    if spec.name.startswith("custom"):
        raise ValueError("benchmark names starting with 'custom' are reserved for custom:PATH benchmarks")
    BENCHMARKS[spec.name] = spec
    return spec


def benchmark_names() -> list[str]:
    """Registered benchmark names, in registration order."""
    return list(BENCHMARKS)


def get_benchmark(name: str) -> BenchmarkSpec:
    """The spec of ``name``; a miss lists the valid names and the custom syntax."""
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise KeyError(
            f"unknown benchmark {name!r}; valid names: {', '.join(BENCHMARKS)}, "
            "or custom:PATH.jsonl[#problem=FIELD,answer=FIELD,id=FIELD]"
        ) from None


# ----------------------------------------------------------------------------- answer cleaning

_INT_RE = re.compile(r"^[+-]?\d+$")
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")


def strip_leading_zeros(answer: str) -> str:
    """``025`` -> ``25`` for integer answers (AIME's zero padding); other answers unchanged."""
    a = answer.strip()
    if _INT_RE.match(a):
        sign = "-" if a.startswith("-") else ""
        return sign + (a.lstrip("+-").lstrip("0") or "0")
    return a


def strip_dollars(answer: str) -> str:
    """``$\\frac{1}{2}$`` -> ``\\frac{1}{2}`` (OlympiadBench); inner ``$`` of a list stay balanced-out."""
    a = answer.strip()
    while len(a) >= 2 and a.startswith("$") and a.endswith("$"):
        a = a[1:-1].strip()
    return a


def strip_thousands(answer: str) -> str:
    """``1,450,000`` -> ``1450000`` (GSM8K); a comma-separated list like ``1, 2`` is left alone."""
    a = answer.strip()
    return a.replace(",", "") if _THOUSANDS_RE.match(a) else a


for _spec in (
    BenchmarkSpec("aime24", ("aime24.jsonl",), 32, strip_leading_zeros, "AIME 2024 I+II (30)"),
    BenchmarkSpec("aime25", ("aime25.jsonl",), 32, strip_leading_zeros, "AIME 2025 I+II (30)"),
    BenchmarkSpec("amc23", ("amc23.jsonl",), 32, strip_leading_zeros, "AMC 2023 (40)"),
    BenchmarkSpec("math500", ("math500.jsonl",), 4, str.strip, "MATH-500 (500)"),
    BenchmarkSpec("minerva_math", ("minerva_math.jsonl", "minerva.jsonl"), 4, str.strip, "Minerva Math (272)"),
    BenchmarkSpec("olympiadbench", ("olympiadbench.jsonl",), 4, strip_dollars, "OlympiadBench OE maths en (675)"),
    BenchmarkSpec("gsm8k", ("gsm8k_test.jsonl", "gsm8k.jsonl"), 4, strip_thousands, "GSM8K test (1319)"),
):
    register_benchmark(_spec)


# ----------------------------------------------------------------------------- loading


def resolve_data_dir(configured: str | os.PathLike[str] | None = None) -> Path:
    """The benchmark folder: ``configured`` (``--data-dir`` / ``data.data_dir``) when given, else
    ``$STAPO_DATA_DIR`` when set, else the copies shipped with stapo (``stapo/evals/data``).

    One rule for training data and benchmarks: :func:`stapo.core.task.data.resolve_data_path`.
    """
    from stapo.core.task.data import resolve_data_path

    return resolve_data_path(configured)


def parse_benchmark_arg(arg: str) -> tuple[str, Path | None, dict[str, str]]:
    """Split one ``--benchmarks`` item into (name, custom path or None, field mapping).

    ``aime24`` -> ("aime24", None, {}); ``custom:x/my.jsonl#answer=final`` -> ("my", Path, {"answer": "final"}).
    """
    arg = arg.strip()
    if not arg:
        raise ValueError("empty benchmark name in --benchmarks")
    if not arg.startswith("custom:"):
        get_benchmark(arg)
        return arg, None, {}
    spec = arg[len("custom:") :]
    path_s, _, mapping_s = spec.partition("#")
    if not path_s:
        raise ValueError(f"custom benchmark {arg!r} needs a path: custom:PATH.jsonl")
    mapping: dict[str, str] = {}
    for item in filter(None, (m.strip() for m in mapping_s.split(","))):
        key, eq, val = item.partition("=")
        if not eq or key not in ("problem", "answer", "id") or not val:
            raise ValueError(
                f"custom benchmark {arg!r}: bad field mapping {item!r}; use problem=FIELD, answer=FIELD, id=FIELD"
            )
        mapping[key] = val
    path = Path(path_s).expanduser()
    return path.stem, path, mapping


def default_k(name: str) -> int:
    """The paper's samples per problem: 32 for AIME24/25 and AMC23, 4 for the others (and custom)."""
    return BENCHMARKS[name].default_k if name in BENCHMARKS else 4


def load_benchmark(arg: str, *, data_dir: str | os.PathLike[str] | None = None, limit: int | None = None) -> list[EvalProblem]:
    """Load a registered benchmark from ``data_dir`` (or a ``custom:`` file), first ``limit`` problems.

    Problems keep the file's order so ``--limit`` slices are stable across runs. Duplicate ids are an
    error: resume keys samples by (benchmark, problem id).
    """
    name, custom_path, mapping = parse_benchmark_arg(arg)
    if custom_path is not None:
        path = custom_path
        if not path.is_file():
            raise FileNotFoundError(f"custom benchmark file not found: {path}")
        clean: Callable[[str], str] = str.strip
    else:
        spec = get_benchmark(name)
        root = resolve_data_dir(data_dir)
        candidates = [root / f for f in spec.files]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise FileNotFoundError(
                f"benchmark {name!r}: none of {', '.join(str(c) for c in candidates)} exists; --data-dir, "
                "data.data_dir and STAPO_DATA_DIR must name a folder with the benchmark files, or leave them "
                "unset to read the copies shipped with stapo"
            )
        path, clean = found, spec.clean_answer
    f_problem = mapping.get("problem", "problem")
    f_answer = mapping.get("answer", "answer")
    f_id = mapping.get("id", "id")
    problems: list[EvalProblem] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            for fld in (f_problem, f_answer):
                if fld not in row:
                    raise ValueError(
                        f"{path}:{lineno}: missing field {fld!r} (fields: {', '.join(row)}); "
                        "map fields with custom:PATH#problem=FIELD,answer=FIELD"
                    )
            pid = str(row.get(f_id, len(problems)))
            if pid in seen:
                raise ValueError(f"{path}:{lineno}: duplicate problem id {pid!r} in field {f_id!r}")
            seen.add(pid)
            raw = str(row[f_answer])
            problems.append(EvalProblem(name, pid, str(row[f_problem]).strip(), clean(raw), raw))
            if limit is not None and len(problems) >= limit:
                break
    if not problems:
        raise ValueError(f"benchmark {name!r}: no problems in {path}")
    return problems
