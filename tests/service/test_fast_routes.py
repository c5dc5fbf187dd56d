"""app.FastRoutes: well-formed /v1/verify and /get_reward requests skip FastAPI's machinery; answers unchanged.

A request sent as ``application/json`` takes the fast path; the same bytes sent as
``application/merge-patch+json`` (a JSON type FastAPI reads, FastRoutes does not) take the FastAPI
route. Both must answer the same status, body and content type; bad requests (which the fast path
replays into the app) must keep their usual 4xx with the reason.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.service.conftest import MAX_ITEMS

FAST = {"content-type": "application/json"}
ROUTE = {"content-type": "application/merge-patch+json"}


def _both(http: httpx.Client, path: str, body: bytes) -> tuple[httpx.Response, httpx.Response]:
    return http.post(path, content=body, headers=FAST), http.post(path, content=body, headers=ROUTE)


def test_well_formed_requests_answer_the_same_on_both_paths(http):
    items = [
        {"prediction": "so \\boxed{\\frac{1}{2}}", "gold": "0.5"},
        {"prediction": "therefore \\boxed{3}", "gold": "4"},
        {"prediction": "", "gold": "4"},
        {"prediction": "x" * 200_000, "gold": "4"},  # too_large
        {"prediction": "Answer: 12", "gold": "12", "mode": "dapo"},
        {"prediction": "Answer: \ud800 7", "gold": "7", "mode": "dapo"},  # lone surrogate: U+FFFD back
    ]
    body = json.dumps({"items": items}).encode()
    http.post("/v1/verify", content=body, headers=FAST)  # fill the caches: ms = 0 on both below
    fast, route = _both(http, "/v1/verify", body)
    assert fast.status_code == route.status_code == 200
    assert fast.headers["content-type"] == route.headers["content-type"] == "application/json"
    assert fast.content == route.content
    res = fast.json()["results"]
    assert [r["status"] for r in res] == ["ok", "ok", "no_answer", "too_large", "ok", "ok"]
    assert [r["correct"] for r in res] == [True, False, False, False, True, False]

    prompt = "<|user|>What is 1+1?<|assistant|>"
    reward = {
        "query": [prompt + "It is \\boxed{2}.", prompt + "no idea"],
        "prompts": [prompt] * 2,
        "labels": ["2", 2],
    }
    body = json.dumps(reward).encode()
    http.post("/get_reward", content=body, headers=FAST)
    fast, route = _both(http, "/get_reward", body)
    assert fast.status_code == route.status_code == 200
    assert fast.content == route.content
    assert fast.json()["rewards"] == [1.0, 0.0]


def test_bad_requests_keep_their_4xx_through_the_fast_path(http):
    cases = {
        b'{"items": [': 422,  # malformed JSON
        b"": 422,  # no body
        b"[1, 2]": 422,  # not an object
        b'{"items": [{"prediction": "1", "gold": 1}]}': 422,  # wrong type
        b'{"items": [{"prediction": "1", "gold": "1", "mode": "nope"}]}': 422,
        b'{"items": [], "budget_s": -1}': 422,
        b'{"items": [{"prediction": "\xff", "gold": "1"}]}': 400,  # not UTF-8
        b"[" * 100_000: 400,  # nested too deep for json.loads (RecursionError)
        json.dumps({"items": [{"prediction": "1", "gold": "1"}] * (MAX_ITEMS + 1)}).encode(): 413,
    }
    for body, code in cases.items():
        fast, route = _both(http, "/v1/verify", body)
        assert fast.status_code == route.status_code == code, (body[:60], fast.text, route.text)
        assert fast.json() == route.json()
        assert fast.json()["detail"]
    r = http.post("/get_reward", content=b'{"query": ["a", "b"], "labels": ["1"]}', headers=FAST)
    assert r.status_code == 422 and "labels" in r.text


def test_charset_parameter_and_other_methods(http):
    body = json.dumps({"items": [{"prediction": "\\boxed{2}", "gold": "2"}]}).encode()
    r = http.post("/v1/verify", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["results"][0]["correct"] is True
    assert http.get("/v1/verify").status_code == 405  # FastAPI's answer, not the fast path's
    assert http.post("/v1/verify/", content=body, headers=FAST).status_code in (200, 307)


def _pydantic_args(data):
    from stapo.verifier_service.schemas import VerifyRequest

    req = VerifyRequest.model_validate(data)
    return [(it.prediction, it.gold, it.mode) for it in req.items], req.budget_s


def test_hand_check_of_verify_bodies_agrees_with_pydantic():
    """parse_verify_request's hand-checked shape: same values as VerifyRequest, and it never accepts
    what pydantic rejects (random bodies with wrong types, odd keys, bad modes and budgets)."""
    import random

    from stapo.verifier_service.app import parse_verify_request

    rng = random.Random(5)
    values = ["x", "", "\\boxed{2}", 2, 2.5, None, True, [], {}, "math", "dapo", "nope", "Math"]
    budgets = [None, 1, 0, -1, 0.5, 86_400, 86_400.5, 10**400, float("nan"), float("inf"), True, "1", [], 3]
    checked = rejected = 0
    for _ in range(4000):
        items = []
        for _ in range(rng.randint(0, 3)):
            it = {k: rng.choice(values) for k in ("prediction", "gold", "mode") if rng.random() < 0.85}
            if rng.random() < 0.6:
                it["prediction"], it["gold"] = f"p{rng.random()}", f"g{rng.random()}"
            if rng.random() < 0.1:
                it["extra"] = 1
            items.append(it if rng.random() < 0.95 else rng.choice(values))
        data = {"items": items} if rng.random() < 0.9 else {"things": items}
        if rng.random() < 0.4:
            data["budget_s"] = rng.choice(budgets)
        if rng.random() < 0.05:
            data["other"] = 1
        try:
            want = _pydantic_args(data)
        except Exception:
            want = None
        try:
            got = parse_verify_request(data)
            got = (got.items, got.budget_s)
        except Exception:
            got = None
        assert got == want, data
        checked += want is not None
        rejected += want is None
    assert checked > 500 and rejected > 500  # both sides of the contract were exercised


def _old_render(results) -> bytes:
    """The response body as of commit 13a7952: a dict per result (extracted cleaned), json.dumps."""

    def clean(s):
        try:
            s.encode("utf-8")
            return s
        except UnicodeEncodeError:
            return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")

    content = {
        "results": [
            {
                "correct": r.correct,
                "score": r.score,
                "status": r.status,
                "extracted": clean(r.extracted) if r.extracted is not None else None,
                "ms": r.ms,
            }
            for r in results
        ]
    }
    text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return clean(text).encode("utf-8")


def test_results_json_is_byte_identical_to_the_dict_rendering():
    import random
    import sys

    from stapo.verifier_service.app import results_json, results_response
    from stapo.verifier_service.grader import GradeResult

    rng = random.Random(9)
    pieces = [
        "x",
        '"',
        "\\",
        "\n",
        "\x00",
        "\x1f",
        "\u2028",
        "é",
        "\ud800",
        "\udc00",
        "\ud83d\ude00",
        "😀",
        "\ufffd",
    ]
    for _ in range(3000):
        results = []
        for _ in range(rng.randint(0, 5)):
            ext = (
                None
                if rng.random() < 0.2
                else "".join(
                    rng.choice(pieces) if rng.random() < 0.7 else chr(rng.randint(0, sys.maxunicode))
                    for _ in range(rng.randint(0, 8))
                )
            )
            ms = rng.choice([0.0, 1e-7, 0.123456789, 2000.0, 1e22, rng.random() * 100])
            results.append(
                GradeResult(
                    rng.random() < 0.5, rng.choice([0.0, 1.0]), rng.choice(["ok", "timeout"]), ext, ms
                )
            )
        want = _old_render(results)
        assert results_json(results) == want
        assert results_response(results).body == want
    # unusual values: the dict path, which answers as before (a non-finite number cannot be JSON)
    odd = [GradeResult(True, 1, "ok", "1", 0.0), GradeResult(1, 1.0, "ok", "1", 0.0)]
    assert results_json(odd) is None and results_response(odd).body == _old_render(odd)
    with pytest.raises(ValueError):
        results_response([GradeResult(True, 1.0, "ok", "1", float("nan"))])
