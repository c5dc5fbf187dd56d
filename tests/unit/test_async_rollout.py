"""The rollout producer process: the staleness bound holds whichever side is slow, the batches carry
behaviour log-probs and their version, and a producer that dies is reported, never waited on.

Each test starts a real producer process (spawn) with its own copy of a tiny random policy."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest

from stapo.core.async_rollout import (
    AsyncRollouts,
    FaultInjection,
    ProducerDied,
    generating_version,
    staleness,
)
from stapo.core.config import load_config
from stapo.core.models import load_policy

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "seed": 0}


def tiny_cfg(k: int, steps: int, *extra: str):
    return load_config(None, [
        "model.name_or_path=tiny-random", f"model.tiny={TINY}", "data.source=arithmetic", "data.template=short",
        "data.val_size=0", "data.arithmetic={num_problems: 16, digits: 1, num_ops: 1}",
        "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4", "reward.workers=1",
        "trainer.device=cpu", f"trainer.max_steps={steps}", "rollout.async.enabled=true",
        f"rollout.async.max_staleness={k}", *extra,
    ])


def params(cfg):
    model, _ = load_policy(cfg.model)
    return model, lambda: ((n, p.detach()) for n, p in model.named_parameters())


def test_versions_are_fixed_by_the_step() -> None:
    assert [generating_version(t, 0) for t in (1, 2, 3)] == [0, 1, 2]
    assert [generating_version(t, 2) for t in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    assert [generating_version(t, 1, start=4) for t in (5, 6, 7)] == [4, 4, 5]  # resumed at step 4
    assert all(staleness(t, generating_version(t, 2)) <= 2 for t in range(1, 20))
    with pytest.raises(ValueError, match="not after"):
        generating_version(3, 1, start=3)


def test_slow_trainer_fast_producer_runs_ahead_within_the_bound_then_a_kill_is_reported() -> None:
    cfg = tiny_cfg(1, 6)
    _, named = params(cfg)
    published: dict[int, float] = {}
    with AsyncRollouts(cfg, named()) as ar:
        batches = []
        for step in range(1, 5):
            b = ar.next_batch(step, timeout=120)
            batches.append(b)
            assert b.version == generating_version(step, 1) and staleness(step, b.version) == min(1, step - 1)
            assert len(b.seqs) == 4 and all(s.version == b.version for s in b.seqs)
            for s in b.seqs:  # behaviour log-probs of the sampled tokens, recorded at generation
                assert len(s.behaviour_logprobs) == len(s.response_ids)
                assert all(math.isfinite(x) and x <= 0 for x in s.behaviour_logprobs)
            time.sleep(1.5)  # a slow learner
            if step < 4:
                ar.publish(step, named())
                published[step] = time.time()
        # the producer sampled step t+1 (from version t-1) before the learner had finished step t
        for step in (2, 3):
            assert batches[step].started_at < published[step]
        # step 6 needs version 4, never published: the producer waits; killing it is reported
        assert ar.next_batch(5, timeout=120).version == 3
        os.kill(ar.pid, signal.SIGKILL)
        with pytest.raises(ProducerDied, match="exited with code -9 before delivering step 6"):
            ar.next_batch(6, timeout=60)  # a hang would end in TimeoutError, failing the test


def test_slow_producer_fast_trainer_waits_then_a_death_mid_step_is_reported() -> None:
    cfg = tiny_cfg(2, 4)
    _, named = params(cfg)
    with AsyncRollouts(cfg, named(), fault=FaultInjection(delay_s=1.0, die_at_step=4)) as ar:
        for step in range(1, 4):
            t0 = time.time()
            b = ar.next_batch(step, timeout=120)
            waited = time.time() - t0
            assert staleness(step, b.version) == min(2, step - 1) <= 2
            if step > 1:
                assert waited > 0.3  # the learner, not the producer, was the one waiting
            ar.publish(step, named())
        with pytest.raises(ProducerDied, match="exited with code 3 before delivering step 4"):
            ar.next_batch(4, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("STAPO_SLOW") != "1", reason="slow: set STAPO_SLOW=1")
def test_producer_exception_is_reported_with_its_traceback() -> None:
    cfg = tiny_cfg(1, 3)
    _, named = params(cfg)
    with AsyncRollouts(cfg, named(), fault=FaultInjection(raise_at_step=1)) as ar:
        with pytest.raises(ProducerDied, match="(?s)failed at step 1.*fault injected at step 1"):
            ar.next_batch(1, timeout=120)
