"""HTTP clients of the verification service: ``VerifierClient`` (sync) and ``AsyncVerifierClient``.

* batching: items are sent in requests of ``batch_size``;
* sharding and failover: with several URLs, batch k goes to URL k mod n first, and to the next
  URL when that one fails (a dead replica costs one connection error, not the run);
* retries with exponential backoff (+ jitter) on connection errors, timeouts and 5xx; a 429
  (the service's queue is full of work) waits the ``Retry-After`` it gives, plus up to 25% jitter
  so that many clients do not come back in lockstep, and does not use up a retry (up to
  ``max_busy_wait_s`` in all); the waits are logged and counted in ``busy_waits`` / ``busy_wait_s``;
  other 4xx are the caller's mistake and raise ``VerifierRequestError`` at once;
* each request carries ``budget_s`` = the HTTP timeout: items the service could not start by then
  are not graded for nobody (they answer ``timeout``);
* never a silent 0: when every attempt failed, ``VerifierUnavailable`` is raised. An item the
  service could not grade comes back with its status (``timeout``, ``error``, ``too_large``).

    from stapo.verifier_service.clients.client import VerifierClient
    with VerifierClient(["http://10.0.0.5:8000", "http://10.0.0.6:8000"], token="...") as vc:
        results = vc.verify([{"prediction": "... \\\\boxed{2}", "gold": "2"}])   # list[Verdict]
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from stapo.verifier_service.grader import Verdict
from stapo.verifier_service.server.schemas import VerifyItem, as_item

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
log = logging.getLogger("stapo.verifier_service.clients.client")


class VerifierUnavailable(RuntimeError):
    """Every URL failed for a batch after all retries: no result is better than a made-up 0."""


class VerifierRequestError(RuntimeError):
    """The service rejected the request itself (4xx other than 429): retrying cannot help."""


def _urls(urls: str | Sequence[str]) -> list[str]:
    out = [urls] if isinstance(urls, str) else list(urls)
    out = [u.rstrip("/") for u in out if u and u.strip()]
    if not out:
        raise ValueError("urls: give at least one service URL (http://host:port)")
    for u in out:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"urls: {u!r} is not an http(s) URL")
    return out


def _parse_results(data: Any, n: int, url: str) -> list[Verdict]:
    try:
        res = data["results"]
        if len(res) != n:
            raise ValueError(f"{len(res)} results for {n} items")
        return [
            Verdict(
                bool(r["correct"]),
                float(r["score"]),
                r["status"],
                r.get("extracted"),
                float(r.get("ms", 0.0)),
                r.get("rule"),
            )
            for r in res
        ]
    except (KeyError, TypeError, ValueError) as err:
        raise VerifierUnavailable(f"{url}: malformed answer from the service ({err})") from err


class _Base:
    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 5,
        batch_size: int = 256,
        concurrency: int = 4,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        max_busy_wait_s: float = 600.0,
    ) -> None:
        self.urls = _urls(urls)
        if retries < 0:
            raise ValueError(f"retries: must be >= 0, got {retries}")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        self.timeout_s = timeout_s
        self.retries = retries
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_busy_wait_s = max_busy_wait_s
        self.busy_waits = 0  # 429s honoured
        self.busy_wait_s = 0.0  # seconds spent waiting on them
        self._stats_lock = threading.Lock()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    def _batches(self, items: Sequence[VerifyItem | dict | Sequence[str]]) -> list[list[dict[str, str]]]:
        norm = [as_item(x, f"items[{i}]") for i, x in enumerate(items)]
        rows = [{"prediction": p, "gold": g, "mode": m} for p, g, m in norm]
        return [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after:
            try:
                return min(self.max_backoff_s, max(0.0, float(retry_after)))
            except ValueError:
                pass
        base = min(self.max_backoff_s, self.backoff_s * (2**attempt))
        return base * (0.5 + random.random() / 2)  # jitter: replicas do not get hit in lockstep

    def _busy_delay(self, resp: httpx.Response, url: str, waited: float) -> float | None:
        """A 429: the Retry-After the service estimated, + up to 25% jitter; None once waited too long."""
        try:
            base = max(0.5, float(resp.headers.get("retry-after", "1")))
        except ValueError:
            base = 1.0
        delay = base * (1.0 + random.random() / 4)
        if waited + delay > self.max_busy_wait_s:
            return None
        with self._stats_lock:
            self.busy_waits += 1
            self.busy_wait_s += delay
        log.warning("verifier %s busy (429): waiting %.1f s as it asked (Retry-After %s)", url, delay, base)
        return delay

    def _body(self, batch: list[dict[str, str]]) -> dict[str, Any]:
        # explain: each result names the grader rule that decided it, so a trainer grading through
        # the service logs reward/rule/<name> as one grading in-process does (a few bytes per item).
        return {"items": batch, "budget_s": self.timeout_s, "explain": True}

    def _plan(self, k: int, attempt: int) -> str:
        """URL for batch k on this attempt: its shard first, then the others in turn (failover)."""
        return self.urls[(k + attempt) % len(self.urls)]

    @staticmethod
    def _classify(resp: httpx.Response, url: str) -> str | None:
        """None: success; 'retry': transient; raise for a request the service will never accept."""
        if resp.status_code == 200:
            return None
        if resp.status_code in RETRY_STATUS:
            return "retry"
        try:
            detail = resp.json().get("detail")
        except ValueError:
            detail = resp.text[:300]
        raise VerifierRequestError(f"{url}: HTTP {resp.status_code}: {detail}")


class VerifierClient(_Base):
    """Synchronous client (thread-safe); batches go out ``concurrency`` at a time."""

    def __init__(self, urls: str | Sequence[str], **kw: Any) -> None:
        super().__init__(urls, **kw)
        self._http = httpx.Client(timeout=self.timeout_s, headers=self._headers)

    def verify(self, items: Sequence[VerifyItem | dict | Sequence[str]]) -> list[Verdict]:
        """Grade items; one ``Verdict`` per item, in order. Raises ``VerifierUnavailable``."""
        batches = self._batches(items)
        if not batches:
            return []
        if len(batches) == 1 or self.concurrency == 1:
            parts = [self._send(k, b) for k, b in enumerate(batches)]
        else:
            with ThreadPoolExecutor(min(self.concurrency, len(batches))) as ex:
                parts = list(ex.map(self._send, range(len(batches)), batches))
        return [r for part in parts for r in part]

    def _send(self, k: int, batch: list[dict[str, str]]) -> list[Verdict]:
        last = "no attempt made"
        attempt = waited = 0
        while attempt <= self.retries:
            url = self._plan(k, attempt)
            retry_after = None
            try:
                resp = self._http.post(f"{url}/v1/verify", json=self._body(batch))
                if self._classify(resp, url) is None:
                    return _parse_results(resp.json(), len(batch), url)
                last = f"{url}: HTTP {resp.status_code}"
                if resp.status_code == 429:
                    busy = self._busy_delay(resp, url, waited)
                    if busy is not None:
                        time.sleep(busy)
                        waited += busy
                        continue
                retry_after = resp.headers.get("retry-after")
            except httpx.TransportError as err:  # connect errors, resets, timeouts
                last = f"{url}: {type(err).__name__}: {err}"
            if attempt < self.retries:
                time.sleep(self._delay(attempt, retry_after))
            attempt += 1
        raise VerifierUnavailable(
            f"verifier unavailable after {self.retries + 1} attempts; last error: {last}"
        )

    def health(self) -> dict[str, bool]:
        """``{url: ready?}`` for every URL (readiness, not just liveness)."""
        out = {}
        for u in self.urls:
            try:
                out[u] = self._http.get(f"{u}/readyz", timeout=min(5.0, self.timeout_s)).status_code == 200
            except httpx.HTTPError:
                out[u] = False
        return out

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VerifierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncVerifierClient(_Base):
    """The asyncio twin of :class:`VerifierClient`."""

    def __init__(self, urls: str | Sequence[str], **kw: Any) -> None:
        super().__init__(urls, **kw)
        self._http = httpx.AsyncClient(timeout=self.timeout_s, headers=self._headers)

    async def verify(self, items: Sequence[VerifyItem | dict | Sequence[str]]) -> list[Verdict]:
        batches = self._batches(items)
        sem = asyncio.Semaphore(self.concurrency)

        async def one(k: int, b: list[dict[str, str]]) -> list[Verdict]:
            async with sem:
                return await self._send(k, b)

        parts = await asyncio.gather(*(one(k, b) for k, b in enumerate(batches)))
        return [r for part in parts for r in part]

    async def _send(self, k: int, batch: list[dict[str, str]]) -> list[Verdict]:
        last = "no attempt made"
        attempt = waited = 0
        while attempt <= self.retries:
            url = self._plan(k, attempt)
            retry_after = None
            try:
                resp = await self._http.post(f"{url}/v1/verify", json=self._body(batch))
                if self._classify(resp, url) is None:
                    return _parse_results(resp.json(), len(batch), url)
                last = f"{url}: HTTP {resp.status_code}"
                if resp.status_code == 429:
                    busy = self._busy_delay(resp, url, waited)
                    if busy is not None:
                        await asyncio.sleep(busy)
                        waited += busy
                        continue
                retry_after = resp.headers.get("retry-after")
            except httpx.TransportError as err:
                last = f"{url}: {type(err).__name__}: {err}"
            if attempt < self.retries:
                await asyncio.sleep(self._delay(attempt, retry_after))
            attempt += 1
        raise VerifierUnavailable(
            f"verifier unavailable after {self.retries + 1} attempts; last error: {last}"
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncVerifierClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
