"""End to end `stapo train` on a tiny random model: real forward/backward, real grader pool.

What can fail here: parameters must move, metrics must be present and finite, the S2T mask must
silence tokens exactly when its thresholds say so, a resumed run must reproduce an uninterrupted
one, a reward outage must stop the run loudly, a NaN update must be skipped and logged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from stapo.configs import preset_path
from stapo.core.config import load_config
from stapo.core.tracking import read_jsonl
from stapo.core.train.loop import train
from stapo.core.train.run import Run

REQUIRED = [
    "step", "reward/mean", "reward/std", "entropy/mean", "stapo/silenced_frac",
    "phase/lowp_lowh_pos", "phase/lowp_lowh_neg", "phase/lowp_highh_pos", "phase/lowp_highh_neg",
    "phase/highp_lowh_pos", "phase/highp_lowh_neg", "phase/highp_highh_pos", "phase/highp_highh_neg",
    "actor/loss", "actor/grad_norm", "actor/clip_frac_low", "actor/clip_frac_high",
    "response_length/mean", "response_length/clip_ratio", "time/rollout_s", "time/reward_s",
    "time/train_s", "time/step_s", "perf/tokens_per_s",
]
TIMING = ("time/", "perf/")

# The shape this test is calibrated on: a character vocabulary, 2 prompts x 4 responses of up to 8
# tokens (the tiny preset itself answers with one token from a digits-only vocabulary).
TINY_SHAPE = ["model.tiny.vocab=chars", "data.arithmetic.answer_range=null", "rollout.prompts_per_step=2",
              "rollout.n=4", "rollout.max_new_tokens=8", "trainer.micro_batch_size=4"]


def tiny(*overrides: str):
    # Loose S2T thresholds: on a random model every token has p ~ 1/vocab, so tau_p=0.5 and the
    # 90th entropy percentile make silencing certain whenever a group has a positive advantage.
    # A random model never answers right, so rewards would all be 0 and advantages vanish: DAPO's
    # overlong shaping over the whole 32-token budget makes rewards vary with length instead (a
    # random model ends a response early with p ~ 1 - (1 - 1/101)^32 ~ 0.27).
    base = ["logging.live=false", "logging.tensorboard=false", "algorithm.overlong.enabled=true",
            "rollout.max_new_tokens=32", "algorithm.overlong.buffer=31"]
    return load_config(preset_path("tiny"), [*TINY_SHAPE, *base, *overrides])


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def _deterministic_rows(run_dir: Path) -> list[dict]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One 3-step STAPO run, shared by the checks below (it is the slow part)."""
    run_dir = tmp_path_factory.mktemp("tiny")
    cfg = tiny("algorithm.s2t.tau_p=0.5", "algorithm.s2t.q=0.9")
    run = Run.build(cfg, run_dir, log=lambda m: None)
    seen = {"before": _params(run.model), "model": run.model}
    result = train(run)
    return result, run_dir, seen


