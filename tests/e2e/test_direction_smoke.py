"""`python benchmarks/direction.py --smoke`: the direction harness end to end on the tiny model.

Real `stapo train` processes (2 at a time, OMP_NUM_THREADS=1), the real recipes (stapo-base,
stapo and stapo-random, all three always), 2 seeds x 2 steps: the pilot, the arms, the per-seed
table, the paired contrasts, the verdict, direction.json and the `stapo compare` report over the
arms. The tiny model learns nothing in 2 steps, so the test checks the machinery and the record, and
that the verdict is the one the recorded contrasts give (tests/unit/test_direction.py checks the
rule itself on hand-computed cases)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # 8 tiny training processes

ROOT = Path(__file__).resolve().parents[2]


def test_direction_smoke_runs_pilot_arms_and_prints_the_verdict(tmp_path: Path) -> None:
    out = tmp_path / "direction"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "direction.py"), "--smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = res.stdout
    assert text.index("verdict rules, fixed before running") < text.index("pilot:") < text.index("arms A, B and C:")
    rec = json.loads((out / "direction.json").read_text())
    assert rec["design"]["arms"] == ["stapo-base", "stapo", "stapo-random"] and rec["design"]["seeds"] == [0, 1]
    assert set(rec["per_seed"]) == {"A", "B", "C"} and all(set(v) == {"0", "1"} for v in rec["per_seed"].values())
    a0 = rec["per_seed"]["A"]["0"]
    assert set(a0["accuracy"]) == {"0", "1", "2"} and a0["steps"] == 2
    assert a0["endpoint"] == a0["accuracy"]["2"]  # 2 steps: the last third is step 2 alone
    assert all(m["silenced_rate"] == 0 for m in rec["per_seed"]["A"].values())  # the arms differ in the weighting
    assert sum(m["silenced_rate"] for m in rec["per_seed"]["B"].values()) > 0  # and B's fires (tiny's tau_p 0.1)
    assert rec["pilot"]["mechanism"]["steps"] >= 1 and rec["pilot"]["b_silenced_rate"] > 0
    # the contrasts as recorded, B - C recomputed from the per-seed endpoints
    cs = {c["name"]: c for c in rec["contrasts"]}
    assert list(cs) == ["B - C", "B / A", "B - A", "C - A", "B / C"] and cs["B - C"]["deciding"]
    ends = {arm: [rec["per_seed"][arm][s]["endpoint"] for s in ("0", "1")] for arm in ("B", "C")}
    assert cs["B - C"]["diffs"] == pytest.approx({"0": ends["B"][0] - ends["C"][0], "1": ends["B"][1] - ends["C"][1]})
    assert cs["B / A"]["deciding"] == rec["entropy_applies"] == rec["pilot"]["entropy_rises"]
    deciding = [c["side"] for c in rec["contrasts"] if c["deciding"]]
    expected = ("holds" if all(s == "for" for s in deciding) else
                "refuted" if all(s == "against" for s in deciding) else "inconclusive")
    assert rec["verdict"] == expected and f"verdict: {expected.upper()}" in text
    rows = [line.split() for line in text.split("\nper seed")[1].splitlines() if line.strip()[:1] in ("A", "B", "C")]
    assert [r[:2] for r in rows[:6]] == [["A", "0"], ["A", "1"], ["B", "0"], ["B", "1"], ["C", "0"], ["C", "1"]]
    cmp = json.loads((out / "compare" / "compare.json").read_text())
    assert list(cmp["seeded"]["groups"]) == ["A", "B", "C"] and cmp["seeded"]["pairing"]["training"] == "seed"
    # arms differ in the method only: no confound between the paired runs
    assert cmp["config_check"]["warning"] is None
