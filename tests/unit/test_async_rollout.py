"""Asynchronous rollouts through a producer process (the hf engine on its own copy of the policy,
driven by the same versioned driver as the rollout servers): the staleness bound holds whichever side
is slow, the batches carry behaviour log-probs and their version, and a producer that dies is
reported, never waited on.

The checks share one real producer process (spawn) with its own copy of a tiny random policy, and
the learner side's real prompts, prompt sampler and grader."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch

from stapo.core.config import load_config
from stapo.core.rollout.async_rollout import (
    AsyncRollouts,
    FaultInjection,
    ProducerDied,
    generating_version,
    staleness,
)
from stapo.core.rollout.process import ProcessRolloutEngine
from stapo.core.rollout.rollouts import RolloutInputs
from stapo.core.task.data import encode_prompt, load_prompts
from stapo.core.task.rewards import RewardFunction
from stapo.core.task.sampler import build_sampler
from stapo.core.trainer.models import load_policy

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "seed": 0}


def tiny_cfg(k: int, steps: int, *extra: str):
    return load_config(None, [
        "model.name_or_path=tiny-random", f"model.tiny={TINY}", "data.source=arithmetic", "data.template=short",
        "data.val_size=0", "data.arithmetic={num_problems: 16, digits: 1, num_ops: 1}",
        "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=4", "reward.workers=1",
        "trainer.device=cpu", f"trainer.max_steps={steps}", "rollout.async.enabled=true",
        f"rollout.async.max_staleness={k}", *extra,
    ])


def async_rollouts(cfg, fault: FaultInjection) -> AsyncRollouts:
    """The driver on a producer process, as the async hook builds it for one hf rank (the learner's
    own policy stands in for its trainer: its weights are what gets published)."""
    model, tok = load_policy(cfg.model)
    prompts, _ = load_prompts(cfg.data, tok)

    def encode(rec):
        return encode_prompt(tok, rec.prompt, chat_template=cfg.data.chat_template)

    inputs = RolloutInputs(cfg=cfg, engine=None, rewards=RewardFunction(cfg.reward),
                           sampler=build_sampler(cfg, prompts, encode=encode, model=model), train_prompts=prompts,
                           encode=encode)
    return AsyncRollouts(inputs, ProcessRolloutEngine(cfg, fault=fault), start=0, owns_engine=True,
                         weights=lambda: ((n, p.detach()) for n, p in model.named_parameters()))


def test_versions_are_fixed_by_the_step() -> None:
    assert [generating_version(t, 0) for t in (1, 2, 3)] == [0, 1, 2]
    assert [generating_version(t, 2) for t in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    assert [generating_version(t, 1, start=4) for t in (5, 6, 7)] == [4, 4, 5]  # resumed at step 4
    assert all(staleness(t, generating_version(t, 2)) <= 2 for t in range(1, 20))
    with pytest.raises(ValueError, match="not after"):
        generating_version(3, 1, start=3)


@pytest.fixture(scope="module")
def one_producer_run():
    """One producer process (k = 2) through three phases, recorded for the checks below: starting a
    producer (imports, its own policy copy and grader pool) costs far more than the steps themselves.

    - steps 1-3, fast producer and slow learner (1.5 s per step): the producer runs ahead;
    - steps 4-6, slow producer (2.5 s and 1.5 s before steps 5 and 6; version 2 exists 1.5 s before
      the learner asks for step 5) and fast learner: the learner waits;
    - step 7 (30 s before it): the producer is killed mid-step, after the learner took step 6.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the producer inherits it: one thread is fastest on a shared, loaded machine
    try:
        return _run_phases()
    finally:
        torch.set_num_threads(threads)


def _run_phases() -> dict:
    cfg = tiny_cfg(2, 8)
    out: dict = {"batches": {}, "published": {}, "waited": {}}
    fault = FaultInjection(step_delays={5: 2.5, 6: 1.5, 7: 30.0})
    ar = async_rollouts(cfg, fault)
    try:
        for step in range(1, 7):
            t0 = time.time()
            out["batches"][step] = ar.rollouts(step, timeout=120)
            out["waited"][step] = time.time() - t0
            if step <= 3:
                time.sleep(1.5)  # a slow learner
            out["published"][step] = time.time()  # just before: the producer may start at once
            ar.publish(step)
        os.kill(ar.engine.pid, signal.SIGKILL)  # mid-step: step 7's batch is in its 30 s delay
        t0 = time.time()
        try:
            ar.rollouts(7, timeout=60)  # a hang would end in TimeoutError, failing the check
        except Exception as err:  # noqa: BLE001 - recorded, checked below
            out["error"] = err
        out["error_after_s"] = time.time() - t0
        out["started_at"] = dict(ar.engine.started_at)  # when the producer began each step's batch
    finally:
        ar.close()
    return out


