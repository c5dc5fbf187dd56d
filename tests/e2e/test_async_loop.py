"""The RL loop with asynchronous rollouts (a real producer process, tiny random model, real grader).

What can fail here: with max_staleness = 0 the async path must make the synchronous loop's updates
(same seeds) to 1e-6; with max_staleness = 1 every step's batch must lag by exactly min(1, t - 1)
versions and the off-policy statistics (staleness, ESS, ratios, the per-mini-batch LR scale) must
be logged, with DEEP-GRPO's branches (sampled by the learner from the stale roots) trained beside.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from stapo.configs import preset_path
from stapo.core.config import load_config
from stapo.core.tracking import read_jsonl
from stapo.core.train.loop import train
from stapo.core.train.run import Run

SKIP = ("time/", "perf/", "async/", "offpolicy/", "reward/retried")  # the machine's load, not training

# The shape this test is calibrated on: a character vocabulary, 2 prompts x 4 responses of up to 8
# tokens (the tiny preset itself answers with one token from a digits-only vocabulary).
TINY_SHAPE = ["model.tiny.vocab=chars", "data.arithmetic.answer_range=null", "rollout.prompts_per_step=2",
              "rollout.n=4", "rollout.max_new_tokens=8", "trainer.micro_batch_size=4"]


def tiny(*overrides: str):
    # as tests/e2e/test_train_tiny.py: overlong shaping gives a random model's rewards some spread
    base = ["logging.live=false", "logging.tensorboard=false", "algorithm.overlong.enabled=true",
            "rollout.max_new_tokens=16", "algorithm.overlong.buffer=15", "data.val_size=0",
            "checkpoint.export_hf=false", "trainer.lr=0.01", "logging.dump_tokens_every=0",
            "algorithm.s2t.tau_p=0.5", "algorithm.s2t.q=0.9", "reward.workers=1",
            "reward.deadline_s=60"]  # a loaded machine must not turn a reward into a retry or a failure
    return load_config(preset_path("tiny"), [*TINY_SHAPE, *base, *overrides])


def final_params(run_dir: Path) -> torch.Tensor:
    ck = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    state = torch.load(ck / "trainer" / "trainer_state.pt", map_location="cpu", weights_only=False)["model"]
    return torch.cat([t.flatten().double() for _, t in sorted(state.items())])


def rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(SKIP)} for r in read_jsonl(run_dir / "metrics.jsonl")]


def close(a: dict, b: dict, tol: float = 1e-6) -> bool:
    def same(x: float | None, y: float | None) -> bool:  # None: a NaN metric (no S2T candidate) as written
        if x is None or y is None or math.isnan(x) or math.isnan(y):
            return (x is None or math.isnan(x)) and (y is None or math.isnan(y))
        return abs(x - y) <= tol * max(1.0, abs(x))

    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def test_max_staleness_zero_is_the_synchronous_loop(tmp_path, one_thread):
    train(Run.build(tiny(), tmp_path / "sync", log=lambda m: None))
    train(Run.build(tiny("rollout.async.enabled=true", "rollout.async.max_staleness=0",
                         "algorithm.off_policy.ess_lr_scaling=true"), tmp_path / "async", log=lambda m: None))
    a, b = rows(tmp_path / "sync"), rows(tmp_path / "async")
    assert [r["step"] for r in b] == [1, 2, 3]
    assert any(r["actor/grad_norm"] > 0 for r in a)  # the updates compared are real ones
    for ra, rb in zip(a, b, strict=True):
        assert close(ra, rb), {k: (ra[k], rb.get(k)) for k in ra if not close({k: ra[k]}, {k: rb.get(k, math.inf)})}
    assert (final_params(tmp_path / "sync") - final_params(tmp_path / "async")).abs().max() <= 1e-6
    logged = read_jsonl(tmp_path / "async" / "metrics.jsonl")
    assert [r["async/staleness"] for r in logged] == [0.0, 0.0, 0.0]


def test_one_step_off_policy_with_vcpo_logs_staleness_ess_and_ratios(tmp_path, one_thread):
    train(Run.build(tiny("rollout.async.enabled=true", "rollout.async.max_staleness=1", "trainer.max_steps=3",
                         "algorithm.off_policy.ess_lr_scaling=true", "algorithm.off_policy.min_variance_baseline=true",
                         "algorithm.off_policy.behaviour_weight_cap=5.0", "algorithm.mini_batches=2",
                         # DEEP-GRPO on the same run: branches from stale roots, sampled by the learner
                         "algorithm.deep_grpo.enabled=true", "algorithm.deep_grpo.k_branches=4",
                         "algorithm.deep_grpo.max_pivots=1", "algorithm.deep_grpo.lambda=1.0"),
                    tmp_path / "k1", log=lambda m: None))
    logged = read_jsonl(tmp_path / "k1" / "metrics.jsonl")
    assert [r["async/staleness"] for r in logged] == [0.0, 1.0, 1.0]
    assert [r["async/version"] for r in logged] == [0.0, 0.0, 1.0]
    for r in logged:
        assert math.isfinite(r["actor/loss"]) and "stapo/silenced_frac" in r
        # the baseline is configured, so every updated step reports the off-policy block
        if "offpolicy/ess_ratio" in r:
            assert 0 < r["offpolicy/ess_ratio"] <= 1 + 1e-12
            # one multiplier per optimizer step (2 mini-batches), each from its mini-batch's ESS
            assert 0 < r["offpolicy/lr_scale_min"] <= r["offpolicy/lr_scale"] <= 1
            assert r["offpolicy/ratio_min"] <= r["offpolicy/ratio_mean"] <= r["offpolicy/ratio_max"]
    stale = [r for r in logged if r["async/staleness"] > 0 and "offpolicy/ess" in r]
    assert stale, "no stale step reached the update"
    for r in stale:  # a step's weights really moved between version 0 and 1: ratios are not all 1
        assert r["offpolicy/stale_frac"] == 1.0 and r["offpolicy/ratio_max"] != r["offpolicy/ratio_min"]
    assert logged[0]["offpolicy/ess_ratio"] == 1.0 and logged[0]["offpolicy/lr_scale"] == 1.0  # on-policy step
    # DEEP-GRPO ran beside the stale roots: pivots among their failures, a local loss on the branches
    assert all(r["deep/pivots"] == 1.0 and r["deep/branches"] == 4.0 for r in logged)
    assert any(r.get("deep/local_tokens", 0.0) > 0 for r in stale), "the local loss never ran on a stale step"
