"""The public API of docs/architecture.md imports as listed, and the old module paths of the flat
``stapo.core`` give the modules at their new paths with a DeprecationWarning that names them.

The tables are read from the page, so a row that names a missing module or name fails here; the
"Where did it move" table must be ``stapo.core.MOVED`` row for row.
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

import stapo.core
from stapo.core import MOVED

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _rows(heading: str) -> list[list[str]]:
    """The cells (backticks removed) of the first table under ``heading``, header and rule left out."""
    lines = DOC.read_text().split(heading + "\n", 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[c.strip().replace("`", "") for c in ln.strip("|").split("|")] for ln in lines[start + 2:end]]


PUBLIC = _rows("## The public API")
OLD_PATHS = _rows("### Where did it move")


def test_the_tables_are_read():
    assert len(PUBLIC) >= 15 and PUBLIC[0][0] == "stapo.core.algos" and "stapo_loss" in PUBLIC[0][1]
    assert ["stapo.core.models", "stapo.core.trainer.models"] in OLD_PATHS


@pytest.mark.parametrize("row", PUBLIC, ids=lambda r: r[0])
def test_every_public_name_imports(row):
    module = importlib.import_module(row[0])
    names = [n.strip() for n in row[1].split(",")]
    missing = [n for n in names if not re.fullmatch(r"\w+", n) or not hasattr(module, n)]
    assert not missing, f"{row[0]} lacks {missing}"


def test_the_moved_table_is_the_import_shims():
    assert dict(OLD_PATHS) == MOVED


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_path_gives_the_new_module_and_warns(old, new, monkeypatch):
    real = importlib.import_module(new)
    monkeypatch.delitem(sys.modules, old, raising=False)
    monkeypatch.delattr(stapo.core, old.rsplit(".", 1)[1], raising=False)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} is an old path of {new}")):
        shim = importlib.import_module(old)
    assert shim is real
    assert real.__spec__.name == new and real.__name__ == new  # the module keeps its own identity


def test_no_old_path_shadows_a_module():
    """An old path names no file of stapo.core (the finder stands last, after the real ones)."""
    core = Path(stapo.core.__file__).parent
    assert not [old for old in MOVED if (core / (old.rsplit(".", 1)[1] + ".py")).exists()]
    assert all(importlib.util.find_spec(new) is not None for new in MOVED.values())


def test_a_users_script_on_an_old_path_runs_and_is_told_where(tmp_path):
    """A script written for the flat layout runs; Python shows the warning (raised for ``__main__``'s
    import line) with the new path; an unknown name is still a plain ImportError."""
    script = tmp_path / "old.py"
    script.write_text("from stapo.core.models import build_tiny_tokenizer\n"
                      "from stapo.core import loop\n"
                      "print(build_tiny_tokenizer.__module__, loop.__name__)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["stapo.core.trainer.models", "stapo.core.train.loop"]
    assert f"{script}:1: DeprecationWarning: stapo.core.models is an old path of stapo.core.trainer.models" in out.stderr
    assert f"{script}:2: DeprecationWarning: stapo.core.loop is an old path of stapo.core.train.loop" in out.stderr
    with warnings.catch_warnings(), pytest.raises(ModuleNotFoundError, match="stapo.core.no_such_module"):
        importlib.import_module("stapo.core.no_such_module")
