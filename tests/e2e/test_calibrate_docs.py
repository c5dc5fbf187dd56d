"""`stapo calibrate` end to end on the tiny config, and every documented `stapo calibrate` line
(README.md, docs/*.md, the command's --help examples).

Real sampling, grading, teacher forcing and the registered ``s2t`` weighting on the tiny random
model (configs/tiny.yaml: tau_p 0.1, q 0.75, so its A > 0 tokens are candidates). The documented
lines of README.md and docs/*.md run as written except for what this machine forces: a line's
``--config demo`` runs with ``--config tiny`` (the demo model is a 135M model: ~10 minutes here) and
``--out`` goes to a temporary folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from doc_lines import documented

from stapo.cli.calibrate import command

pytestmark = pytest.mark.long  # each line samples, grades and teacher-forces the tiny model (~15 s)


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stapo.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "COLUMNS": "200"})


def test_calibrate_on_tiny_leads_with_the_counts_and_names_its_rule(tmp_path):
    out = tmp_path / "calib"
    res = _run(["calibrate", "--config", "tiny", "--limit", "8", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    text = " ".join(res.stdout.split())
    result = json.loads((out / "calibration.json").read_text())
    s, tax, c = result["sample"], result["taxonomy"], result["counts"]
    # the answer comes before the tables, and names tiny's tau_p as its own, not the paper's
    assert text.index(" ".join(result["answer"].split())) < text.index("silenced fraction of response tokens")
    assert "S2T at tau_p 0.1, q 0.75 (the paper uses tau_p 0.002) silences" in text and "the paper's rule" not in text
    assert "silenced tokens per mini-batch" in result["answer"] and "a 3-step run silences" in result["answer"]
    assert "rows tau_p, columns q" in text and "E[random candidates]" in text and "E[random A > 0 tokens]" in text
    assert s["responses"] == 64 and s["tokens"] == 64 and s["minibatches"] == 1
    assert len(result["grid"]) == 6 * 3  # the default 5 x 3 grid plus the config's tau_p 0.1 row
    (ref,) = [r for r in result["grid"] if r["configured"]]
    assert (ref["tau_p"], ref["q"]) == (0.1, 0.75)
    # tiny: 8 prompts x 8 responses of 1 token, one mini-batch a step, 3 steps
    assert c["per_step"] == pytest.approx(ref["silenced"]) and c["per_run"] == pytest.approx(3 * ref["silenced"])
    assert sum(x["count"] for x in tax["cells"]) == tax["positive_tokens"] > 0
    sets = tax["sets"]
    assert sets["silenced"]["count"] == sets["random_candidates"]["count"] == sets["random_positive"]["count"] > 0
    assert (out / "calibration.png").stat().st_size > 1000
    bad = _run(["calibrate", "--config", "tiny", "--limit", "0"], timeout=120)
    assert bad.returncode == 2 and "--limit must be >= 1" in bad.stderr


def _is_command(rest: list[str]) -> bool:
    """``stapo calibrate --config ...`` or ``stapo calibrate  # comment`` (it takes no positional
    argument), not a listing's ``stapo calibrate will S2T ...``."""
    return rest[0].startswith(("-", "#"))


DOCUMENTED = documented("calibrate", command.__doc__ or "", _is_command)


def test_the_docs_show_calibrate_lines():
    for where in ("README.md", "docs/algorithms.md", "stapo calibrate --help"):
        assert any(w.startswith(where) for w, _ in DOCUMENTED), where


@pytest.mark.parametrize(("where", "argv"), DOCUMENTED, ids=[w for w, _ in DOCUMENTED])
def test_documented_calibrate_line_runs(where, argv, tmp_path):
    args = list(argv)
    if "--config" in args and args[args.index("--config") + 1] == "demo":
        args[args.index("--config") + 1] = "tiny"
    if "--out" in args:
        args[args.index("--out") + 1] = str(tmp_path / "out")
    else:
        args += ["--out", str(tmp_path / "out")]
    res = _run(args)
    assert res.returncode == 0, (where, res.stderr[-3000:])
    assert (tmp_path / "out" / "calibration.json").exists(), where
