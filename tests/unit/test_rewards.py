"""Rewards through the real grader pool: failures are retried, counted, and never a silent 0."""

from __future__ import annotations

import pytest

from stapo.core.config import RewardConfig
from stapo.core.task.rewards import RewardError, RewardFunction
from stapo.verifier_service.server.pool import GraderPool

TOWER = r"\boxed{5^{5^{5^{5^{5^{5^{5}}}}}}}"  # str() of its parse never returns: a guaranteed timeout


@pytest.fixture(scope="module")
def pool():
    p = GraderPool(workers=1, deadline_s=1.0)
    yield p
    p.close()


def test_rewards_and_statuses(pool):
    fn = RewardFunction(RewardConfig(correct=1.0, incorrect=-1.0), grader=pool)
    long_no_answer = "Let me think about this problem step by step. First we add the numbers carefully."
    out = fn([r"so \boxed{7}", r"\boxed{8}", long_no_answer], ["7", "7", "7"])
    assert out.rewards == [1.0, -1.0, -1.0]
    assert out.correct == [True, False, False]
    assert out.valid == [True, True, True]  # a wrong or missing answer is a computed reward
    assert out.status == ["ok", "ok", "no_answer"]
    assert out.extracted[0] == "7"


def test_timeouts_are_retried_and_marked_invalid(pool):
    fn = RewardFunction(RewardConfig(retries=1, max_failure_frac=0.6), grader=pool)
    out = fn([TOWER, r"\boxed{3}"], ["3", "3"])
    assert out.valid == [False, True]
    assert out.status[0] == "timeout" and out.retried == 1
    assert out.correct == [False, True]


def test_too_many_failures_stop_the_run(pool):
    fn = RewardFunction(RewardConfig(retries=0, max_failure_frac=0.2), grader=pool)
    with pytest.raises(RewardError, match=r"1/2 rewards could not be computed.*timeout"):
        fn([TOWER, r"\boxed{3}"], ["3", "3"])
