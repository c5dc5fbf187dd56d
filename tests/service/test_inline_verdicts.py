"""Verdicts decided in the server process (``grader.compare(..., budget="cheap")`` in ``cache.Memo.plan``).

The server process decides a first-seen (gold, answer) pair itself when only string and exact-number
tests are needed; everything else goes to a worker. What must hold: a decided verdict is the one
``grade`` returns (on the grading corpus, the RL streams and by hand), hostile answers cannot make
the deadline-less server process spend real time, and a service with inline verdicts answers every
item exactly as one without them (real uvicorn servers, real HTTP).
"""

from __future__ import annotations

import json
import time
from importlib import resources

import httpx
import pytest

from stapo.verifier_service.clients.loadgen import build_stream, load_golds
from stapo.verifier_service.grader import Answer, compare, extract, grade
from tests.service.conftest import start_server


def cheap_verdict(gold: str, answer: str, mode: str) -> bool | None:
    """The verdict budget ``cheap`` gives for a response whose final answer is ``answer``; None: only a
    worker can tell (or the mode is unknown)."""
    try:
        v = compare(gold, Answer(answer, mode), budget="cheap")
    except ValueError:
        return None
    return None if v is None else v.correct


def _corpus_dev() -> list[tuple[str, str, str]]:
    text = resources.files("stapo.verifier_service").joinpath("data", "corpus_dev.jsonl").read_text("utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [(r["prediction"], r["gold"], "math") for r in rows]


def _streams() -> list[tuple[str, str, str]]:
    boxed = build_stream(1200, seed=11)
    dapo = build_stream(1200, seed=12, style="answer_line", golds=load_golds(source="dapo17k"))
    # the answer-line stream once more in mode dapo (the DAPO string rule)
    return boxed + dapo + [(p, g, "dapo") for p, g, _ in dapo[:600]]


@pytest.mark.parametrize("source", ["corpus_dev", "streams"])
def test_a_decided_verdict_is_the_graders(source):
    items = _corpus_dev() if source == "corpus_dev" else _streams()
    decided = 0
    for pred, gold, mode in items:
        answer = extract(pred, mode, budget="cheap")
        if answer is None or answer.text is None:
            continue
        q = cheap_verdict(gold, answer.text, mode)
        if q is None:
            continue
        decided += 1
        r = grade(pred, gold, mode)
        assert r.status == "ok" and r.correct is q and r.extracted == answer.extracted, (
            pred[-120:],
            gold,
            mode,
            q,
            r,
        )
    # it must actually decide most of them (integer golds, equal strings), or it buys nothing
    assert decided > 0.3 * len(items), (decided, len(items))


@pytest.mark.parametrize(
    ("gold", "answer", "mode", "expected"),
    [
        ("12", "12", "math", True),
        ("12", "12.0", "math", True),
        ("12", "\\text{12}", "math", True),
        ("1,450", "1450", "math", True),
        ("0.5", "\\frac{1}{2}", "math", True),
        ("\\frac{3}{4}", "0.75", "math", True),
        ("50\\%", "50", "math", True),
        ("7", "8", "math", False),
        ("12", "-12", "math", False),
        ("(B)", "B", "math", True),
        ("(B)", "C", "math", False),
        ("y = 2x + 3", "y=2x+3", "math", True),  # equal up to spacing: no sympy needed
        ("y = 2x + 3", "y=7x+3", "math", None),  # an equation: a worker decides
        ("\\sqrt{2}", "\\sqrt{3}", "math", None),
        ("1" * 70, "1" * 70, "math", None),  # longer than budget cheap compares: a worker decides
        ("5", "5", "verify_only_math_and_dapo", None),
        ("5", "5 a ", "dapo", True),  # DAPO removes "a " before spaces: 5
        ("5", "5 a", "dapo", False),  # ... but not a trailing "a": 5a
        ("1000", "$1{,}000$", "dapo", True),
        ("1/2", "0.5", "dapo", False),  # the DAPO rule is strings only
    ],
)
def test_cheap_verdict_by_hand(gold, answer, mode, expected):
    assert cheap_verdict(gold, answer, mode) is expected


def test_hostile_answers_are_not_worked_on_in_the_server_process():
    """Huge exponents, power towers, deep braces: decided cheaply or left to a worker, never computed.

    The bound is a hang guard (seconds), not a timing claim: 10^(10^8) or 9^9^9^9^9 evaluated exactly
    would take minutes or exhaust memory."""
    hostile = [
        "1e999999999", "10^{99999999}", "9^{9^{9^{9^9}}}", "2^{2^{2^{2^{2^{2}}}}}", "1" * 64, "{" * 30 + "}" * 30,
        "\\frac{1}{0}", "0/0", "1e400", "-0.0000000000000000000000000000000000001", "10^{400}", "10^{401}",
    ]  # fmt: skip
    t0 = time.monotonic()
    for a in hostile:
        for g in ("1", "10^{400}", a):
            cheap_verdict(g, a, "math")
    assert time.monotonic() - t0 < 5.0
    assert cheap_verdict("1", "9^{9^{9^{9^9}}}", "math") is None  # only a worker (with a deadline) may try


def test_service_answers_the_same_with_and_without_inline_verdicts(server):
    """Two real servers (the session's, and one with STAPO_VERIFIER_INLINE_VERDICTS=false): the same
    results item by item; the inline one sends far fewer items to its workers. One request also holds
    two DAPO answers that look alike once stripped ("5 a " and "5 a") but get different DAPO verdicts: keyed on the raw line,
    neither inherits the other's verdict (keyed on the stripped text, the second would)."""
    items = [{"prediction": p, "gold": g, "mode": m} for p, g, m in _streams()[::8]]
    twins = [
        {"prediction": "Work.\nAnswer: 5 a ", "gold": "5", "mode": "dapo"},
        {"prediction": "Other work.\nAnswer: 5 a", "gold": "5", "mode": "dapo"},
    ]
    out = {}
    for name in ("inline", "workers"):
        srv = server if name == "inline" else start_server(STAPO_VERIFIER_INLINE_VERDICTS="false")
        try:
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                res = []
                for i in range(0, len(items), 64):
                    r = c.post("/v1/verify", json={"items": items[i : i + 64]})
                    assert r.status_code == 200, r.text
                    res += r.json()["results"]
                r = c.post("/v1/verify", json={"items": twins})
                assert [x["correct"] for x in r.json()["results"]] == [True, False]
                metrics = c.get("/metrics").text
        finally:
            if srv is not server:
                srv.stop()
        out[name] = ([(x["correct"], x["status"], x["extracted"]) for x in res], metrics)
    assert out["inline"][0] == out["workers"][0]
    inline_line = 'stapo_verifier_pool_events_total{event="inline_verdicts"}'
    n_inline = float(
        next(line for line in out["inline"][1].splitlines() if line.startswith(inline_line)).split()[-1]
    )
    assert n_inline > 0.3 * len(items)
    assert f"{inline_line} 0.0" in out["workers"][1]
