"""The first ten minutes show the method: on the tiny config STAPO silences tokens and trains
differently from GRPO; `stapo compare` says when S2T never fired and when two runs are the same;
`stapo inspect` lists exactly the tokens the update silenced; the rate watch warns once (`stapo
calibrate`: tests/e2e/test_calibrate_docs.py). Real loop, real tiny model, real grader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stapo.configs import preset_path
from stapo.core.config import load_config
from stapo.core.tracking import read_jsonl
from stapo.core.train.loop import train
from stapo.core.train.prepare import method_overrides
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
    (w,) = warnings  # said before the first update; the windows do not repeat it
    assert w.startswith("warning: S2T cannot act at this scale: at step 1 no token was a candidate")
    assert "tau_p=1e-09, q=0.75" in w and "--set algorithm.s2t.tau_p=0.1 makes 100% of them candidates" in w
    assert runs["inert_logs"].index(w) < next(i for i, m in enumerate(runs["inert_logs"]) if m.startswith("step 1/"))
    summary = json.loads((runs["root"] / "inert" / "summary.json").read_text())
    assert summary["s2t_note"].startswith("S2T silenced no token in this run's 4 steps")


def test_a_python_built_paper_recipe_on_tiny_says_it_cannot_act_and_prints_no_library_noise(tmp_path):
    """`--config tiny --recipe stapo`'s method built from Python (`Run.build` + `train`, its own process):
    the method line first, the warning before step 1, the note in summary.json; no DeepSpeed accelerator
    probe and no shard-writing bars (the export is on)."""
    import subprocess
    import sys

    code = (
        "from stapo.core.train.prepare import method_overrides\n"
        "from stapo.configs import preset_path\n"
        "from stapo.core.config import load_config\n"
        "from stapo.core.train.loop import train\n"
        "from stapo.core.train.run import Run\n"
        "sets = method_overrides(preset_path('stapo'), 1)\n"
        "cfg = load_config(preset_path('tiny'), [*sets, 'trainer.max_steps=1', 'checkpoint.export_hf=true'])\n"
        f"train(Run.build(cfg, {str(tmp_path / 'run')!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "method: stapo (token weighting s2t, tau_p 0.002, q 0.75)"
    warning = next(i for i, m in enumerate(lines) if m.startswith("warning: S2T cannot act at this scale"))
    assert warning < next(i for i, m in enumerate(lines) if m.startswith("step 1/1"))
    assert "--set algorithm.s2t.tau_p=0.1" in lines[warning]
    assert "Setting accelerator" not in done.stdout + done.stderr
    assert "Writing model shards" not in done.stderr and (tmp_path / "run" / "final" / "config.json").is_file()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["s2t_note"].startswith("S2T silenced no token in this run's 1 step (")


def test_the_readme_line_that_puts_tiny_tau_p_back_makes_the_ablation_act(tmp_path, stapo_main, monkeypatch):
    """README's `--recipe stapo-random --set algorithm.s2t.tau_p=0.1` line, run (2 steps, in tmp_path)."""
    import shlex

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith("stapo train --config tiny --recipe stapo-random")]
    argv = shlex.split(line)[1:]
    assert argv[-2:] == ["--run-dir", "runs/tiny-random"]
    monkeypatch.chdir(tmp_path)
    code, out, err = stapo_main(*argv, "--set", "trainer.max_steps=2")
    assert code == 0, err
    assert "method: stapo-random (token weighting s2t, tau_p 0.1, q 0.75, silence random)" in out
    assert "cannot act" not in out + err
    summary = json.loads((tmp_path / "runs" / "tiny-random" / "summary.json").read_text())
    assert summary["s2t_silenced"] > 0


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
