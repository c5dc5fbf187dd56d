"""``Run.build``: a run's parts, made from the config or given in their stead, and the config it runs
with, the same as ``stapo train``'s (tiny random model, 1 process).

1. ``trainer.update_memory: auto`` resolves as ``stapo train`` resolves it: on a GPU config the plan
   picks the bounded path for both, and the run trains with it (config.yaml says so);
2. a part given as a keyword is the one the loop uses: a grader standing in behind the reward
   function decides every logged reward;
3. an unknown part is refused, naming the parts;
4. no test patches the loop module or a run's constructor: tests build a ``Run`` and give or read its
   parts (this file greps the tests tree).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stapo.configs import preset_path
from stapo.core.config import load_config
from stapo.core.placement import rank_placement
from stapo.core.task.rewards import RewardFunction
from stapo.core.tracking import read_jsonl
from stapo.core.train.loop import train
from stapo.core.train.run import PARTS, Run
from stapo.core.trainer import build_trainer_backend
from stapo.core.trainer.models import load_policy

FAST = ["trainer.max_steps=1", "data.val_size=0", "logging.dump_tokens_every=0", "logging.tensorboard=false",
        "logging.live=false"]
# A GPU config the plan can size without a GPU (the card is the config's): the tiny model's kept graphs
# peak above a 1.2 GiB card and its bounded path fits it (stapo.core.train.plan), so `auto` becomes `bounded`.
GPU = ["trainer.device=cuda", "trainer.gpu_memory_gib=1.2"]


def test_build_resolves_update_memory_as_stapo_train_does(tmp_path, monkeypatch, stub_train, stapo_main):
    from stapo.core.train import prepare

    # no GPU here: the launch's device check (which refuses cuda on a CPU machine) stands in for a GPU node's
    monkeypatch.setattr(prepare, "check_engine_and_device", lambda cfg, environ=None, given=(): None)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, _out, err = stapo_main("train", "--config", "tiny", "--run-dir", str(tmp_path / "cli"),
                                 *[a for o in [*GPU, *FAST] for a in ("--set", o)])
    assert code == 0, err
    (by_cli,) = stub_train  # the config `stapo train` hands the library
    assert by_cli.trainer.update_memory == "bounded"

    cfg = load_config(preset_path("tiny"), [*GPU, *FAST])
    assert cfg.trainer.update_memory == "auto"
    # CPU parts stand in for the GPU's: this rank's place, the policy and its trainer backend
    cpu = load_config(preset_path("tiny"), FAST)
    model, tokenizer = load_policy(cpu.model)
    backend = build_trainer_backend(cpu, model, total_optimizer_steps=1)
    run = Run.build(cfg, tmp_path / "lib", log=lambda m: None, placement=rank_placement("cpu"), model=model,
                    tokenizer=tokenizer, backend=backend)
    assert run.plan is not None and run.plan.update_path == "bounded"
    assert run.cfg.trainer.update_memory == by_cli.trainer.update_memory
    train(run)
    assert load_config(tmp_path / "lib" / "config.yaml").trainer.update_memory == "bounded"
    assert read_jsonl(tmp_path / "lib" / "metrics.jsonl")[0]["actor/grad_norm"] > 0


def test_build_on_a_cpu_leaves_auto_as_it_is(tmp_path):
    run = Run.build(load_config(preset_path("tiny"), FAST), tmp_path, log=lambda m: None,
                    rewards=RewardFunction(load_config(preset_path("tiny")).reward, grader=EvenDigit()))
    try:
        assert run.plan is None and run.cfg.trainer.update_memory == "auto"
    finally:
        run.close()


class EvenDigit:
    """A grader standing in for the verifier: a response is right when it starts with an even digit."""

    def __init__(self) -> None:
        self.verdicts: list[bool] = []

    def grade_many(self, items: list[dict]) -> list[dict]:
        out = [{"status": "ok", "correct": it["prediction"].strip()[:1] in tuple("02468"), "rule": "even",
                "extracted": it["prediction"]} for it in items]
        self.verdicts += [r["correct"] for r in out]
        return out


def test_a_given_reward_function_decides_the_logged_rewards(tmp_path):
    cfg = load_config(preset_path("tiny"), FAST)
    grader = EvenDigit()
    train(Run.build(cfg, tmp_path, log=lambda m: None, rewards=RewardFunction(cfg.reward, grader=grader)))
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    n = cfg.rollout.prompts_per_step * cfg.rollout.n
    assert len(grader.verdicts) == n  # every response of the step, graded by the stand-in only
    assert row["reward/mean"] == pytest.approx(sum(grader.verdicts) / n)  # scale: 1 right, 0 wrong
    assert 0 < sum(grader.verdicts) < n, "the check needs both verdicts"


def test_an_unknown_part_is_refused_naming_the_parts(tmp_path):
    with pytest.raises(TypeError, match=r"unknown parts: grader; parts are: plan, placement, .*actor"):
        Run.build(load_config(preset_path("tiny")), tmp_path, grader=object())
    assert PARTS[0] == "plan" and PARTS[-1] == "actor"
    assert not tmp_path.joinpath("config.yaml").exists()


TESTS = Path(__file__).resolve().parents[1]
# what a test that patches the loop would write: a spy on the old private run, a monkeypatch of the
# loop module (as an object or by dotted name), an attribute of the loop module assigned. (Spelt so
# that a plain grep of the tests tree for these patterns finds nothing in this file either.)
_PATCHING = re.compile("|".join([
    r"\b_[R]un\b", r"setattr\(\s*loop\b", r"patch(\.object)?\(\s*loop\b", r"[\"']stapo\.core\.loop\.\w",
    r"^\s*loop\.\w+(\.\w+)*\s*=[^=]",
]), re.M)


def test_no_test_patches_the_loop_module():
    hits = [f"{p.relative_to(TESTS)}:{text[: m.start()].count(chr(10)) + 1}"
            for p in sorted(TESTS.rglob("*.py")) if p.name != Path(__file__).name
            for text in [p.read_text()] for m in _PATCHING.finditer(text)]
    assert not hits, f"build a Run and give or read its parts instead (stapo.core.train.run): {hits}"
    for bad in ("loop.{R}.__init__ = spy", 'monkeypatch.setattr{p}loop, "train", f)',
                'mock.patch("stapo.core{d}loop.train")', "    loop.rollout_and_grade = spy"):
        bad = bad.format(R="_" + "Run", p="(", d=".")
        assert _PATCHING.search(bad), bad
    assert not _PATCHING.search("from stapo.core.train.loop import train\nassert loop.Sequence_ == x")


def _embedding_example() -> str:
    """The runnable block of docs/architecture.md's section on training from Python (its first)."""
    text = (TESTS.parent / "docs" / "architecture.md").read_text()
    section = text[text.index("## A run (`stapo.core.train.run`)"):]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_documented_embedding_example_runs(tmp_path):
    """As a user runs it: a script of its own, in a fresh interpreter (its guard keeps the grader's
    workers from training again), from the folder the runs land in."""
    import subprocess
    import sys

    script = tmp_path / "train_tiny.py"
    script.write_text(_embedding_example())
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()  # the runs' own lines (log=print), then what the example prints
    assert any(re.fullmatch(r"2 0\.\d+ 0\.\d+", line) for line in lines) and lines[-1] == "runs/tiny-even", lines
    for run in ("tiny", "tiny-even"):
        assert [r["step"] for r in read_jsonl(tmp_path / "runs" / run / "metrics.jsonl")] == [1, 2]
