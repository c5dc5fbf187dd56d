"""Bounded answer time for every client: a request that sends no ``budget_s`` gets the default one.

The session server (conftest) has 2 workers, a 2 s deadline and the default budget factor (2.8), so
a request without a budget that holds items the grader cannot finish answers within 3 deadlines (6 s). Its ordinary
items are graded first, so they are graded right: shapes ``scheduler.looks_costly`` knows go after the rest
of their request, and shapes it does not know are cut at their first slice of the deadline and sent
again after the rest.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from stapo.verifier_service.server.scheduler import looks_costly
from tests.service.conftest import DEADLINE_S, start_server, sympy_items

BUDGET_S = 3 * DEADLINE_S  # the bound: Settings.default_budget_factor (2.8) x the deadline + the cut-off


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


def new_shapes(n: int) -> list[dict]:
    """Pathological answers of other shapes, a gold each (each holds a worker for a whole deadline or
    most of it): powers with huge exponents, Gamma and binomials of huge numbers, floats times a huge
    power of ten or with a huge e-exponent, left-nested powers, the tangent of a huge power."""
    shapes = [
        lambda k: f"\\boxed{{{99_990 + k}^{{99999999}}}}",
        lambda k: f"\\boxed{{\\Gamma(10^{{{9 + k % 3}}})}}",
        lambda k: f"\\boxed{{1.{k + 1} \\times 10^{{{99_999_990 + k}}}}}",
        lambda k: f"\\boxed{{\\binom{{10^{{9}}}}{{10^{{8}} + {k}}}}}",
        lambda k: f"Therefore the answer is $\\boxed{{1.{k + 3}e99999999}}$.",
        lambda k: f"\\boxed{{(((({k + 7}^{k + 7})^{k + 7})^{k + 7})^{k + 7})^{k + 7}}}",
        lambda k: f"\\boxed{{\\left(10^{{9}}\\right)^{{10^{{{9 + k % 4}}}}}}}",
        lambda k: f"\\boxed{{\\tan(10^{{{100_000 + k}}})}}",
    ]
    return [{"prediction": shapes[k % len(shapes)](k), "gold": str(800_000 + k)} for k in range(n)]


def unknown_shapes(n: int) -> list[dict]:
    """Slow answers ``looks_costly`` does not recognise (the sine of a huge power, nested exponentials):
    only their first run can tell."""
    shapes = [
        lambda k: f"\\boxed{{\\sin(10^{{{99_990 + k}}})}}",
        lambda k: f"\\boxed{{\\exp(\\exp(\\exp(\\exp({10 + k}))))}}",
    ]
    return [{"prediction": shapes[k % len(shapes)](k), "gold": str(900_000 + k)} for k in range(n)]


@pytest.fixture(scope="module")
def default_deadline_server():
    """The service's default item deadline (5 s, so a 15 s default budget and 0.5 s first slices) on
    2 workers: a killed worker's replacement takes about a second to start on this loaded machine,
    which the 2 s session server's 0.2 s slices would not absorb."""
    srv = start_server(workers=2, STAPO_VERIFIER_DEADLINE_S="5")
    yield srv
    srv.stop()


def test_other_shapes_and_unknown_ones(default_deadline_server):
    """40 pathological items of shapes the test above does not use, 4 that ``looks_costly`` does
    not know (cut at their first slice and sent again after the rest), 20 ordinary ones: answered
    within 3 x 5 s, every ordinary item right."""
    srv = default_deadline_server
    known, unknown = new_shapes(40), unknown_shapes(4)
    assert all(looks_costly(x["prediction"]) for x in known)
    assert not any(looks_costly(x["prediction"]) for x in unknown)
    ordinary = sympy_items(20, start=7200)
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        _check_mixed_request(
            http, srv, known + unknown + ordinary, n_bad=len(known) + len(unknown), seed=7, budget_s=15.0
        )
        metrics = http.get("/metrics").text
    sliced = [ln for ln in metrics.splitlines() if 'event="sliced_items"' in ln and not ln.startswith("#")]
    assert sliced and float(sliced[0].split()[-1]) > 0, sliced  # the unknown ones were found by running


def test_a_request_without_budget_answers_within_the_default_budget(http, server):
    server.wait_full()
    ordinary = sympy_items(20, start=7000)
    _check_mixed_request(http, server, pathological(40) + ordinary, n_bad=40, seed=5)


def _check_mixed_request(
    http, server, items: list[dict], *, n_bad: int, seed: int, budget_s: float = BUDGET_S
) -> None:
    """``items``: ``n_bad`` pathological items first, then ordinary right ones; sent shuffled, no
    budget_s. ``budget_s``: the server's default budget (3 x its deadline)."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    t0 = time.monotonic()
    r = http.post("/v1/verify", json={"items": [items[i] for i in order]})  # no budget_s
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    got = {i: res for i, res in zip(order, r.json()["results"], strict=True)}
    # the slack covers HTTP, the watchdog's tick and pebble's kill on a loaded 2-core machine
    assert elapsed < budget_s + 2.0, f"{elapsed:.1f} s for a request without a budget"
    bad = [got[i] for i in range(n_bad, len(items)) if not (got[i]["status"] == "ok" and got[i]["correct"])]
    assert not bad, bad[:3]
    assert all(got[i]["status"] in ("timeout", "ok", "no_answer", "error") for i in range(n_bad))
    assert sum(got[i]["status"] == "timeout" for i in range(n_bad)) > 0  # the budget cut them, not the grader
    server.wait_full(timeout=15)
