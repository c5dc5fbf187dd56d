"""Warm grading processes with a hard wall-clock deadline on every item, shared fairly.

Why processes and an outside deadline: math-verify's timeouts use ``signal.alarm``. They work only
on a process's main thread (uvicorn runs handlers elsewhere), and even there they cannot interrupt
C code (a GMP factorial of ``(10^{10})!``) or ``str()`` of a parsed power tower. The only deadline
that always holds is one enforced from outside: a worker that overruns is killed and replaced.

Who does what:

- the process layer is pebble's ``ProcessPool`` (a maintained library): it starts the workers,
  kills a worker whose task is cancelled or runs past the task's timeout and starts another,
  replaces a worker that died (the task fails with ``ProcessExpired``), and retires a worker after
  ``max_tasks`` tasks (recycling by item count: tasks hold at most ``batch_size`` items);
- this module keeps what is stapo's own: fair scheduling across requests, batching, the caches,
  admission, per-item deadlines inside a batch, restart with backoff, recycling by memory, metrics.

How a request flows::

    submit(items) -> too_large / cache hits / verdict-cache hits / duplicates answered at once
                  -> the rest becomes a job: a queue of items in request order
    dispatch      -> whenever fewer tasks run than there are workers: the open job that has received
                     the LEAST worker time so far (fair queueing by attained service: a 1-item request
                     sent behind a 512-item flood goes next) gives a task of up to ``batch_size``
                     items, fewer when the mode's recent per-item time says it would run longer than
                     ``TASK_TARGET_S`` (a task never holds a worker long, so fairness needs no preemption)
    worker        -> grades the task's items one by one; before each it writes (task, index, start
                     time) to its slot of a shared array, so the parent knows which item runs since when
    watchdog      -> an item running past its deadline: cancel the task's future (pebble kills the
                     worker), answer that item 'timeout', put the task's other items back at the head
                     of ITS OWN job's queue, one per task
    dead worker   -> (killed from outside, out of memory) the same, but the item in flight is retried
                     once on another worker before it answers 'error'

Cancellation: cancelling the future ``submit`` returned (the service does so when the client
disconnects) drops the job's queued items at once; a job whose ``budget_s`` is spent answers its
still-queued items 'timeout' without grading them. Admission is measured in work: the estimated
seconds of what is pending beyond ``max_queue_s`` raises :class:`PoolBusy` with a ``retry_after_s``.

Results: 'timeout' and 'error' are never cached (a retry re-grades; an item that timed out before
gets ``retry_deadline_factor`` x the deadline on its next try). Caches: ``cache.py``.

Self-healing: workers that keep dying while starting break the pool for a while (callers get
:class:`PoolBroken`, ``broken`` says why), then it tries again with exponential backoff. A pebble
pool that stopped working as a whole is replaced by a fresh one. A worker above
``worker_max_rss_mb`` resident memory gets the whole set of workers replaced (pebble cannot retire
one chosen worker; the old set finishes its tasks and exits).

Fork safety: a process forked from one that owns a pool (verl's reward workers, DataLoader
workers) gets a fresh pool of its own on its first call, started with ``spawn`` (the parent's fork
server is not the child's to use); the parent's workers are left alone.

Workers start with ``forkserver`` (default) or ``spawn``: never plain ``fork`` of a process that
runs uvicorn's threads. With forkserver the grader is preloaded in the fork server, so a
replacement worker is up in milliseconds. As with any multiprocessing pool, a script that builds a
pool at import time needs the ``if __name__ == "__main__":`` guard.

Usage::

    from stapo.verifier_service.pool import GraderPool
    with GraderPool(workers=2, deadline_s=5.0) as pool:
        results = pool.grade_many([{"prediction": "so \\\\boxed{4}", "gold": "4"}])
        # async code: results = await pool.agrade_many(items)
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import multiprocessing as mp
import multiprocessing.util
import operator
import os
import re
import signal
import socket
import threading
import time
import weakref
import zlib
from collections.abc import Iterable, Sequence
from multiprocessing.connection import wait as mp_wait
from typing import Any

import pebble

from stapo.verifier_service.cache import (
    ByteLRU,
    Item,
    VerdictKey,
    cache_key,
    inline_grade,
    untimed,
    verdict_key,
)
from stapo.verifier_service.grader import GradeResult
from stapo.verifier_service.schemas import MODES, VerifyItem

log = logging.getLogger("stapo.verifier_service.pool")

TASK_TARGET_S = 0.05
"""A task is cut so that, at the mode's recent per-item time, it holds a worker about this long:
long enough to amortize IPC, short enough that a newly arrived request waits little."""

EWMA_ALPHA = 0.05
"""Weight of one item in the per-mode running mean of grading time (admission and task sizes)."""

INITIAL_ITEM_S = 0.005
"""Per-item time assumed for a mode before any of its items were graded."""

MAX_RESTART_BACKOFF_S = 60.0
WATCH_TICK_S = 0.05
"""The watchdog looks at running items at least this often (a deadline holds to within this)."""

COSTLY = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\w+\s*\^|[\d})]\s*!|(?:[{(\[][^{}()\[\]]*){12}")
"""Shapes that can hold a worker for a whole deadline: a power tower (``5^{5^{5^5}}``), a factorial,
brackets nested 12 deep. Only the order of work depends on it (see ``looks_costly``)."""


def looks_costly(prediction: str) -> bool:
    """Whether the end of a response (where the answer is) has a shape that can take a deadline.

    Such items go after the rest of their request, one per task: a request that mixes ordinary
    items with pathological ones gets its ordinary items graded first, within its budget, and the
    pathological ones overrun in parallel. Verdicts do not depend on it."""
    return COSTLY.search(prediction, max(0, len(prediction) - 2000)) is not None


FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(GradeResult)))
"""A result travels from a worker as a plain tuple of its fields (cheaper to pickle than the object)."""


class PoolClosed(RuntimeError):
    """The pool was closed; it grades nothing more."""


class PoolBusy(RuntimeError):
    """Too much work is queued: back off for ``retry_after_s`` and retry (the service answers 429)."""

    def __init__(self, msg: str, retry_after_s: float = 1.0) -> None:
        super().__init__(msg)
        self.retry_after_s = retry_after_s


class PoolBroken(RuntimeError):
    """Workers die while starting, again and again (an import error, a memory limit set too low).

    ``retry_after_s``: when the pool tries to start them again."""

    def __init__(self, msg: str, retry_after_s: float = 5.0) -> None:
        super().__init__(msg)
        self.retry_after_s = retry_after_s


def timeout_result(deadline_s: float) -> GradeResult:
    return GradeResult(correct=False, score=0.0, status="timeout", extracted=None, ms=deadline_s * 1000.0)


def status_result(status: str) -> GradeResult:
    """A result that carries only a status (too_large, error): never correct, score 0."""
    return GradeResult(correct=False, score=0.0, status=status, extracted=None, ms=0.0)


def as_item(x: VerifyItem | dict[str, Any] | Sequence[str], where: str = "item") -> Item:
    """Accept a VerifyItem, a dict with prediction/gold(/mode), or a (prediction, gold[, mode]) tuple."""
    if type(x) is tuple and len(x) == 3:  # what the service sends: validated already, skip pydantic
        pred, gold, mode = x
        if type(pred) is str and type(gold) is str and type(mode) is str and mode in MODES:
            return x
    if isinstance(x, VerifyItem):
        return (x.prediction, x.gold, x.mode)
    if isinstance(x, dict):
        v = VerifyItem.model_validate(x)  # a clear error naming the bad field
        return (v.prediction, v.gold, v.mode)
    if isinstance(x, (tuple, list)) and len(x) in (2, 3):
        mode = x[2] if len(x) == 3 else "math"
        v = VerifyItem(prediction=x[0], gold=x[1], mode=mode)
        return (v.prediction, v.gold, v.mode)
    raise TypeError(
        f"{where}: expected a VerifyItem, a dict or a (prediction, gold[, mode]) tuple, got {type(x).__name__}"
    )


# --------------------------------------------------------------------------- worker process

WORKER: dict[str, Any] = {}
"""Set in each worker by ``worker_init``: the progress array and the grader's size limit."""


