"""The grader pool's queue, without processes: admission, fair queueing, budgets, deadlines.

What to send next and with which deadline is decided here; who runs it (pebble's workers, their
start-up, deaths and recycling) is ``pool.py``'s, and what is known already (caches, inline
verdicts) is ``cache.py``'s. A :class:`Job` is one request: its cache plan and the queue of its
leaders (the items a worker must grade). The scheduler

- admits a job or refuses it (:class:`PoolBusy`: too many items, or too many estimated seconds, queued);
- picks the open job that has received the least worker time (fair queueing: a huge batch cannot
  starve a small request), costly shapes last within a job (``looks_costly``);
- gives each item its deadline: the pool's, longer for an item that timed out before, a first
  slice (``FIRST_SLICE``) while other work waits, never past the job's budget;
- estimates queued seconds from a running mean of per-item time per mode (``observe``).

It has no thread and no process of its own: every method runs in the caller's thread under
``lock`` (the pool holds it across a pick and the hand-off to pebble), so a test drives it alone.
"""

from __future__ import annotations

import collections
import concurrent.futures
import re
import threading
import time
from collections.abc import Iterable

from stapo.verifier_service.grader import Verdict
from stapo.verifier_service.server.cache import Item, Plan

EWMA_ALPHA = 0.05
"""Weight of one item in the per-mode running mean of grading time (admission, fair queueing)."""
INITIAL_ITEM_S = 0.005
"""Per-item time assumed for a mode before any of its items were graded."""
COSTLY_KEY = "costly"

COSTLY = re.compile(
    r"\^\s*\{[^{}]*\^|\^\s*\w+\s*\^|[\d})]\s*!|(?:[{(\[][^{}()\[\]]*){12}"  # towers, factorials, nesting
    r"|\^\s*\{?\s*[-+]?\d{6}|\d\s*[eE]\s*\+?\d{5}"  # exponents of 6+ digits (1.5 \times 10^{99999999}, 1.5e99999)
    r"|\^[^()]*\)\s*\^"  # left-nested powers ((9^9)^9)^9
    r"|\\Gamma\b|\\binom\s*\{[^{}]*(?:\^|\d{5})"  # Gamma, binomials of huge numbers
)
"""Shapes that can hold a worker for a whole deadline: a power tower (``5^{5^{5^5}}``), a factorial,
brackets nested 12 deep, an exponent of six or more digits, left-nested powers, Gamma, a binomial of
a huge number. Only the order of work and the admission estimate depend on it."""


FIRST_SLICE = 0.1
"""An item's first run gets this share of its deadline while other work waits (``Scheduler.take``)."""


def looks_costly(prediction: str) -> bool:
    """Whether the end of a response (where the answer is) has a shape that can take a deadline.

    Such items go after the rest of their request: a request that mixes ordinary items with
    pathological ones gets its ordinary items graded first, within its budget. Shapes it misses
    (``\\Gamma(10^9)``, ``99999^{99999999}``, a float times ``10^{99999999}``) are found by their
    first run instead: it is a slice (``FIRST_SLICE``) of the deadline while other work waits, and an
    item that outruns it goes behind its request's other unsent items (ahead of the known costly
    shapes) with the rest of its deadline. Verdicts do
    not depend on it."""
    return COSTLY.search(prediction, max(0, len(prediction) - 2000)) is not None


class RetryLater(RuntimeError):
    def __init__(self, msg: str, retry_after_s: float = 1.0) -> None:
        super().__init__(msg)
        self.retry_after_s = retry_after_s


class PoolBusy(RetryLater):
    """Too much work is queued: back off for ``retry_after_s`` and retry (the service answers 429)."""


