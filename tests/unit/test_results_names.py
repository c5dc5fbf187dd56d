"""benchmarks/RESULTS.md names only what the code still has, and stays one current section per harness.

Every backticked span of RESULTS.md is read; the parts that look like a stapo code name are checked,
everything else (commands' flags, numbers, LaTeX, other projects' names) is left alone:

- a path whose first part is a top-level entry of this repository (``benchmarks/verifier.py``,
  ``evals/data/*.jsonl``, also inside a command): the file exists (a glob matches one);
- a dotted name whose first part is ``stapo``, a stapo module or package (``loadgen.build_stream``,
  ``stapo.core.train.plan``) or a stapo class (``Actor.update``): the module imports and each attribute
  exists; a dotted name that starts with a config section (``trainer.micro_batch_tokens``) may
  instead be a key of the run config;
- a bare snake_case or CamelCase identifier (``split_rows``, ``VerifierClient``): stapo's code
  defines or uses it (a function, class, parameter, assignment or string in the stapo packages,
  benchmarks/ or tests/), unless ``FOREIGN`` names it as another project's, with the project.

Run: ``pytest tests/unit/test_results_names.py``.
"""

from __future__ import annotations

import ast
import glob
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks/RESULTS.md"
MAX_LINES = 900  # one section per harness, current figures only: a longer file means stale ones kept
# pyproject's package-dir: folder -> package
PACKAGES = {"stapo_pkg": "stapo", "cli": "stapo.cli", "core": "stapo.core", "evals": "stapo.evals",
            "verifier_service": "stapo.verifier_service", "configs": "stapo.configs"}
SCANNED = (*PACKAGES, "benchmarks", "tests", "integrations")
FOREIGN = {
    # TRL (GRPOTrainer and its inputs)
    "GRPOTrainer", "padding_free", "per_device_train_batch_size", "prompt_ids", "prompt_mask",
    "completion_ids", "completion_mask", "num_items_in_batch", "old_per_token_logps", "compute_loss",
    # verl (dp_actor and its options)
    "use_dynamic_bsz", "ppo_max_token_len_per_gpu", "_forward_micro_batch",
    # transformers
    "AttentionInterface", "AttentionMaskInterface", "save_pretrained", "flash_attention_2",
}
FILE_SUFFIXES = {"py", "sh", "json", "jsonl", "yaml", "yml", "md", "toml", "txt"}
IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DOTTED_RE = re.compile(r"([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)(?:\(\))?")
CODE_WORD_RE = re.compile(r"_?[a-z][a-z0-9]*(?:_[a-z0-9]+)+|[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+")


def spans() -> list[str]:
    return re.findall(r"`([^`\n]+)`", RESULTS.read_text("utf-8"))


@cache
def top_level() -> frozenset[str]:
    return frozenset(p.name for p in ROOT.iterdir() if not p.name.startswith(".") or p.name == ".ci")


@cache
def modules() -> dict[str, list[str]]:
    """Last part of each stapo module or package name -> its full names (``loadgen`` ->
    ``stapo.verifier_service.clients.loadgen``); ``stapo`` and the packages themselves included."""
    out: dict[str, list[str]] = {"stapo": ["stapo"]}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            full = ".".join([package, *parts])
            out.setdefault(full.rsplit(".", 1)[-1], []).append(full)
    return out


