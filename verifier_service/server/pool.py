"""Warm grading processes with a hard wall-clock deadline on every item, shared fairly.

math-verify's own timeouts (``signal.alarm``) work only on a main thread and cannot interrupt C
code (a GMP factorial) or ``str()`` of a power tower: the only deadline that always holds is
enforced from outside, by killing the worker. Each item is one task of pebble's ``ProcessPool``
with ``timeout=`` its deadline: pebble starts the workers, kills and replaces one whose task
overruns, reports one that died under its task (``ProcessExpired``) and retires one after
``max_tasks`` tasks. stapo's own, in three parts: what is known already (``cache.py``: caches,
inline verdicts), what runs next (``scheduler.py``, no processes: fair queueing across requests,
pebble getting at most one task per worker, admission (``PoolBusy``), request budgets, deadlines),
and this module, the supervisor of the processes, for what pebble 5 does not do (docs/verifier.md): replacing the pebble pool when it gave up (a worker died
while no task ran) or a worker's memory grew, backing off after start-up failures
(:class:`PoolBroken`), and fork safety.

A script that builds a pool needs ``if __name__ == "__main__":``: each worker (``forkserver`` or
``spawn``) imports the caller's script again, as multiprocessing does, under the name ``__mp_main__``.
A pool started from a script's body outside that guard is refused in the caller, in one line, before
any worker starts (:func:`unguarded_start`: whatever the start method, and whichever thread grades
first, nothing re-runs the script's training or model loading). As a second line of defence, a pool
built while a script is re-run that way raises :data:`GUARD_MESSAGE` at once, so the worker dies and
the parent's pool reports it (:class:`PoolBroken`) instead of waiting for workers that never start::

    from stapo.verifier_service.server.pool import GraderPool
    with GraderPool(workers=2, deadline_s=5.0) as pool:
        results = pool.grade_many([{"prediction": "so \\boxed{4}", "gold": "4"}])
        # async code: results = await pool.agrade_many(items)
"""

from __future__ import annotations

import ast
import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import inspect
import itertools
import logging
import math
import multiprocessing as mp
import multiprocessing.util
import operator
import os
import resource
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import pebble

from stapo.verifier_service.grader import Verdict
from stapo.verifier_service.server.cache import Memo
from stapo.verifier_service.server.scheduler import Job, RetryLater, Scheduler
from stapo.verifier_service.server.schemas import VerifyItem, as_item
from stapo.verifier_service.server.settings import PoolSettings

log = logging.getLogger("stapo.verifier_service.server.pool")

MAX_RESTART_BACKOFF_S = 60.0


TICK_S = 0.05
"""How often request budgets and workers are looked at while work is pending."""
FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(Verdict)))
"""A result travels from a worker as a plain tuple of its fields (cheaper to pickle than the object)."""


class PoolClosed(RuntimeError):
    """The pool was closed; it grades nothing more."""


class PoolBroken(RetryLater):
    """Workers die while starting, again and again (an import error, a memory limit set too low);
    the pool tries again in ``retry_after_s``."""


def status_result(status: str) -> Verdict:
    """A result that carries only a status (too_large, error): never correct, score 0."""
    return Verdict(correct=False, score=0.0, status=status, extracted=None, ms=0.0)


def _start_fork_server() -> None:
    """Start this process's fork server now, with SIGINT ignored while it starts.

    The server imports the warm-up (seconds) before it installs its own guard against Ctrl-C, so a
    Ctrl-C in that window printed a long traceback from inside sympy / ANTLR. An ignored SIGINT is
    inherited by the server (Python keeps an inherited SIG_IGN) and by the workers it forks; the
    pool, not the terminal, ends them. Off the main thread the server starts on first use, as before.
    """
    import multiprocessing.forkserver

    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    except ChildProcessError:
        # A process forked from one whose fork server runs inherits that server's record, and the
        # server is not its child: leave the start to first use, as off the main thread.
        pass
    finally:
        signal.signal(signal.SIGINT, previous)


# --------------------------------------------------------------------------- worker process

TASKS = itertools.count(1)
"""Tasks this worker has run (each worker is a fresh process: it counts from 1)."""


