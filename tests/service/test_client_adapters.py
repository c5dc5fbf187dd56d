"""Client retries / failover against real HTTP servers, and the verl / TRL / OpenRLHF adapters."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stapo.verifier_service.clients import adapters
from stapo.verifier_service.clients.client import (
    AsyncVerifierClient,
    VerifierClient,
    VerifierRequestError,
    VerifierUnavailable,
)
from stapo.verifier_service.grader import grade
from tests.service.conftest import free_port

ITEMS = [
    {"prediction": "so \\boxed{\\frac{1}{2}}", "gold": "0.5"},
    {"prediction": "so \\boxed{3}", "gold": "4"},
    {"prediction": "", "gold": "4"},
]


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


class Flaky:
    """A real HTTP server answering 503 (with Retry-After: 0) to the first ``fails`` requests, then 200."""

    def __init__(self, fails: int, status: int = 503) -> None:
        self.calls = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                n = int(self.headers["content-length"])
                items = json.loads(self.rfile.read(n))["items"]
                outer.calls += 1
                if outer.calls <= fails:
                    body, code = b'{"detail": "busy"}', status
                else:
                    res = [
                        {"correct": True, "score": 1.0, "status": "ok", "extracted": "x", "ms": 0.1}
                        for _ in items
                    ]
                    body, code = json.dumps({"results": res}).encode(), 200
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.send_header("retry-after", "0")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def test_client_grades_and_fails_over_from_a_dead_url(server):
    with VerifierClient([dead_url(), server.url], retries=3, backoff_s=0.01, batch_size=2) as vc:
        res = vc.verify(ITEMS)  # batch 0 starts on the dead URL, batch 1 on the live one
        assert [r.status for r in res] == ["ok", "ok", "no_answer"]
        assert [r.correct for r in res] == [True, False, False]
        assert vc.health() == {vc.urls[0]: False, vc.urls[1]: True}
        # every verdict names its rule, as grading in this process does (training logs reward/rule/*)
        assert [r.rule for r in res] == [grade(i["prediction"], i["gold"], "math").rule for i in ITEMS]
        assert all(r.rule for r in res)


def test_client_retries_429_and_5xx_then_succeeds():
    for status in (503, 429, 500):
        f = Flaky(fails=2, status=status)
        try:
            with VerifierClient(f.url, retries=3, backoff_s=0.01) as vc:
                assert [r.correct for r in vc.verify(ITEMS[:2])] == [True, True]
            assert f.calls == 3
        finally:
            f.close()


def test_client_raises_unavailable_never_a_silent_zero():
    f = Flaky(fails=100)
    try:
        with VerifierClient([dead_url(), f.url], retries=2, backoff_s=0.01) as vc:
            with pytest.raises(VerifierUnavailable, match="after 3 attempts"):
                vc.verify(ITEMS)
    finally:
        f.close()


def test_client_does_not_retry_a_bad_request(server):
    with VerifierClient(server.url, retries=5, backoff_s=0.01, batch_size=5000) as vc:
        with pytest.raises(VerifierRequestError, match="413"):
            vc.verify([{"prediction": "1", "gold": "1"}] * 5000)  # over max_items: retrying cannot help
    with pytest.raises(ValueError, match="urls"):
        VerifierClient([])
    with pytest.raises(ValueError, match="mode"):
        VerifierClient(server.url).verify([{"prediction": "1", "gold": "1", "mode": "bogus"}])


def test_async_client_with_failover(server):
    async def main():
        async with AsyncVerifierClient(
            [dead_url(), server.url], retries=3, backoff_s=0.01, batch_size=1
        ) as vc:
            return await vc.verify(ITEMS)

    res = asyncio.run(main())
    assert [r.status for r in res] == ["ok", "ok", "no_answer"]


# --------------------------------------------------------------------------- adapters

RESPONSE_RIGHT = "<think>2+2 is 4</think> The answer is \\boxed{4}."
RESPONSE_WRONG = "I think it is \\boxed{5}."


@pytest.fixture(params=["url", "in_process"])
def where(request, server, monkeypatch):
    """Each adapter is exercised through the service URL and through an in-process pool."""
    adapters.close_verifiers()
    if request.param == "url":
        monkeypatch.setenv("STAPO_VERIFIER_URL", server.url)
    else:
        monkeypatch.delenv("STAPO_VERIFIER_URL", raising=False)
        monkeypatch.setenv("STAPO_VERIFIER_WORKERS", "1")
    yield request.param
    adapters.close_verifiers()


def test_verl_compute_score(where):
    out = adapters.compute_score("openai/gsm8k", RESPONSE_RIGHT, "4", extra_info={"split": "train"})
    assert out == {"score": 1.0, "acc": True, "pred": "4", "status": "ok", "verifier_failed": 0.0}
    out = adapters.compute_score("math_dapo", RESPONSE_WRONG, 4)  # int golds come from parquet
    assert out["score"] == 0.0 and out["acc"] is False and out["pred"] == "5"
    batch = adapters.compute_score_batch(
        data_sources=["a", "b"],
        solution_strs=[RESPONSE_RIGHT, RESPONSE_WRONG],
        ground_truths=["4", "4"],
        extra_infos=[None, None],
    )
    assert [b["score"] for b in batch] == [1.0, 0.0]


def test_trl_reward_plain_and_conversational(where):
    reward = adapters.make_trl_reward("answer")
    assert reward.__name__ == "stapo_math_answer"
    got = reward(
        prompts=["q", "q"],
        completions=[RESPONSE_RIGHT, RESPONSE_WRONG],
        answer=["4", "4"],
        trainer_state=None,
    )
    assert got == [1.0, 0.0]
    conv = [
        [{"role": "assistant", "content": RESPONSE_RIGHT}],
        [{"role": "assistant", "content": RESPONSE_WRONG}],
    ]
    prompts = [[{"role": "user", "content": "2+2?"}]] * 2
    assert reward(prompts=prompts, completions=conv, answer=["4", "4"]) == [1.0, 0.0]
    with pytest.raises(KeyError, match="available"):
        reward(prompts=prompts, completions=conv, solution=["4", "4"])


HUGE = "1" * 200_000  # over max_prediction_chars of the pool and of the service: status too_large


def test_trl_reward_gives_none_for_an_item_that_could_not_be_graded(where):
    reward = adapters.make_trl_reward("answer")
    got = reward(prompts=["q"] * 3, completions=[RESPONSE_RIGHT, HUGE, ""], answer=["4", "4", "4"])
    assert got == [1.0, None, 0.0]  # too_large -> None (TRL: no reward), no_answer -> a wrong answer
    with pytest.raises(ValueError, match=r"answer\[1\]: missing gold"):
        reward(prompts=["q"] * 2, completions=[RESPONSE_RIGHT] * 2, answer=["4", None])


def test_verl_failure_is_a_status_not_a_silent_number(where, monkeypatch):
    out = adapters.compute_score("a", HUGE, "4")
    assert out["status"] == "too_large" and out["verifier_failed"] == 1.0 and out["score"] == 0.0
    assert adapters.compute_score("a", HUGE, "4", failure_score=-1.0)["score"] == -1.0
    monkeypatch.setenv("STAPO_VERIFIER_FAILURE_SCORE", "-2")
    assert adapters.compute_score("a", HUGE, "4")["score"] == -2.0
    with pytest.raises(ValueError, match="missing gold"):
        adapters.compute_score("a", "The answer is None", None)  # never graded against the text "None"


def test_openrlhf_reward_func(where):
    prompt = "User: what is 2+2? Write \\boxed{answer}.\nAssistant: "
    out = adapters.reward_func(
        [prompt + RESPONSE_RIGHT, prompt + RESPONSE_WRONG], [prompt, prompt], ["4", "4"]
    )
    rewards = out["rewards"]
    assert [float(x) for x in rewards] == [1.0, 0.0]
    assert [float(x) for x in out["scores"]] == [1.0, 0.0]
    assert [float(x) for x in out["extra_logs"]["accuracy"]] == [1.0, 0.0]


def test_openrlhf_query_decoded_with_special_tokens(where):
    """OpenRLHF: query = tokenizer.batch_decode(prompt + response, skip_special_tokens=False):
    left padding, the chat template's tokens and the end-of-turn token are all in the text."""
    prompt = "<|im_start|>user\nWhat is 3/4 of 1? Answer: at the end.<|im_end|>\n<|im_start|>assistant\n"
    pad = "<|endoftext|>" * 3
    queries = [
        pad + prompt + "So\nAnswer: 3/4<|im_end|>",
        pad + prompt + "So\nAnswer: \\frac{3}{4}<|im_end|>" + pad,
        prompt + "So\nAnswer: 3/5<|im_end|>",
    ]
    out = adapters.reward_func(queries, [prompt] * 3, ["\\frac{3}{4}"] * 3)
    assert [float(x) for x in out["rewards"]] == [1.0, 1.0, 0.0]
    out = adapters.reward_func([prompt + HUGE], [prompt], ["4"], failure_score=-1.0)
    assert [float(x) for x in out["rewards"]] == [-1.0]
    assert [float(x) for x in out["extra_logs"]["verifier_failed"]] == [1.0]
    with pytest.raises(ValueError, match=r"labels\[0\]: missing gold"):
        adapters.reward_func([prompt], [prompt], [None])


def test_adapters_raise_when_the_service_is_down(monkeypatch):
    adapters.close_verifiers()
    monkeypatch.setenv("STAPO_VERIFIER_URL", dead_url())
    from stapo.verifier_service.clients import client as client_mod

    monkeypatch.setattr(
        client_mod.VerifierClient, "__init__", _fast_fail_init(client_mod.VerifierClient.__init__)
    )
    try:
        with pytest.raises(VerifierUnavailable):
            adapters.compute_score("x", RESPONSE_RIGHT, "4")
    finally:
        adapters.close_verifiers()


def _fast_fail_init(orig):
    def init(self, urls, **kw):
        kw.update(retries=1, backoff_s=0.01)
        orig(self, urls, **kw)

    return init