def test_every_batch_is_sampled_by_its_fixed_version_with_behaviour_logprobs(one_producer_run) -> None:
    for step, (seqs, metrics) in one_producer_run["batches"].items():
        version = generating_version(step, 2)
        assert metrics["async/version"] == version
        assert metrics["async/staleness"] == staleness(step, version) == min(2, step - 1) <= 2
        assert len(seqs) == 4 and all(s.version == version for s in seqs)
        for s in seqs:  # behaviour log-probs of the sampled tokens, recorded at generation
            assert len(s.behaviour_logprobs) == len(s.response_ids)
            assert all(math.isfinite(x) and x <= 0 for x in s.behaviour_logprobs)


def test_slow_trainer_fast_producer_runs_ahead_within_the_bound(one_producer_run) -> None:
    started, published = one_producer_run["started_at"], one_producer_run["published"]
    # step t+1 began before the learner had finished step t, and (k = 2) at least once step t+2 did
    for step in (1, 2, 3):
        assert started[step + 1] < published[step]
    assert any(started[step + 2] < published[step] for step in (1, 2, 3))
    # ... but never before its version existed: the bound holds with the learner as the slow side
    for step in (4, 5, 6):
        assert started[step] >= published[generating_version(step, 2)]


def test_slow_producer_fast_trainer_waits_within_the_bound(one_producer_run) -> None:
    for step in (5, 6):  # the learner, not the producer, was the one waiting
        assert one_producer_run["waited"][step] > 0.3
        assert one_producer_run["batches"][step][1]["async/staleness"] == 2


def test_a_producer_killed_mid_step_is_reported_not_waited_on(one_producer_run) -> None:
    err = one_producer_run.get("error")
    assert isinstance(err, ProducerDied), err
    assert "exited with code -9 before delivering step 7" in str(err)
    assert one_producer_run["error_after_s"] < 10  # detected by polling, not by the 60 s timeout


# Opt-in (each starts a producer of its own): the other two ways a producer ends. The learner sees
# both through the same checks as the kill above (liveness poll, failure report on the queue).
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("STAPO_SLOW") != "1", reason="slow: set STAPO_SLOW=1")
def test_a_producer_exiting_mid_step_is_reported() -> None:
    ar = async_rollouts(tiny_cfg(2, 3), FaultInjection(die_at_step=2))
    try:
        ar.rollouts(1, timeout=120)
        with pytest.raises(ProducerDied, match="exited with code 3 before delivering step 2"):
            ar.rollouts(2, timeout=120)
    finally:
        ar.close()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("STAPO_SLOW") != "1", reason="slow: set STAPO_SLOW=1")
def test_producer_exception_is_reported_with_its_traceback() -> None:
    ar = async_rollouts(tiny_cfg(1, 3), FaultInjection(raise_at_step=1))
    try:
        with pytest.raises(ProducerDied, match="(?s)failed at step 1.*fault injected at step 1"):
            ar.rollouts(1, timeout=120)
    finally:
        ar.close()


def test_the_train_layers_run_is_what_the_rollout_layer_reads():
    """The rollout layer types the loop's run by a protocol of what it reads (``RolloutRun``, and
    ``AsyncRun`` for asynchronous rollouts): the train layer's ``Run`` declares every member, and
    ``RolloutInputs`` every member of ``RolloutRun``."""
    import dataclasses
    import typing

    from stapo.core.rollout.async_rollout import AsyncRun
    from stapo.core.rollout.rollouts import RolloutRun
    from stapo.core.train.run import Run

    def members(proto: type) -> set[str]:
        return {n for c in proto.__mro__ if c not in (typing.Protocol, typing.Generic, object)
                for n in vars(c) if not n.startswith("_")}

    assert {"cfg", "engine", "rewards", "sampler", "train_prompts", "encode", "rank", "world_size"} <= members(RolloutRun)
    assert members(AsyncRun) == members(RolloutRun) | {"backend"}
    declared = set(typing.get_type_hints(Run)) | {n for n in vars(Run) if callable(vars(Run)[n])}
    assert members(AsyncRun) <= declared, members(AsyncRun) - declared
    assert members(RolloutRun) <= {f.name for f in dataclasses.fields(RolloutInputs)}
