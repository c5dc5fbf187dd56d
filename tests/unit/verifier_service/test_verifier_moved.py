"""The flat layout's module paths of ``stapo.verifier_service`` give the modules at their role-layout
paths, with a DeprecationWarning that names the new path; docs/verifier.md's "Where did it move" table
is ``stapo.verifier_service.MOVED`` row for row.

Run: ``pytest tests/unit/verifier_service/test_verifier_moved.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from stapo.verifier_service import MOVED

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "verifier.md"


def _table(heading: str) -> dict[str, str]:
    lines = DOC.read_text().split(heading + "\n", 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = [[c.strip().replace("`", "") for c in ln.strip("|").split("|")] for ln in lines[start + 2:end]]
    return dict(rows)


def test_the_moved_table_is_the_import_shims():
    table = _table("## Where did it move")
    assert table["stapo.verifier_service.adapters"] == "stapo.verifier_service.clients.adapters"
    assert table == MOVED


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_path_gives_the_new_module_and_warns(old, new, monkeypatch):
    real = importlib.import_module(new)
    parent, _, leaf = old.rpartition(".")
    monkeypatch.delitem(sys.modules, old, raising=False)
    if parent in sys.modules:
        monkeypatch.delattr(sys.modules[parent], leaf, raising=False)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} is an old path of {new}")):
        shim = importlib.import_module(old)
    assert shim is real
    assert real.__spec__.name == new and real.__name__ == new  # the module keeps its own identity


def test_no_old_path_names_a_file():
    """An old path is no module of the tree, so the finder, which stands first, shadows nothing."""
    root = REPO / "verifier_service"
    for old in MOVED:
        rel = root.joinpath(*old.split(".")[2:])
        assert not rel.with_suffix(".py").exists() and not rel.is_dir(), old
    assert all(importlib.util.find_spec(new) is not None for new in MOVED.values())


def test_a_users_script_on_old_paths_runs_and_is_told_where(tmp_path):
    """A script written for the flat layout runs (verl's ``pkg://`` import of the adapters, a submodule
    of the moved ``rules`` package: one module object, not a second copy) and Python shows each
    warning with the new path; an unknown name is still a plain ImportError."""
    script = tmp_path / "old.py"
    script.write_text(
        "import importlib\n"
        "from stapo.verifier_service.pool import GraderPool\n"
        "adapters = importlib.import_module('stapo.verifier_service.adapters')\n"
        "new_table = importlib.import_module('stapo.verifier_service.grader.rules.table')\n"
        "import stapo.verifier_service.rules.table as table\n"
        "print(GraderPool.__module__, adapters.compute_score.__module__, table is new_table, table.__name__)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["stapo.verifier_service.server.pool", "stapo.verifier_service.clients.adapters",
                                  "True", "stapo.verifier_service.grader.rules.table"]
    assert (f"{script}:2: DeprecationWarning: stapo.verifier_service.pool is an old path of "
            "stapo.verifier_service.server.pool") in out.stderr
    assert (f"{script}:5: DeprecationWarning: stapo.verifier_service.rules.table is an old path of "
            "stapo.verifier_service.grader.rules.table") in out.stderr
    with warnings.catch_warnings(), pytest.raises(ModuleNotFoundError, match="stapo.verifier_service.no_such"):
        importlib.import_module("stapo.verifier_service.no_such")
