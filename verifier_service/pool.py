"""A pool of warm grading processes with a hard wall-clock deadline on every item, shared fairly.

Why a pool of our own: math-verify's timeouts use ``signal.alarm``. They work only on a process's
main thread (uvicorn runs handlers elsewhere), and even there they cannot interrupt C code (a GMP
factorial of ``(10^{10})!``) or ``str()`` of a parsed power tower, which never returns. The only
deadline that always holds is one enforced from outside: the parent times each item and kills the
worker that overruns.

How it works (one dispatcher thread in the parent, N worker processes)::

    submit(items) -> too_large / cache hits / verdict-cache hits / duplicates answered at once
                  -> the rest becomes a job: a queue of items in request order
    dispatcher    -> when a worker is idle, picks the open job that has received the LEAST worker
                     time so far (fair queueing by attained service: a 1-item request sent behind
                     a 512-item flood goes next, whatever else is queued) and sends it a task of
                     up to ``batch_size`` items, fewer when the mode's recent per-item time says
                     the task would run longer than ``TASK_TARGET_S`` (a task never holds a worker
                     for long, so fairness needs no preemption)
    worker        -> grades the items one by one; before each it writes (start time, index) to
                     a shared-memory slot; results go back in batches (every 2 ms, and at the end
                     of the task), so the dispatcher wakes once per batch, not once per item
    dispatcher    -> reads the slot: an item running past its deadline -> SIGKILL the worker,
                     answer that item 'timeout', put the rest of its task back at the head of ITS
                     OWN job's queue (so it does not jump ahead of other jobs), start a fresh
                     worker in the slot
    dead worker   -> (killed from outside, out of memory) same, but the item in flight is retried
                     once on another worker before it answers 'error'

Cancellation: cancelling the future ``submit`` returned (the service does so when the client
disconnects) drops the job's queued items at once; a job whose ``budget_s`` is spent answers its
still-queued items 'timeout' without grading them. Admission is measured in work: the estimated
seconds of what is pending (items queued or in flight x the mode's recent per-item time / workers;
a task of hung items in flight is real backlog) beyond
``max_queue_s`` raises :class:`PoolBusy` with a ``retry_after_s`` from that estimate.

Results: 'timeout' and 'error' are never cached (a retry re-grades; an item that timed out before
gets ``retry_deadline_factor`` x the deadline on its next try). Two caches, both bounded in bytes:
results by the whole item, and verdicts by (mode, gold, extracted answer) so a response whose final
answer was seen before skips the workers (RL groups repeat final answers; ``verdict_key``).

Self-healing: workers that keep dying while starting break the pool for a while (callers get
:class:`PoolBroken`, ``broken`` says why), then it tries again with exponential backoff. Workers
are recycled after ``worker_max_items`` items or above ``worker_max_rss_mb`` resident memory.

Fork safety: a process forked from one that owns a pool (verl's reward workers, DataLoader
workers, ``multiprocessing`` with fork) gets a fresh pool of its own on its first call; the
parent's workers are left alone (they are not the child's to stop).

Workers start with ``forkserver`` (default) or ``spawn``: never plain ``fork`` of a process that
runs uvicorn's threads. With forkserver the grader is preloaded in the server process, so a
replacement worker is up in ~20 ms. Workers never re-import the caller's ``__main__``
(see ``_main_module_hidden``), so no ``if __name__ == "__main__"`` guard is needed either.

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
import hashlib
import logging
import math
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import types
import weakref
import zlib
from collections.abc import Iterable, Sequence
from multiprocessing.connection import wait as mp_wait
from typing import Any, NamedTuple

from stapo.verifier_service.grader import GradeResult, dapo_line, marker_answer, quick_verdict
from stapo.verifier_service.schemas import MODES, VerifyItem

log = logging.getLogger("stapo.verifier_service.pool")

Item = tuple[str, str, str]
"""(prediction, gold, mode): what travels to a worker."""

_CACHEABLE = frozenset({"ok", "no_answer"})
"""Statuses worth remembering. Never 'timeout' (a machine under load times out items it would grade
on a retry; core/rewards.py retries them, and a cached timeout answered the retry with ms=0) nor
'error' (it may come from a crash)."""

TASK_TARGET_S = 0.05
"""A task is cut so that, at the mode's recent per-item time, it holds a worker about this long:
long enough to amortize IPC, short enough that a newly arrived request waits little."""

EWMA_ALPHA = 0.05
"""Weight of one item in the per-mode running mean of grading time (admission and task sizes)."""

INITIAL_ITEM_S = 0.005
"""Per-item time assumed for a mode before any of its items were graded."""

MAX_RESTART_BACKOFF_S = 60.0

VERDICT_MAX_CHARS = 16_000
VERDICT_MAX_BOXES = 8
"""The verdict cache's extraction runs in the parent, which has no deadline: only predictions this
short with this few boxes go through it (worst case ~10 ms); the rest always go to a worker."""


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


def _digest(*parts: str) -> bytes:
    """blake2b-128 of the parts, each followed by NUL (one encode and one hash call: per item, hot)."""
    text = "\x00".join(parts) + "\x00"
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def cache_key(item: Item) -> bytes:
    """16-byte digest of the whole item: long predictions stay out of the cache's memory."""
    pred, gold, mode = item
    return hashlib.blake2b(
        f"{mode}\x00{gold}\x00{pred}\x00".encode("utf-8", "surrogatepass"), digest_size=16
    ).digest()


