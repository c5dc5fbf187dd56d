"""Self-healing, recycling, bounded memory and fork safety of the grading pool. Real worker
processes; the start failures are real too (an address-space limit too small for a spawned worker
to import the grader), not a mocked crash.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time

import httpx
import pebble

from stapo.verifier_service.grader import Verdict
from stapo.verifier_service.server.pool import GraderPool, PoolBroken
from tests.service.conftest import free_port


def _wait(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_pool_that_cannot_start_workers_is_retried_with_backoff(monkeypatch):
    """Workers die while starting -> the pool is broken *for a while* (callers get PoolBroken with a
    retry time), then tries again; once workers can start, it serves again without a restart.

    The fault: spawned workers inherit PYTHONHOME=/nonexistent and die in interpreter start-up, every
    time. (A tight worker_memory_mb is not a reliable fault: RLIMIT_AS only refuses *new* mappings, and
    a fresh spawn worker could report ready from memory it already had - it did, in full-suite runs.)
    """
    monkeypatch.setenv("PYTHONHOME", "/nonexistent")  # read by the spawned interpreters only
    pool = GraderPool(workers=1, deadline_s=2.0, start_method="spawn", max_start_failures=1)
    try:
        _wait(lambda: pool.broken is not None, 60, "pool never reported broken")
        assert "dying while starting" in pool.broken and pool.restart_in_s() is not None
        try:
            pool.grade("\\boxed{2}", "2")
            raise AssertionError("a broken pool graded")
        except PoolBroken as err:
            assert err.retry_after_s >= 1
        monkeypatch.delenv("PYTHONHOME")  # the operator fixed the cause
        _wait(lambda: pool.broken is None and pool.ready_workers() == 1, 60, "pool never healed")
        assert pool.grade("\\boxed{2}", "2").correct
        assert pool.stats["pool_restarts"] >= 1 and pool.stats["restarts_startup"] >= 2  # (the metric's counter)
    finally:
        pool.close()


# Imported at start-up by every interpreter that has the folder on PYTHONPATH: the server starts, its
# spawned grading workers (``-c "from multiprocessing.spawn import spawn_main ..."``) die at once.
_KILL_SPAWNED = """
import os, sys
if "spawn_main" in " ".join(getattr(sys, "orig_argv", sys.argv)):
    os._exit(3)
"""


def test_readyz_is_503_with_the_reason_while_the_pool_is_broken(tmp_path):
    """The container health check probes /readyz: it must fail while every request would get 503.

    The fault: a ``sitecustomize`` that kills spawned workers in start-up (a 40 MB RLIMIT_AS was not
    reliable: a fresh worker could report ready from memory it already had, and the test waited out
    its 240 s in a full-suite run)."""
    (tmp_path / "sitecustomize.py").write_text(_KILL_SPAWNED)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_VERIFIER_")}
    env.update(
        STAPO_VERIFIER_WORKERS="1",
        STAPO_VERIFIER_START_METHOD="spawn",
        STAPO_VERIFIER_LOG_LEVEL="warning",
        PYTHONPATH=os.pathsep.join(x for x in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if x),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "stapo.cli.main", "verifier", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        body: dict = {}

        def broken() -> bool:
            nonlocal body
            try:
                r = httpx.get(f"{url}/readyz", timeout=2)
                body = r.json()
                return r.status_code == 503 and "dying while starting" in body.get("reason", "")
            except (httpx.HTTPError, ValueError):
                return False

        _wait(broken, 120, "readyz never reported the broken pool")  # 6 failed spawns
        assert body["ready"] is False and "restart_in_s" in body and "worker_pids" not in body
        assert httpx.get(f"{url}/healthz").status_code == 200  # alive, but not ready
        r = httpx.post(f"{url}/v1/verify", json={"items": [{"prediction": "1", "gold": "1"}]}, timeout=10)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_workers_are_recycled_after_n_items_and_above_rss():
    with GraderPool(
        workers=1, deadline_s=5.0, worker_max_items=4, worker_max_rss_mb=0, inline_verdicts=False
    ) as pool:
        assert pool.wait_ready(60)
        first = pool.worker_pids()
        for k in range(3):
            res = pool.grade_many([(f"\\boxed{{{k}{j}}}", f"{k}{j}") for j in range(4)])
            assert all(r.correct for r in res)
        assert pool.stats["recycled_items"] >= 2 and pool.worker_pids() != first
    with GraderPool(
        workers=1, deadline_s=5.0, worker_max_items=0, worker_max_rss_mb=1, inline_verdicts=False
    ) as pool:
        assert pool.wait_ready(60)
        assert pool.grade("\\boxed{7}", "7").correct
        _wait(lambda: pool.stats["recycled_rss"] >= 1, 10, "a worker over the RSS bound was not recycled")
        _wait(lambda: pool.ready_workers() == 1, 30, "no worker after recycling")
        assert pool.grade("\\boxed{8}", "8").correct


def test_pebble_gives_up_when_an_idle_worker_dies():
    """Why the pool replaces its pebble pool: pebble 5 replaces a worker that died while others ran
    tasks, but one that dies while *no* task runs makes it give up on the whole pool ("All workers
    expired"). The day this fails, pebble heals such a pool itself and the replacement can go."""
    pool = pebble.ProcessPool(1, context=multiprocessing.get_context("forkserver"))
    try:
        victim = pool.schedule(os.getpid).result(timeout=60)
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: not pool.active, 10, "pebble kept the pool")
    finally:
        pool.stop()
        pool.join()