def worker_init(progress: Any, ready: Any, memory_mb: int, warmup: bool, max_chars: int) -> None:
    """pebble's initializer, run once in every worker; tells the parent it is ready (its pid)."""
    # pebble stops a worker with SIGTERM and waits for a Python-level handler; a worker stuck in C
    # code (a GMP power) never runs one. Dying at once is what a killed grader should do.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):  # Linux: die with the parent, leave no graders behind
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if memory_mb > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
    import stapo.verifier_service.grader  # noqa: F401  (imported before the first task's clock starts)

    if warmup:  # a no-op when the fork server already imported (and so ran) it
        import stapo.verifier_service.warmup  # noqa: F401
    WORKER.update(progress=progress, max_chars=max_chars)
    with contextlib.suppress(OSError):  # the pool closed while this worker started: nothing to tell
        ready.send(os.getpid())


def grade_task(slot: int, seq: int, items: list[Item]) -> tuple[int, float, list[tuple]]:
    """Grade a task's items in order: (pid, resident MiB, one result tuple per item).

    Before each item it writes (index, start time) into the task's slot, so the parent can tell
    which item overran and which ones finished before it (their results die with a killed worker).
    """
    from stapo.verifier_service.grader import grade

    p, base = WORKER["progress"], 3 * slot
    p[base] = seq
    out = []
    for j, (pred, gold, mode) in enumerate(items):
        p[base + 1] = math.inf  # no deadline while the index changes
        p[base + 2] = j
        t0 = time.perf_counter()
        p[base + 1] = time.monotonic()
        try:
            r = FIELDS(grade(pred, gold, mode, max_chars=WORKER["max_chars"]))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # math-verify's TimeoutException is a BaseException
            log.debug("grade raised %r", err)
            r = FIELDS(GradeResult(False, 0.0, "error", None, (time.perf_counter() - t0) * 1000.0))
        out.append(r)
    p[base + 1] = math.inf
    return os.getpid(), rss_mb(), out


