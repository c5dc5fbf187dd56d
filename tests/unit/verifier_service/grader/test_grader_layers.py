"""The grader's layers import one way, at module top: ``parsing.py`` <- ``rules/`` (the families, then
``rules/table.py``) <- the package's own module (``grader/__init__.py``: extract, compare, grade).

Math-Verify keeps its parser apart from its grader; this test keeps ours so: a rule family that
reached up into the table or the grader, or an import hidden inside a function to dodge a cycle,
fails here naming the file and line. Run: ``pytest tests/unit/verifier_service/grader/test_grader_layers.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from stapo.verifier_service import grader
from stapo.verifier_service.grader.rules import table

ROOT = Path(__file__).resolve().parents[4]
PKG = "stapo.verifier_service.grader"
GRADER = Path("verifier_service", "grader")
FAMILIES = ("strings", "numbers", "structure", "rejections", "symbolic")
LAYER = {
    "parsing": 0,
    **{f"rules.{f}": 1 for f in FAMILIES},
    "rules": 1,  # the package itself holds only the RuleVerdict alias
    "rules.table": 2,
    "grader": 3,
}


def _file(name: str, root: Path = ROOT) -> Path:
    """The file of a grader module named relative to the package (``grader``: the package's own)."""
    path = root / GRADER / Path(*name.split(".")) if name != "grader" else root / GRADER
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _relative(module: str) -> str | None:
    """A stapo module's name relative to the grader package (``grader``: the package), None outside it."""
    if module == PKG:
        return "grader"
    return module.removeprefix(PKG + ".") if module.startswith(PKG + ".") else None


def imports(name: str, root: Path = ROOT) -> list[tuple[int, str, bool]]:
    """(line, imported grader module relative to the package, at module top?); ``from pkg import mod``
    names the submodule."""
    tree = ast.parse(_file(name, root).read_text("utf-8"))
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            full = [s if _is_module(s, root) else node.module for s in subs]
        elif isinstance(node, ast.Import):
            full = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, r, id(node) in top) for m in full if (r := _relative(m)) is not None]
    return out


def _is_module(module: str, root: Path) -> bool:
    path = root.joinpath("verifier_service", *module.split(".")[2:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


@pytest.mark.parametrize("name", sorted(LAYER))
def test_each_layer_imports_only_lower_layers_at_module_top(name):
    for line, target, at_top in imports(name):
        where = f"{_file(name).relative_to(ROOT)}:{line}"
        assert at_top, f"{where}: import of {target} inside a function"
        if target in LAYER and target != "rules":
            assert LAYER[target] < LAYER[name], f"{where}: {name} (layer {LAYER[name]}) imports {target}"


def test_the_families_do_not_import_each_other():
    for family in FAMILIES:
        others = {t for _, t, _ in imports(f"rules.{family}")} & {f"rules.{f}" for f in FAMILIES}
        assert not others, f"rules/{family}.py imports {others}: a family reads only parsing.py"


def test_the_scan_sees_a_reversed_arrow(tmp_path):
    """The check itself: a family that imports the table, and a function-level import, are seen."""
    fake = tmp_path / "verifier_service" / "grader" / "rules"
    fake.mkdir(parents=True)
    for empty in (fake.parent / "__init__.py", fake / "__init__.py", fake / "table.py"):
        empty.write_text("")
    (fake / "numbers.py").write_text(
        "from stapo.verifier_service.grader.rules.table import RULES\n"
        "def f():\n    from stapo.verifier_service import grader\n"
    )
    found = imports("rules.numbers", tmp_path)
    assert (1, "rules.table", True) in found and (3, "grader", False) in found


def test_the_grader_keeps_its_public_surface():
    """The split moved code, not names: ``grader`` still answers for everything its callers read."""
    assert grader.__all__ == ["Answer", "Verdict", "answers_equivalent", "compare", "extract", "grade"]
    for name in ("MAX_CHARS", "RULES", "RULE_NAMES", "UNDECIDED", "GraderSettings", "configure", "cache_info",
                 "cache_clear"):
        assert hasattr(grader, name), name
    assert grader.RULES is table.RULES and grader.RULE_NAMES == tuple(r.name for r in table.RULES)
