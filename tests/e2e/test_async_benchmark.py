"""`python benchmarks/async_rollouts.py` (docs/async.md, "Throughput"): the benchmark end to end,
shrunk by its own flags (a 1-layer policy, 3 steps, one round) so it runs in a default suite.

Real training runs, async off then on (a real producer process, the real grader); what can fail is
the harness: both runs train, the async run logs its waits, and the table has its three rows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # two tiny training runs and a producer process

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "async.md"
SMALL = ["--steps", "3", "--skip", "1", "--rounds", "1", "--hidden", "32", "--layers", "1", "--max-new-tokens", "4"]


def test_the_documented_benchmark_prints_off_on_and_their_ratio() -> None:
    [line] = re.findall(r"`(python benchmarks/async_rollouts\.py)`", DOC.read_text())
    script = line.split()[1]
    res = subprocess.run([sys.executable, str(ROOT / script), *SMALL], capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [r for r in res.stdout.splitlines() if r.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["off", "on (k=1)", "on/off ratio"], rows
    on = [float(x) for x in rows[2].split("|")[2:8]]
    assert all(x >= 0 for x in on) and on[0] > 0  # time/step, tok/s, waits, rollout, update, CPU s/step