def rss_mb() -> float:
    """This process's resident memory in MiB (Linux /proc; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


# --------------------------------------------------------------------------- parent side


class RecordingContext:
    """A multiprocessing context that remembers the worker processes pebble starts through it.

    pebble accepts any multiprocessing context; this one lets the pool see its own workers (PIDs,
    exit codes) without reading pebble's internals, and hand them over cleanly after a fork.
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.procs: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ctx, name)

    def Process(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - the context API's name
        p = self.ctx.Process(*args, **kwargs)
        self.procs.append(p)
        return p


class Generation:
    """One pebble pool and what is known about its workers."""

    def __init__(self, ctx: RecordingContext, pool: pebble.ProcessPool) -> None:
        self.ctx, self.pool = ctx, pool
        self.ready: set[int] = set()  # PIDs that finished worker_init
        self.tasks_by_pid: collections.Counter[int] = collections.Counter()
        self.dead = False  # stopped or replaced: nothing more is sent to it

    def live_ready(self) -> list[int]:
        return sorted(p.pid for p in self.ctx.procs if p.pid in self.ready and p.is_alive())


class Job:
    """One submit() call: results in order, duplicates answered from their leader, a queue to dispatch."""

    __slots__ = (
        "results", "dups", "keys", "vkeys", "vdups", "remaining", "future", "queue", "items", "deadlines",
        "crashes", "served", "expires", "default_expires", "cancelled", "spread", "shard", "single",
        "__weakref__",
    )  # fmt: skip

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.results: list[GradeResult | None] = [None] * len(items)
        self.dups: dict[int, list[int]] = {}
        self.keys: dict[int, bytes] = {}
        self.vkeys: dict[int, VerdictKey] = {}
        self.vdups: dict[int, list[int]] = {}  # leader -> items with the same (mode, gold, answer)
        self.remaining = 0  # leaders not answered yet (queued or in flight)
        self.future: concurrent.futures.Future[list[GradeResult]] = concurrent.futures.Future()
        self.queue: list[collections.deque[int]] = []  # leader indices not yet sent, one deque per gold shard
        self.shard: dict[int, int] = {}  # item -> its gold shard
        self.single: set[int] = set()  # items back from a lost worker: sent one per task
        self.deadlines: dict[int, float] = {}  # leader -> its deadline when not the pool's default
        self.crashes: dict[int, int] = {}
        self.served = 0.0  # estimated worker-seconds dispatched so far (fair-queueing key)
        self.expires: float | None = None
        self.default_expires: float | None = None  # becomes ``expires`` when an item times out
        self.cancelled = False
        self.spread = 1  # most items per task so that the job's items reach every worker

    def queued(self) -> list[int]:
        return [i for d in self.queue for i in d]

    def clear_queue(self) -> list[int]:
        idx = self.queued()
        for d in self.queue:
            d.clear()
        return idx


@dataclasses.dataclass(eq=False)
class Task:
    """A slice of one job sent to a worker, in progress slot ``slot``."""

    job: Job
    idx: list[int]
    deadline_s: float
    slot: int
    seq: int
    gen: Generation
    future: Any = None
    killed: str | None = None  # why the watchdog cancelled it


def stop_generations(gens: list[Generation]) -> None:
    """Stop every worker of these pebble pools (SIGTERM; they die at once) and wait for them."""
    for gen in gens:
        gen.dead = True
        with contextlib.suppress(Exception):
            gen.pool.stop()
    for gen in gens:
        with contextlib.suppress(Exception):
            gen.pool.join(timeout=5.0)


_POOLS: weakref.WeakSet[GraderPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pool in list(_POOLS):
        with contextlib.suppress(Exception):
            pool._forget_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)
_REBUILD_LOCK = threading.Lock()


class GraderPool:
    """Warm grading processes with a hard per-item deadline; see the module docstring.

    Thread-safe: ``submit``/``grade_many``/``agrade_many`` may be called from any thread or event
    loop at the same time. Results come back in input order, one per item, never an exception for
    a bad item: a failure is a status (timeout, error, too_large).
    """

    def __init__(
        self,
        workers: int | None = None,
        deadline_s: float = 5.0,
        *,
        batch_size: int = 16,
        max_prediction_chars: int = 100_000,
        max_gold_chars: int = 10_000,
        cache_size: int = 65_536,
        cache_max_mb: float = 64.0,
        verdict_cache: bool = True,
        inline_verdicts: bool = True,
        max_pending_items: int = 200_000,
        max_queue_s: float = 60.0,
        retry_deadline_factor: float = 2.0,
        start_method: str = "forkserver",
        worker_memory_mb: int = 0,
        worker_max_items: int = 50_000,
        worker_max_rss_mb: int = 1024,
        startup_timeout_s: float = 60.0,
        crash_retries: int = 1,
        max_start_failures: int = 5,
        warmup: bool = True,
    ) -> None:
        if workers is None:
            from stapo.verifier_service.settings import default_workers

            workers = default_workers()
        for name, ok in (
            ("workers", workers >= 1),
            ("deadline_s", deadline_s > 0),
            ("batch_size", batch_size >= 1),
            ("max_queue_s", max_queue_s > 0),
            ("retry_deadline_factor", retry_deadline_factor >= 1),
        ):
            if not ok:
                raise ValueError(f"{name}: out of range, got {locals()[name]!r}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"start_method: 'forkserver' or 'spawn' (never plain fork under threads), got {start_method!r}"
            )
        self.size = workers
        self.deadline_s = float(deadline_s)
        self.batch_size = batch_size
        self.max_prediction_chars = max_prediction_chars
        self.max_gold_chars = max_gold_chars
        self.max_pending_items = max_pending_items
        self.max_queue_s = float(max_queue_s)
        self.retry_deadline_factor = float(retry_deadline_factor)
        self.startup_timeout_s = startup_timeout_s
        self.crash_retries = crash_retries
        self.max_start_failures = max_start_failures
        self.worker_max_items = worker_max_items
        self.worker_max_rss_mb = worker_max_rss_mb
        self.verdict_cache = verdict_cache
        self.inline_verdicts = inline_verdicts and verdict_cache
        self.worker_memory_mb = worker_memory_mb
        self.warmup = warmup
        self.start_method = start_method
        # pebble retires a worker after max_tasks tasks; a task holds at most batch_size items
        self.max_tasks = math.ceil(worker_max_items / batch_size) if worker_max_items else 0
        cache_bytes = int(cache_max_mb * 2**20)
        # Two caches share the byte budget: whole items, and verdicts by extracted answer.
        self.cache = ByteLRU(cache_bytes // 2 if verdict_cache else cache_bytes, cache_size)
        self.verdicts = ByteLRU(cache_bytes // 2 if verdict_cache else 0, cache_size)
        self.timed_out = ByteLRU(1 << 20, 4096)  # keys of items that timed out: a retry gets longer
        self.stats: collections.Counter[str] = collections.Counter()
        self._start()
        _POOLS.add(self)

    def _start(self) -> None:
        """Everything that belongs to one process: state, locks, the progress array, workers, watchdog."""
        self._owner_pid = os.getpid()
        self._ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # Only has an effect before this process's fork server starts. The warm-up module
            # imports math-verify + sympy and grades a few items once, in the fork server, so
            # every worker (and every replacement) is born warm: ~20 ms instead of ~0.5 s.
            self._ctx.set_forkserver_preload(
                ["stapo.verifier_service.pool"] + (["stapo.verifier_service.warmup"] if self.warmup else [])
            )
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no job is outstanding
        self._active: dict[Job, None] = {}  # jobs with queued items, in arrival order
        self._outstanding: set[Job] = set()
        self._running: dict[int, Task] = {}  # slot -> task in flight
        self._free_slots = list(range(self.size))
        self._pending_items = 0  # queued + in flight
        self._pending_by_mode: collections.Counter[str] = collections.Counter()
        self._item_s: dict[str, float] = {}  # mode -> running mean of per-item seconds (timeouts too)
        self._typical_log_s: dict[str, float] = {}  # running mean of log(seconds), no timeouts: sizes tasks
        self._closing = self._stop = False
        self._broken: str | None = None
        self._restart_at = 0.0
        self._backoff_s = 1.0
        self._start_failures = 0
        self._seq = 0
        self._gens: list[Generation] = []  # the current one last; older ones finish their tasks
        # Stopped when this process exits: multiprocessing's exit handler runs these finalizers before
        # it joins every child, so a process that never closed its pool does not wait on its workers.
        multiprocessing.util.Finalize(self, stop_generations, args=(self._gens,), exitpriority=10)
        self._gen_started = 0.0
        self._unready_since: float | None = None
        self._ready_event = threading.Event()
        self._progress = self._ctx.RawArray("d", 3 * self.size)  # per slot: task seq, item start, item index
        self._ready_r, self._ready_w = self._ctx.Pipe(duplex=False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._new_generation()
        self._thread = threading.Thread(target=self._watch, name="stapo-grader-pool", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- workers (pebble)

    def _new_generation(self) -> None:
        """Start a fresh pebble pool; the previous one (if any) finishes its tasks and exits."""
        for old in self._gens:
            self._retire(old)
        ctx = RecordingContext(self._ctx)
        pool = pebble.ProcessPool(
            max_workers=self.size,
            max_tasks=self.max_tasks,
            initializer=worker_init,
            initargs=(
                self._progress,
                self._ready_w,
                self.worker_memory_mb,
                self.warmup,
                # The pool checks the size limits itself; the grader's own limit must not be tighter.
                max(self.max_prediction_chars, self.max_gold_chars),
            ),
            context=ctx,
        )
        gen = Generation(ctx, pool)
        self._gens.append(gen)
        self._gen_started = time.monotonic()
        self._unready_since = self._gen_started
        try:
            pool.active  # noqa: B018 - pebble starts its workers on first use; start them now
        except Exception as err:  # the fork server is gone, no fds left, ...: a failed start
            log.warning("grader workers could not start: %r", err)
            self.stats["start_errors"] += 1
            self._start_failures += 1

    def _retire(self, gen: Generation, *, kill: bool = False) -> None:
        """Send nothing more to ``gen``; its running tasks finish (or die, ``kill``), then its workers exit."""
        if gen.dead and not kill:
            return
        gen.dead = True
        with contextlib.suppress(Exception):
            gen.pool.stop() if kill else gen.pool.close()
        threading.Thread(target=self._join, args=(gen,), daemon=True).start()

    def _join(self, gen: Generation) -> None:
        with contextlib.suppress(Exception):
            gen.pool.join()
        with self._lock:
            if gen in self._gens and gen is not self._gens[-1]:
                self._gens.remove(gen)

    def _current(self) -> Generation | None:
        gen = self._gens[-1] if self._gens else None
        return None if gen is None or gen.dead else gen

    # ----------------------------------------------------------------- fork safety

    def _forget_parent(self) -> None:
        """In an ``os.fork()`` child: the workers, pipes and threads are the parent's; let go of them.

        multiprocessing's exit handler (and pebble's) would stop or join every process it knows of,
        the parent's workers included; each worker's sentinel is pointed at a closed pipe, so the
        child sees them as ended. Nothing is sent to the parent's workers."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        for lru in (self.cache, self.verdicts, self.timed_out):
            lru.reset_lock()
        for gen in self._gens:
            gen.dead = True
            for p in gen.ctx.procs:
                with contextlib.suppress(Exception):
                    r, w = os.pipe()
                    os.close(w)
                    os.dup2(r, p.sentinel)
                    os.close(r)
        self._gens.clear()  # in place: this process's exit finalizer must not stop the parent's workers
        for conn in (self._ready_r, self._ready_w, self._wake_r, self._wake_w):
            with contextlib.suppress(Exception):
                conn.close()

    def _ensure_owner(self) -> None:
        """Rebuild the pool in a forked child on first use (new workers, new watchdog)."""
        if self._owner_pid == os.getpid():
            return
        with _REBUILD_LOCK:
            if self._owner_pid == os.getpid():
                return
            closing = self._closing
            log.info("grader pool: process forked; starting workers of its own (spawn)")
            self.start_method = "spawn"  # multiprocessing's fork server belongs to the parent
            self._start()
            self.stats["fork_rebuilds"] += 1
            self._closing = closing

    # ----------------------------------------------------------------- public API

    def submit(
        self,
        items: Iterable[VerifyItem | dict[str, Any] | Sequence[str]],
        *,
        budget_s: float | None = None,
        default_budget_s: float | None = None,
        explain: bool = False,
    ) -> concurrent.futures.Future:
        """Queue items; the future resolves to ``list[GradeResult]`` in input order.

        ``budget_s``: items not graded this many seconds from now answer 'timeout' (the caller will
        have given up); nothing of the request runs past it. Without it, ``default_budget_s`` from
        now applies once one of the request's items has timed out: a request of items the grader
        cannot finish answers in bounded time, and a large batch of ordinary items is never cut.
        ``explain``: every result names the rule that decided it; results without one (decided in
        this process by ``quick_verdict``, which gives only the verdict) are graded by a worker.
        Cancelling the future drops the queued items.
        Raises :class:`PoolBusy` (too much queued work), :class:`PoolBroken`, :class:`PoolClosed`.
        """
        self._ensure_owner()
        norm = [as_item(x, f"items[{i}]") for i, x in enumerate(items)]
        job = Job(norm)
        leaders: dict[bytes, int] = {}
        vleaders: dict[bytes, int] = {}
        hits = vhits = inline = too_large = 0
        for i, item in enumerate(norm):
            pred, gold, mode = item
            if len(pred) > self.max_prediction_chars or len(gold) > self.max_gold_chars:
                job.results[i] = status_result("too_large")
                too_large += 1
                continue
            key = cache_key(item)
            lead = leaders.get(key)
            if lead is not None:
                job.dups.setdefault(lead, []).append(i)
                hits += 1
                continue
            cached = self.cache.get(key)
            if cached is not None and not (explain and cached.rule is None):
                job.results[i] = cached
                hits += 1
                continue
            shard = zlib.crc32(gold.encode("utf-8", "surrogatepass")) % self.size
            if self.verdict_cache and (vk := verdict_key(item)) is not None:
                v = self.verdicts.get(vk.digest)
                if v is not None and not (explain and v.rule is None):
                    job.results[i] = v
                    self.cache.put(key, v)  # the same item again skips the extraction too
                    vhits += 1
                    continue
                vl = vleaders.get(vk.digest)
                if vl is not None:  # same gold and final answer as an item sent above: its verdict
                    job.vdups.setdefault(vl, []).append(i)
                    job.keys[i], job.shard[i] = key, shard
                    vhits += 1
                    continue
                if self.inline_verdicts and not explain and (r := inline_grade(gold, mode, vk)) is not None:
                    job.results[i] = r  # decided here: no worker round trip
                    self.verdicts.put(vk.digest, untimed(r))
                    self.cache.put(key, untimed(r))
                    inline += 1
                    continue
                vleaders[vk.digest] = i
                job.vkeys[i] = vk
            leaders[key] = i
            job.keys[i], job.shard[i] = key, shard
            if self.timed_out.get(key) is not None:
                job.deadlines[i] = self.deadline_s * self.retry_deadline_factor
        new_s = sum(self._est_item_s(norm[i][2]) for i in leaders.values()) / self.size
        with self._lock:
            self.stats["items"] += len(norm)
            self.stats["cache_hits"] += hits + vhits + inline
            self.stats["verdict_hits"] += vhits
            self.stats["inline_verdicts"] += inline
            self.stats["cache_misses"] += len(leaders)
            self.stats["too_large"] += too_large
            if self._closing:
                raise PoolClosed("the grader pool is closed")
            if self._broken:
                raise PoolBroken(self._broken, max(1.0, self._restart_at - time.monotonic()))
            if not leaders:
                job.future.set_result(job.results)  # type: ignore[arg-type]
                return job.future
            if self._pending_items + len(leaders) > self.max_pending_items:
                self.stats["rejected"] += 1
                raise PoolBusy(
                    f"{self._pending_items} items already queued (max_pending_items={self.max_pending_items}); "
                    "retry later",
                    5.0,
                )
            queued_s = self._queued_seconds()
            if queued_s > 0 and queued_s + new_s > self.max_queue_s:
                wait = max(1.0, queued_s + new_s - self.max_queue_s)
                self.stats["rejected"] += 1
                raise PoolBusy(
                    f"about {queued_s:.0f} s of grading already queued and this request adds {new_s:.1f} s; "
                    f"the bound is max_queue_s={self.max_queue_s:g}; retry in {wait:.0f} s",
                    wait,
                )
            job.remaining = len(leaders)
            job.spread = max(1, math.ceil(len(leaders) / self.size))
            job.queue = [collections.deque() for _ in range(self.size)]
            costly = [i for i in leaders.values() if looks_costly(norm[i][0])]
            job.single.update(costly)
            for i in [*(i for i in leaders.values() if i not in job.single), *costly]:
                job.queue[job.shard[i]].append(i)
                self._pending_by_mode[norm[i][2]] += 1
            if budget_s is not None:
                job.expires = time.monotonic() + budget_s
            elif default_budget_s is not None:
                job.default_expires = time.monotonic() + default_budget_s
            self._outstanding.add(job)
            self._active[job] = None
            self._pending_items += len(leaders)
        job.future.add_done_callback(lambda f, j=weakref.ref(job): self._on_future_done(f, j))
        self._dispatch()
        return job.future

    def grade_many(self, items: Iterable[VerifyItem | dict[str, Any] | Sequence[str]]) -> list[GradeResult]:
        """Grade items (blocking); one result per item, in order."""
        return self.submit(items).result()

    async def agrade_many(
        self, items: Iterable[VerifyItem | dict[str, Any] | Sequence[str]], *, budget_s: float | None = None
    ) -> list[GradeResult]:
        """Grade items without blocking the event loop; cancelling the awaiting task cancels the job."""
        return await asyncio.wrap_future(self.submit(items, budget_s=budget_s))

    def grade(self, prediction: str, gold: str, mode: str = "math") -> GradeResult:
        return self.grade_many([(prediction, gold, mode)])[0]

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every worker has started once (True) or the timeout passes (False)."""
        self._ensure_owner()
        return self._ready_event.wait(timeout)

    def worker_pids(self) -> list[int]:
        gen = self._current()
        return gen.live_ready() if gen is not None else []

    def ready_workers(self) -> int:
        return len(self.worker_pids())

    @property
    def broken(self) -> str | None:
        return self._broken

    def restart_in_s(self) -> float | None:
        """Seconds until a broken pool tries to start its workers again (None when not broken)."""
        return max(0.0, self._restart_at - time.monotonic()) if self._broken else None

    @property
    def closed(self) -> bool:
        return self._closing

    def pending_items(self) -> int:
        return self._pending_items

    def queued_seconds(self) -> float:
        """Estimated seconds of grading pending (queued or in flight), spread over the workers."""
        with self._lock:
            return self._queued_seconds()

    def item_seconds(self) -> dict[str, float]:
        """Recent per-item grading time by mode (running mean), as used for admission."""
        return dict(self._item_s)

    def cache_len(self) -> int:
        return len(self.cache) + len(self.verdicts)

    def cache_bytes(self) -> int:
        return self.cache.bytes + self.verdicts.bytes

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop taking work, let queued and in-flight items finish (up to ``timeout``), stop workers."""
        if self._owner_pid != os.getpid():  # a forked child's copy that never graded: nothing of ours runs
            self._closing = self._stop = True
            return
        with self._lock:
            if self._closing and self._stop:
                return
            self._closing = True
            end = None if timeout is None else time.monotonic() + timeout
            while self._outstanding and not self._broken:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._idle.wait(0.5 if left is None else min(left, 0.5))
            self._stop = True
        self._wake()
        self._thread.join(timeout=10.0)

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the real API
        with contextlib.suppress(Exception):
            if not self._stop and self._owner_pid == os.getpid():
                self._stop = True
                self._wake()

    # ----------------------------------------------------------------- bookkeeping

    def _est_item_s(self, mode: str) -> float:
        return self._item_s.get(mode, INITIAL_ITEM_S)

    def _queued_seconds(self) -> float:
        return sum(n * self._est_item_s(m) for m, n in self._pending_by_mode.items() if n) / self.size

    def _observe(self, mode: str, seconds: float, *, timed_out: bool = False) -> None:
        """Admission counts every item's cost (arithmetic mean, timeouts at their deadline); task
        sizing uses the typical item (geometric mean of the items that finished): grading times are
        heavy-tailed, and one slow item in a hundred must not cut every task to a few items."""
        old = self._item_s.get(mode)
        self._item_s[mode] = seconds if old is None else old + EWMA_ALPHA * (seconds - old)
        if not timed_out:
            x = math.log(max(seconds, 1e-6))
            old = self._typical_log_s.get(mode)
            self._typical_log_s[mode] = x if old is None else old + EWMA_ALPHA * (x - old)

    def _typical_s(self, mode: str) -> float:
        x = self._typical_log_s.get(mode)
        return INITIAL_ITEM_S if x is None else math.exp(x)

    def _on_future_done(self, fut: concurrent.futures.Future, ref: Any) -> None:
        """The caller cancelled (the HTTP client went away): drop what is still queued."""
        job = ref()
        if job is not None and fut.cancelled():
            self._drop_queued(job, cancelled=True)

    def _finish_job_locked(self, job: Job, n: int) -> None:
        """``n`` of a job's items will never complete here (dropped); under the lock."""
        self._pending_items -= n
        job.remaining -= n
        if job.remaining <= 0:
            self._outstanding.discard(job)
            if not self._outstanding:
                self._idle.notify_all()

    def _drop_queued(self, job: Job, *, cancelled: bool) -> None:
        """Remove a job's queued items: cancelled -> forgotten; budget spent -> answered 'timeout'."""
        with self._lock:
            idx = job.clear_queue()
            self._active.pop(job, None)
            if cancelled:
                job.cancelled = True
                for i in idx:
                    self._pending_by_mode[job.items[i][2]] -= 1
                self._finish_job_locked(job, len(idx))
                self.stats["cancelled_items"] += len(idx)
                return
            self.stats["expired_items"] += len(idx)
        for i in idx:
            self._complete(job, i, GradeResult(False, 0.0, "timeout", None, 0.0), count=False)

    def _requeue(self, job: Job, idx: list[int], *, single: bool = False) -> None:
        """Items back from a lost worker: the head of their own job's queue, not of everyone's.

        ``single``: they go one per task, so that if the lost task held several hostile items they
        now overrun in parallel, not one deadline after another."""
        if not idx:
            return
        with self._lock:  # the cancelled flag is set under this lock too
            if single:
                job.single.update(idx)
            if job.cancelled:
                for i in idx:
                    self._pending_by_mode[job.items[i][2]] -= 1
                self._finish_job_locked(job, len(idx))
                return
            for i in reversed(idx):
                job.queue[job.shard[i]].appendleft(i)
            self._active.setdefault(job, None)

    def _complete(self, job: Job, leader: int, r: GradeResult, *, count: bool = True) -> None:
        job.results[leader] = r
        for d in job.dups.get(leader, ()):
            job.results[d] = r
        key = job.keys.get(leader)
        vk = job.vkeys.get(leader)
        same_answer = vk is not None and r.status == "ok" and r.extracted == vk.extracted
        if r.status in ("ok", "no_answer"):  # never 'timeout' (a retry may succeed) nor 'error'
            if key is not None:
                self.cache.put(key, untimed(r))
            if same_answer:
                self.verdicts.put(vk.digest, untimed(r))
        elif r.status == "timeout" and count:
            if key is not None:
                self.timed_out.put(key, r)
            if job.expires is None and job.default_expires is not None:
                job.expires = job.default_expires  # this request holds items the grader cannot finish
        if r.status in ("timeout", "error") and count:
            self.stats[r.status + "s"] += 1
        followers = job.vdups.pop(leader, None)
        if followers and same_answer:
            for f in followers:
                job.results[f] = untimed(r)
                self.cache.put(job.keys[f], untimed(r))
        elif followers:  # the leader's verdict does not carry over (timeout, error, other answer): grade each
            with self._lock:
                job.remaining += len(followers)
                self._pending_items += len(followers)
                for f in followers:
                    self._pending_by_mode[job.items[f][2]] += 1
            self._requeue(job, followers)
        with self._lock:
            self._pending_by_mode[job.items[leader][2]] -= 1
            self._finish_job_locked(job, 1)
            done = job.remaining == 0
        if done and not job.future.done():
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                job.future.set_result(job.results)  # type: ignore[arg-type]

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    # ----------------------------------------------------------------- scheduling

    def _pick(self, slot: int) -> Job | None:
        """The open job that has received the least worker time (ties: the oldest); expired jobs left
        for the watchdog to drain. A job with no items of this slot's gold shard counts one task
        target more (the worker would steal, with cold caches): fairness holds to within one short task."""
        best: Job | None = None
        best_key = 0.0
        now = time.monotonic()
        for job in self._active:
            if job.expires is not None and now > job.expires:
                continue
            key = job.served + (0.0 if job.queue[slot % self.size] else TASK_TARGET_S)
            if best is None or key < best_key:
                best, best_key = job, key
        return best

    def _take(self, job: Job, slot: int) -> tuple[list[int], float]:
        """Up to batch_size items of the job (its shard of this slot first, else the fullest shard),
        fewer when they would hold the worker too long."""
        d = job.queue[slot % self.size] or max(job.queue, key=len)
        first = d[0]
        mode = job.items[first][2]
        deadline = job.deadlines.get(first, self.deadline_s)
        n = min(self.batch_size, max(1, int(TASK_TARGET_S / max(self._typical_s(mode), 1e-6))), job.spread)
        if first in job.single:
            n = 1
        idx = [d.popleft()]
        while (
            d
            and len(idx) < n
            and d[0] not in job.single
            and job.deadlines.get(d[0], self.deadline_s) == deadline
        ):
            idx.append(d.popleft())
        if not any(job.queue):
            self._active.pop(job, None)
        job.served += len(idx) * self._est_item_s(mode)
        if job.expires is not None:  # nothing runs past the request's budget
            deadline = min(deadline, max(0.05, job.expires - time.monotonic()))
        return idx, deadline

    def _dispatch(self) -> None:
        """Send tasks while a worker is free (called on submit, on each finished task, by the watchdog)."""
        while True:
            with self._lock:
                gen = self._current()
                if gen is None or self._broken or self._stop or not self._free_slots or not self._active:
                    return
                slot = self._free_slots[-1]
                job = self._pick(slot)
                if job is None:
                    return
                self._free_slots.pop()
                idx, deadline = self._take(job, slot)
                self._seq += 1
                task = Task(job, idx, deadline, slot, self._seq, gen)
                self._running[slot] = task
                self._progress[3 * slot] = -1.0  # not started: the watchdog waits for the worker's mark
            items = [job.items[i] for i in idx]
            try:
                # pebble's own timeout is the backstop (a worker that hangs before its first mark)
                task.future = gen.pool.schedule(
                    grade_task, (slot, task.seq, items), timeout=deadline * len(idx) + self.startup_timeout_s
                )
            except Exception as err:  # the pebble pool stopped working: the watchdog replaces it (not active)
                log.warning("grader pool: could not send a task (%r)", err)
                self._release(task)
                self._requeue(job, idx)
                self._wake()
                return
            task.future.add_done_callback(lambda f, t=task: self._on_task_done(t, f))

    def _release(self, task: Task) -> None:
        with self._lock:
            if self._running.get(task.slot) is task:
                del self._running[task.slot]
                self._free_slots.append(task.slot)

    def _on_task_done(self, task: Task, fut: Any) -> None:
        """A task's future resolved (pebble's thread, or the watchdog's when it cancelled it)."""
        try:
            if fut.cancelled():
                self._lost(task, task.killed or "cancelled")
            elif (err := fut.exception()) is not None:
                if isinstance(err, TimeoutError):
                    self._lost(task, "timeout")
                elif isinstance(err, pebble.ProcessExpired):
                    self._lost(task, "crash")
                else:  # the pebble pool broke (BrokenProcessPool): nobody's item to blame
                    log.warning("grader pool: task failed with %r", err)
                    self._release(task)
                    self._requeue(task.job, task.idx)
                    self._wake()
            else:
                pid, rss, results = fut.result()
                self._release(task)
                self._delivered(task, pid, rss, results)
        except Exception:  # pragma: no cover - a bug here must not hang every caller
            log.exception("grader pool: handling a finished task failed")
        self._dispatch()

    def _delivered(self, task: Task, pid: int, rss: float, results: list[tuple]) -> None:
        for i, t in zip(task.idx, results, strict=True):
            r = GradeResult(*t)
            self._observe(task.job.items[i][2], r.ms / 1000.0)
            self._complete(task.job, i, r)
        gen = task.gen
        gen.tasks_by_pid[pid] += 1
        if self.max_tasks and gen.tasks_by_pid[pid] == self.max_tasks:
            self.stats["recycled_items"] += 1  # pebble retires it now
        if self.worker_max_rss_mb and rss > self.worker_max_rss_mb and gen is self._current():
            log.info(
                "grader worker %s: %.0f MiB resident > %d; replacing the workers",
                pid,
                rss,
                self.worker_max_rss_mb,
            )
            self.stats["recycled_rss"] += 1
            self._new_generation()

    def _lost(self, task: Task, reason: str) -> None:
        """A task's worker is gone (killed for overrunning, or died): answer or re-queue its items."""
        base = 3 * task.slot
        started = self._progress[base] == task.seq
        i = min(int(self._progress[base + 2]), len(task.idx) - 1) if started else 0
        self._release(task)
        job = task.job
        leader = task.idx[i]
        rest = task.idx[:i] + task.idx[i + 1 :]  # finished before it (results lost) or not started
        if reason == "cancelled":  # the pool is closing
            rest = task.idx
        elif reason == "timeout":
            self._observe(job.items[leader][2], task.deadline_s, timed_out=True)
            self._complete(job, leader, timeout_result(task.deadline_s))
        else:
            job.crashes[leader] = job.crashes.get(leader, 0) + 1
            if job.crashes[leader] > self.crash_retries:
                self._complete(job, leader, status_result("error"))
            else:
                rest = task.idx[:i] + task.idx[i:]
        self._requeue(job, rest, single=True)
        self.stats[f"restarts_{reason}"] += 1
        log.warning("grader worker lost (%s); pebble replaces it", reason)

    # ----------------------------------------------------------------- watchdog thread

    def _watch(self) -> None:
        """Deadlines of running items, worker start-up, restarts after failures, spent budgets."""
        try:
            while not self._stop:
                ready = mp_wait([self._ready_r, self._wake_r], self._tick())
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError, OSError):
                        while self._wake_r.recv(4096):
                            pass
                while self._ready_r.poll():
                    self._on_ready(self._ready_r.recv())
                self._check_deadlines()
                self._check_workers()
                self._expire_budgets()
                self._dispatch()
        except BaseException:  # pragma: no cover - a bug here must not hang every caller
            log.exception("grader pool watchdog crashed")
            self._broken = "the grader pool watchdog crashed; see the server log"
            self._restart_at = math.inf
        finally:
            self._shutdown()

    def _tick(self) -> float:
        if self._running or any(j.expires is not None for j in self._active):
            return WATCH_TICK_S
        if self._broken and math.isfinite(self._restart_at):
            return max(0.001, min(1.0, self._restart_at - time.monotonic()))
        return 0.25

    def _on_ready(self, pid: int) -> None:
        gen = self._current()
        if gen is None:
            return
        gen.ready.add(pid)  # (a worker may report before its Process object knows its pid)
        self._unready_since = None
        self._start_failures = 0
        self._backoff_s = 1.0
        if self._broken and self._restart_at == math.inf:
            log.warning("grader pool: workers start again; the pool is back")
            self._broken = None
        if len(gen.live_ready()) >= self.size:
            self._ready_event.set()

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for task in list(self._running.values()):
            base = 3 * task.slot
            if self._progress[base] != task.seq or task.killed or task.future is None:
                continue
            start = self._progress[base + 1]
            if now - start > task.deadline_s and self._progress[base] == task.seq:
                task.killed = "timeout"
                task.future.cancel()  # pebble stops the worker and starts another

    def _check_workers(self) -> None:
        """Workers that died before they were ready count as start failures; too many break the pool."""
        gen = self._current()
        if gen is not None:
            for p in list(gen.ctx.procs):
                if p.pid is None or p.is_alive():  # (not started yet, or running)
                    continue
                gen.ctx.procs.remove(p)
                gen.tasks_by_pid.pop(p.pid, None)
                if p.exitcode not in (0, None) and p.pid not in gen.ready:
                    self._start_failures += 1
                    self.stats["start_errors"] += 1
                gen.ready.discard(p.pid)
            # time without any ready worker: since the generation started, or since its last ready
            # worker was killed or retired (replacements must report ready within the same timeout)
            if gen.ready:
                self._unready_since = None
            elif self._unready_since is None:
                self._unready_since = time.monotonic()
            starting_too_long = (
                not gen.ready and time.monotonic() - self._unready_since > self.startup_timeout_s
            )
            if self._start_failures > self.max_start_failures or starting_too_long:
                self._break_for_a_while()
            elif not gen.pool.active:  # pebble gave up on this pool (a worker died between tasks)
                self.stats["restarts_crash"] += 1
                self._new_generation()
        elif self._broken and time.monotonic() >= self._restart_at:
            log.warning("grader pool: trying to start workers again (backoff %.0f s)", self._backoff_s)
            self.stats["pool_restarts"] += 1
            self._start_failures = self.max_start_failures  # one more failure breaks it again, longer
            self._restart_at = math.inf  # until a worker reports ready or fails again
            self._new_generation()

    def _break_for_a_while(self) -> None:
        """Workers keep dying while starting: fail what is queued, try again after a backoff."""
        if self._start_failures:
            what = f"grader workers keep dying while starting ({self._start_failures} times in a row)"
        else:
            what = f"no grader worker became ready within {self.startup_timeout_s:.0f} s"
        why = (
            f"{what}; check the server log (import error? worker_memory_mb too low? a script that calls "
            "stapo must guard its body with `if __name__ == '__main__':`, since workers import __main__ "
            f"again); the pool tries again in {self._backoff_s:.0f} s"
        )
        self._restart_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(MAX_RESTART_BACKOFF_S, self._backoff_s * 2)
        for gen in self._gens:
            self._retire(gen, kill=True)
        self._fail_all(why, PoolBroken(why, self._backoff_s))
        self._broken = why

    def _expire_budgets(self) -> None:
        now = time.monotonic()
        for job in [j for j in list(self._active) if j.expires is not None and now > j.expires]:
            self._drop_queued(job, cancelled=False)

    def _fail_all(self, why: str, err: Exception) -> None:
        """Fail every outstanding job; items still in flight finish on their workers, unread."""
        with self._lock:
            jobs = list(self._outstanding)
            self._outstanding.clear()
            self._active.clear()
            for job in jobs:
                idx = job.clear_queue()
                for i in idx:
                    self._pending_by_mode[job.items[i][2]] -= 1
                self._finish_job_locked(job, len(idx))
                job.cancelled = True
            self._idle.notify_all()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(err)

    def _shutdown(self) -> None:
        """Watchdog exit: fail what is left, stop the workers (pebble: SIGTERM, then SIGKILL)."""
        self._closing = True
        self._fail_all("closed", PoolClosed("the grader pool closed before these items were graded"))
        stop_generations(self._gens)
        for conn in (self._ready_r, self._ready_w, self._wake_r, self._wake_w):
            with contextlib.suppress(Exception):
                conn.close()