def test_tiny_run_writes_everything(tiny_run):
    result, run_dir, seen = tiny_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        for k in REQUIRED:
            assert r[k] is not None and math.isfinite(r[k]), (k, r[k])
        cells = sum(r[k] for k in REQUIRED if k.startswith("phase/"))
        assert cells == pytest.approx(1.0, abs=1e-6)
    assert (run_dir / "config.yaml").exists()
    assert (run_dir / "final" / "config.json").exists()
    assert len(read_jsonl(run_dir / "val.jsonl")) == 2  # before and after
    dumps = sorted((run_dir / "dumps").glob("step_*.json"))
    assert dumps, "token dumps missing"
    d = json.loads(dumps[0].read_text())
    seq = d["sequences"][0]
    assert len(seq["tokens"]) == len(seq["prob"]) == len(seq["entropy"]) == len(seq["weight"]) == len(seq["top"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3


def test_parameters_moved(tiny_run):
    _, run_dir, seen = tiny_run
    after = _params(seen["model"])
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert any(r["reward/std"] > 0 for r in rows)
    assert not torch.equal(seen["before"], after)


def test_silencing_follows_thresholds(tiny_run, tmp_path):
    _, run_dir, _ = tiny_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    pos_lowp = [r["phase/lowp_lowh_pos"] for r in rows]
    # S2T silences exactly the low-p, low-H, positive-advantage cell.
    for r in rows:
        assert r["stapo/silenced_frac"] == pytest.approx(r["phase/lowp_lowh_pos"], abs=1e-9)
    # With `none` nothing is silenced, on the same seeds.
    cfg = tiny("algorithm.token_weighting=none", "trainer.max_steps=1", "data.val_size=0",
               "algorithm.s2t.tau_p=0.5", "algorithm.s2t.q=0.9")
    train(Run.build(cfg, tmp_path / "none", log=lambda m: None))
    none_rows = read_jsonl(tmp_path / "none" / "metrics.jsonl")
    assert none_rows[0]["stapo/silenced_frac"] == 0.0
    assert max(pos_lowp) > 0
    assert max(r["stapo/silenced_frac"] for r in rows) > 0


def test_resume_reproduces_uninterrupted_run(tmp_path):
    over = ["trainer.max_steps=4", "checkpoint.every=2", "data.val_size=0", "checkpoint.export_hf=false",
            "trainer.lr=0.01"]
    train(Run.build(tiny(*over), tmp_path / "a", log=lambda m: None))

    run = Run.build(tiny(*over), tmp_path / "b", log=lambda m: None)
    real = run.actor.update

    def crash_at_step_3(inputs):
        if inputs.step == 3:
            raise KeyboardInterrupt("killed")  # like a kill mid-step, after step 2's checkpoint
        return real(inputs)

    run.actor.update = crash_at_step_3  # (this run's actor only)
    with pytest.raises(KeyboardInterrupt):
        train(run)
    train(Run.build(tiny(*over), tmp_path / "b", log=lambda m: None), resume=True)
    a, b = _deterministic_rows(tmp_path / "a"), _deterministic_rows(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b


def test_reward_outage_fails_loudly(tmp_path):
    from stapo.core.task.rewards import RewardError, RewardFunction
    from stapo.core.train.prepare import LaunchError

    cfg = tiny("reward.urls=['http://127.0.0.1:9']", "data.val_size=0", "trainer.max_steps=1")
    with pytest.raises(LaunchError, match=r"^reward\.urls: http://127\.0\.0\.1:9/readyz did not answer"):
        Run.build(cfg, tmp_path / "down", log=lambda m: None)  # a verifier down at start: refused before loading
    # one that goes down after the start (given, so not probed): the first step stops the run, loudly
    with pytest.raises(RewardError, match="127.0.0.1:9"):
        train(Run.build(cfg, tmp_path / "down", log=lambda m: None, rewards=RewardFunction(cfg.reward)))
    assert read_jsonl(tmp_path / "down" / "metrics.jsonl") == []


def test_nan_loss_skips_update_and_is_logged(tmp_path):
    from stapo.core.algos import POLICY_LOSSES, PolicyLoss

    cfg = tiny("data.val_size=0", "trainer.max_steps=1")
    name = cfg.algorithm.policy_loss
    real = POLICY_LOSSES.get(name)

    def nan_loss(*a, **k):
        per_tok, m = real.fn(*a, **k)
        return per_tok * float("nan"), m

    def restore():
        POLICY_LOSSES.unregister(name)
        POLICY_LOSSES.add(name, real)

    # the configured loss's registration, its function swapped for one whose loss is NaN (unfused path)
    POLICY_LOSSES.unregister(name)
    POLICY_LOSSES.add(name, PolicyLoss(nan_loss, real.options, elementwise=False))
    try:
        run = Run.build(cfg, tmp_path / "nan", log=lambda m: None)
        before = _params(run.model)
        train(run)
    finally:
        restore()
    row = read_jsonl(tmp_path / "nan" / "metrics.jsonl")[0]
    assert row["actor/skipped_updates"] == 1.0
    assert torch.equal(before, _params(run.model))