class VerdictKey(NamedTuple):
    """What the parent knows about an item's final answer (``verdict_key``)."""

    digest: bytes
    """of mode + gold + the answer the verdict reads: equal digests, equal verdicts"""
    extracted: str
    """the answer as ``grade`` reports it (``GradeResult.extracted``)"""
    answer: str
    """the string the verdict reads (mode ``math``: = extracted; ``dapo``: the raw, unstripped line)"""


def verdict_key(item: Item) -> VerdictKey | None:
    """(digest of mode + gold + extracted answer, extracted answer, answer) when the grader's verdict
    depends on nothing else; None when only a worker can tell (no marker: math-verify's search; prose in
    the answer; too long). Runs the grader's own extraction steps, in the parent, in microseconds.

    The verdict of mode ``math`` is ``_equiv(latexify(gold_answer(gold)), latexify(extract_answer(
    prediction)))`` whenever the extracted answer exists and is not prose (grader._grade_math); mode
    ``dapo`` compares DAPO-normalized strings of the extracted ``Answer:`` text (dapo.py). A test
    (tests/service/test_fairness.py) checks that this key's answer equals what ``grade`` extracts.
    The answer comes from ``grader.marker_answer``, the grader's own cheap extraction, so the key
    and the grade cannot drift apart.
    """
    pred, gold, mode = item
    # The parent has no deadline: only inputs whose extraction is surely cheap (box matching is
    # linear per box, so few boxes in a bounded text; "\\boxed{" x 5000 takes seconds).
    if len(pred) > VERDICT_MAX_CHARS or len(gold) > 2_000:
        return None
    if pred.count("boxed") + pred.count("fbox") > VERDICT_MAX_BOXES:
        return None
    if mode not in ("math", "dapo"):
        return None
    try:
        if mode == "dapo":
            answer = dapo_line(pred)
            ext = answer.strip() if answer is not None else None
        else:
            answer = ext = marker_answer(pred, mode)
    except Exception:  # the worker will say what went wrong
        return None
    if ext is None or answer is None:
        return None
    return VerdictKey(_digest("verdict", mode, gold, answer), ext, answer)


def inline_grade(gold: str, mode: str, vk: VerdictKey) -> GradeResult | None:
    """The item's result when ``grader.quick_verdict`` decides it in this process, else None.

    Most first sights on an RL stream are integers against an integer gold (DAPO-Math-17k, GSM8K)
    or an answer equal to the gold up to markup: a worker would take microseconds to grade them,
    after a round trip (pickling, a pipe, two context switches) that costs more than the grading.
    """
    t0 = time.perf_counter()
    try:
        ok = quick_verdict(gold, vk.answer, mode)
    except Exception:  # the worker will say what went wrong
        return None
    if ok is None:
        return None
    return GradeResult(ok, 1.0 if ok else 0.0, "ok", vk.extracted, (time.perf_counter() - t0) * 1e3)


class _ByteLRU:
    """An LRU map bounded in (estimated) bytes as well as entries."""

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.data: collections.OrderedDict[bytes, tuple[GradeResult, int]] = collections.OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    @staticmethod
    def size_of(r: GradeResult) -> int:
        # key (16 B digest object ~49 B) + result object + dict slot; the extracted text dominates
        return 260 + (len(r.extracted) * 4 if r.extracted else 0)

    def get(self, key: bytes) -> GradeResult | None:
        if self.max_bytes <= 0 or self.max_entries <= 0:
            return None
        with self.lock:
            hit = self.data.get(key)
            if hit is None:
                return None
            self.data.move_to_end(key)
            return hit[0]

    def put(self, key: bytes, r: GradeResult) -> None:
        if self.max_bytes <= 0 or self.max_entries <= 0:
            return
        n = self.size_of(r)
        if n > self.max_bytes:
            return
        with self.lock:
            old = self.data.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self.data[key] = (r, n)
            self.bytes += n
            while self.bytes > self.max_bytes or len(self.data) > self.max_entries:
                _, (_, m) = self.data.popitem(last=False)
                self.bytes -= m

    def __len__(self) -> int:
        return len(self.data)

    def clear(self) -> None:
        with self.lock:
            self.data.clear()
            self.bytes = 0


def _rss_mb(pid: int | None) -> float:
    """Resident memory of a process in MiB (Linux /proc; 0 where unknown)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


# --------------------------------------------------------------------------- worker process


def _set_parent_death_signal() -> None:
    """Linux: die with the parent (SIGKILL on its exit), so a killed server leaves no graders behind."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


RSS_CHECK_ITEMS = 64
"""A worker's resident memory is read (``worker_max_rss_mb``) after its first task, then every this many items."""

FLUSH_S = 0.002
"""A worker sends its finished results at least this often (and at the end of each task)."""


