"""Bounded answer time for every client: a request that sends no ``budget_s`` gets the default one.

The session server (conftest) has 2 workers, a 2 s deadline and the default budget factor (4), so
a request without a budget that holds items the grader cannot finish answers within 8 s. Its ordinary items are graded
first (pathological shapes go after the rest of their request), so they are graded right.
"""

from __future__ import annotations

import random
import time

from tests.service.conftest import DEADLINE_S, sympy_items

BUDGET_S = 4 * DEADLINE_S  # Settings.default_budget_factor x the server's deadline


def pathological(n: int) -> list[dict]:
    """Power towers and deeply nested brackets, each with a gold of its own (no cache helps)."""
    out = []
    for k in range(n):
        if k % 2:
            pred = f"so \\boxed{{{k + 2}^{{{k + 2}^{{{k + 2}^{{{k + 2}^{k + 2}}}}}}}}}"
        else:
            pred = "the answer is \\boxed{" + "(" * 300 + str(k) + ")" * 300 + "}"
        out.append({"prediction": pred, "gold": str(700_000 + k)})
    return out


def test_a_request_without_budget_answers_within_the_default_budget(http, server):
    server.wait_full()
    ordinary = sympy_items(20, start=7000)
    items = pathological(40) + ordinary
    order = list(range(len(items)))
    random.Random(5).shuffle(order)
    t0 = time.monotonic()
    r = http.post("/v1/verify", json={"items": [items[i] for i in order]})  # no budget_s
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    got = {i: res for i, res in zip(order, r.json()["results"], strict=True)}
    # the slack covers HTTP, the watchdog's tick and pebble's kill on a loaded 2-core machine
    assert elapsed < BUDGET_S + 2.0, f"{elapsed:.1f} s for a request without a budget"
    bad = [got[i] for i in range(40, 60) if not (got[i]["status"] == "ok" and got[i]["correct"])]
    assert not bad, bad[:3]
    assert all(got[i]["status"] in ("timeout", "ok", "no_answer", "error") for i in range(40))
    assert sum(got[i]["status"] == "timeout" for i in range(40)) > 0  # the budget cut them, not the grader
    server.wait_full(timeout=15)