def worker_init(ready: Any, memory_mb: int, warmup: bool) -> None:
    """pebble's initializer, run once in every worker; tells the parent it is ready (its pid)."""
    # pebble stops a worker with SIGTERM and waits 3 s for a Python-level handler; a worker stuck in
    # C code (a GMP power) never runs one. Dying at once is what a killed grader should do.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):  # Linux: die with the parent, leave no graders behind
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if memory_mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
    import stapo.verifier_service.grader  # noqa: F401  (imported before the first task's clock starts)

    if warmup:  # a no-op when the fork server already imported (and so ran) it
        import stapo.verifier_service.server.warmup  # noqa: F401
    with contextlib.suppress(OSError):  # the pool closed while this worker started: nothing to tell
        ready.send(os.getpid())


def grade_item(pred: str, gold: str, mode: str, max_chars: int) -> tuple[int, int, float, tuple]:
    """One pebble task: (pid, tasks this worker ran, its peak resident MiB, the result's fields)."""
    from stapo.verifier_service.grader import grade

    t0 = time.perf_counter()
    try:
        r = grade(pred, gold, mode, max_chars=max_chars)
    except BaseException as err:  # math-verify's TimeoutException is a BaseException; never requeued
        log.debug("grade raised %r", err)
        r = Verdict(False, 0.0, "error", None, (time.perf_counter() - t0) * 1000.0)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return os.getpid(), next(TASKS), rss_mb, FIELDS(r)


# --------------------------------------------------------------------------- parent side


class RecordingContext:
    """A multiprocessing context that remembers the worker processes pebble starts through it.

    pebble accepts any multiprocessing context; this one lets the pool see its own workers (PIDs,
    exit codes, sentinels) without reading pebble's internals."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.procs: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ctx, name)

    def Process(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - the context API's name
        p = self.ctx.Process(*args, **kwargs)
        self.procs.append(p)
        return p


_POOLS: weakref.WeakSet[GraderPool] = weakref.WeakSet()
_REBUILD_LOCK = threading.Lock()


GUARD_MESSAGE = (
    "a grading worker is running your script again (multiprocessing imports the main script in each "
    "worker, as __mp_main__): guard the script's body with `if __name__ == '__main__':`"
)


def rerunning_main() -> bool:
    """Is this process re-running the caller's script in a new worker? multiprocessing runs it as
    the module ``__mp_main__`` while ``__main__`` is still the worker's own; in the parent (and in
    a worker once that is done) ``sys.modules['__mp_main__']`` is ``sys.modules['__main__']``."""
    mp_main = sys.modules.get("__mp_main__")
    return mp_main is not None and mp_main is not sys.modules.get("__main__")


def unguarded_start() -> str | None:
    """``"script.py:LINE"`` when this pool is being started from the caller's script body outside
    ``if __name__ == "__main__":`` (None: guarded, or no script file: ``-c``, a notebook, a REPL).

    The frame running the script's top level (``<module>`` with ``__main__``'s globals) is on the
    stack at the line that led here; the script's syntax tree says whether that line is inside a
    main guard. Workers of either start method import that script again: an unguarded line would
    run again in each of them (a model load, a training loop). A framework may grade on a worker
    thread (OpenRLHF's ``asyncio.to_thread``, a ``ThreadPoolExecutor``), whose own stack never holds
    that frame: the script's top level then runs on the main thread, waiting at the line that
    started the threads, so the main thread's stack is read too.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str) or not os.path.isfile(path):
        return None
    line = _script_line(inspect.currentframe(), vars(main))
    if line is None and threading.current_thread() is not threading.main_thread():
        line = _script_line(sys._current_frames().get(threading.main_thread().ident), vars(main))
    if line is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    guarded = any(isinstance(node, ast.If) and _is_main_test(node.test) and node.body
                  and node.body[0].lineno <= line <= (node.body[-1].end_lineno or line) for node in ast.walk(tree))
    return None if guarded else f"{path}:{line}"


def _script_line(frame: Any, main_globals: dict) -> int | None:
    """The line the script's top level is at on the stack that ends in ``frame`` (None: not on it)."""
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is main_globals):
        frame = frame.f_back
    return None if frame is None else frame.f_lineno


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


