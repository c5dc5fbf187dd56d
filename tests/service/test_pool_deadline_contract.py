"""The grader pool's deadline contract, through its public API only (``GraderPool``, ``grade_many``).

Two rules whose breakage otherwise surfaces only as a hang or through a 30 s HTTP test:

* every item answers within its deadline: a worker that overruns is killed and replaced. The wait
  here is bounded by the test itself (a thread and ``Future.result(timeout)``), so a skipped kill
  fails in seconds with a clear message instead of hanging until an outer timeout;
* 'timeout' is never cached: a retry of an item that timed out is graded again (it spends its
  deadline again), both for the identical item and for another text with the same final answer
  (the verdict cache). A cached timeout would answer at once and the retry would be worthless.

Written against behaviour, not the pool's internals, so it holds for any implementation.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from stapo.verifier_service.server.pool import GraderPool

DEADLINE_S = 1.0
SLACK_S = 4.0  # kill + replacement on 2 busy cores; far below a hang
TOWER = r"\boxed{5^{5^{5^{5^{5^{5^{5}}}}}}}"  # str() of its parse never returns: a guaranteed timeout

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def pool():
    # inline verdicts off: every item goes to a worker, the path whose deadline is under test
    p = GraderPool(workers=1, deadline_s=DEADLINE_S, inline_verdicts=False, cache_size=64)
    assert p.wait_ready(60)
    yield p
    p.close(timeout=10)


def bounded_grade(pool: GraderPool, items: list, bound_s: float) -> tuple[list, float]:
    """``pool.grade_many(items)`` and its wall time; fails (instead of hanging) past ``bound_s``."""
    ex = concurrent.futures.ThreadPoolExecutor(1)
    t0 = time.monotonic()
    fut = ex.submit(pool.grade_many, items)
    try:
        res = fut.result(timeout=bound_s)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"grade_many did not answer within {bound_s:.1f} s: the deadline kill did not happen")
    finally:
        ex.shutdown(wait=False)
    return res, time.monotonic() - t0


def test_runaway_item_answers_timeout_within_its_deadline(pool):
    (r,), took = bounded_grade(pool, [(TOWER, "3")], DEADLINE_S + SLACK_S)
    assert r.status == "timeout" and not r.correct, r
    assert took >= DEADLINE_S * 0.9, took  # it was graded, not refused
    # a fresh worker took over: the next items are graded normally
    res, _ = bounded_grade(pool, [(r"\boxed{4}", "4"), (r"\boxed{5}", "4")], 30)
    assert [(x.status, x.correct) for x in res] == [("ok", True), ("ok", False)]


def test_timed_out_item_is_graded_again_on_retry(pool):
    """A retry spends at least the deadline again (graded), never an instant cached 'timeout'."""
    item = (TOWER.replace("5", "6"), "2")
    (first,), _ = bounded_grade(pool, [item], DEADLINE_S + SLACK_S)
    assert first.status == "timeout", first
    # the pool may give a retry a longer deadline; it must still be bounded
    (again,), took = bounded_grade(pool, [item], 3 * DEADLINE_S + SLACK_S)
    assert again.status == "timeout", again
    assert took >= DEADLINE_S * 0.9 and again.ms >= DEADLINE_S * 1000 * 0.9, (took, again)
    # another text with the same final answer and gold (what a verdict cache would key on)
    (other,), took = bounded_grade(pool, [("Therefore " + item[0], item[1])], 3 * DEADLINE_S + SLACK_S)
    assert other.status == "timeout" and took >= DEADLINE_S * 0.9, (took, other)


def test_ok_verdicts_are_cached_so_the_timing_test_can_tell(pool):
    """The control for the test above: a graded 'ok' item IS answered from the cache on a repeat
    (ms == 0), so 'graded again' is a property of timeouts, not of every repeat."""
    item = (r"so \boxed{\frac{3\sqrt{2}}{4}}", r"\frac{\sqrt{18}}{4}")
    (first,), _ = bounded_grade(pool, [item], 30)
    (again,), _ = bounded_grade(pool, [item], 30)
    assert first.status == again.status == "ok" and first.correct and again.correct
    assert again.ms == 0.0 and first.ms > 0.0, (first, again)
