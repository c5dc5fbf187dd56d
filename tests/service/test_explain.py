"""``explain: true`` on /v1/verify: each result names the grader's rule that decided it, with the
extracted answer, also when a cache answers; without it the results keep their plain shape."""

from __future__ import annotations

import dataclasses

import pytest

from stapo.verifier_service.grader import GradeResult, grade

HAS_RULE = "rule" in {f.name for f in dataclasses.fields(GradeResult)}

ITEMS = [
    {"prediction": "so \\boxed{\\frac{1}{2}}", "gold": "0.5"},
    {"prediction": "the answer is \\boxed{7}", "gold": "8"},
    {"prediction": "no answer here", "gold": "3"},
    {"prediction": "Answer: 12", "gold": "12", "mode": "dapo"},
]


def test_plain_results_have_no_rule(http):
    r = http.post("/v1/verify", json={"items": ITEMS[:1]})
    assert r.status_code == 200 and "rule" not in r.json()["results"][0]


@pytest.mark.skipif(not HAS_RULE, reason="GradeResult has no 'rule' field yet (the grader's rule table)")
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
