"""The verifier under hostile and overloaded use, over real HTTP.

The session server runs 2 workers with a 2 s deadline (conftest). A "flood" is a request of power
towers, each of which holds a worker for a full deadline before it is killed: without fair
scheduling a request sent behind 640 of them waits ~10 minutes.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx

from stapo.verifier_service.clients.loadgen import build_stream
from stapo.verifier_service.grader import grade
from tests.service.conftest import DEADLINE_S, verify, wait_pending

POWER = "so \\boxed{5^{5^{5^{5^5}}}}"


def flood(n: int, tag: int) -> list[dict]:
    """n distinct items that each cost a full deadline (distinct golds: no cache or duplicate helps)."""
    return [{"prediction": POWER, "gold": str(tag * 100_000 + k)} for k in range(n)]


def _abandon(url: str, items: list[dict], give_up_s: float) -> None:
    """Send items and give up after ``give_up_s`` (the client closes its connection)."""
    try:
        httpx.post(f"{url}/v1/verify", json={"items": items}, timeout=give_up_s)
    except httpx.TimeoutException:
        pass


def test_small_request_is_not_starved_and_abandoned_floods_are_cancelled(server):
    """Fair queueing: a 1-item request behind two floods (512 + 128 items) answers within 2 deadlines + 2 s;
    when the floods' clients give up, their queued items are dropped (queue back to 0 within a deadline)."""
    server.wait_full()
    floods = [
        threading.Thread(target=_abandon, args=(server.url, flood(512, 1), 4.0)),
        threading.Thread(target=_abandon, args=(server.url, flood(128, 2), 4.0)),
    ]
    for t in floods:
        t.start()
    wait_pending(server, lambda b: b.get("pending_items", 0) >= 600, timeout=15)
    t0 = time.monotonic()
    r = httpx.post(
        f"{server.url}/v1/verify",
        json={"items": [{"prediction": "so \\boxed{\\frac{3}{4}}", "gold": "0.75"}]},
        timeout=2 * DEADLINE_S + 3.0,
    )
    elapsed = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["results"][0]["correct"] is True
    assert elapsed < 2 * DEADLINE_S + 2.0, f"small request took {elapsed:.1f} s behind the floods"
    for t in floods:
        t.join(timeout=30)
    # The floods' clients are gone: what is queued is dropped, what is in flight ends within a deadline.
    wait_pending(
        server,
        lambda b: b.get("pending_items", 1) == 0 and b.get("queued_seconds", 1) == 0,
        timeout=DEADLINE_S + 1.5,
    )
    server.wait_full(timeout=10)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "stapo_verifier_cancelled_requests_total 2.0" in metrics


def test_timed_out_item_is_regraded_on_retry(http, server):
    """'timeout' is never served from the cache; the retry gets a longer deadline."""
    server.wait_full()
    item = {"prediction": "\\boxed{7^{7^{7^{7^7}}}}", "gold": "11"}
    (first,) = verify(http, [item])
    assert first["status"] == "timeout"
    t0 = time.monotonic()
    (again,) = verify(http, [item])
    elapsed = time.monotonic() - t0
    assert again["status"] == "timeout"
    assert elapsed > DEADLINE_S and again["ms"] > DEADLINE_S * 1000, (elapsed, again)  # graded again, longer
    server.wait_full(timeout=10)


