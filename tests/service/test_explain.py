"""``explain: true`` on /v1/verify: each result names the grader's rule that decided it, with the
extracted answer, also when a cache answers; without it the results keep their plain shape."""

from __future__ import annotations

import dataclasses

import pytest

from stapo.verifier_service.grader import Verdict, grade

HAS_RULE = "rule" in {f.name for f in dataclasses.fields(Verdict)}

ITEMS = [
    {"prediction": "so \\boxed{\\frac{1}{2}}", "gold": "0.5"},
    {"prediction": "the answer is \\boxed{7}", "gold": "8"},
    {"prediction": "no answer here", "gold": "3"},
    {"prediction": "Answer: 12", "gold": "12", "mode": "dapo"},
]


def test_plain_results_have_no_rule(http):
    r = http.post("/v1/verify", json={"items": ITEMS[:1]})
    assert r.status_code == 200 and "rule" not in r.json()["results"][0]


@pytest.mark.skipif(not HAS_RULE, reason="Verdict has no 'rule' field yet (the grader's rule table)")
def test_explain_names_the_rule_and_the_extracted_answer(http):
    want = [grade(it["prediction"], it["gold"], it.get("mode", "math")) for it in ITEMS]
    for _ in range(2):  # the second time every item is a cache hit: the rule is kept
        r = http.post("/v1/verify", json={"items": ITEMS, "explain": True})
        assert r.status_code == 200, r.text
        got = r.json()["results"]
        assert [g["rule"] for g in got] == [w.rule for w in want]
        assert [g["extracted"] for g in got] == [w.extracted for w in want]
        assert [g["correct"] for g in got] == [w.correct for w in want]
        assert all(isinstance(g["rule"], str) and g["rule"] for g in got)


def test_explain_must_be_a_boolean(http):
    r = http.post("/v1/verify", json={"items": ITEMS[:1], "explain": "maybe"})
    assert r.status_code == 422 and "explain" in r.text


def _counter(http, line_start: str) -> float:
    text = http.get("/metrics").text
    return float(next(line for line in text.splitlines() if line.startswith(line_start)).split()[-1])


def test_inline_verdicts_and_cache_hits_carry_the_rule(http):
    """A verdict decided in the server process (string and exact-number rules, no worker) names its
    rule, and so does the cached verdict that answers the same items again: first a plain request
    (decided inline), then ``explain: true`` twice, answered from the cache (``ms`` 0)."""
    items = [
        {"prediction": "so \\boxed{4127}", "gold": "4127"},  # same-string, decided in the server
        {"prediction": "so \\boxed{4126}", "gold": "4127"},
        {"prediction": "Answer: 4127", "gold": "4127", "mode": "dapo"},
    ]
    want = [grade(it["prediction"], it["gold"], it.get("mode", "math")) for it in items]
    inline_line = 'stapo_verifier_pool_events_total{event="inline_verdicts"}'
    before = _counter(http, inline_line)
    r = http.post("/v1/verify", json={"items": items})
    assert r.status_code == 200 and [g["correct"] for g in r.json()["results"]] == [w.correct for w in want]
    assert _counter(http, inline_line) - before == len(items)  # none went to a worker
    hits = _counter(http, "stapo_verifier_cache_hits_total")
    for _ in range(2):
        r = http.post("/v1/verify", json={"items": items, "explain": True})
        assert r.status_code == 200, r.text
        got = r.json()["results"]
        assert [g["rule"] for g in got] == [w.rule for w in want] == ["same-string", "exact-number", "dapo"]
        assert [g["extracted"] for g in got] == [w.extracted for w in want]
        assert all(g["ms"] == 0.0 for g in got)  # cache hits
    assert _counter(http, "stapo_verifier_cache_hits_total") - hits == 2 * len(items)


def test_undecided_is_reported_not_guessed(http):
    """A gold the grader cannot read: status 'undecided' (no verdict), not a 'wrong' answer."""
    r = http.post(
        "/v1/verify", json={"items": [{"prediction": "so \\boxed{3}", "gold": "@#"}], "explain": True}
    )
    assert r.status_code == 200, r.text
    got = r.json()["results"][0]
    assert (got["status"], got["correct"], got["rule"], got["extracted"]) == (
        "undecided",
        False,
        "undecided",
        "3",
    )
