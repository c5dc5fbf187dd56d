"""The pool used in-process (no HTTP) and the `stapo verifier` commands."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from stapo.cli.common import CLIError
from stapo.cli.verifier import app as verifier_app
from stapo.cli.verifier import build_settings
from stapo.verifier_service.server.pool import GraderPool, PoolClosed
from stapo.verifier_service.server.scheduler import PoolBusy


@pytest.fixture(scope="module")
def pool():
    # inline_verdicts off: these tests are about the worker path (a boxed integer against an integer gold
    # would otherwise be decided in this process and never queued; tests/service/test_inline_verdicts.py)
    with GraderPool(
        workers=1,
        deadline_s=1.5,
        max_prediction_chars=1000,
        max_pending_items=50,
        cache_size=8,
        inline_verdicts=False,
    ) as p:
        assert p.wait_ready(60)
        yield p


def test_pool_order_duplicates_cache_and_limits(pool):
    items = [
        ("\\boxed{2}", "2"),
        ("\\boxed{3}", "2"),
        ("\\boxed{2}", "2"),
        ("x" * 1001, "2"),
        {"prediction": "Answer: 7", "gold": "7", "mode": "dapo"},
    ]
    before = dict(pool.stats)
    res = pool.grade_many(items)
    assert [(r.correct, r.status) for r in res] == [
        (True, "ok"),
        (False, "ok"),
        (True, "ok"),
        (False, "too_large"),
        (True, "ok"),
    ]
    assert pool.stats["cache_hits"] - before.get("cache_hits", 0) == 1  # the duplicate was not sent
    again = pool.grade_many(items[:1])[0]
    assert again.correct and again.ms == 0.0  # answered from the result cache
    assert pool.cache_len() <= 8


def test_pool_deadline_kills_and_replaces_the_worker(pool):
    pid = pool.worker_pids()[0]
    t0 = time.monotonic()
    r = pool.grade("\\boxed{9^{9^{9^{9^9}}}}", "3")
    assert r.status == "timeout" and not r.correct and time.monotonic() - t0 < 1.5 + 1.0
    assert pool.grade("\\boxed{4}", "4").correct  # a fresh worker took over
    assert pool.worker_pids() != [pid] and pool.stats["restarts_timeout"] >= 1


def test_pool_backpressure_and_bad_items(pool):
    with pytest.raises(PoolBusy, match="max_pending_items"):
        pool.submit([(f"\\boxed{{{k}}}", "1") for k in range(51)])
    with pytest.raises(ValueError, match="gold"):
        pool.grade_many([{"prediction": "1"}])
    with pytest.raises(ValueError, match="workers"):
        GraderPool(workers=0)
    with pytest.raises(ValueError, match="start_method"):
        GraderPool(workers=1, start_method="fork")


def test_closed_pool_refuses_work():
    p = GraderPool(workers=1, deadline_s=1.0)
    p.close()
    with pytest.raises(PoolClosed):
        p.grade("1", "1")


def test_cli_settings_and_bad_flags(monkeypatch):
    monkeypatch.setenv("STAPO_VERIFIER_DEADLINE_S", "3")
    s = build_settings(workers=3, port=None)
    assert (s.workers, s.deadline_s, s.host) == (3, 3.0, "127.0.0.1")  # flag > env > default
    with pytest.raises(CLIError, match="deadline_s"):
        build_settings(deadline_s=-1)
    with pytest.raises(CLIError, match="bench only targets"):
        CliRunner().invoke(verifier_app, ["bench", "http://example.com:8000"], catch_exceptions=False)


def test_cli_bench_prints_throughput_and_latency(server):
    res = CliRunner().invoke(
        verifier_app,
        ["bench", server.url, "--requests", "4", "--batch", "16", "--concurrency", "2"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    for word in ("items/s", "p50 ms", "p99 ms", "service", "math-verify", "statuses"):
        assert word in res.output


def test_service_path_never_imports_torch():
    """The verifier image has no torch: nothing the service imports may pull it in."""
    import subprocess
    import sys

    code = (
        "import sys, stapo.verifier_service.server.app, stapo.verifier_service.clients.client, stapo.verifier_service.server.pool, "
        "stapo.verifier_service.clients.adapters, stapo.cli.verifier, stapo.verifier_service.server.warmup; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_batched_results_before_a_hang_are_not_blamed():
    """Results travel in batches; a worker killed mid-task loses the unsent ones, which are regraded.

    One worker, one task: fast items, then a hang, then fast items. Only the hang is a timeout.
    """
    items = [(f"\\boxed{{{k}}}", str(k)) for k in range(10)]
    items += [("\\boxed{5^{5^{5^{5^5}}}}", "3")]
    items += [(f"\\boxed{{{k}}}", str(k + 1)) for k in range(5)]
    with GraderPool(workers=1, deadline_s=1.5) as one:
        assert one.wait_ready(60)
        res = one.grade_many(items)
        assert one.stats["restarts_timeout"] == 1
    assert [r.status for r in res] == ["ok"] * 10 + ["timeout"] + ["ok"] * 5
    assert [r.correct for r in res] == [True] * 10 + [False] * 6
