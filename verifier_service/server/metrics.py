"""Prometheus metrics of the verification service (``GET /metrics``).

Each app gets its own ``CollectorRegistry`` (two apps in one test process do not collide).
Request metrics are recorded as they happen; pool metrics (timeouts, worker restarts, cache hits,
workers up, queue depth) are read from the pool's counters at scrape time, so the pool needs no
knowledge of Prometheus.

    stapo_verifier_requests_total{route,code}      HTTP requests
    stapo_verifier_request_seconds{route}          latency histogram
    stapo_verifier_items_total{status}             graded items by status
    stapo_verifier_timeouts_total                  items killed at the deadline
    stapo_verifier_worker_restarts_total{reason}   timeout | crash | startup
    stapo_verifier_cache_hits_total / _misses_total   result cache (+ duplicates inside a request)
    stapo_verifier_cancelled_requests_total        requests whose client went away (queued items dropped)
    stapo_verifier_pool_events_total{event}        rejected | cancelled_items | expired_items | sliced_items | recycled_items |
                                                   recycled_rss | pool_restarts | fork_rebuilds | verdict_hits |
                                                   inline_verdicts (decided in the server process)
    stapo_verifier_workers / _workers_ready / _pending_items / _queued_seconds / _cache_entries /
    _cache_bytes   gauges
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
POOL_EVENTS = (
    "rejected",
    "cancelled_items",
    "expired_items",
    "sliced_items",
    "recycled_items",
    "recycled_rss",
    "pool_restarts",
    "fork_rebuilds",
    "verdict_hits",
    "inline_verdicts",
)
ROUTES = frozenset({"/v1/verify", "/get_reward", "/healthz", "/readyz", "/metrics"})
"""Routes labelled by name; anything else is 'other', so a scanner cannot blow up the label set."""


class _PoolCollector(Collector):
    def __init__(self, get_pool: Callable[[], Any]) -> None:
        self._get_pool = get_pool

    def collect(self) -> Iterator[Metric]:
        pool = self._get_pool()
        if pool is None:
            return
        stats = dict(pool.stats)
        yield CounterMetricFamily(
            "stapo_verifier_timeouts",
            "Items that overran the deadline (worker killed)",
            value=stats.get("timeouts", 0),
        )
        restarts = CounterMetricFamily(
            "stapo_verifier_worker_restarts", "Grading workers replaced, by reason", labels=["reason"]
        )
        for reason in ("timeout", "crash", "startup"):
            restarts.add_metric([reason], stats.get(f"restarts_{reason}", 0))
        yield restarts
        events = CounterMetricFamily(
            "stapo_verifier_pool_events",
            "Admission, cancellation, recycling and self-healing events",
            labels=["event"],
        )
        for ev in POOL_EVENTS:
            events.add_metric([ev], stats.get(ev, 0))
        yield events
        yield CounterMetricFamily(
            "stapo_verifier_cache_hits",
            "Items answered from the result cache or a duplicate",
            value=stats.get("cache_hits", 0),
        )
        yield CounterMetricFamily(
            "stapo_verifier_cache_misses", "Items sent to a worker", value=stats.get("cache_misses", 0)
        )
        yield GaugeMetricFamily("stapo_verifier_workers", "Configured grading workers", value=pool.size)
        yield GaugeMetricFamily(
            "stapo_verifier_workers_ready", "Grading workers up", value=pool.ready_workers()
        )
        yield GaugeMetricFamily(
            "stapo_verifier_pending_items", "Items queued or in flight", value=pool.pending_items()
        )
        yield GaugeMetricFamily(
            "stapo_verifier_queued_seconds",
            "Estimated seconds of grading queued, per worker (admission control)",
            value=pool.queued_seconds(),
        )
        yield GaugeMetricFamily(
            "stapo_verifier_cache_entries", "Entries in the result caches", value=pool.cache_len()
        )
        yield GaugeMetricFamily(
            "stapo_verifier_cache_bytes", "Estimated bytes of the result caches", value=pool.cache_bytes()
        )


class ServiceMetrics:
    """The metrics of one app; ``render()`` gives the Prometheus text format."""

    def __init__(self, get_pool: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "stapo_verifier_requests",
            "HTTP requests by route and status code",
            ["route", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "stapo_verifier_request_seconds",
            "Request latency in seconds",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.items = Counter(
            "stapo_verifier_items", "Graded items by status", ["status"], registry=self.registry
        )
        self.cancelled_requests = Counter(
            "stapo_verifier_cancelled_requests",
            "Requests whose client disconnected before the answer (their queued items were dropped)",
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(get_pool))
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}

    def observe_request(self, path: str, code: int, seconds: float) -> None:
        route = path if path in ROUTES else "other"
        children = self._children.get((route, code))
        if children is None:  # labels() locks and builds a key on every call: once per (route, code)
            children = self._children[(route, code)] = (
                self.requests.labels(route, str(code)),
                self.latency.labels(route),
            )
        children[0].inc()
        children[1].observe(seconds)

    def observe_statuses(self, statuses: list[str]) -> None:
        counts: dict[str, int] = {}
        for s in statuses:
            counts[s] = counts.get(s, 0) + 1
        for s, n in counts.items():
            self.items.labels(s).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