def test_a_worker_killed_while_idle_is_replaced():
    with GraderPool(workers=1, deadline_s=5.0, inline_verdicts=False) as pool:
        assert pool.wait_ready(60)
        victim = pool.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: pool.worker_pids() not in ([], [victim]), 30, "no worker after the idle one was killed")
        assert pool.submit([("\\boxed{5}", "5")]).result(timeout=30)[0].correct
        assert pool.stats["restarts_crash"] == 1  # (one that died under a task would count too; none did)


def test_caches_are_bounded_in_bytes():
    from stapo.verifier_service.server.cache import ByteLRU

    lru = ByteLRU(max_bytes=50_000, max_entries=10_000)
    for k in range(500):
        lru.put(k.to_bytes(16, "big"), Verdict(True, 1.0, "ok", "x" * 1000, 0.0))
    assert lru.bytes <= 50_000 and 0 < len(lru) < 20
    assert lru.get((499).to_bytes(16, "big")) is not None and lru.get((0).to_bytes(16, "big")) is None
    with GraderPool(workers=1, deadline_s=5.0, cache_max_mb=0.05) as pool:
        pool.grade_many([(f"\\boxed{{{'9' * 2000}{k}}}", "1") for k in range(40)])
        assert 0 < pool.cache_bytes() <= 0.05 * 2**20


def test_pool_is_fork_safe():
    """Fork after grading: the child grades (under a timeout) with workers of its own,
    and its exit leaves the parent's workers alone (multiprocessing's exit handler would SIGTERM them)."""
    with GraderPool(workers=1, deadline_s=5.0, inline_verdicts=False) as pool:  # worker items only
        assert pool.grade("\\boxed{2}", "2").correct
        parent_workers = pool.worker_pids()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                os.close(r)
                signal.alarm(90)  # a hang kills the child; the parent sees no answer
                res = pool.grade_many([("\\boxed{3}", "3"), ("so \\boxed{4}", "5")])
                # a worker reports its pid on the ready pipe, read by the pool's thread: under load
                # that report can come after the worker's first result
                until = time.monotonic() + 20
                while not pool.worker_pids() and time.monotonic() < until:
                    time.sleep(0.05)
                out = {"res": [[x.correct, x.status] for x in res], "workers": pool.worker_pids()}
                os.write(w, json.dumps(out).encode())
                from multiprocessing import util

                util._exit_function()  # what a normal interpreter exit runs (stops daemonic children)
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        ready, _, _ = select.select([r], [], [], 120)
        data = os.read(r, 65536) if ready else b""
        os.close(r)
        _, status = os.waitpid(pid, 0)
        assert data, "the forked child did not answer (hung?)"
        out = json.loads(data)
        assert out["res"] == [[True, "ok"], [False, "ok"]]
        assert out["workers"] and not set(out["workers"]) & set(parent_workers)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        time.sleep(0.5)
        assert pool.worker_pids() == parent_workers  # the child's exit did not touch them
        assert pool.grade("\\boxed{6}", "6").correct and pool.stats["restarts_crash"] == 0
