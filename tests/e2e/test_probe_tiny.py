"""`stapo probe` end to end on the tiny config, and every documented `stapo probe` line (README.md,
docs/*.md and the command's --help examples; ``--pool`` lines pool two probes of the tiny run).

A tiny run trains 2 steps with a checkpoint after each (real AdamW state); the probe reads the
initial model and that checkpoint: real sampling, grading and gradients. The documented lines run as
written except for what this machine forces: ``--config demo`` runs with ``--config tiny`` (the demo
model is a 135M model: an hour here), a checkpoint folder is the tiny run's first checkpoint and a
run folder the tiny run (its last), ``--batches``
at most 2, ``--prompts`` dropped, ``--out`` a temporary folder."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from doc_lines import documented

from stapo.cli.probe import command

pytestmark = pytest.mark.long  # a tiny training run and several probes (~20 s each)


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stapo.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("probe") / "run"
    res = _run(["train", "--config", "tiny", "--recipe", "stapo-base", "--set", "trainer.max_steps=2",
                "--set", "checkpoint.every=1", "--set", "checkpoint.keep_last=2", "--run-dir", str(run)])
    assert res.returncode == 0, res.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def split_probes(tiny_run) -> list[Path]:
    """The initial model and the first checkpoint probed by two separate runs (1 batch each)."""
    out = []
    for name, target in (("p0", "init"), ("p1", str(tiny_run / "checkpoints" / "step_000001"))):
        where = tiny_run.parent / name
        res = _run(["probe", target, "--config", "tiny", "--batches", "1", "--check", "0", "--out", str(where)])
        assert res.returncode == 0, res.stderr[-3000:]
        out.append(where / "probe.json")
    return out


def test_probe_on_tiny_writes_the_verdict_and_the_paired_contrasts(tiny_run, tmp_path):
    out = tmp_path / "probe"
    res = _run(["probe", "init", str(tiny_run / "checkpoints" / "step_000001"), "--config", "tiny",
                "--batches", "3", "--check", "1", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-3000:]
    text = " ".join(res.stdout.split())
    assert text.index("verdict rule (stated before any batch runs)") < text.index("init: J_val")
    result = json.loads((out / "probe.json").read_text())
    assert f"verdict: {result['verdict']}" in text and "linearization: 4/4 SGD steps agree" in text
    assert result["complete"] is True
    assert result["verdict"] in ("holds", "refuted", "inconclusive")
    got = {(c["checkpoint"], c["name"], c["metric"], c["precond"]): c for c in result["contrasts"]}
    for where in ("init", "step 1", "pooled"):
        for name in ("B-C", "B-A"):
            for metric in ("J_val", "H"):
                c = got[where, name, metric, "sgd"]
                assert set(c) >= {"name", "metric", "mean", "ci95", "n"}
                assert c["n"] == (6 if where == "pooled" else 3)
                lo, hi = c["ci95"]
                assert lo <= c["mean"] <= hi
    assert got["init", "B-C", "J_val", "adam"]["n"] == 3  # a fresh optimizer's first step
    assert got["step 1", "B-C", "J_val", "adam"]["n"] == 3  # the checkpoint's AdamW moments
    batches = result["batches"]
    assert len(batches) == 6 and all(b["candidates"] >= b["silenced"] >= 0 for b in batches)
    assert any(b["silenced"] for b in batches)  # tiny: tau_p 0.1, every A > 0 token is a candidate
    for b in batches:  # with nothing silenced B is A
        if not b["silenced"]:
            assert b["changes"]["B"]["J_val"]["sgd"] == pytest.approx(b["changes"]["A"]["J_val"]["sgd"])
    assert len(result["checks"]) == 4 and result["checks_agree"] is True
    assert [c["seed"] for c in result["checks"]] == [0] * 4  # a check names its batch: checkpoint, seed, batch
    assert all(math.isfinite(c["J_val"]["predicted"]) for c in result["checks"])
    base = {(c["checkpoint"], c["batch"], m): abs(c[m]["predicted"]) for c in result["checks"] if c["arm"] == "A"
            for m in ("J_val", "H")}
    for c in result["checks"]:  # the rule's scale: the larger of the arm's and arm A's change on that batch
        for m in ("J_val", "H"):
            assert c[m]["scale"] == pytest.approx(max(abs(c[m]["predicted"]), base[c["checkpoint"], c["batch"], m]))
    for line in res.stdout.splitlines():
        if line.startswith(("init ", "step 1 ", "pooled ", "where ")):
            assert len(line) <= 80, line


def test_pool_reports_the_batches_of_separate_probes_together(split_probes, tmp_path):
    res = _run(["probe", "--pool", str(split_probes[0]), "--pool", str(split_probes[1]), "--out", str(tmp_path)])
    assert res.returncode == 0, res.stderr[-3000:]
    parts = [json.loads(p.read_text()) for p in split_probes]
    result = json.loads((tmp_path / "probe.json").read_text())
    assert [b["checkpoint"] for b in result["batches"]] == ["init", "step 1"]
    got = {(c["checkpoint"], c["name"], c["metric"], c["precond"]): c for c in result["contrasts"]}
    diffs = [p["batches"][0]["changes"]["B"]["H"]["sgd"] - p["batches"][0]["changes"]["C"]["H"]["sgd"] for p in parts]
    assert got["pooled", "B-C", "H", "sgd"]["n"] == 2
    assert got["pooled", "B-C", "H", "sgd"]["mean"] == pytest.approx(sum(diffs) / 2)
    again = _run(["probe", "--pool", str(split_probes[0]), "--pool", str(split_probes[0]), "--out", str(tmp_path)])
    assert again.returncode == 2 and "appears in two results" in again.stderr


def test_probe_refuses_bad_input_before_loading(tmp_path):
    for args, msg in ((["probe", str(tmp_path / "nope"), "--config", "tiny"], "no such folder"),
                      (["probe", "init"], "`init` alone needs --config"),
                      (["probe", "init", "--config", "tiny", "--batches", "0"], "--batches must be >= 1"),
                      (["probe", "init", "--config", "tiny", "--batches", "2", "--check", "3"], "--check must be"),
                      (["probe", str(tmp_path), "--config", "tiny"], "neither a checkpoint"),
                      (["probe", "init", "--config", "tiny", "--device", "cuda:7"], "cuda")):
        res = _run(args, timeout=120)
        assert res.returncode == 2 and msg in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr


def _is_command(rest: list[str]) -> bool:
    """``stapo probe`` followed by an option (``--pool``, ``--config``), ``init`` or a folder, not a
    listing's or a sentence's ``stapo probe does ...``."""
    return rest[0].startswith("-") or rest[0] == "init" or "/" in rest[0]


DOCUMENTED = documented("probe", command.__doc__ or "", _is_command)


def test_the_docs_show_probe_lines():
    for where in ("docs/evaluation.md", "stapo probe --help"):
        assert any(w.startswith(where) for w, _ in DOCUMENTED), where


@pytest.mark.parametrize(("where", "argv"), DOCUMENTED, ids=[w for w, _ in DOCUMENTED])
def test_documented_probe_line_runs(where, argv, tiny_run, split_probes, tmp_path):
    args, i, pools = [], 0, iter(split_probes)
    while i < len(argv):
        a = argv[i]
        if a == "--pool":
            args += [a, str(next(pools))]
            i += 2
            continue
        if a in ("--config", "-c") and argv[i + 1] == "demo":
            args += [a, "tiny"]
            i += 2
            continue
        if a in ("--prompts", "-p", "--out", "-o", "--device"):
            i += 2
            continue
        if a in ("--batches", "-b"):
            args += [a, str(min(2, int(argv[i + 1])))]
            i += 2
            continue
        if a.startswith("runs/"):  # a checkpoint folder: the tiny run's first; a run folder: the run (its last)
            args.append(str(tiny_run / "checkpoints" / "step_000001" if "checkpoints" in a else tiny_run))
        else:
            args.append(a)
        i += 1
    if "--config" not in args and "-c" not in args and "--pool" not in args:
        args += ["--config", "tiny"]
    res = _run([*args, "--out", str(tmp_path / "out")])
    assert res.returncode == 0, (where, args, res.stderr[-3000:])
    assert json.loads((tmp_path / "out" / "probe.json").read_text())["verdict"], where