@cache
def code_names() -> tuple[frozenset[str], dict[str, list[tuple[str, frozenset[str]]]]]:
    """(every identifier stapo's code defines or uses as a string, class name -> [(module, its members)])."""
    names: set[str] = set()
    classes: dict[str, list[tuple[str, frozenset[str]]]] = {}
    for folder in SCANNED:
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__).resolve():
                continue  # this file's own examples of stale names
            tree = ast.parse(path.read_text("utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.Name):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, ast.keyword) and node.arg:
                    names.add(node.arg)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.update(IDENT_RE.findall(node.value))
                if isinstance(node, ast.ClassDef) and folder in PACKAGES:
                    members = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                    members |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets
                                if isinstance(t, ast.Name)}
                    members |= {n.target.id for n in node.body
                                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
                    module = ".".join([PACKAGES[folder], *path.relative_to(ROOT / folder).with_suffix("").parts])
                    classes.setdefault(node.name, []).append((module.removesuffix(".__init__"), frozenset(members)))
    return frozenset(names), classes


def _attribute_chain(module: str, attrs: list[str]) -> bool:
    """``module`` imports and ``module.a.b...`` exists (a submodule counts as an attribute)."""
    try:
        obj = importlib.import_module(module)
    except ImportError:
        return False
    for i, a in enumerate(attrs):
        if not hasattr(obj, a):
            try:
                obj = importlib.import_module(".".join([module, *attrs[: i + 1]]))
                continue
            except ImportError:
                return False
        obj = getattr(obj, a)
    return True


def _config_key(parts: list[str]) -> bool:
    """``trainer.micro_batch_tokens``: a key of the run config (``stapo.core.config.Config``)."""
    model = importlib.import_module("stapo.core.config").Config
    for p in parts:
        fields = getattr(model, "model_fields", {})
        if p not in fields:
            return False
        model = fields[p].annotation
    return True


def dotted_problem(token: str) -> str | None:
    """Why a dotted stapo name does not resolve; None when it does or is not a stapo name."""
    m = DOTTED_RE.fullmatch(token)
    if m is None or token.rsplit(".", 1)[-1] in FILE_SUFFIXES:
        return None  # not a dotted name, or a file name (``pool.py``: a path is checked as a path)
    first, rest = m.group(1), m.group(2)[1:].split(".")
    _, classes = code_names()
    candidates = modules().get(first, [])
    if first in classes and first[:1].isupper():
        if any(rest[0] in members for _, members in classes[first]):
            return None
        return f"`{token}`: no stapo class {first} has {rest[0]}"
    if not candidates:
        return None  # not a stapo module: another project's name (zero.Init, httpx.AsyncClient)
    if any(_attribute_chain(full, rest) for full in candidates) or _config_key([first, *rest]):
        return None
    return f"`{token}`: {' / '.join(candidates)} has no {'.'.join(rest)}"


def _braces(path: str) -> list[str]:
    """``data/corpus_{dev,heldback}.jsonl`` -> both paths (one brace group)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    return [path[: m.start()] + alt + path[m.end() :] for alt in m.group(1).split(",")] if m else [path]


def path_problem(token: str) -> str | None:
    token = token.strip("()[],;:")
    if "/" not in token or token.split("/", 1)[0] not in top_level() or "://" in token:
        return None
    missing = [p for p in _braces(token) if not glob.glob(str(ROOT / p))]
    return f"`{token}`: no such file" if missing else None


def word_problem(span: str) -> str | None:
    if not CODE_WORD_RE.fullmatch(span) or span in FOREIGN:
        return None
    return None if span in code_names()[0] else f"`{span}`: no stapo code defines or uses it"


def test_results_names_resolve():
    problems = []
    for span in spans():
        for token in span.split():
            problems.append(path_problem(token))
            problems.append(dotted_problem(token))
        problems.append(word_problem(span))
    problems = sorted({p for p in problems if p})
    assert not problems, "benchmarks/RESULTS.md names what the code no longer has:\n" + "\n".join(problems)


def test_results_is_current_and_short():
    text = RESULTS.read_text("utf-8")
    assert len(text.splitlines()) <= MAX_LINES
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert len(sections) == len(set(sections)), "one `## <harness>` section per harness"
    assert not any("earlier" in s.lower() for s in sections), "earlier measurements live in git history"


@pytest.mark.parametrize(
    "span, stale",
    [
        ("grader._search_match_oracle", True),  # a grader internal that no longer exists
        ("grader.PROSE_AS_TEXT", True),
        ("benchmarks/no_such_harness.py", True),
        ("split_rowz", True),  # looks like code, and no code has it
        ("cutoff", False),  # a plain word is not checked
        ("grader.compare", False),
        ("loadgen.build_stream", False),
        ("trainer.micro_batch_tokens", False),  # a config key
        ("zero.Init", False),  # DeepSpeed's, not stapo's
        ("evals/data/*.jsonl", False),
        ("verifier_service/data/corpus_{dev,heldback}.jsonl", False),
        ("verifier_service/data/corpus_{dev,later}.jsonl", True),
        ("pool.py", False),  # a file name, not the attribute ``py``
        ("verl/workers/actor/dp_actor.py", False),  # another repository's path
        ("python benchmarks/verifier.py --items 4096", False),
        ("0.707107", False),
        ("padding_free", False),  # TRL's, in FOREIGN
        ("VerifierClient", False),
        ("NoSuchClassAnywhere", True),
    ],
)
def test_the_checks_catch_stale_names(span, stale):
    """The checks themselves: stale stapo names are caught, other spans pass."""
    found = [path_problem(t) or dotted_problem(t) for t in span.split()] + [word_problem(span)]
    assert any(found) is stale, found
