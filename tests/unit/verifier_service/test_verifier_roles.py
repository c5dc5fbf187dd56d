"""``stapo.verifier_service`` is laid out by role and its imports point one way: ``grader`` (the library)
<- ``server`` (settings, pool, app) <- ``clients`` (HTTP client, adapters, load generator), and none
reaches into the rest of stapo but its root package (``stapo.__version__``; no torch on the service's path).

Every import of a stapo module, at module top or inside a function, is read from the source (AST).
Run: ``pytest tests/unit/verifier_service/test_verifier_roles.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "verifier_service"
ROLES = {"grader": 0, "server": 1, "clients": 2}
FILES = sorted(p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE)


def role(module: str) -> int | None:
    """The role of a ``stapo.verifier_service`` module (None: the package's own ``__init__``)."""
    parts = module.split(".")
    return ROLES.get(parts[2]) if len(parts) > 2 and parts[:2] == ["stapo", "verifier_service"] else None


def stapo_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a stapo module in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("stapo")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("stapo"):
            out.append((node.lineno, node.module))
    return out


def test_every_module_is_in_a_role():
    assert {p.relative_to(PACKAGE).parts[0] for p in FILES} == set(ROLES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_the_roles_and_stay_in_the_package(path):
    me = ROLES[path.relative_to(PACKAGE).parts[0]]
    for line, target in stapo_imports(path.read_text("utf-8")):
        if target == "stapo":
            continue
        where = f"{path.relative_to(PACKAGE.parent)}:{line}"
        assert target.startswith("stapo.verifier_service."), f"{where}: {target} is outside the verifier"
        assert role(target) is not None and role(target) <= me, f"{where}: {target} is a higher role"


def test_the_scan_sees_a_reversed_arrow():
    src = "def f():\n    from stapo.verifier_service.clients.client import VerifierClient\nimport stapo.core.batch\n"
    assert sorted(stapo_imports(src)) == [(2, "stapo.verifier_service.clients.client"), (3, "stapo.core.batch")]
    assert role("stapo.verifier_service.clients.client") > ROLES["server"]
