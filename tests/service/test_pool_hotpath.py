"""The server process's per-item path of GraderPool and its keys.

- ``as_item`` passes validated ``(str, str, mode)`` tuples through without pydantic, and still
  rejects everything else with the field named;
- cache and verdict keys are blake2b-128 of length-prefixed fields (checked against hashlib fed by
  hand, an independent computation), so no field contents make two items share a key: a pair that
  collides under fields joined with NUL is graded apart;
- a pool that sleeps with an idle worker answers every newly submitted item at once (no lost wake-up).
"""

from __future__ import annotations

import hashlib
import time

import pytest
from pydantic import ValidationError

from stapo.verifier_service.grader import grade
from stapo.verifier_service.server.cache import cache_key, cheap_answer, verdict_key
from stapo.verifier_service.server.pool import GraderPool
from stapo.verifier_service.server.schemas import as_item


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

    out = as_item((S("x"), "y", "math"))  # a str subclass goes through pydantic (validated, returned as str)
    assert out == ("x", "y", "math")


def _by_hand(*parts: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        b = part.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


def test_keys_are_blake2b_of_length_prefixed_fields():
    for pred, gold, mode in [("so \\boxed{2}", "2", "math"), ("\ud800 lone", "é", "dapo"), ("", "", "math")]:
        assert cache_key((pred, gold, mode)) == _by_hand(mode, gold, pred)
    vk = verdict_key("4", cheap_answer(("so \\boxed{4}", "4", "math")))
    assert vk.digest == _by_hand("verdict", "math", "4", "4")


def test_a_pair_that_collides_when_fields_are_joined_gets_its_own_verdict():
    """Joined with NUL (a separator instead of length prefixes), these two items are one key: the second
    would have been answered with the first one's cached verdict."""
    first = ("x\x00\\boxed{3}", "3", "math")  # the box says 3, the gold is 3: correct
    second = ("\\boxed{3}", "3\x00x", "math")  # the gold is "3<NUL>x": not 3
    joined = [f"{m}\x00{g}\x00{p}\x00" for p, g, m in (first, second)]
    assert joined[0] == joined[1]  # a joined key's input: a real collision
    assert cache_key(first) != cache_key(second)
    want = [grade(*first), grade(*second)]
    assert want[0].correct != want[1].correct  # the verdicts differ, so a shared key would be wrong
    with GraderPool(workers=1, deadline_s=5.0, warmup=False) as pool:
        assert pool.grade(*first).correct == want[0].correct
        assert pool.grade(*second).correct == want[1].correct  # not the first one's cached verdict


def test_an_idle_pool_answers_each_new_item_at_once():
    with GraderPool(workers=1, deadline_s=5.0, verdict_cache=False, warmup=False) as pool:
        assert pool.wait_ready(60)
        t0 = time.monotonic()
        for k in range(20):  # each one reaches the (idle) worker; caches off: a real grade each
            time.sleep(0.01)
            r = pool.grade(f"so \\boxed{{{k}}}", str(k))
            assert r.correct and r.status == "ok"
        # a lost wake-up costs a watchdog tick at least; 20 of them would be seconds
        assert time.monotonic() - t0 < 10.0


def test_queued_work_runs_while_the_only_worker_is_held_by_a_hang():
    with GraderPool(workers=1, deadline_s=2.0, verdict_cache=False, warmup=False) as pool:
        assert pool.wait_ready(60)
        hung = pool.submit([("\\boxed{5^{5^{5^{5^5}}}}", "7", "math")])  # holds the worker ~2 s
        futs = [pool.submit([(f"so \\boxed{{{k}}}", str(k), "math")]) for k in range(10)]
        assert hung.result(30)[0].status == "timeout"
        assert all(f.result(30)[0].correct for f in futs)