UNGUARDED_MESSAGE = (
    "the grader pool is started from {where}, outside `if __name__ == '__main__':`; its worker processes import "
    "the main script again and would run that code once more each: put the script's body under the guard, or "
    "grade through the service (STAPO_VERIFIER_URL)"
)


def _after_fork_in_child() -> None:
    for pool in list(_POOLS):
        with contextlib.suppress(Exception):
            pool._forget_parent()


def _stop_at_exit(ref: Any = None) -> None:
    """Stop the workers of one pool (``ref``: a weak reference) or of every pool of this process;
    their watchdogs start no new ones."""
    for pool in [ref()] if ref is not None else list(_POOLS):
        if pool is not None and pool._owner_pid == os.getpid():
            pool._closing = pool._stop = True
            pool._replace_pebble(start=False)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_stop_at_exit)  # runs before pebble's exit handler (registered earlier)


class GraderPool:
    """Warm grading processes with a hard per-item deadline; see the module docstring.

    Thread-safe: ``submit``/``grade_many``/``agrade_many`` may be called from any thread or event
    loop at the same time. Results come back in input order, one per item, never an exception for
    a bad item: a failure is a status (timeout, error, too_large).
    """

    def __init__(self, settings: PoolSettings | None = None, /, **overrides: Any) -> None:
        """``settings`` (a :class:`PoolSettings`, or the service's :class:`Settings`, which is one),
        with any of its fields given by name on top: ``GraderPool(workers=2, deadline_s=2.0)`` is
        ``GraderPool(PoolSettings(workers=2, deadline_s=2.0))``. A bad value raises ValueError naming the
        field before anything starts."""
        if rerunning_main():
            raise RuntimeError(GUARD_MESSAGE)
        if (where := unguarded_start()) is not None:
            raise RuntimeError(UNGUARDED_MESSAGE.format(where=where))
        given = {name: getattr(settings, name) for name in PoolSettings.model_fields} if settings is not None else {}
        self.settings = s = PoolSettings(**{**given, **overrides})
        self.size, self.deadline_s, self.start_method = s.workers, s.deadline_s, s.start_method
        self.max_prediction_chars, self.max_gold_chars = s.max_prediction_chars, s.max_gold_chars
        self.max_pending_items, self.max_queue_s = s.max_pending_items, s.max_queue_s
        self.retry_deadline_factor = s.retry_deadline_factor
        self.startup_timeout_s, self.crash_retries = s.startup_timeout_s, s.crash_retries
        self.max_start_failures, self.worker_max_rss_mb = s.max_start_failures, s.worker_max_rss_mb
        # pebble retires a worker after max_tasks tasks (one item each)
        self.max_tasks = s.worker_max_items
        self.worker_args = (s.worker_memory_mb, s.warmup)  # pebble's initializer arguments after the ready pipe
        self.max_chars = max(s.max_prediction_chars, s.max_gold_chars)  # the pool checks the limits itself
        self.memo = Memo(int(s.cache_max_mb * 2**20), s.cache_size, verdicts=s.verdict_cache, inline=s.inline_verdicts)
        self.stats: collections.Counter[str] = collections.Counter()
        self._start()
        _POOLS.add(self)

    def _start(self) -> None:
        """Everything that belongs to one process: state, locks, pipes, workers, the watchdog."""
        self._owner_pid = os.getpid()
        self._ctx = RecordingContext(mp.get_context(self.start_method))  # every worker this process starts
        if self.start_method == "forkserver":
            # Only has an effect before this process's fork server starts. The warm-up module
            # imports math-verify + sympy and grades a few items once, in the fork server, so
            # every worker (and every replacement) is born warm: ~20 ms instead of ~0.5 s.
            warm = ["stapo.verifier_service.server.warmup"] if self.worker_args[1] else []
            self._ctx.set_forkserver_preload(["stapo.verifier_service.server.pool", *warm])
            _start_fork_server()
        self.sched = Scheduler(
            self.size,
            self.deadline_s,
            max_pending_items=self.max_pending_items,
            max_queue_s=self.max_queue_s,
            retry_deadline_factor=self.retry_deadline_factor,
            stats=self.stats,
        )
        self._lock = self.sched.lock  # guards the scheduler's queues and ``_running`` together
        self._running: dict[Any, tuple[Job, int, float, bool]] = {}  # pebble future -> item, deadline, sliced
        self._closing = self._stop = self._recycle = False
        self._broken: str | None = None
        self._restart_at = 0.0
        self._backoff_s = 1.0
        self._start_failures = 0
        self._ready: set[int] = set()  # PIDs of workers that finished worker_init
        self._ready_event = threading.Event()
        self._ready_r, self._ready_w = self._ctx.Pipe(duplex=False)  # workers' PIDs; 0 wakes the watchdog
        self._pebble: pebble.ProcessPool | None = None
        # multiprocessing's exit handler runs this before it joins every child (a forked child may
        # call that handler directly, without the interpreter's atexit)
        multiprocessing.util.Finalize(self, _stop_at_exit, args=(weakref.ref(self),), exitpriority=10)
        self._replace_pebble()
        self._thread = threading.Thread(target=self._watch, name="stapo-grader-pool", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- workers (pebble)

    def _replace_pebble(self, *, start: bool = True) -> None:
        """Stop the pebble pool (its running items go back to the head of their jobs' queues, no
        fault of theirs) and, ``start``, start a fresh one. Called by the watchdog thread only."""
        with self._lock:
            old, self._pebble, self._recycle = self._pebble, None, False
            lost = list(self._running.values())
            self._running.clear()
        if old is not None:
            old.stop()
            with contextlib.suppress(Exception):
                old.join(timeout=5.0)  # pebble stops the workers (they die at once) and settles the futures
        for job, i, *_ in lost:
            self.sched.requeue(job, [i])
        self._unready_since = time.monotonic()
        if start:
            pool = pebble.ProcessPool(
                self.size, self.max_tasks, worker_init, (self._ready_w, *self.worker_args), context=self._ctx
            )
            self._pebble_active(pool)  # pebble starts its workers on first use: start them now
            self._pebble = pool

    @staticmethod
    def _pebble_active(pool: pebble.ProcessPool | None) -> bool:
        """Whether pebble runs ``pool`` (False once it gave up, or when starting its workers failed)."""
        try:
            return pool is not None and pool.active
        except Exception:  # the fork server is gone, no fds left, ...
            return False

    # ----------------------------------------------------------------- fork safety

    def _forget_parent(self) -> None:
        """In an ``os.fork()`` child: the workers, pipes and threads are the parent's; let go of them.

        pebble's and multiprocessing's exit handlers stop and join every worker they know of, the
        parent's included; each worker's (public) sentinel is pointed at a closed pipe, so the
        child sees them as ended. Nothing is sent to the parent's workers."""
        self._lock = self.sched.lock = threading.Lock()
        self.memo.reset_locks()
        self._pebble = None
        for p in self._ctx.procs:
            with contextlib.suppress(Exception):
                r, w = os.pipe()
                os.close(w)
                os.dup2(r, p.sentinel)
                os.close(r)

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
    ) -> concurrent.futures.Future:
        """Queue items; the future resolves to ``list[Verdict]`` in input order.

        ``budget_s``: items not graded this many seconds from now answer 'timeout' (the caller will
        have given up); nothing of the request runs past it. Without it, ``default_budget_s`` from
        now applies once the request shows an item that can take a whole deadline (a shape
        ``looks_costly`` knows, a timeout; not an item that outran its first slice, which a loaded
        machine can make of an ordinary one): a request of items
        the grader cannot finish answers in bounded time, and a large batch of ordinary items is
        never cut.
        Every result names the rule that decided it (``Verdict.rule``), cached ones too.
        Cancelling the future drops the queued items.
        Raises :class:`PoolBusy` (too much queued work), :class:`PoolBroken`, :class:`PoolClosed`.
        """
        self._ensure_owner()
        items = [as_item(x, f"items[{i}]") for i, x in enumerate(items)]
        plan = self.memo.plan(items, max_chars=(self.max_prediction_chars, self.max_gold_chars))
        job = Job(items, plan)
        if budget_s is not None:
            job.expires = time.monotonic() + budget_s
        elif default_budget_s is not None:
            job.default_expires = time.monotonic() + default_budget_s
            if job.costly:  # a shape that can take a whole deadline: the budget holds from the start
                job.expires = job.default_expires
        c = plan.counts
        with self._lock:
            self.stats.update(c, items=len(items), cache_misses=len(plan.leaders))
            self.stats["cache_hits"] += c["verdict_hits"] + c["inline_verdicts"]
            if self._closing:
                raise PoolClosed("the grader pool is closed")
            if self._broken:
                raise PoolBroken(self._broken, max(1.0, self._restart_at - time.monotonic()))
            if not plan.leaders:
                job.future.set_result(plan.results)  # type: ignore[arg-type]
                return job.future
            self.sched.admit_locked(job)  # or PoolBusy
        job.future.add_done_callback(lambda f, j=weakref.ref(job): self._on_future_done(f, j))
        if budget_s is not None:
            self._wake()  # the watchdog's tick shortens while a budget runs
        self._dispatch()
        return job.future

    def grade_many(self, items: Iterable[VerifyItem | dict[str, Any] | Sequence[str]]) -> list[Verdict]:
        """Grade items (blocking); one result per item, in order."""
        return self.submit(items).result()

    async def agrade_many(
        self, items: Iterable[VerifyItem | dict[str, Any] | Sequence[str]], *, budget_s: float | None = None
    ) -> list[Verdict]:
        """Grade items without blocking the event loop; cancelling the awaiting task cancels the job."""
        return await asyncio.wrap_future(self.submit(items, budget_s=budget_s))

    def grade(self, prediction: str, gold: str, mode: str = "math") -> Verdict:
        return self.grade_many([(prediction, gold, mode)])[0]

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every worker has started once (True) or the timeout passes (False)."""
        self._ensure_owner()
        return self._ready_event.wait(timeout)

    def worker_pids(self) -> list[int]:
        """Workers that finished ``worker_init`` and are alive."""
        return sorted(p.pid for p in list(self._ctx.procs) if p.pid in self._ready and p.is_alive())

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
        return self.sched.pending_items

    def queued_seconds(self) -> float:
        """Estimated seconds of grading pending (queued or in flight), spread over the workers."""
        with self._lock:
            return self.sched.queued_seconds_locked()

    def cache_len(self) -> int:
        return len(self.memo)

    def cache_bytes(self) -> int:
        return self.memo.bytes

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop taking work, let queued and in-flight items finish (up to ``timeout``), stop workers."""
        if self._owner_pid != os.getpid():  # a forked child's copy that never graded: nothing of ours runs
            self._closing = self._stop = True
            return
        with self._lock:
            if self._stop:
                return
            self._closing = True
            jobs = [j.future for j in self.sched.outstanding]
        concurrent.futures.wait(jobs, timeout)  # (a broken pool fails them)
        self._stop = True
        self._wake()
        self._thread.join(timeout=10.0)

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- bookkeeping

    def _on_future_done(self, fut: concurrent.futures.Future, ref: Any) -> None:
        """The caller cancelled (the HTTP client went away): drop what is still queued."""
        job = ref()
        if job is not None and fut.cancelled():
            self.sched.drop_queued(job, cancelled=True)

    def _complete(self, job: Job, leader: int, r: Verdict, *, count: bool = True) -> None:
        """A leader's result (``count`` False: a spent budget's ungraded 'timeout', not the item's fault)."""
        followers = self.memo.settle(job.plan, leader, r, remember=count)
        if r.status in ("timeout", "error") and count:
            self.stats[r.status + "s"] += 1
            if r.status == "timeout" and job.expires is None:
                job.expires = job.default_expires  # this request holds items the grader cannot finish
        done = self.sched.settle(job, leader, followers)  # their leader's verdict did not carry over
        if followers:
            self.sched.requeue(job, followers)
        if done and not job.future.done():
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                job.future.set_result(job.plan.results)  # type: ignore[arg-type]

    def _wake(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._ready_w.send(0)

    # ----------------------------------------------------------------- scheduling

    def _dispatch(self) -> None:
        """Hand pebble one item per free worker (on submit, on each finished task, by the watchdog)."""
        while True:
            with self._lock:
                pool = self._pebble
                full = len(self._running) >= self.size
                if pool is None or full or self._broken or self._stop or self._recycle:
                    return
                task = self.sched.take_locked()
                if task is None:
                    return
                job, i, deadline, sliced = task
                try:
                    fut = pool.schedule(grade_item, (*job.items[i], self.max_chars), timeout=deadline)
                except Exception as err:  # the pebble pool stopped working: the watchdog replaces it
                    log.warning("grader pool: could not send a task (%r)", err)
                    self.sched.give_back_locked(job, i)
                    return
                self._running[fut] = (job, i, deadline, sliced)
            fut.add_done_callback(self._on_task_done)

    def _on_task_done(self, fut: Any) -> None:
        """A task's future resolved (in a pebble thread): answer the item, or send it again."""
        with self._lock:
            task = self._running.pop(fut, None)
        if task is None:  # settled already (its pebble pool was replaced)
            return
        job, i, deadline, sliced = task
        try:
            err = concurrent.futures.CancelledError() if fut.cancelled() else fut.exception()
            if fut.cancelled() and job.expires is not None and time.monotonic() >= job.expires:
                # cut by the request's spent budget (_watch): not the item's fault, nothing remembered
                self._complete(job, i, Verdict(False, 0.0, "timeout", None, deadline * 1000.0), count=False)
            elif err is None:
                pid, tasks, rss, fields = fut.result()
                r = Verdict(*fields)
                if i not in job.costly:
                    self.sched.observe(job.items[i][2], r.ms / 1000.0)
                self._complete(job, i, r)
                self.stats["recycled_items"] += tasks == self.max_tasks  # pebble retires the worker now
                if self.worker_max_rss_mb and rss > self.worker_max_rss_mb and not self._recycle:
                    log.info("grader worker %s: %.0f MiB resident > %d; replacing the workers", pid, rss,
                             self.worker_max_rss_mb)  # fmt: skip
                    self.stats["recycled_rss"] += 1
                    self._recycle = True  # the watchdog replaces the pebble pool (no chosen worker retires)
                    self._wake()
            elif isinstance(err, concurrent.futures.TimeoutError) and sliced:  # its first slice ran out
                self.stats["restarts_timeout"] += 1
                self.stats["sliced_items"] += 1
                self.sched.slice_out(job, i, deadline)
            elif isinstance(err, concurrent.futures.TimeoutError):  # pebble killed the worker
                self.stats["restarts_timeout"] += 1
                if i not in job.costly:
                    self.sched.observe(job.items[i][2], deadline)
                self._complete(job, i, Verdict(False, 0.0, "timeout", None, deadline * 1000.0))
            elif isinstance(err, pebble.ProcessExpired):  # the worker died under it (killed, out of memory)
                self.stats["restarts_crash"] += 1
                log.warning("grader worker died (%s); pebble replaces it", err)
                job.crashes[i] += 1
                if job.crashes[i] > self.crash_retries:
                    self._complete(job, i, status_result("error"))
                else:
                    self.sched.requeue(job, [i])
            else:  # the pool is stopping, or pebble's pool broke: nobody's item to blame
                self.sched.requeue(job, [i])
                self._wake()
        except Exception:  # pragma: no cover - a bug here must not hang every caller
            log.exception("grader pool: handling a finished task failed")
        self._dispatch()

    # ----------------------------------------------------------------- watchdog thread

    def _watch(self) -> None:
        """Worker start-up and deaths, restarts after failures, memory recycling, spent budgets."""
        try:
            while not self._stop:
                busy = self._running or any(j.expires is not None for j in list(self.sched.outstanding))
                if self._ready_r.poll(TICK_S if busy else 0.25):
                    while self._ready_r.poll():
                        if pid := self._ready_r.recv():
                            self._on_ready(pid)
                self._check_workers()
                now = time.monotonic()
                for job in self.sched.expired(now):
                    for i in self.sched.drop_queued(job, cancelled=False):
                        self._complete(job, i, Verdict(False, 0.0, "timeout", None, 0.0), count=False)
                    self._cut_running(job)
                self._dispatch()
        except BaseException:  # pragma: no cover - a bug here must not hang every caller
            log.exception("grader pool watchdog crashed")
            self._broken = "the grader pool watchdog crashed; see the server log"
            self._restart_at = math.inf
        finally:
            self._shutdown()

    def _cut_running(self, job: Job) -> None:
        """A spent budget also stops the job's items in flight (pebble kills their workers), so an
        item sent before the budget was armed (no ``job.expires`` then) does not run past it."""
        with self._lock:
            futs = [f for f, task in self._running.items() if task[0] is job]
        for f in futs:
            f.cancel()

    def _on_ready(self, pid: int) -> None:
        self._ready.add(pid)  # (it may report before its Process object knows its pid)
        self._start_failures, self._backoff_s = 0, 1.0
        if self._broken and self._restart_at == math.inf:
            log.warning("grader pool: workers start again; the pool is back")
            self._broken = None
        if len(self.worker_pids()) >= self.size:
            self._ready_event.set()

    def _check_workers(self) -> None:
        """Workers that died before they were ready count as start failures; too many break the pool."""
        now = time.monotonic()
        if self._pebble is None:
            if self._broken and now >= self._restart_at:
                log.warning("grader pool: trying to start workers again (backoff %.0f s)", self._backoff_s)
                self.stats["pool_restarts"] += 1
                self._start_failures = self.max_start_failures  # one more failure breaks it again, longer
                self._restart_at = math.inf  # until a worker reports ready or fails again
                self._replace_pebble()
            return
        for p in [p for p in list(self._ctx.procs) if p.pid is not None and not p.is_alive()]:
            self._ctx.procs.remove(p)
            if p.pid not in self._ready and p.exitcode > 0:  # failed while starting (not killed by a signal)
                self._start_failures += 1
                self.stats["restarts_startup"] += 1  # the metric worker_restarts_total{reason="startup"}
            self._ready.discard(p.pid)
        # time without any ready worker: since the pebble pool started, or since its last ready
        # worker was killed or retired (replacements must report ready within the same timeout)
        if self.worker_pids():
            self._unready_since = None
        elif self._unready_since is None:
            self._unready_since = now
        slow = now - (self._unready_since or now) > self.startup_timeout_s
        if self._start_failures > self.max_start_failures or slow:
            self._break_for_a_while()
        elif self._recycle:  # a worker's memory passed worker_max_rss_mb
            self._replace_pebble()
        elif not self._pebble_active(self._pebble):  # pebble gave up: a worker died while no task ran
            self.stats["restarts_crash"] += 1
            self._replace_pebble()

    def _break_for_a_while(self) -> None:
        """Workers keep dying while starting: fail what is queued, try again after a backoff."""
        if self._start_failures:
            what = f"grader workers keep dying while starting ({self._start_failures} times in a row)"
        else:
            what = f"no grader worker became ready within {self.startup_timeout_s:.0f} s"
        why = (
            f"{what}; check the server log (import error? worker_memory_mb too low? {GUARD_MESSAGE}?); "
            f"the pool tries again in {self._backoff_s:.0f} s"
        )
        self._restart_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(MAX_RESTART_BACKOFF_S, self._backoff_s * 2)
        self._broken = why
        self._fail_all(PoolBroken(why, self._backoff_s))

    def _fail_all(self, err: Exception) -> None:
        """Stop the workers and fail every outstanding job with ``err``."""
        self._replace_pebble(start=False)
        for job in self.sched.clear():
            if not job.future.done():
                job.future.set_exception(err)

    def _shutdown(self) -> None:
        """Watchdog exit: fail what is left, stop the workers (they die at once on SIGTERM)."""
        self._closing = True
        self._fail_all(PoolClosed("the grader pool closed before these items were graded"))
        for conn in (self._ready_r, self._ready_w):
            with contextlib.suppress(Exception):
                conn.close()
