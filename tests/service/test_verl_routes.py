"""Every verl reward-manager route, called the way verl calls it.

verl itself (and torch/ray) does not run here, so each test reproduces only the manager's call and
result handling, read from verl's source (``verl/workers/reward_manager/{naive,dapo,batch,prime}.py``
and ``verl/experimental/reward/reward_loop/{naive,dapo,prime}.py``): the same keyword / positional
call, the same executor, the same ``isinstance(result, dict)`` / ``float(result[0])`` handling. The
custom function is loaded from the adapters FILE the way verl's ``get_custom_reward_fn`` loads it
(``spec_from_file_location``, module name ``custom_module``), with ``reward_kwargs`` bound by a
partial. Grading is real (in-process pool, real math-verify).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import numpy as np
import pytest

from stapo.verifier_service.clients import adapters

RIGHT = "<think>2+2 is 4</think> The answer is \\boxed{\\frac{3}{4}}."
WRONG = "I think it is \\boxed{5}."
HUGE = "1" * 200_000  # over every max_prediction_chars default: status too_large


@pytest.fixture(scope="module")
def custom_module():
    """The adapters file loaded as verl loads a custom reward file."""
    spec = importlib.util.spec_from_file_location("custom_module", adapters.__file__)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["custom_module"] = mod
    spec.loader.exec_module(mod)
    yield mod
    mod.close_verifiers()
    sys.modules.pop("custom_module", None)


@pytest.fixture(autouse=True)
def in_process(monkeypatch):
    monkeypatch.delenv("STAPO_VERIFIER_URL", raising=False)
    monkeypatch.delenv("STAPO_VERIFIER_FAILURE_SCORE", raising=False)
    monkeypatch.setenv("STAPO_VERIFIER_WORKERS", "1")


def _bind(fn, **reward_kwargs):
    """verl: custom_reward_function.reward_kwargs are bound to the loaded function."""

    def call(*args, **kwargs):
        return fn(*args, **kwargs, **reward_kwargs)

    return call


def legacy_naive_or_dapo(compute_score, data_sources, responses, golds, extras):
    """verl.workers.reward_manager.naive/dapo: one keyword call per item, dict -> score + extra info."""
    rewards, extra = [], defaultdict(list)
    for ds, resp, gt, ei in zip(data_sources, responses, golds, extras, strict=True):
        result = compute_score(data_source=ds, solution_str=resp, ground_truth=gt, extra_info=ei)
        if isinstance(result, dict):
            reward = result["score"]
            for k, v in result.items():
                extra[k].append(v)
        else:
            reward = result
        rewards.append(reward)
    return rewards, dict(extra)


def legacy_batch(compute_score, data_sources, responses, golds, extras, **reward_kwargs):
    """verl.workers.reward_manager.batch: one keyword call for the batch; numpy object arrays."""
    scores = compute_score(
        data_sources=np.array(data_sources, dtype=object),
        solution_strs=responses,
        ground_truths=golds,
        extra_infos=np.array(extras, dtype=object),
        **reward_kwargs,
    )
    rewards, extra = [], defaultdict(list)
    for s in scores:
        if isinstance(s, dict):
            rewards.append(s["score"])
            for k, v in s.items():
                extra[k].append(v)
        else:
            rewards.append(s)
    return rewards, dict(extra)


def legacy_prime(evaluation_func, data_sources, responses, golds, extras):
    """verl.workers.reward_manager.prime: positional call in a ProcessPoolExecutor; float(result[0]).

    Any exception while reading the results makes the manager print "Setting all as 0"; we let it
    propagate so the test sees it.
    """

    async def run():
        loop = asyncio.get_running_loop()
        with ProcessPoolExecutor(max_workers=2) as ex:
            futs = [
                asyncio.wait_for(loop.run_in_executor(ex, partial(evaluation_func, t, c, r, e)), 300)
                for c, r, t, e in zip(responses, golds, data_sources, extras, strict=True)
            ]
            results = await asyncio.gather(*futs)
        out = []
        for result in results:
            if result is None:
                out.append(0.0)
            elif isinstance(result, (int, float, bool)):
                out.append(float(result))
            else:
                out.append(float(result[0]))
        return out

    return asyncio.run(run())


def reward_loop(compute_score, data_source, response, gold, extra_info, **verl_kwargs):
    """verl.experimental.reward.reward_loop.{naive,dapo,prime}.run_single: keyword call in an executor."""

    async def run():
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            None,
            lambda: compute_score(
                data_source=data_source,
                solution_str=response,
                ground_truth=gold,
                extra_info=extra_info,
                **verl_kwargs,
            ),
        )
        if isinstance(result, dict):
            return result["score"], dict(result)
        return result, {"acc": result}

    return asyncio.run(run())


def test_legacy_naive_and_dapo_managers(custom_module):
    fn = _bind(custom_module.compute_score)
    rewards, extra = legacy_naive_or_dapo(
        fn, ["a", "b", "c"], [RIGHT, WRONG, HUGE], ["0.75", np.int64(4), "4"], [{}, None, {}]
    )
    assert rewards == [1.0, 0.0, 0.0]
    assert extra["status"] == ["ok", "ok", "too_large"]
    assert extra["verifier_failed"] == [0.0, 0.0, 1.0]
    assert extra["pred"][:2] == ["\\frac{3}{4}", "5"]


def test_legacy_manager_with_configured_failure_value(custom_module):
    fn = _bind(custom_module.compute_score, failure_score=-1.0)
    rewards, extra = legacy_naive_or_dapo(fn, ["a", "b"], [WRONG, HUGE], ["4", "4"], [None, None])
    assert rewards == [0.0, -1.0] and extra["status"] == ["ok", "too_large"]


def test_legacy_batch_manager(custom_module, monkeypatch):
    monkeypatch.setenv("STAPO_VERIFIER_FAILURE_SCORE", "-0.5")
    rewards, extra = legacy_batch(
        custom_module.compute_score_batch,
        ["a", "b", "c"],
        [RIGHT, WRONG, HUGE],
        [np.array(["3/4"], dtype=object), "4", "4"],
        [None, None, None],
        mode="math",
    )
    assert rewards == [1.0, 0.0, -0.5]
    assert extra["status"] == ["ok", "ok", "too_large"]


def test_legacy_prime_manager_needs_a_non_dict_result(custom_module):
    # the dict-returning compute_score breaks prime's float(result[0]) -> "Setting all as 0"
    with pytest.raises(KeyError):
        legacy_prime(custom_module.compute_score, ["a"], [RIGHT], ["0.75"], [None])
    scores = legacy_prime(
        custom_module.compute_score_prime,
        ["a", "b", "c"],
        [RIGHT, WRONG, HUGE],
        ["0.75", "4", "4"],
        [None] * 3,
    )
    assert scores == [1.0, 0.0, 0.0]
    assert custom_module.compute_score_prime("a", HUGE, "4", None, failure_score=-1.0) == (-1.0, "too_large")
    assert custom_module.compute_score_prime("a", RIGHT, "3/4") == (1.0, "ok")


@pytest.mark.parametrize(
    "verl_kwargs",
    [
        {"reward_model": None, "reward_model_tokenizer": None},  # naive / dapo reward loop
        {"reward_router_address": None, "reward_model_tokenizer": None},  # prime reward loop
    ],
)
def test_new_reward_loop_managers(custom_module, verl_kwargs):
    fn = _bind(custom_module.compute_score, mode="math")
    score, info = reward_loop(fn, "a", RIGHT, "3/4", {}, **verl_kwargs)
    assert score == 1.0 and info["status"] == "ok" and info["acc"] is True
    score, info = reward_loop(fn, "a", HUGE, "4", {}, **verl_kwargs)
    assert score == 0.0 and info["status"] == "too_large" and info["verifier_failed"] == 1.0


def test_missing_gold_is_a_clear_error(custom_module):
    with pytest.raises(ValueError, match=r"ground_truth\[0\]: missing gold"):
        custom_module.compute_score("a", "Answer: None", None)
    with pytest.raises(ValueError, match=r"ground_truths\[1\]: missing gold"):
        custom_module.compute_score_batch(["a", "b"], [RIGHT, RIGHT], ["3/4", float("nan")])
    with pytest.raises(ValueError, match="missing gold"):
        custom_module.compute_score_prime("a", "None", [None])
