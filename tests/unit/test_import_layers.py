"""stapo.core is a stack of layers; each module imports only its own layer or the ones below it, and
no module but the loop imports the loop.

The layers, lowest first (docs/architecture.md draws them):

    0 base     stapo.core.{lazy, fairness, loss_options, weighting_options, batch, placement, tokenstats}
               plain types, option models, seeds, devices, the chunked token statistics: no stapo import
    1 algos    stapo.core.algos            pure tensor math, registered by name (reads the option models)
    2 config   stapo.core.{config, tracking}
               the run's typed config (checks names against the algos registries) and its metrics files
    3 task     stapo.core.task             what the policy learns: prompt sources and templates, the prompt
                                           sampler, rewards
    4 trainer  stapo.core.trainer          the policy (models), backends, data-parallel reductions
    5 rollout  stapo.core.rollout          engines, one step's sampling and grading, asynchronous rollouts
    6 train    stapo.core.train            the actor's passes and micro-batches, the loop's hooks, reference,
                                           DEEP-GRPO, the loop, checkpoints, the run dir, the memory plan,
                                           calibrate

An import that points up (eager, inside a function, or for type checking) would make a lower layer
depend on a higher one. Imports sit at module top: inside a function only where a layer keeps a
heavy or optional dependency out of ``import`` (the config loads without torch, so its check of
names against the algos registries imports them when it runs), never to let two modules need each
other (no import circle in core/, counting imports inside functions and for type checking); at most ``MAX_FUNCTION_LEVEL`` such imports of stapo modules in all of core/. Heavy
third-party backends (vLLM, DeepSpeed, transformers, matplotlib) stay lazy and are not counted.

Above core, every top-level package of the distribution (pyproject's ``package-dir``) imports only
the packages :data:`PACKAGE_IMPORTS` lets it: the CLI everything; evals the engine and the grader;
core the grader (``task.rewards`` grades through its pool or client) but never evals or the CLI;
the verifier service nothing of the RL engine, evals or the CLI (no torch on its path).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

CORE = Path(__file__).resolve().parents[2] / "core"
BASE = ("lazy", "fairness", "loss_options", "weighting_options", "batch", "placement", "tokenstats")
LAYERS: dict[str, int] = {
    "stapo.core": 0,
    **{f"stapo.core.{m}": 0 for m in BASE},
    "stapo.core.algos": 1,
    "stapo.core.config": 2,
    "stapo.core.tracking": 2,
    "stapo.core.task": 3,
    "stapo.core.trainer": 4,
    "stapo.core.rollout": 5,
    "stapo.core.train": 6,
}
NAMES = ("base", "algos", "config", "task", "trainer", "rollout", "train")
MAX_FUNCTION_LEVEL = 25


ROOT = CORE.parent
# {"stapo": "stapo_pkg", "stapo.cli": "cli", "stapo.core": "core", ...}: each package's folder
PACKAGE_DIRS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
# What each top-level package may import besides itself (the distribution's root holds its version).
PACKAGE_IMPORTS: dict[str, tuple[str, ...]] = {
    "stapo": (),
    "stapo.configs": ("stapo",),
    "stapo.verifier_service": ("stapo",),
    "stapo.core": ("stapo", "stapo.configs", "stapo.verifier_service"),
    "stapo.evals": ("stapo", "stapo.configs", "stapo.core", "stapo.verifier_service"),
    "stapo.cli": ("stapo", "stapo.configs", "stapo.core", "stapo.evals", "stapo.verifier_service"),
}


def module_name(path: Path) -> str:
    pkg, folder = next((p, f) for p, f in PACKAGE_DIRS.items() if path.is_relative_to(ROOT / f))
    parts = [*pkg.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package(module: str) -> str:
    """The top-level package of a stapo module: its longest prefix in PACKAGE_DIRS."""
    parts = module.split(".")
    return next(".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in PACKAGE_DIRS)


def layer(module: str) -> int | None:
    """The layer of a stapo.core module: its longest prefix in LAYERS (None: in no layer)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])] if n > 2 or module == "stapo.core" else None
    return None


