"""`benchmarks/gpu_suite.sh --dry-run`: the GPU suite end to end on the CPU, from the carried wheels.

The suite's dry run fetches the wheels the GPU machine lacks (the same set `benchmarks/gpu_wheels.sh`
gives the device), installs them with Python 3.12 into an empty folder and imports every carried
module from there, then runs every part on tiny shapes on a bare Python 3.11 whose path holds only
those wheels and a stand-in for the device's own packages. What can fail here: a wheel missing from
the carried set (an import or a part fails), a part that breaks on the CPU, output the device tool
would not bring back (more than 8 files, a file over 16 MiB, folders deeper than 2), a run past its
540 s budget. The GPU itself is the one thing this cannot stand in for (no GPU here).

Downloads land once in the wheel cache outside git (``$STAPO_WHEEL_CACHE``, default
``~/.cache/stapo-gpu-wheels``), so only a machine's first run pays for them. It needs Python 3.12
(``$PY312``, else pyenv's newest 3.12, else ``python3.12`` on PATH) and skips without it.

The default suite runs the install half and one part (``--parts checks``): what a missing wheel breaks.
Every part on tiny shapes takes the whole 540 s budget here, so that run is opt-in::

    STAPO_SLOW=1 .venv/bin/python -m pytest tests/e2e/test_gpu_suite_dry.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
def _python312() -> Path | None:
    """The device's Python minor here: $PY312, pyenv's newest 3.12 (as the Makefile finds minors), or PATH's."""
    if os.environ.get("PY312"):
        return Path(os.environ["PY312"])
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = sorted(root.glob("versions/3.12.*/bin/python3.12"), key=lambda p: [int(x) for x in
                                                                               p.parts[-3].split(".")[:3] if x.isdigit()])
    return found[-1] if found else (Path(shutil.which("python3.12")) if shutil.which("python3.12") else None)


PY312 = _python312()
BUDGET_S = 540


NO_PY312 = pytest.mark.skipif(PY312 is None or not PY312.exists(), reason="no Python 3.12 (pyenv's, PATH's, or $PY312)")


def _dry_run(tmp_path: Path, *args: str) -> tuple[str, dict, float, Path]:
    """Run ``gpu_suite.sh --dry-run ARGS``; return its log, results.json, seconds taken and $OUT."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "WORK": str(work), "PY312": str(PY312)}
    t0 = time.monotonic()
    # the script bounds its parts by the budget; this bound is for its install steps hanging
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--dry-run", *args], env=env,
                       capture_output=True, text=True, timeout=BUDGET_S + 240)
    took = time.monotonic() - t0
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    assert "imports (Python 3.12" in log and "requirements: all met" in log, log[-3000:]
    return log, json.loads((out / "results.json").read_text()), took, out


@pytest.mark.long
@NO_PY312
def test_dry_run_installs_the_carried_wheels_and_runs_the_checks(tmp_path):
    _, report, _, _ = _dry_run(tmp_path, "--parts", "checks")
    assert list(report["parts"]) == ["checks"] and report["parts"]["checks"]["ok"], report["parts"]


@pytest.mark.long
@NO_PY312
@pytest.mark.skipif(os.environ.get("STAPO_SLOW") != "1", reason="slow (the whole 540 s budget): set STAPO_SLOW=1")
def test_dry_run_installs_the_carried_wheels_and_runs_every_part(tmp_path):
    log, report, took, out = _dry_run(tmp_path)
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_suite

    ran = {name: res for name, res in report["parts"].items() if "skipped" not in res}
    assert all(res["ok"] for res in ran.values()), {n: r.get("error") or r for n, r in ran.items() if not r["ok"]}
    # every part runs inside the budget on an idle machine; on a loaded one the budget may cut the last
    # (lowest-priority) parts, which then say so, but never the first three
    assert [p.name for p in gpu_suite.PARTS if p.default][:3] == list(ran)[:3]
    skipped = [n for n, r in report["parts"].items() if "skipped" in r]
    assert all(report["parts"][n]["skipped"].startswith("needs ~") for n in skipped)
    assert took < BUDGET_S + 60, f"{took:.0f} s"
    if "train_resume" in ran:  # the lowest-priority measured part: a loaded machine's budget may skip it
        assert report["parts"]["train_resume"]["differences"]["step3"] is None
    assert report["parts"]["zero3_train"]["checkpoint"] and report["parts"]["sync_stream"]["ok"]
    files = [f for f in out.rglob("*") if f.is_file()]
    assert len(files) <= 8 and all(f.stat().st_size <= 16 * 2**20 for f in files)
    assert all(len(f.relative_to(out).parts) <= 3 for f in files)
