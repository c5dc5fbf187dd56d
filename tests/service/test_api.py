"""The HTTP contract of the service: every status, order, OpenRLHF's /get_reward, 422/413, ops routes."""

from __future__ import annotations

import json
import re

from tests.service.conftest import MAX_BODY, MAX_ITEMS, verify


def test_every_status_is_reachable_and_results_keep_order(http):
    items = [
        {"prediction": "so the answer is \\boxed{\\frac{1}{2}}", "gold": "0.5"},  # ok, correct
        {"prediction": "therefore \\boxed{3}", "gold": "4"},  # ok, wrong
        {"prediction": "", "gold": "4"},  # no_answer
        {"prediction": "\\boxed{1}", "gold": ""},  # error (empty gold)
        {"prediction": "x" * 200_000, "gold": "4"},  # too_large (> max_prediction_chars)
        {"prediction": "\\boxed{5^{5^{5^{5^5}}}}", "gold": "7"},  # timeout (power tower)
        {"prediction": "Answer: 12", "gold": "12", "mode": "dapo"},  # dapo mode
    ]
    res = verify(http, items)
    assert [r["status"] for r in res] == ["ok", "ok", "no_answer", "error", "too_large", "timeout", "ok"]
    assert [r["correct"] for r in res] == [True, False, False, False, False, False, True]
    assert [r["score"] for r in res] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert res[0]["extracted"] == "\\frac{1}{2}" and res[1]["extracted"] == "3"
    assert res[5]["extracted"] is None and res[5]["ms"] >= 1000 * 2.0


def test_get_reward_follows_openrlhf_protocol(http):
    prompt = "<|user|>What is 1+1? Put the answer in \\boxed{}.<|assistant|>"
    body = {
        "query": [prompt + "It is \\boxed{2}.", prompt + "It is \\boxed{3}.", prompt + "no idea"],
        "prompts": [prompt, prompt, prompt],
        "labels": ["2", 2, "2"],  # a JSON data set may hold numbers
        "metas": [{}, {}, {}],  # newer OpenRLHF sends extra keys; accepted and ignored
    }
    r = http.post("/get_reward", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["rewards"] == [1.0, 0.0, 0.0] and out["scores"] == out["rewards"]
    assert out["extra_logs"]["accuracy"] == [1.0, 0.0, 0.0]
    assert set(out["extra_logs"]) >= {"verifier_timeout", "verifier_too_large", "verifier_error", "verifier_no_answer"}
    # the prompt contains "\boxed{}" itself: stripping it is what makes item 3 not "correct"
    assert all(len(v) == 3 for v in out["extra_logs"].values())


def test_get_reward_rejects_mismatched_lengths(http):
    r = http.post("/get_reward", json={"query": ["a", "b"], "labels": ["1"]})
    assert r.status_code == 422
    assert "labels" in r.text


def test_malformed_json_and_wrong_types_are_422_with_reason(http):
    r = http.post("/v1/verify", content=b'{"items": [', headers={"content-type": "application/json"})
    assert r.status_code == 422 and "JSON decode error" in r.text
    r = http.post("/v1/verify", json={"items": [{"prediction": "1", "gold": 1}]})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "items", 0, "gold"]
    r = http.post("/v1/verify", json={"items": [{"prediction": "1", "gold": "1", "mode": "nope"}]})
    assert r.status_code == 422 and "mode" in r.text
    r = http.post("/v1/verify", json={"things": []})
    assert r.status_code == 422 and "items" in r.text


def test_oversize_body_is_413_by_content_length_and_while_reading(http):
    big = json.dumps({"items": [{"prediction": "x" * (MAX_BODY + 10), "gold": "1"}]}).encode()
    r = http.post("/v1/verify", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["detail"]

    def chunks():  # no Content-Length: the limit is enforced on the bytes as they arrive
        yield b'{"items": [{"prediction": "'
        for _ in range(MAX_BODY // 65536 + 2):
            yield b"x" * 65536
        yield b'", "gold": "1"}]}'

    r = http.post("/v1/verify", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["detail"]


def test_too_many_items_is_413(http):
    r = http.post("/v1/verify", json={"items": [{"prediction": "1", "gold": "1"}] * (MAX_ITEMS + 1)})
    assert r.status_code == 413 and str(MAX_ITEMS) in r.json()["detail"]


def test_empty_batch_is_fine(http):
    assert verify(http, []) == []


def test_health_ready_metrics_docs(http, server):
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz").json()
    assert ready["ready"] is True and ready["workers"] == server.workers
    verify(http, [{"prediction": "\\boxed{2}", "gold": "2"}] * 3)  # 1 graded + 2 duplicates
    text = http.get("/metrics").text
    for name in (
        "stapo_verifier_requests_total",
        "stapo_verifier_request_seconds_bucket",
        "stapo_verifier_items_total",
        "stapo_verifier_timeouts_total",
        "stapo_verifier_worker_restarts_total",
        "stapo_verifier_cache_hits_total",
        "stapo_verifier_workers_ready",
    ):
        assert name in text, name
    assert 'stapo_verifier_requests_total{code="200",route="/v1/verify"}' in text
    assert http.get("/docs").status_code == 200
    assert "/v1/verify" in http.get("/openapi.json").json()["paths"]


def test_docs_pages_load_nothing_from_another_host(http):
    """/docs and /redoc work on a machine with no internet: every script, style sheet and icon they
    reference is a path on this server, and the server serves it."""
    for page, needs in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        r = http.get(page)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"], page
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}", r.text, re.I), (page, r.text)
        refs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
        assert any(ref.endswith(needs) for ref in refs), (page, refs)
        for ref in refs:
            assert ref.startswith("/"), (page, ref)
            got = http.get(ref)
            assert got.status_code == 200 and len(got.content) > 0, (page, ref, got.status_code)