def _is_module(name: str) -> bool:
    pkg = package(name)
    rel = (ROOT / PACKAGE_DIRS[pkg]).joinpath(*name.split(".")[len(pkg.split(".")):])
    return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def imports(path: Path, text: str | None = None) -> list[tuple[str, int, bool]]:
    """(imported stapo module, line, inside a function) for every import of a stapo module in a file
    (``text``: read in its place); ``from pkg import mod`` names the submodule."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, inside) for a in child.names if a.name.startswith("stapo"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                if source.startswith("stapo"):
                    subs = [f"{source}.{a.name}" for a in child.names if _is_module(f"{source}.{a.name}")]
                    out.extend((m, child.lineno, inside) for m in (subs or [source]))
            visit(child, inside)

    visit(ast.parse(path.read_text() if text is None else text, str(path)), False)
    return out


def function_level_statements(path: Path) -> list[int]:
    """Lines of the import statements of stapo modules that sit inside a function."""
    return sorted({line for _, line, inside in imports(path) if inside})


FILES = sorted(CORE.rglob("*.py"))
PACKAGE_FILES = sorted(p for folder in PACKAGE_DIRS.values() for p in (ROOT / folder).rglob("*.py"))


def package_violations(path: Path, text: str | None = None) -> list[str]:
    """The imports of ``path`` (``text``: read in its place) that reach a top-level package its own
    may not (:data:`PACKAGE_IMPORTS`)."""
    me = package(module_name(path))
    return [f"{path.relative_to(ROOT)}:{line} {target} ({package(target)}) from {me}"
            for target, line, _ in imports(path, text)
            if package(target) != me and package(target) not in PACKAGE_IMPORTS[me]]


def test_every_core_module_is_in_a_layer():
    loose = [module_name(p) for p in FILES if layer(module_name(p)) is None]
    assert not loose, f"place these in a layer (LAYERS here and docs/architecture.md): {loose}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(CORE)))
def test_imports_point_down(path):
    me = module_name(path)
    up = [f"{path.relative_to(CORE.parent)}:{line} {target} ({NAMES[layer(target)]}) from {NAMES[layer(me)]}"
          for target, line, _ in imports(path)
          if target.startswith("stapo.core") and layer(target) is not None and layer(target) > layer(me)]
    assert not up, "imports of a higher layer:\n" + "\n".join(up)


def test_no_core_module_but_the_loop_imports_the_loop():
    """Every part of a step reads and tests without the loop: the loop strings them together."""
    loop = CORE / "train" / "loop.py"
    bad = [f"{p.relative_to(CORE.parent)}:{line}" for p in FILES if p != loop
           for target, line, _ in imports(p) if target == "stapo.core.train.loop"]
    assert not bad, f"these import stapo.core.train.loop: {bad}"


def test_few_imports_sit_inside_functions():
    found = {str(p.relative_to(CORE.parent)): function_level_statements(p) for p in FILES}
    found = {f: lines for f, lines in found.items() if lines}
    total = sum(len(v) for v in found.values())
    assert total <= MAX_FUNCTION_LEVEL, f"{total} function-level imports of stapo modules in core/: {found}"


def test_every_top_level_package_has_its_imports_declared():
    assert sorted(PACKAGE_DIRS) == sorted(PACKAGE_IMPORTS), "declare the new package in PACKAGE_IMPORTS"


@pytest.mark.parametrize("path", PACKAGE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_top_level_packages_import_only_what_they_may(path):
    bad = package_violations(path)
    assert not bad, "imports of a package this one may not import:\n" + "\n".join(bad)


def test_the_scan_sees_each_form():
    """The scan reads the forms the layering relies on (a check that cannot fail checks nothing)."""
    assert layer("stapo.core.train.loop") == 6 and layer("stapo.core.batch") == 0
    assert layer("stapo.core.algos.weights") == 1 and layer("stapo.core.newthing") is None
    src = ("from stapo.core.train import loop\nfrom .registry import Registry\n"
           "def f():\n    import stapo.core.task.sampler\n    from stapo.core import config\n")
    found = [(m, inside) for m, _, inside in imports(CORE / "algos" / "weights.py", src)]
    assert found == [("stapo.core.train.loop", False), ("stapo.core.algos.registry", False),
                     ("stapo.core.task.sampler", True), ("stapo.core.config", True)]
    in_train = [m for m, _, _ in imports(CORE / "train" / "extras.py", "from . import loop\nfrom .loop import x\n")]
    assert in_train == ["stapo.core.train.loop", "stapo.core.train.loop"]
    # across top-level packages: core reaching evals or the CLI (at top, in a function, by relative
    # import) is caught; the grader and the distribution's version are allowed
    up = ("import stapo.evals\nfrom stapo.cli import main\ndef f():\n    from stapo.evals.inspect import x\n"
          "from ...evals import runner\nfrom stapo.verifier_service import grader\nfrom stapo import __version__\n")
    assert [v.split()[1] for v in package_violations(CORE / "task" / "data.py", up)] == [
        "stapo.evals", "stapo.cli.main", "stapo.evals.inspect", "stapo.evals.runner"]
    assert package_violations(ROOT / "verifier_service" / "app.py", "from stapo.core import batch\n")
    assert module_name(ROOT / "stapo_pkg" / "__init__.py") == "stapo" and package("stapo.__version__") == "stapo"


def import_graph() -> dict[str, set[str]]:
    """Every core module -> the core modules it imports (at top, inside a function or for type
    checking: any of them closes a circle)."""
    return {module_name(p): {t for t, _, _ in imports(p) if t.startswith("stapo.core") and t != module_name(p)}
            for p in FILES}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: the strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_core():
    """No two core modules need each other, not even through an import inside a function (the
    order the modules load in would then decide what works)."""
    found = circles(import_graph())
    assert not found, f"import circles in core/: {found}"


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
    # the train layer as it once was: the update, the hooks' module and DEEP-GRPO (an import in a function)
    graph = {"update": {"extras"}, "extras": {"deep_grpo"}, "deep_grpo": {"update", "extras"}}
    assert circles(graph) == [["deep_grpo", "extras", "update"]]