def _worker_main(conn: Any, memory_mb: int, warmup: bool, max_chars: int, progress: Any = None) -> None:
    """Grade items forever: receive ``(task_id, first, [items])``, send ``(task_id, (k, [results]))``.

    Before each item the worker writes its start time and index into ``progress`` (shared memory
    the parent reads for the deadline), so results can travel in batches (every ``FLUSH_S``, and at
    the end of the task) without losing track of which item a hung worker is on.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which shuts us down in order
    _set_parent_death_signal()
    if memory_mb > 0:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from stapo.verifier_service.grader import grade

    if warmup:  # a no-op when the fork server already imported (and so ran) it
        import stapo.verifier_service.warmup  # noqa: F401
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, first, items = msg
        done: list[tuple] = []
        done_from = first
        last_flush = time.monotonic()
        for j, (pred, gold, mode) in enumerate(items):
            t0 = time.perf_counter()
            if progress is not None:
                progress[0] = time.monotonic()  # start time first, then the index (the parent reads both)
                progress[1] = first + j
            try:
                r = grade(pred, gold, mode, max_chars=max_chars)
                out = (bool(r.correct), float(r.score), r.status, r.extracted, float(r.ms))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # math-verify's TimeoutException is a BaseException
                log.debug("grade raised %r", err)
                out = (False, 0.0, "error", None, (time.perf_counter() - t0) * 1000.0)
            done.append(out)
            now = time.monotonic()
            if progress is None or now - last_flush >= FLUSH_S or j == len(items) - 1:
                conn.send((task_id, (done_from, done)))
                done_from, done, last_flush = first + j + 1, [], now


# --------------------------------------------------------------------------- parent side

_MAIN_LOCK = threading.Lock()
_REBUILD_LOCK = threading.Lock()
_POOLS: weakref.WeakSet[GraderPool] = weakref.WeakSet()


@contextlib.contextmanager
def _main_module_hidden():
    """Start workers without re-running the caller's ``__main__`` in them.

    multiprocessing's spawn/forkserver children re-import the parent's main module (that is why
    scripts need ``if __name__ == "__main__":``). Graders need nothing from it, and importing it
    (the whole ``stapo`` CLI, or a user's training script) made every replacement worker slow and
    made the pool unusable from scripts without the guard. ``get_preparation_data`` reads
    ``sys.modules["__main__"]`` while ``Process.start()`` runs; for those milliseconds it sees an
    empty module (no ``__file__``, no ``__spec__``), so the child is told no main to import. This is
    the one place stapo relies on that multiprocessing detail.
    """
    with _MAIN_LOCK:
        real = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if real is not None:
                sys.modules["__main__"] = real


def _after_fork_in_child() -> None:
    """``os.fork()`` child of a process with pools: forget the parent's workers, reset our locks.

    Without this the child's copy of a pool has no dispatcher thread (threads do not survive fork)
    and grading hangs; worse, multiprocessing's exit handler in the child would SIGTERM the
    parent's workers (they are in the inherited ``multiprocessing.process._children``). Each pool
    is rebuilt lazily on its first use in the child (``_ensure_owner``).
    """
    global _MAIN_LOCK, _REBUILD_LOCK
    _MAIN_LOCK = threading.Lock()
    _REBUILD_LOCK = threading.Lock()
    for pool in list(_POOLS):
        with contextlib.suppress(Exception):
            pool._forget_parent_workers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _ShardQueue:
    """A job's items not yet sent, one deque per gold shard (= worker slot): a worker takes its own
    shard's items first, so the grader's per-process caches for those golds stay hot (repeats of a
    pair cost ~23 us there, a first sight ~1.3 ms), and steals from the fullest shard otherwise."""

    __slots__ = ("q", "n")

    def __init__(self, shards: int) -> None:
        self.q: list[collections.deque[int]] = [collections.deque() for _ in range(shards)]
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for d in self.q:
            yield from d

    def clear(self) -> None:
        for d in self.q:
            d.clear()
        self.n = 0

    def append(self, shard: int, i: int) -> None:
        self.q[shard].append(i)
        self.n += 1

    def push_front(self, shard: int, i: int) -> None:
        self.q[shard].appendleft(i)
        self.n += 1

    def source(self, slot: int) -> collections.deque[int]:
        d = self.q[slot % len(self.q)]
        return d if d else max(self.q, key=len)


class _Job:
    """One submit() call: results in order, duplicates answered from their leader, a queue to dispatch."""

    __slots__ = (
        "results", "dups", "keys", "vkeys", "vdups", "remaining", "future", "queue", "items", "deadlines",
        "crashes", "served", "expires", "cancelled", "seq", "spread", "shard", "single", "__weakref__",
    )  # fmt: skip

    def __init__(self, n: int, seq: int) -> None:
        self.results: list[GradeResult | None] = [None] * n
        self.dups: dict[int, list[int]] = {}
        self.keys: dict[int, bytes] = {}
        self.vkeys: dict[int, VerdictKey] = {}
        self.vdups: dict[int, list[int]] = {}  # leader -> items with the same (mode, gold, answer)
        self.remaining = 0  # leaders not answered yet (queued or in flight)
        self.future: concurrent.futures.Future[list[GradeResult]] = concurrent.futures.Future()
        self.queue = _ShardQueue(1)  # leader indices not yet sent, by gold shard
        self.shard: dict[int, int] = {}  # item -> its gold shard
        self.single: set[int] = set()  # items back from a lost worker: sent one per task
        self.items: list[Item] = []
        self.deadlines: dict[int, float] = {}  # leader -> its deadline when not the pool's default
        self.crashes: dict[int, int] = {}
        self.served = 0.0  # estimated worker-seconds dispatched so far (fair-queueing key)
        self.expires: float | None = None
        self.cancelled = False
        self.seq = seq
        self.spread = 1  # most items per task so that the job's items reach every worker


class _Task:
    """A slice of one job for one worker; ``pos`` is the item the worker is on."""

    __slots__ = ("job", "idx", "items", "pos", "deadline_s")

    def __init__(self, job: _Job, idx: list[int], deadline_s: float) -> None:
        self.job, self.idx, self.deadline_s, self.pos = job, idx, deadline_s, 0
        self.items = [job.items[i] for i in idx]


class _Worker:
    __slots__ = (
        "slot", "proc", "conn", "state", "task", "task_id", "started_at", "pid", "progress", "done", "rss_check_at",
    )  # fmt: skip

    def __init__(self, slot: int, proc: Any, conn: Any, progress: Any) -> None:
        self.slot, self.proc, self.conn, self.progress = slot, proc, conn, progress
        self.state = "starting" if proc is not None else "dead"  # -> idle <-> busy -> dead
        self.task: _Task | None = None
        self.task_id = 0
        self.started_at = time.monotonic()
        self.pid: int | None = proc.pid if proc is not None else None
        self.done = 0  # items graded by this process (recycling)
        self.rss_check_at = 0  # its resident memory is read when ``done`` reaches this (after its first task)


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
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s: must be > 0, got {deadline_s}")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if not max_queue_s > 0:
            raise ValueError(f"max_queue_s: must be > 0, got {max_queue_s}")
        if not retry_deadline_factor >= 1:
            raise ValueError(f"retry_deadline_factor: must be >= 1, got {retry_deadline_factor}")
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
        self._memory_mb = worker_memory_mb
        self._warmup = warmup
        self._start_method = start_method
        cache_bytes = int(cache_max_mb * 2**20)
        # Two caches share the byte budget: whole items, and verdicts by extracted answer.
        self._cache = _ByteLRU(cache_bytes // 2 if verdict_cache else cache_bytes, cache_size)
        self._verdicts = _ByteLRU(cache_bytes // 2 if verdict_cache else 0, cache_size)
        self._timed_out = _ByteLRU(1 << 20, 4096)  # keys of items that timed out: a retry gets longer
        self.stats: collections.Counter[str] = collections.Counter()
        self._start()
        _POOLS.add(self)

    def _start(self) -> None:
        """Everything that belongs to one process: queues, locks, workers, dispatcher thread."""
        self._owner_pid = os.getpid()
        self._ctx = mp.get_context(self._start_method)
        if self._start_method == "forkserver":
            # Only has an effect before this process's fork server starts; harmless afterwards.
            # The warm-up module imports math-verify + sympy and grades a few items once, in the
            # fork server; this module holds the workers' entry point. Both preloaded, every worker
            # (and every replacement) is born warm: ~20 ms from fork to ready instead of ~0.5 s.
            preload = ["stapo.verifier_service.pool"] + (
                ["stapo.verifier_service.warmup"] if self._warmup else []
            )
            self._ctx.set_forkserver_preload(preload)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no job is outstanding
        self._active: dict[_Job, None] = {}  # jobs with queued items, in arrival order
        self._pending_items = 0  # queued + in flight
        self._pending_by_mode: collections.Counter[str] = collections.Counter()
        self._item_s: dict[str, float] = {}  # mode -> running mean of per-item seconds (timeouts too)
        self._typical_log_s: dict[str, float] = {}  # running mean of log(seconds), no timeouts: sizes tasks
        self._outstanding: set[_Job] = set()
        self._closing = False
        self._stop = False
        self._broken: str | None = None
        self._restart_at = 0.0
        self._backoff_s = 1.0
        self._task_ids = 0
        self._job_seq = 0
        self._start_failures = 0
        self._ready_event = threading.Event()
        self._want_work = False  # the dispatcher sleeps with an idle worker: new work must wake it
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._workers: list[_Worker] = [self._spawn(slot) for slot in range(self.size)]
        self._thread = threading.Thread(target=self._loop, name="stapo-grader-pool", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- fork safety

    def _forget_parent_workers(self) -> None:
        """In a forked child: the workers, pipes and thread are the parent's; drop them (see module doc)."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._cache.lock = threading.Lock()
        self._verdicts.lock = threading.Lock()
        self._timed_out.lock = threading.Lock()
        children = getattr(mp.process, "_children", None)
        for w in self._workers:
            if children is not None and w.proc is not None:
                children.discard(w.proc)
            with contextlib.suppress(Exception):
                if w.conn is not None:
                    w.conn.close()  # our copy of the fd only; the parent keeps its own
        self._workers = []
        self._forked_from = self._owner_pid

    def _ensure_owner(self) -> None:
        """Rebuild the pool in a forked child on first use (new fork server, new workers, new thread)."""
        if self._owner_pid == os.getpid():
            return
        with _REBUILD_LOCK:
            if self._owner_pid == os.getpid():
                return
            if self._start_method == "forkserver":
                _reset_forkserver_state()
            closing = self._closing
            with contextlib.suppress(Exception):
                self._wake_r.close()
                self._wake_w.close()
            log.info("grader pool: process forked (pid %s -> %s); starting workers of its own",
                     getattr(self, "_forked_from", "?"), os.getpid())  # fmt: skip
            self._start()
            self.stats["fork_rebuilds"] += 1
            if closing:
                self._closing = True

    # ----------------------------------------------------------------- public API

    def submit(
        self,
        items: Iterable[VerifyItem | dict[str, Any] | Sequence[str]],
        *,
        budget_s: float | None = None,
    ) -> concurrent.futures.Future:
        """Queue items; the future resolves to ``list[GradeResult]`` in input order.

        ``budget_s``: items still queued this many seconds from now answer 'timeout' without being
        graded (the caller will have given up). Cancelling the future drops the queued items.
        Raises :class:`PoolBusy` (too much queued work), :class:`PoolBroken`, :class:`PoolClosed`.
        """
        self._ensure_owner()
        norm = [as_item(x, f"items[{i}]") for i, x in enumerate(items)]
        job = _Job(len(norm), 0)
        job.items = norm
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
            cached = self._cache.get(key)
            if cached is not None:
                job.results[i] = cached
                hits += 1
                continue
            if self.verdict_cache:
                vk = verdict_key(item)
                if vk is not None:
                    v = self._verdicts.get(vk.digest)
                    if v is not None:
                        job.results[i] = v
                        self._cache.put(key, v)  # the same item again skips the extraction too
                        vhits += 1
                        continue
                    vl = vleaders.get(vk.digest)
                    if vl is not None:  # same gold and final answer as an item sent above: its verdict
                        job.vdups.setdefault(vl, []).append(i)
                        job.keys[i] = key
                        job.shard[i] = zlib.crc32(gold.encode("utf-8", "surrogatepass")) % self.size
                        vhits += 1
                        continue
                    if self.inline_verdicts:
                        r = inline_grade(gold, mode, vk)
                        if r is not None:  # decided here: no worker round trip
                            job.results[i] = r
                            kept = GradeResult(r.correct, r.score, r.status, r.extracted, 0.0)
                            self._verdicts.put(vk.digest, kept)
                            self._cache.put(key, kept)
                            inline += 1
                            continue
                    vleaders[vk.digest] = i
                    job.vkeys[i] = vk
            leaders[key] = i
            job.keys[i] = key
            job.shard[i] = zlib.crc32(gold.encode("utf-8", "surrogatepass")) % self.size
            if self._timed_out.get(key) is not None:
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
            self._job_seq += 1
            job.seq = self._job_seq
            job.remaining = len(leaders)
            job.spread = max(1, math.ceil(len(leaders) / self.size))
            job.queue = _ShardQueue(self.size)
            for i in leaders.values():
                job.queue.append(job.shard[i], i)
            if budget_s is not None:
                job.expires = time.monotonic() + budget_s
            self._outstanding.add(job)
            self._active[job] = None
            self._pending_items += len(leaders)
            for i in leaders.values():
                self._pending_by_mode[norm[i][2]] += 1
        job.future.add_done_callback(lambda f, j=weakref.ref(job): self._on_future_done(f, j))
        self._wake_for_work()
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

    def ready_workers(self) -> int:
        return sum(1 for w in self._workers if w.state in ("idle", "busy"))

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.pid is not None and w.state in ("idle", "busy")]

    def worker_rss_mb(self) -> list[float]:
        return [_rss_mb(w.pid) for w in self._workers if w.state in ("idle", "busy")]

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
        return len(self._cache) + len(self._verdicts)

    def cache_bytes(self) -> int:
        return self._cache.bytes + self._verdicts.bytes

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
                self._idle.wait(left if left is None else min(left, 0.5))
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
        heavy-tailed (median ~12 us, 1% of items ~90% of the time), and one slow item in a hundred
        must not cut every task to a few items."""
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
        if job is None or not fut.cancelled():
            return
        self._drop_queued(job, cancelled=True)
        self._wake()

    def _drop_queued(self, job: _Job, *, cancelled: bool) -> None:
        """Remove a job's queued items: cancelled -> forgotten; budget spent -> answered 'timeout'."""
        with self._lock:
            idx = list(job.queue)
            job.queue.clear()
            self._active.pop(job, None)
            if cancelled:
                job.cancelled = True
                self._uncount(job, idx)
                self._pending_items -= len(idx)
                job.remaining -= len(idx)
                self.stats["cancelled_items"] += len(idx)
                if job.remaining <= 0:
                    self._outstanding.discard(job)
                    if not self._outstanding:
                        self._idle.notify_all()
                return
        self.stats["expired_items"] += len(idx)
        for i in idx:
            self._complete(job, i, GradeResult(False, 0.0, "timeout", None, 0.0), count=False)

    def _uncount(self, job: _Job, idx: list[int]) -> None:
        """Items that will never complete (dropped): out of the per-mode pending counts (admission)."""
        for i in idx:
            self._pending_by_mode[job.items[i][2]] -= 1

    def _requeue(self, job: _Job, idx: list[int], *, single: bool = False) -> None:
        """Items back from a lost worker: the head of their own job's queue, not of everyone's.

        ``single``: they go one per task, so that if the lost task held several hostile items they
        now overrun in parallel, not one deadline after another."""
        if not idx:
            return
        if single:
            job.single.update(idx)
        with self._lock:  # the cancelled flag is set under this lock too
            if job.cancelled:
                self._uncount(job, idx)
                self._pending_items -= len(idx)
                job.remaining -= len(idx)
                if job.remaining <= 0:
                    self._outstanding.discard(job)
                    if not self._outstanding:
                        self._idle.notify_all()
                return
            for i in reversed(idx):
                job.queue.push_front(job.shard[i], i)
            self._active.setdefault(job, None)

    def _complete(self, job: _Job, leader: int, r: GradeResult, *, count: bool = True) -> None:
        job.results[leader] = r
        for d in job.dups.get(leader, ()):
            job.results[d] = r
        key = job.keys.get(leader)
        if r.status in ("ok", "no_answer"):
            if key is not None:
                self._cache.put(key, GradeResult(r.correct, r.score, r.status, r.extracted, 0.0))
            vk = job.vkeys.get(leader)
            if vk is not None and r.status == "ok" and r.extracted == vk.extracted:
                self._verdicts.put(vk.digest, GradeResult(r.correct, r.score, r.status, r.extracted, 0.0))
        elif r.status == "timeout" and key is not None and count:
            self._timed_out.put(key, r)
        if r.status in ("timeout", "error") and count:
            self.stats[r.status + "s"] += 1
        followers = job.vdups.pop(leader, None)
        if followers:
            vk = job.vkeys.get(leader)
            if vk is not None and r.status == "ok" and r.extracted == vk.extracted:
                same = GradeResult(r.correct, r.score, r.status, r.extracted, 0.0)
                for f in followers:
                    job.results[f] = same
                    self._cache.put(job.keys[f], same)
            else:  # the leader's verdict does not carry over (timeout, error, other answer): grade each
                with self._lock:
                    job.remaining += len(followers)
                    self._pending_items += len(followers)
                    for f in followers:
                        self._pending_by_mode[job.items[f][2]] += 1
                self._requeue(job, followers)
        with self._lock:
            job.remaining -= 1
            self._pending_items -= 1
            self._pending_by_mode[job.items[leader][2]] -= 1
            if job.remaining == 0:
                self._outstanding.discard(job)
                if not self._outstanding:
                    self._idle.notify_all()
        if job.remaining == 0 and not job.future.done():
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                job.future.set_result(job.results)  # type: ignore[arg-type]

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    def _wake_for_work(self) -> None:
        """New work was queued: wake the dispatcher only if it sleeps with a worker idle.

        Otherwise it is awake (it dispatches before it sleeps again) or every worker is busy (it
        wakes on their results and dispatches then): a wake-up byte would cost a syscall here and a
        dispatcher wake-up contending for the GIL with the event loop, for nothing. No wake-up is
        lost: the dispatcher sets ``_want_work`` and then looks at ``_active`` before it sleeps;
        this thread queued the job before it reads the flag.
        """
        if self._want_work:
            self._want_work = False
            self._wake()

    # ----------------------------------------------------------------- dispatcher thread

    def _spawn(self, slot: int) -> _Worker:
        try:
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            progress = self._ctx.RawArray("d", 2)  # [start of the item in progress (monotonic), its index]
            proc = self._ctx.Process(
                target=_worker_main,
                # The pool checks the size limits itself; the grader's own limit must not be tighter.
                args=(
                    child_conn,
                    self._memory_mb,
                    self._warmup,
                    max(self.max_prediction_chars, self.max_gold_chars),
                    progress,
                ),
                name=f"stapo-grader-{slot}",
                daemon=True,
            )
            with _main_module_hidden():
                proc.start()
        except Exception as err:  # the fork server is gone, no fds left, ...: a failed start
            log.warning("grader worker %s could not start: %r", slot, err)
            self.stats["start_errors"] += 1
            self._start_failures += 1
            w = _Worker(slot, None, None, None)
            w.state = "dead"
            return w
        child_conn.close()  # the child holds the only other end: its death reads as EOF here
        return _Worker(slot, proc, parent_conn, progress)

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._heal()
                self._dispatch()
                waitables: list[Any] = [self._wake_r]
                owner: dict[Any, _Worker] = {}
                for w in self._workers:
                    if w.state != "dead":
                        waitables += [w.conn, w.proc.sentinel]
                        owner[w.conn] = w
                        owner[w.proc.sentinel] = w
                # wakes from submit() only when a worker is idle (_wake_for_work); re-check after the flag
                self._want_work = any(w.state == "idle" for w in self._workers)
                if self._want_work and self._active:
                    self._want_work = False
                    continue
                ready = mp_wait(waitables, self._wait_timeout())
                self._want_work = False
                for obj in ready:
                    if obj is self._wake_r:
                        with contextlib.suppress(BlockingIOError, OSError):
                            while self._wake_r.recv(4096):
                                pass
                        continue
                    w = owner[obj]
                    self._drain(w)
                    if obj is w.proc.sentinel and w.state != "dead":
                        self._drain(w)
                        self._lost(w, "crash")
                self._check_deadlines()
        except BaseException:  # pragma: no cover - a bug here must not hang every caller
            log.exception("grader pool dispatcher crashed")
            self._broken = "the grader pool dispatcher crashed; see the server log"
            self._restart_at = float("inf")
        finally:
            self._shutdown()

    def _heal(self) -> None:
        """Start workers in empty slots; a broken pool waits for its backoff first."""
        if self._stop:
            return
        now = time.monotonic()
        if self._broken:
            if now < self._restart_at:
                return
            log.warning("grader pool: trying to start workers again (backoff %.0f s)", self._backoff_s)
            self.stats["pool_restarts"] += 1
            self._start_failures = self.max_start_failures  # one more failure breaks it again, longer
            self._restart_at = float("inf")  # until a worker reports ready or fails again
        for k, w in enumerate(self._workers):
            if w.state == "dead":
                self._workers[k] = self._spawn(k)
                if self._workers[k].state == "dead" and self._start_failures > self.max_start_failures:
                    self._break_for_a_while()
                    return

    def _pick(self, slot: int = 0) -> _Job | None:
        """The open job that has received the least worker time (ties: the oldest); expired jobs drained.

        A job with no items of this worker's gold shard counts one task target more (it would make
        the worker steal, with cold caches): fairness holds to within one short task."""
        best: _Job | None = None
        best_key = 0.0
        now = time.monotonic()
        expired = []
        for job in self._active:
            if job.expires is not None and now > job.expires:
                expired.append(job)
                continue
            key = job.served + (0.0 if job.queue.q[slot % len(job.queue.q)] else TASK_TARGET_S)
            if best is None or key < best_key:
                best, best_key = job, key
        for job in expired:
            self._lock.release()
            try:
                self._drop_queued(job, cancelled=False)
            finally:
                self._lock.acquire()
        return best

    def _take(self, job: _Job, slot: int) -> _Task:
        """Up to batch_size items of the job (its shard of this worker first), fewer when they would
        hold the worker too long."""
        d = job.queue.source(slot)
        first = d[0]
        mode = job.items[first][2]
        per = self._est_item_s(mode)
        typical = self._typical_s(mode)
        deadline = job.deadlines.get(first, self.deadline_s)
        n = min(
            self.batch_size,
            max(1, int(TASK_TARGET_S / max(typical, 1e-6))),
            job.spread,  # a small job is spread over every worker
        )
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
        job.queue.n -= len(idx)
        if not job.queue:
            self._active.pop(job, None)
        job.served += len(idx) * per
        return _Task(job, idx, deadline)

    def _dispatch(self) -> None:
        for w in self._workers:
            if w.state != "idle":
                continue
            with self._lock:
                job = self._pick(w.slot)
                task = self._take(job, w.slot) if job is not None else None
            if task is None:
                return
            self._send(w, task)

    def _send(self, w: _Worker, task: _Task) -> None:
        self._task_ids += 1
        w.task, w.task_id, w.state = task, self._task_ids, "busy"
        w.progress[0] = time.monotonic()
        w.progress[1] = task.pos
        try:
            w.conn.send((w.task_id, task.pos, task.items[task.pos :] if task.pos else task.items))
        except (OSError, EOFError, ValueError):
            self._lost(w, "crash", blame_item=False)

    def _drain(self, w: _Worker) -> None:
        try:
            while w.state != "dead" and w.conn.poll():
                self._on_message(w, w.conn.recv())
        except (EOFError, OSError):
            self._lost(w, "crash")

    def _on_message(self, w: _Worker, msg: tuple[Any, Any]) -> None:
        tag, body = msg
        if tag == "ready":
            w.state = "idle"
            self._start_failures = 0
            if self._broken and self._restart_at == float("inf"):
                log.warning("grader pool: workers start again; the pool is back")
                self._broken = None
            self._backoff_s = 1.0
            if all(x.state in ("idle", "busy") for x in self._workers):
                self._ready_event.set()
            return
        task = w.task
        if task is None or tag != w.task_id:
            return  # a stale message from a task that was already re-queued
        first, results = body
        for k, r in enumerate(results, start=first):
            if k == task.pos and k < len(task.idx):
                res = GradeResult(*r)
                self._observe(task.items[k][2], res.ms / 1000.0)
                self._complete(task.job, task.idx[k], res)
                task.pos += 1
                w.done += 1
        if task.pos >= len(task.idx):
            w.task, w.state = None, "idle"
            self._maybe_recycle(w)

    def _maybe_recycle(self, w: _Worker) -> None:
        """Replace an idle worker that graded worker_max_items items or grew past worker_max_rss_mb."""
        why = None
        if self.worker_max_items and w.done >= self.worker_max_items:
            why = "items"
        elif self.worker_max_rss_mb and w.done >= w.rss_check_at:
            w.rss_check_at = w.done + RSS_CHECK_ITEMS  # a /proc read per task was a hot spot
            if _rss_mb(w.pid) > self.worker_max_rss_mb:
                why = "rss"
        if why is None:
            return
        w.state = "dead"
        with contextlib.suppress(Exception):
            w.proc.kill()  # idle: nothing is lost
            w.conn.close()
        with contextlib.suppress(Exception):
            w.proc.join(timeout=2.0)
        self.stats[f"recycled_{why}"] += 1
        self._workers[w.slot] = self._spawn(w.slot)

    def _lost(self, w: _Worker, reason: str, *, blame_item: bool = True) -> None:
        """A worker is gone (killed for overrunning, or died): answer or re-queue its items, replace it."""
        if w.state == "dead":
            return
        was_starting = w.state == "starting"
        w.state = "dead"
        with contextlib.suppress(Exception):
            w.proc.kill()  # SIGKILL: returns at once; the item is answered before the worker is reaped
        with contextlib.suppress(Exception):
            w.conn.close()
        task, w.task = w.task, None
        if task is not None and task.pos < len(task.idx):
            # The item in progress, from shared memory; those before it finished, but their
            # results were still in the worker's batch: they go back to the queue, unblamed.
            i = min(max(task.pos, int(w.progress[1])), len(task.idx) - 1) if blame_item else task.pos
            job = task.job
            redo = [task.idx[j] for j in range(task.pos, i)]
            task.pos = i
            leader = task.idx[i]
            if reason == "timeout":
                self._observe(task.items[i][2], task.deadline_s, timed_out=True)
                self._complete(job, leader, timeout_result(task.deadline_s))
                task.pos += 1
            elif blame_item:
                job.crashes[leader] = job.crashes.get(leader, 0) + 1
                if job.crashes[leader] > self.crash_retries:
                    self._complete(job, leader, status_result("error"))
                    task.pos += 1
            # The rest goes back to the head of its own job's queue: other jobs keep their turn.
            self._requeue(job, redo + [task.idx[j] for j in range(task.pos, len(task.idx))], single=True)
        self.stats[f"restarts_{reason}"] += 1
        log.warning("grader worker %s (pid %s) lost: %s; replacing it", w.slot, w.pid, reason)
        with contextlib.suppress(Exception):
            w.proc.join(timeout=2.0)  # reap (SIGKILL cannot be ignored; this is quick)
        if was_starting:
            self._start_failures += 1
            if self._start_failures > self.max_start_failures:
                self._break_for_a_while()
                return
        if not self._stop:
            self._workers[w.slot] = self._spawn(w.slot)

    def _break_for_a_while(self) -> None:
        """Workers keep dying while starting: fail what is queued, try again after a backoff."""
        why = (
            f"grader workers keep dying while starting ({self._start_failures} times in a row); "
            "check the server log (import error? worker_memory_mb too low?); "
            f"the pool tries again in {self._backoff_s:.0f} s"
        )
        self._restart_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(MAX_RESTART_BACKOFF_S, self._backoff_s * 2)
        for w in self._workers:
            if w.state == "starting":
                with contextlib.suppress(Exception):
                    w.proc.kill()
                    w.conn.close()
                w.state = "dead"
        self._fail_all(why)

    def _fail_all(self, why: str) -> None:
        """Fail every outstanding job; items still in flight finish on their workers, unread."""
        self._broken = why
        with self._lock:
            jobs = list(self._outstanding)
            self._outstanding.clear()
            self._active.clear()
            for job in jobs:
                idx = list(job.queue)
                job.queue.clear()
                self._uncount(job, idx)
                self._pending_items -= len(idx)
                job.remaining -= len(idx)
                job.cancelled = True
            self._idle.notify_all()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(PoolBroken(why, self._backoff_s))

    def _wait_timeout(self) -> float:
        now = time.monotonic()
        t = 1.0
        for w in self._workers:
            if w.state == "busy" and w.task is not None:
                t = min(t, w.progress[0] + w.task.deadline_s - now)
            elif w.state == "starting":
                t = min(t, w.started_at + self.startup_timeout_s - now)
        if self._broken and self._restart_at != float("inf"):
            t = min(t, self._restart_at - now)
        if any(j.expires is not None for j in self._active):
            t = min(t, 0.25)
        return max(0.001, t)

    def _check_deadlines(self) -> None:
        for w in list(self._workers):
            now = time.monotonic()
            if w.state == "busy" and w.task is not None and now - w.progress[0] > w.task.deadline_s:
                self._drain(w)  # a result may have arrived just now
                if (
                    w.state == "busy"
                    and w.task is not None
                    and time.monotonic() - w.progress[0] > w.task.deadline_s
                ):
                    self._lost(w, "timeout")
            elif w.state == "starting" and now - w.started_at > self.startup_timeout_s:
                self._lost(w, "startup")

    def _shutdown(self) -> None:
        """Dispatcher exit: fail what is left, stop the workers (politely, then by force)."""
        with self._lock:
            jobs = list(self._outstanding)
            self._outstanding.clear()
            self._active.clear()
            self._closing = True
            self._idle.notify_all()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(PoolClosed("the grader pool closed before these items were graded"))
        for w in self._workers:
            with contextlib.suppress(Exception):
                if w.state in ("idle", "busy", "starting"):
                    w.conn.send(None)
        end = time.monotonic() + 2.0
        for w in self._workers:
            if w.proc is None:
                continue
            with contextlib.suppress(Exception):
                w.proc.join(timeout=max(0.0, end - time.monotonic()))
                if w.proc.is_alive():
                    w.proc.kill()
                    w.proc.join(timeout=1.0)
            with contextlib.suppress(Exception):
                w.conn.close()
            w.state = "dead"
        with contextlib.suppress(Exception):
            self._wake_r.close()
            self._wake_w.close()


def _reset_forkserver_state() -> None:
    """A forked child must start a fork server of its own: the inherited one is the parent's child
    (``waitpid`` on it fails here). Resets multiprocessing's module-level fork-server handle."""
    from multiprocessing import forkserver

    fs = getattr(forkserver, "_forkserver", None)
    if fs is None:
        return
    fd = getattr(fs, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
    fs._forkserver_alive_fd = None
    fs._forkserver_address = None
    fs._forkserver_pid = None
    fs._lock = threading.Lock()