def test_lone_surrogate_in_dapo_mode_is_not_a_500(http):
    """JSON "\\ud800" reaches the extracted answer; the response replaces it (never a 500)."""
    body = '{"items": [{"prediction": "Answer: \\ud800", "gold": "1", "mode": "dapo"}, ' \
        '{"prediction": "\\\\boxed{\\ud83d\\ude00 \\udfff}", "gold": "1"}]}'  # fmt: skip
    r = http.post("/v1/verify", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code in (200, 422), r.text
    if r.status_code == 200:
        res = json.loads(r.content.decode("utf-8"))["results"]  # strictly valid UTF-8
        assert res[0]["status"] == "ok" and res[0]["extracted"] == "\ufffd" and res[0]["correct"] is False
        assert "\U0001f600" in res[1]["extracted"] and "\ufffd" in res[1]["extracted"]
    # 422s never echo the (unencodable) input either
    bad = '{"items": [{"prediction": 5, "gold": "\\ud800"}]}'
    r = http.post("/v1/verify", content=bad.encode(), headers={"content-type": "application/json"})
    # pydantic's JSON parser rejects the lone surrogate itself (json_invalid); either reason is named
    assert (
        r.status_code == 422
        and ("prediction" in r.text or "json_invalid" in r.text)
        and "\\ud800" not in r.text
    )


def _random_text(rng: random.Random, n: int) -> str:
    pools = [
        (0x0, 0x1F), (0x7F, 0x9F), (0xD800, 0xDFFF), (0x20, 0x7E), (0x300, 0x36F), (0x590, 0x6FF),
        (0x4E00, 0x4FFF), (0x1F600, 0x1F64F), (0xFFF0, 0xFFFF), (0x10FFF0, 0x10FFFF), (0x202A, 0x202E),
    ]  # fmt: skip
    out = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def _fuzz_bodies(rng: random.Random) -> list[tuple[str, bytes]]:
    bodies: list[tuple[str, bytes]] = []
    for _ in range(40):
        items = [
            {
                "prediction": rng.choice(["", "Answer: ", "\\boxed{", "$"])
                + _random_text(rng, rng.randint(0, 60))
                + rng.choice(["", "}", "$", "\n"]),
                "gold": _random_text(rng, rng.randint(0, 8)) or "1",
                "mode": rng.choice(["math", "dapo"]),
            }
            for _ in range(rng.randint(1, 4))
        ]
        bodies.append(("/v1/verify", json.dumps({"items": items}).encode()))  # ensure_ascii: \\udXXX escapes
        q = [_random_text(rng, 30) for _ in range(2)]
        bodies.append(("/get_reward", json.dumps({"query": q, "labels": [_random_text(rng, 3), 7]}).encode()))
    huge = "9" * 20_000
    bodies += [
        ("/v1/verify", b'{"items": [{"prediction": ' + huge.encode() + b', "gold": "1"}]}'),
        ("/get_reward", b'{"query": ["\\\\boxed{1}"], "labels": [' + huge.encode() + b"]}"),
        ("/get_reward", b'{"query": ["\\\\boxed{1}"], "labels": [1e400]}'),
        ("/get_reward", b'{"query": ["\\\\boxed{1}"], "labels": [-0.0], "prompts": [null]}'),
        (
            "/v1/verify",
            b'{"items": [{"prediction": "\\\\boxed{' + huge.encode() + b'}", "gold": "1e99999"}]}',
        ),
        ("/v1/verify", b"[" * 50_000 + b"]" * 50_000),
        ("/v1/verify", b'{"items": ' + b'{"a": ' * 20_000 + b"1" + b"}" * 20_000 + b"}"),
        ("/v1/verify", b'{"items": [{"prediction": "\xff\xfe\xc0", "gold": "1"}]}'),  # not UTF-8
        ("/v1/verify", b'{"items": [{"prediction": "a\x00b", "gold": "\x01"}]}'),
        ("/v1/verify", b'{"items": [{"prediction": "x", "gold": "1"}], "budget_s": -1}'),
        ("/v1/verify", b'{"items": [{"prediction": "x", "gold": "1", "mode": "\\ud800"}]}'),
        ("/v1/verify", b'{"items": null}'),
        ("/v1/verify", b""),
    ]
    return bodies


def test_fuzz_never_a_5xx_and_always_valid_utf8(http, server):
    """Random Unicode (lone surrogates, controls, bidi, non-characters), huge numbers, deep nesting."""
    server.wait_full()
    rng = random.Random(10)
    for path, body in _fuzz_bodies(rng):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 413, 422), (path, body[:120], r.status_code, r.text[:300])
        data = json.loads(r.content.decode("utf-8"))  # strict UTF-8, valid JSON
        if r.status_code == 200 and path == "/v1/verify":
            assert all(
                x["status"] in ("ok", "no_answer", "timeout", "error", "too_large") for x in data["results"]
            )
    assert http.get("/healthz").status_code == 200
    server.wait_full(timeout=10)


def test_verdict_key_agrees_with_the_grader():
    """The parent-side verdict cache keys on the answer the parent extracts; it must be the answer the
    grader extracts, or a cached verdict would be served for a different answer. Checked on the RL
    streams and on end-of-turn tokens (the grader may strip them: then this test says the key must too)."""
    from stapo.verifier_service.grader import extract

    items = build_stream(600, seed=7) + build_stream(300, seed=8, style="answer_line")
    items = [(p, g, "dapo" if "Answer:" in p and k % 2 else m) for k, (p, g, m) in enumerate(items)]
    items += [
        ("Answer: 3/4<|im_end|>", "3/4", "math"),
        ("so \\boxed{\\frac{3}{4}}<|endoftext|>", "3/4", "math"),
        ("Answer: 3/4<|im_end|>", "3/4", "dapo"),
        ("<think>\\boxed{1}</think> Answer: 2</s>", "2", "math"),
        ("The answer is $\\sqrt{2}$ I hope it is correct.", "\\sqrt2", "math"),
        ("#### 1,234", "1234", "math"),
    ]
    keyed = 0
    for p, g, m in items:
        k = extract(p, m, budget="cheap")
        if k is None or k.text is None:
            continue
        keyed += 1
        r = grade(p, g, m)
        assert r.status == "ok" and r.extracted == k.extracted, (p[-80:], g, m, k, r)
    assert keyed > 0.8 * len(items)


