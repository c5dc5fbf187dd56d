"""Dependencies run one way: cli -> loop -> (batch, rollouts, update, hooks, ...) -> algos.

No module under core/ other than loop.py imports ``stapo.core.train.loop`` (eagerly, lazily inside a
function, or for type checking), so every part of a step can be read and tested without the loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core"


def _imports_loop(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod == "stapo.core.train.loop" or (mod == "stapo.core.train" and any(a.name == "loop" for a in node.names)) or (
                node.level > 0 and (mod == "loop" or (mod == "" and any(a.name == "loop" for a in node.names)))
            ):
                lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name == "stapo.core.train.loop" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_no_core_module_but_the_loop_imports_the_loop():
    bad = [f"{p.relative_to(CORE.parent)}:{n}" for p in sorted(CORE.rglob("*.py")) if p.name != "loop.py" or
           p.parent != CORE / "train" for n in _imports_loop(ast.parse(p.read_text(), str(p)))]
    assert not bad, f"these import stapo.core.train.loop: {bad}"


def test_the_scan_sees_each_form():
    for src in ("from stapo.core.train.loop import Batch", "def f():\n    from stapo.core.train.loop import x",
                "from stapo.core.train import loop", "from .loop import x", "from . import loop", "import stapo.core.train.loop"):
        assert _imports_loop(ast.parse(src)), src
    assert not _imports_loop(ast.parse("from stapo.core.train.update import Actor"))