class Job:
    """One submit() call: its cache plan (results, duplicates) and its queue of leaders to send."""

    def __init__(self, items: list[Item], plan: Plan) -> None:
        self.items, self.plan = items, plan
        self.future: concurrent.futures.Future[list[Verdict]] = concurrent.futures.Future()
        self.costly = {i for i in plan.leaders if looks_costly(items[i][0])}
        self.known_costly = frozenset(self.costly)  # by shape, before anything ran
        self.sliced: dict[int, float] = {}  # leader -> seconds its first run had before it was cut
        self.queue = collections.deque(sorted(plan.leaders, key=lambda i: i in self.costly))  # costly last
        self.pending = collections.Counter(self.kind(i) for i in plan.leaders)  # queued or in flight
        self.crashes: collections.Counter[int] = collections.Counter()
        self.served = 0.0  # estimated worker-seconds sent so far (the fair-queueing key)
        self.expires: float | None = None
        self.default_expires: float | None = None  # becomes ``expires`` when an item times out
        self.cancelled = False

    def kind(self, i: int) -> str:
        return COSTLY_KEY if i in self.costly else self.items[i][2]


class Scheduler:
    """The jobs with items queued or in flight, and the choice of what runs next; see the module docstring.

    ``size``: how many items run at once (the workers); ``deadline_s``: an item's deadline;
    ``retry_deadline_factor``: the deadline of an item that timed out before, as a multiple.
    Methods whose names end in ``_locked`` expect the caller to hold ``lock``; the others take it.
    """

    def __init__(
        self,
        size: int,
        deadline_s: float,
        *,
        max_pending_items: int,
        max_queue_s: float,
        retry_deadline_factor: float,
        stats: collections.Counter[str] | None = None,
    ) -> None:
        self.size, self.deadline_s = size, deadline_s
        self.max_pending_items, self.max_queue_s = max_pending_items, max_queue_s
        self.retry_deadline_factor = retry_deadline_factor
        self.stats = stats if stats is not None else collections.Counter()
        self.lock = threading.Lock()
        self.outstanding: dict[Job, None] = {}  # jobs with items queued or in flight, in arrival order
        self.pending_items = 0  # queued + in flight
        self.item_s: dict[str, float] = {}  # mode -> running mean of per-item seconds (timeouts too)

    # ----------------------------------------------------------------- estimates

    def est_s(self, kind: str) -> float:
        return self.deadline_s if kind == COSTLY_KEY else self.item_s.get(kind, INITIAL_ITEM_S)

    def job_seconds(self, job: Job) -> float:
        """A job's pending work in wall seconds over all workers; never more than its budget: a costly
        shape counts a deadline, and a request without a budget gets one as soon as one times out."""
        ordinary = sum(n * self.est_s(k) for k, n in job.pending.items() if k != COSTLY_KEY) / self.size
        costly = job.pending[COSTLY_KEY] * self.deadline_s / self.size
        if job.expires is not None:
            return min(ordinary + costly, max(0.0, job.expires - time.monotonic()))
        if job.default_expires is not None:
            costly = min(costly, max(0.0, job.default_expires - time.monotonic()))
        return ordinary + costly

    def queued_seconds_locked(self) -> float:
        return sum(self.job_seconds(j) for j in self.outstanding)

    def observe(self, mode: str, seconds: float) -> None:
        old = self.item_s.get(mode)
        self.item_s[mode] = seconds if old is None else old + EWMA_ALPHA * (seconds - old)

    # ----------------------------------------------------------------- admission

    def admit_locked(self, job: Job) -> None:
        """Queue a job's leaders, or raise :class:`PoolBusy` (too many items or seconds queued)."""
        n = len(job.plan.leaders)
        if self.pending_items + n > self.max_pending_items:
            self.stats["rejected"] += 1
            raise PoolBusy(
                f"{self.pending_items} items already queued (max_pending_items={self.max_pending_items}); "
                "retry later",
                5.0,
            )
        queued_s, new_s = self.queued_seconds_locked(), self.job_seconds(job)
        if queued_s > 0 and queued_s + new_s > self.max_queue_s:
            wait = max(1.0, queued_s + new_s - self.max_queue_s)
            self.stats["rejected"] += 1
            raise PoolBusy(
                f"about {queued_s:.0f} s of grading already queued and this request adds {new_s:.1f} s; "
                f"the bound is max_queue_s={self.max_queue_s:g}; retry in {wait:.0f} s",
                wait,
            )
        self.outstanding[job] = None
        self.pending_items += n

    # ----------------------------------------------------------------- what runs next

    def pick_locked(self) -> Job | None:
        """The open job that has received the least worker time (ties: the oldest); expired jobs are
        left for ``expired`` to answer."""
        now = time.monotonic()
        open_jobs = (j for j in self.outstanding if j.queue and (j.expires is None or now <= j.expires))
        return min(open_jobs, key=lambda j: j.served, default=None)

    def work_waits_locked(self) -> bool:
        """Is any item queued (not yet sent) in any request?"""
        return any(j.queue for j in self.outstanding)

    def take_locked(self) -> tuple[Job, int, float, bool] | None:
        """The next item to send: (job, item index, deadline in seconds, sliced: cut at a first slice
        while others wait); None when nothing is queued. Its job is charged its estimated time."""
        job = self.pick_locked()
        if job is None:
            return None
        i = job.queue.popleft()
        job.served += self.est_s(job.kind(i))
        deadline = self.deadline_s * (self.retry_deadline_factor if i in job.plan.retried else 1)
        deadline -= job.sliced.get(i, 0.0)
        sliced = i not in job.costly and i not in job.plan.retried and self.work_waits_locked()
        if sliced:  # cut at a slice while others wait; it goes on later (slice_out)
            deadline *= FIRST_SLICE
        if job.expires is not None:  # nothing runs past the request's budget
            deadline = min(deadline, max(0.05, job.expires - time.monotonic()))
        return job, i, deadline, sliced

    def give_back_locked(self, job: Job, i: int) -> None:
        """An item taken but not sent (the workers could not take it): first in its job again."""
        job.queue.appendleft(i)

    # ----------------------------------------------------------------- items leaving the queue

    def forget_locked(self, job: Job, idx: Iterable[int]) -> None:
        """These leaders of ``job`` are no longer pending here (answered or dropped)."""
        for i in idx:
            job.pending[job.kind(i)] -= 1
            self.pending_items -= 1
        if not +job.pending:
            self.outstanding.pop(job, None)

    def drop_queued(self, job: Job, *, cancelled: bool) -> list[int]:
        """Remove a job's queued items: cancelled -> forgotten (returns []); budget spent -> returned,
        for the caller to answer 'timeout'."""
        with self.lock:
            idx = list(job.queue)
            job.queue.clear()
            if cancelled:
                job.cancelled = True
                self.forget_locked(job, idx)
                self.stats["cancelled_items"] += len(idx)
                return []
            self.stats["expired_items"] += len(idx)
        return idx

    def requeue(self, job: Job, idx: list[int]) -> None:
        """Items to send again (a lost worker, a verdict that did not carry over): their job's head."""
        with self.lock:  # the cancelled flag is set under this lock too
            if job.cancelled:
                self.forget_locked(job, idx)
                return
            job.queue.extendleft(reversed(idx))

    def settle(self, job: Job, leader: int, followers: list[int]) -> bool:
        """A leader was answered; ``followers`` (its verdict did not carry over to them) are pending
        now. Returns whether the job has nothing pending left. The caller requeues the followers."""
        with self.lock:
            job.pending.update(job.kind(f) for f in followers)
            self.pending_items += len(followers)
            self.forget_locked(job, [leader])
            return not +job.pending

    def slice_out(self, job: Job, i: int, ran_s: float) -> None:
        """An item outran its first slice: it counts as costly now and goes behind the request's
        other unsent items (ahead of the shapes known to be costly: on a loaded machine an ordinary
        item can outrun a slice too) with the rest of its deadline."""
        with self.lock:
            if job.cancelled:
                self.forget_locked(job, [i])
                return
            job.pending[job.kind(i)] -= 1
            job.costly.add(i)
            job.pending[COSTLY_KEY] += 1
            job.sliced[i] = ran_s
            at = next((n for n, j in enumerate(job.queue) if j in job.known_costly), len(job.queue))
            job.queue.insert(at, i)

    def expired(self, now: float) -> list[Job]:
        """Jobs whose budget is spent (their queued items answer 'timeout', their running ones stop)."""
        return [j for j in list(self.outstanding) if j.expires is not None and now > j.expires]

    def clear(self) -> list[Job]:
        """Forget every job (the pool failed or closed); returns them, for their futures to be failed."""
        with self.lock:
            jobs = list(self.outstanding)
            self.outstanding.clear()
            for job in jobs:
                self.forget_locked(job, list(job.queue))
                job.queue.clear()
                job.cancelled = True
        return jobs
