"""Fixtures of the service tests: real uvicorn servers on 127.0.0.1 in subprocesses, real math-verify.

The main server (session scope, started once) runs 2 workers with a 2 s deadline so hostile inputs
cost seconds, not minutes; its body limit is 4 MiB so a 1 MB string reaches the pool (too_large)
while a 5 MB body is refused (413).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

DEADLINE_S = 2.0
WORKERS = 2
MAX_BODY = 4 * 1024 * 1024
MAX_ITEMS = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    workers: int

    def ready(self) -> dict:
        return httpx.get(f"{self.url}/readyz", timeout=5).json()

    def worker_pids(self) -> list[int]:
        """The grading workers: children of the server's fork server (/readyz does not show PIDs)."""
        import psutil

        out = []
        for child in psutil.Process(self.proc.pid).children():
            with contextlib.suppress(psutil.Error):
                if "forkserver" in " ".join(child.cmdline()):
                    out += [g.pid for g in child.children() if g.is_running()]
        return sorted(out)

    def rss_mb(self) -> float:
        """Resident memory of the server and everything under it, in MiB."""
        import psutil

        root = psutil.Process(self.proc.pid)
        total = 0
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total / 2**20

    def wait_full(self, timeout: float = 30.0) -> dict:
        """Block until every worker is up again (after a kill or a timeout)."""
        end = time.monotonic() + timeout
        body: dict = {}
        while time.monotonic() < end:
            try:
                body = self.ready()
                if body.get("workers_ready") == self.workers:
                    return body
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"pool not back to {self.workers} workers: {body}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(
    workers: int = WORKERS, *, args: tuple[str, ...] = (), capture_stdout: bool = False, **env_overrides: str
) -> Server:
    """A real ``stapo verifier serve`` on a free loopback port; stdout (the access log) kept on request."""
    port = free_port()
    env = dict(os.environ)
    env.update(
        STAPO_VERIFIER_WORKERS=str(workers),
        STAPO_VERIFIER_DEADLINE_S=str(DEADLINE_S),
        STAPO_VERIFIER_MAX_BODY_BYTES=str(MAX_BODY),
        STAPO_VERIFIER_MAX_ITEMS=str(MAX_ITEMS),
        STAPO_VERIFIER_LOG_LEVEL="warning",
        STAPO_VERIFIER_GRACEFUL_SHUTDOWN_S="20",
    )
    env.pop("STAPO_VERIFIER_TOKEN", None)
    env.update(env_overrides)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stapo.cli.main", "verifier", "serve", "--port", str(port), *args],
        env=env,
        stdout=subprocess.PIPE if capture_stdout else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    srv = Server(f"http://127.0.0.1:{port}", proc, workers)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{srv.url}/readyz", timeout=2).json().get("workers_ready") == workers:
                return srv
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    srv.stop()
    raise RuntimeError("server did not become ready in 60 s")


def wait_pending(srv: Server, pred, timeout: float) -> dict:
    """Poll /readyz until ``pred(body)`` holds; the last body (AssertionError after ``timeout``)."""
    end = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            body = srv.ready()
            if pred(body):
                return body
        time.sleep(0.05)
    raise AssertionError(f"condition not reached in {timeout} s; /readyz: {body}")


@pytest.fixture(scope="session")
def server():
    srv = start_server()
    yield srv
    code = srv.stop()
    # uvicorn re-raises SIGTERM after its graceful shutdown, so -15 is the normal end; 0 is fine too
    assert code in (0, -signal.SIGTERM), f"server exit status {code} after SIGTERM"


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def verify(http: httpx.Client, items: list[dict]) -> list[dict]:
    r = http.post("/v1/verify", json={"items": items})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert len(res) == len(items)
    return res


def sympy_items(n: int, start: int = 1) -> list[dict]:
    """Distinct, correct items that no string/number fast path can decide (a real sympy comparison each,
    tens of ms): they keep a request in flight long enough to act on it. Use a fresh ``start`` per test,
    or the caches answer them at once."""
    return [
        {
            "prediction": f"so \\boxed{{\\frac{{{k}\\sqrt{{2}}}}{{{k + 1}}}}}",
            "gold": f"\\frac{{\\sqrt{{{2 * k * k}}}}}{{{k + 1}}}",
        }
        for k in range(start, start + n)
    ]


def wait_in_flight(srv: Server, thread, timeout: float = 10.0) -> None:
    """Block until the server's pool holds queued or in-flight items (the request reached the workers)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and thread.is_alive():
        try:
            if srv.ready().get("pending_items", 0) > 0:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.01)
    raise AssertionError("the request never showed up in flight")
