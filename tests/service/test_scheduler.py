"""The grader pool's scheduler driven alone: no process, no thread, no pebble.

Fair queueing, costly shapes last, admission, request budgets and per-item deadlines, each against
an expectation worked out by hand from the rules in verifier_service/server/scheduler.py.
"""

from __future__ import annotations

import time

import pytest

from stapo.verifier_service.server.cache import Memo
from stapo.verifier_service.server.scheduler import FIRST_SLICE, INITIAL_ITEM_S, Job, PoolBusy, Scheduler

TOWER = "so \\boxed{5^{5^{5^5}}}"  # a shape looks_costly knows


def job(*preds: str, mode: str = "math") -> Job:
    """A job whose items are all leaders (distinct predictions, no verdict cache, nothing inline)."""
    items = [(p, "1", mode) for p in preds]
    plan = Memo(1 << 20, 1024, verdicts=False).plan(items, max_chars=(10**5, 10**4))
    assert plan.leaders == list(range(len(items)))
    return Job(items, plan)


def sched(size: int = 1, deadline_s: float = 5.0, **kw) -> Scheduler:
    kw = {"max_pending_items": 1000, "max_queue_s": 1000.0, "retry_deadline_factor": 2.0, **kw}
    return Scheduler(size, deadline_s, **kw)


def drain(s: Scheduler) -> list[tuple[Job, int, float, bool]]:
    out = []
    with s.lock:
        while (task := s.take_locked()) is not None:
            out.append(task)
    return out


def test_the_job_served_least_goes_next_ties_to_the_oldest():
    s = sched()
    a, b = job(*(f"\\boxed{{{k}}}" for k in range(6))), job("\\boxed{7}", "\\boxed{8}")
    with s.lock:
        s.admit_locked(a)
        s.admit_locked(b)
    order = ["a" if j is a else "b" for j, *_ in drain(s)]
    # each item charges its job INITIAL_ITEM_S: a (a=1 unit), b (b=1), tie -> a, b, then a alone
    assert order == ["a", "b", "a", "b", "a", "a", "a", "a"]
    assert a.served == pytest.approx(6 * INITIAL_ITEM_S) and b.served == pytest.approx(2 * INITIAL_ITEM_S)


def test_costly_shapes_go_last_and_count_a_deadline():
    s = sched(size=2, deadline_s=4.0)
    j = job(TOWER, "\\boxed{1}", "\\boxed{2}")
    assert j.costly == {0}
    # two ordinary items at the initial estimate plus one deadline, over two workers
    assert s.job_seconds(j) == pytest.approx((2 * INITIAL_ITEM_S + 4.0) / 2)
    with s.lock:
        s.admit_locked(j)
    assert [i for _, i, *_ in drain(s)] == [1, 2, 0]


def test_admission_by_items_and_by_seconds():
    s = sched(max_pending_items=3)
    with s.lock, pytest.raises(PoolBusy, match="max_pending_items=3"):
        s.admit_locked(job("a", "b", "c", "d"))
    assert s.pending_items == 0 and not s.outstanding and s.stats["rejected"] == 1

    s = sched(size=1, deadline_s=5.0, max_queue_s=8.0)
    with s.lock:
        s.admit_locked(job(TOWER))  # nothing queued yet: always admitted
        assert s.queued_seconds_locked() == pytest.approx(5.0)
        with pytest.raises(PoolBusy, match="max_queue_s=8") as err:
            s.admit_locked(job(TOWER + " "))
    assert err.value.retry_after_s == pytest.approx(2.0)  # 5 + 5 - 8
    assert s.pending_items == 1


def test_deadlines_first_slice_retries_and_budget():
    s = sched(size=1, deadline_s=5.0, retry_deadline_factor=2.0)
    a, b = job("\\boxed{1}", "\\boxed{2}"), job("\\boxed{3}")
    b.plan.retried.add(0)  # timed out before: a longer deadline, never sliced
    with s.lock:
        s.admit_locked(a)
        s.admit_locked(b)
    tasks = drain(s)
    got = [("a" if j is a else "b", i, d, sl) for j, i, d, sl in tasks]
    assert got == [
        ("a", 0, pytest.approx(5.0 * FIRST_SLICE), True),  # others wait: a first slice
        ("b", 0, pytest.approx(10.0), False),  # a retry: twice the deadline
        ("a", 1, pytest.approx(5.0), False),  # nothing else waits: the whole deadline
    ]

    s = sched(size=1, deadline_s=5.0)
    c = job("\\boxed{1}", "\\boxed{2}", "\\boxed{3}")
    c.expires = time.monotonic() + 0.5
    with s.lock:
        s.admit_locked(c)
        assert s.job_seconds(c) <= 0.5  # never more than the budget left
        _, _, d, _ = s.take_locked()
    assert d <= 0.5
    assert s.expired(time.monotonic()) == []
    assert s.expired(c.expires + 1.0) == [c]
    assert s.drop_queued(c, cancelled=False) == [1, 2]  # for the caller to answer 'timeout'
    assert s.stats["expired_items"] == 2


def test_settle_requeue_slice_out_and_cancel():
    s = sched(size=1)
    j = job("\\boxed{1}", "\\boxed{2}", TOWER)
    with s.lock:
        s.admit_locked(j)
        j0, i0, *_ = s.take_locked()
    assert (j0, i0) == (j, 0) and s.pending_items == 3
    s.slice_out(j, 0, 0.5)  # outran its slice: costly now, behind item 1, ahead of the known tower
    assert list(j.queue) == [1, 0, 2] and j.sliced == {0: 0.5} and j.pending["costly"] == 2
    with s.lock:
        _, i, *_ = s.take_locked()
    assert i == 1
    s.requeue(j, [1])  # its worker was lost: back at the head
    assert list(j.queue) == [1, 0, 2]
    with s.lock:
        _, i, *_ = s.take_locked()
    assert i == 1 and s.pending_items == 3
    assert s.settle(j, 1, []) is False and s.pending_items == 2  # answered; 0 and 2 still queued
    assert s.drop_queued(j, cancelled=True) == []  # the caller went away: forgotten
    assert j.cancelled and s.pending_items == 0 and not s.outstanding
    assert s.stats["cancelled_items"] == 2
