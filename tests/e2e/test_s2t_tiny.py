"""The first ten minutes show the method: on the tiny config STAPO silences tokens and trains
differently from GRPO; `stapo compare` says when S2T never fired and when two runs are the same;
`stapo inspect` lists exactly the tokens the update silenced; the rate watch warns once (`stapo
calibrate`: tests/e2e/test_calibrate_docs.py). Real loop, real tiny model, real grader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stapo.cli.train import method_overrides
from stapo.configs import preset_path
from stapo.core.config import load_config
from stapo.core.tracking import read_jsonl
from stapo.core.train.loop import train
from stapo.core.train.run import Run

pytestmark = pytest.mark.long  # three tiny runs (10 steps) in one fixture


def _train(run_dir: Path, *overrides: str, recipe: str | None = None) -> list[str]:
    base = preset_path("tiny")
    sets = method_overrides(preset_path(recipe), load_config(base).rollout.max_new_tokens) if recipe else []
    cfg = load_config(base, [*sets, "checkpoint.export_hf=false", "logging.tensorboard=false", *overrides])
    logs: list[str] = []
    train(Run.build(cfg, run_dir, log=logs.append))
    return logs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("s2t")
    out = {"root": root}
    out["stapo_logs"] = _train(root / "stapo", "trainer.max_steps=2")
    out["grpo_logs"] = _train(root / "grpo", "trainer.max_steps=4", recipe="grpo")
    # S2T on with a tau_p nothing reaches: the mask never fires; the watch judges windows of 2 steps
    out["inert_logs"] = _train(root / "inert", "trainer.max_steps=4", "algorithm.s2t.tau_p=1e-9",
                               "algorithm.s2t.watch_steps=2")
    return out


def test_tiny_stapo_silences_tokens_and_differs_from_grpo(runs):
    stapo = read_jsonl(runs["root"] / "stapo" / "metrics.jsonl")
    grpo = read_jsonl(runs["root"] / "grpo" / "metrics.jsonl")[: len(stapo)]
    assert sum(r["stapo/silenced_count"] for r in stapo) > 0
    assert all(r["stapo/silenced_count"] == 0 for r in grpo)
    assert [r["actor/loss"] for r in stapo] != [r["actor/loss"] for r in grpo]
    assert not [m for m in runs["stapo_logs"] if m.startswith("warning")]  # the mask fired
    notes = [m for m in runs["stapo_logs"] if m.startswith("note: S2T silenced")]
    assert len(notes) <= 1 and all("far above the paper's ~1e-4" in n for n in notes)  # tau_p 0.1: far above
    summary = json.loads((runs["root"] / "stapo" / "summary.json").read_text())
    assert summary["s2t_silenced"] == sum(r["stapo/silenced_count"] for r in stapo) > 0
    assert summary["s2t_silenced_rate"] > 1e-3 and "far above" in summary["s2t_note"]


def test_inert_mask_warns_once_naming_thresholds_rate_and_calibrate(runs):
    warnings = [m for m in runs["inert_logs"] if m.startswith("warning")]
    assert len(warnings) == 1, warnings  # windows close at steps 2 and 4: the second does not repeat it
    (w,) = warnings
    assert "tau_p=1e-09, q=0.75" in w and "silenced no token" in w and "no token was a candidate" in w


def test_compare_names_the_inert_mask_and_the_identical_runs(runs, tmp_path):
    from stapo.evals.compare import compare_runs

    root = runs["root"]
    report = compare_runs([root / "grpo", root / "inert", root / "stapo"], out_dir=tmp_path / "cmp")
    notes = report["config_check"]["notes"]
    assert any(n.startswith("S2T never fired in inert: 0 tokens silenced over 4 steps") for n in notes), notes
    assert any(n.startswith("grpo and inert logged identical metrics") for n in notes), notes
    assert not any("stapo" in n.split(":")[0] for n in notes)  # the tiny STAPO run fired and differs
    training = report["training"]
    assert training["inert"]["silenced_rate"] == 0 and training["stapo"]["silenced_rate"] > 0
    html = (tmp_path / "cmp" / "report.html").read_text()
    assert "S2T never fired in inert" in html and "silenced_rate" in html


def test_inspect_lists_exactly_what_the_update_silenced_on_the_same_boundary(runs):
    from stapo.evals.inspect import inspect_run

    run = runs["root"] / "stapo"
    silenced_total = 0
    for dump_path in sorted((run / "dumps").glob("step_*.json")):
        dump = json.loads(dump_path.read_text())
        tau_p = dump["tau_p"]
        for s in dump["sequences"]:
            tau_h = s["tau_h"]  # its mini-batch's tau_h^(q)
            for p, h, w in zip(s["prob"], s["entropy"], s["weight"], strict=True):
                # the dumped p and H are the ones the mask compared: weight 0 <=> below both, A > 0
                assert (w == 0) == (s["advantage"] > 0 and p < tau_p and h < tau_h), (p, h, w, tau_p, tau_h)
                silenced_total += w == 0
        report = inspect_run(run, step=int(dump["step"]))
        assert all(t["prob"] < tau_p for t in report["silenced_tokens"])
    assert silenced_total > 0
