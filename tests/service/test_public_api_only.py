"""verifier_service/ uses other packages through their public names only.

An AST scan of every module: no import of a private name (``_x``) of another package, no access to
or assignment of a private attribute reached from another package's module (``mp.process._children``,
``getattr(forkserver, "_forkserver")``), no rebinding of ``sys.modules`` entries. Undocumented
details of CPython or a dependency change in any minor release; this keeps them out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "verifier_service"
OURS = ("stapo", ".")
DOCUMENTED = {"sys._current_frames"}
"""Underscored names that Python's reference documents (the ``sys`` module page): the pool's main-guard
check reads the main thread's stack with it when the caller grades on a worker thread."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(source: str, where: str = "<src>") -> list[str]:
    """Private names of other packages used in ``source`` (one line each)."""
    tree = ast.parse(source)
    foreign: set[str] = set()  # local names bound to other packages' modules or objects
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not a.name.startswith(OURS):
                    foreign.add((a.asname or a.name).split(".")[0])
                    if any(_private(p) for p in a.name.split(".")):
                        out.append(f"{where}:{node.lineno}: import {a.name}")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and not (node.module or "").startswith("stapo")
        ):
            mod = node.module or ""
            for a in node.names:
                foreign.add(a.asname or a.name)
                if _private(a.name) or any(_private(p) for p in mod.split(".")):
                    out.append(f"{where}:{node.lineno}: from {mod} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in foreign and any(_private(a) for a in chain):
                dotted = f"{base.id}.{'.'.join(reversed(chain))}"
                if dotted not in DOCUMENTED:
                    out.append(f"{where}:{node.lineno}: {dotted}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
                obj, name = node.args[0], node.args[1]
                while isinstance(obj, ast.Attribute):
                    obj = obj.value
                if (
                    isinstance(obj, ast.Name)
                    and obj.id in foreign
                    and isinstance(name, ast.Constant)
                    and isinstance(name.value, str)
                    and _private(name.value)
                ):
                    out.append(f"{where}:{node.lineno}: {node.func.id}({obj.id}, {name.value!r})")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.value, ast.Attribute)
                    and t.value.attr == "modules"
                    and isinstance(t.value.value, ast.Name)
                    and t.value.value.id == "sys"
                ):
                    out.append(f"{where}:{node.lineno}: sys.modules[...] rebound")
    return sorted(set(out))


@pytest.mark.parametrize(
    "src",
    [
        "import multiprocessing as mp\nmp.process._children.discard(1)",
        "from multiprocessing import forkserver\nforkserver._forkserver._forkserver_pid = None",
        "from multiprocessing import forkserver\nfs = getattr(forkserver, '_forkserver', None)",
        "import multiprocessing as mp\nchildren = getattr(mp.process, '_children', None)",
        "from math_verify.parser import _parse\n",
        "import math_verify._internal\n",
        "import sys, types\nsys.modules['__main__'] = types.ModuleType('__main__')",
        "import math_verify.parser as p\np._cache = {}",
    ],
)
def test_the_scan_catches_private_use(src):
    assert violations(src), src


def test_the_scan_lets_public_and_own_private_names_pass():
    src = (
        "import os, pebble\nfrom stapo.verifier_service.server.cache import ByteLRU\n"
        "class A:\n    def f(self):\n        self._x = 1\n        return pebble.ProcessPool, os.__name__, self._x\n"
        "_LOCAL = 1\n"
    )
    assert violations(src) == []


def test_no_module_of_the_service_uses_private_names_of_other_packages():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 5
    found = [v for f in files for v in violations(f.read_text(), f.name)]
    assert not found, "\n".join(found)