def test_inline_no_answer_agrees_with_the_grader():
    """The server process answers a response cut off before any marker itself ('no_answer'); that must
    be exactly what a worker's ``grade`` returns, and never taken for a response that finished or for
    an empty gold (the grader says 'error' there)."""
    from stapo.verifier_service.grader import compare, extract

    def inline_no_answer(item: tuple[str, str, str]):
        pred, gold, mode = item
        answer = extract(pred, mode, budget="cheap")
        if answer is None or answer.text is not None:
            return None
        return compare(gold, answer, budget="cheap")

    items = build_stream(800, seed=11, cutoff_frac=0.3) + build_stream(
        300, seed=12, cutoff_frac=0.3, style="answer_line"
    )
    items += [
        ("Let me compute $x^2 +", "5", "math"),  # cut inside a math span
        ("Multiplying both sides by 6, we get", "612", "math"),  # cut on a word
        ("Let me compute $x^2 +", "", "math"),  # empty gold: an error, not a no_answer
        ("Let me compute $x^2 +", "5", "dapo"),  # mode dapo: no Answer: line
        ("so the total is 5.", "5", "math"),  # finished: math-verify's search may find 5
        ("5", "5", "math"),
    ]
    fired = 0
    for p, g, m in items:
        r = inline_no_answer((p, g, m))
        if r is None:
            continue
        fired += 1
        w = grade(p, g, m)
        assert (r.correct, r.score, r.status, r.extracted, r.rule) == (
            w.correct,
            w.score,
            w.status,
            w.extracted,
            w.rule,
        ), (p[-80:], g, m, r, w)
    assert fired >= 2 + 0.1 * len(items)
    assert inline_no_answer(("Let me compute $x^2 +", "", "math")) is None
    assert inline_no_answer(("so the total is 5.", "5", "math")) is None


def test_admission_in_work_answers_429_and_the_client_waits_as_told():
    """Items x recent per-item time beyond --max-queue-s -> 429 with a Retry-After from the estimate;
    VerifierClient waits it out (with jitter, without spending a retry) and reports the wait."""
    from stapo.verifier_service.clients.client import VerifierClient
    from tests.service.conftest import start_server

    srv = start_server(workers=2, args=("--max-queue-s", "1"))
    try:
        t = threading.Thread(target=_abandon, args=(srv.url, flood(6, 3), 30.0))
        t.start()
        # after the first two hangs the estimate is ~deadline per item: 4 queued x 2 s / 2 workers = 4 s
        wait_pending(srv, lambda b: b.get("queued_seconds", 0) > 1.5, timeout=15)
        # no answer marker: only a worker can grade these (a boxed integer would be decided in the server
        # process without queueing, and so never refused: see test_inline_verdicts.py)
        small = [{"prediction": f"so the value is {k}", "gold": str(k)} for k in range(5)]
        r = httpx.post(f"{srv.url}/v1/verify", json={"items": small}, timeout=10)
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["retry-after"]) <= 10 and "max_queue_s" in r.json()["detail"]
        with VerifierClient(srv.url, timeout_s=30, retries=0) as vc:
            res = vc.verify(small)
        assert [x.correct for x in res] == [True] * 5
        assert vc.busy_waits >= 1 and vc.busy_wait_s >= 1.0
        t.join(30)
        assert 'stapo_verifier_pool_events_total{event="rejected"}' in httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.stop()


def test_budget_spent_items_are_answered_timeout_without_grading():
    """Items still queued when their request's ``budget_s`` is spent answer 'timeout' ungraded (ms 0),
    and a cancelled job's queued items never reach a worker."""
    from stapo.verifier_service.server.pool import GraderPool

    with GraderPool(workers=1, deadline_s=1.5) as pool:
        assert pool.wait_ready(60)
        hang = pool.submit([(POWER, "1"), (POWER, "2")])  # holds the only worker ~3 s
        time.sleep(0.2)
        late = pool.submit([("so it is 1", "1"), ("so it is 2", "2")], budget_s=0.3)  # worker items
        doomed = pool.submit([(POWER, str(k)) for k in range(3, 40)])
        doomed.cancel()
        res = late.result(timeout=10)
        assert [(r.status, r.ms) for r in res] == [("timeout", 0.0), ("timeout", 0.0)]
        assert [r.status for r in hang.result(timeout=10)] == ["timeout", "timeout"]
        assert pool.stats["expired_items"] == 2 and pool.stats["cancelled_items"] == 37
        assert pool.pending_items() == 0 and pool.queued_seconds() == 0
