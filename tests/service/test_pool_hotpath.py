"""The server process's per-item and per-request path of GraderPool: cheaper, same behaviour.

- ``as_item`` passes validated ``(str, str, mode)`` tuples through without pydantic, and still
  rejects everything else with the field named;
- ``cache_key`` is the blake2b-128 of mode, gold, prediction, each NUL-terminated (checked against
  hashlib fed part by part, an independent computation);
- ``submit`` wakes the dispatcher only when it sleeps with a worker idle: no wake-up byte while every
  worker is busy, and no lost wake-up when one is idle (a lost one would cost the dispatcher's 1 s
  wait timeout per request: the loose time bound below would catch it);
- a worker's RSS is read after its first task, then every ``RSS_CHECK_ITEMS`` items.
"""

from __future__ import annotations

import hashlib
import time

import pytest
from pydantic import ValidationError

from stapo.verifier_service import pool as P
from stapo.verifier_service.pool import GraderPool, as_item, cache_key, verdict_key


def test_as_item_fast_path_and_its_limits():
    assert as_item(("so \\boxed{2}", "2", "math")) == ("so \\boxed{2}", "2", "math")
    assert as_item(("Answer: 2", "2", "dapo")) == ("Answer: 2", "2", "dapo")
    assert as_item(("a", "b")) == ("a", "b", "math")
    assert as_item({"prediction": "a", "gold": "b", "mode": "dapo"}) == ("a", "b", "dapo")
    with pytest.raises(ValidationError, match="mode"):
        as_item(("a", "b", "nope"))
    with pytest.raises(ValidationError, match="gold"):
        as_item(("a", 1, "math"))

    class S(str):
        pass

    out = as_item((S("x"), "y", "math"))  # a str subclass goes through pydantic, as before
    assert out == ("x", "y", "math")


def test_cache_key_is_blake2b_of_the_nul_terminated_parts():
    for pred, gold, mode in [("so \\boxed{2}", "2", "math"), ("\ud800 lone", "é", "dapo"), ("", "", "math")]:
        h = hashlib.blake2b(digest_size=16)
        for part in (mode, gold, pred):
            h.update(part.encode("utf-8", "surrogatepass"))
            h.update(b"\x00")
        assert cache_key((pred, gold, mode)) == h.digest()
    h = hashlib.blake2b(digest_size=16)
    for part in ("verdict", "math", "4", "4"):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    vk = verdict_key(("so \\boxed{4}", "4", "math"))
    assert vk is not None and vk.digest == h.digest()
    # distinct items, distinct keys (the NUL separators keep "ab"+"c" apart from "a"+"bc")
    assert cache_key(("c", "ab", "math")) != cache_key(("bc", "a", "math"))


def _count_wakes(pool: GraderPool) -> list[int]:
    calls = [0]
    real = pool._wake

    def counting() -> None:
        calls[0] += 1
        real()

    pool._wake = counting  # type: ignore[method-assign]
    return calls


def test_submit_wakes_an_idle_dispatcher_and_never_loses_a_wakeup():
    with GraderPool(workers=1, deadline_s=5.0, verdict_cache=False, warmup=False) as pool:
        assert pool.wait_ready(60)
        calls = _count_wakes(pool)
        t0 = time.monotonic()
        for k in range(20):  # each one reaches the (idle) worker; caches off: a real grade each
            time.sleep(0.01)  # let the dispatcher fall asleep again
            r = pool.grade(f"so \\boxed{{{k}}}", str(k))
            assert r.correct and r.status == "ok"
        # 20 lost wake-ups would take >= 20 s (the dispatcher's 1 s wait timeout each)
        assert time.monotonic() - t0 < 10.0
        assert calls[0] >= 1  # it slept with the worker idle: woken by submit


def test_no_wakeup_byte_while_every_worker_is_busy():
    with GraderPool(workers=1, deadline_s=2.0, verdict_cache=False, warmup=False) as pool:
        assert pool.wait_ready(60)
        hung = pool.submit([("\\boxed{5^{5^{5^{5^5}}}}", "7", "math")])  # holds the worker ~2 s
        end = time.monotonic() + 5
        while pool.ready_workers() and not any(w.state == "busy" for w in pool._workers):
            assert time.monotonic() < end
            time.sleep(0.01)
        calls = _count_wakes(pool)
        futs = [pool.submit([(f"so \\boxed{{{k}}}", str(k), "math")]) for k in range(10)]
        assert calls[0] == 0  # the worker is busy: its result wakes the dispatcher, not us
        assert hung.result(30)[0].status == "timeout"
        assert all(f.result(30)[0].correct for f in futs)  # and the queued work still ran


def test_rss_is_read_after_the_first_task_then_every_n_items(monkeypatch):
    reads: list[int] = []
    real = P._rss_mb

    def counting(pid):
        reads.append(pid)
        return real(pid)

    monkeypatch.setattr(P, "_rss_mb", counting)
    with GraderPool(workers=1, deadline_s=5.0, verdict_cache=False, warmup=False, batch_size=4) as pool:
        assert pool.wait_ready(60)
        for k in range(40):
            assert pool.grade(f"so \\boxed{{{k}}}", str(k)).correct
        n_first = len(reads)
        assert 1 <= n_first <= 2  # after the first task (done=1), and at done >= 65 not yet
        for k in range(40, 80):
            assert pool.grade(f"so \\boxed{{{k}}}", str(k)).correct
        assert len(reads) == n_first + 1  # 80 items: one more read, at 65
