"""OpenRLHF's own reward path against the service and the adapters (run in an OpenRLHF venv).

``openrlhf.utils.agent.SingleTurnAgentExecutor(remote_rm_url)`` is what each vLLM engine actor
builds from ``--remote_rm_url`` (``openrlhf/trainer/ray/vllm_engine.py``); its ``execute(...)``
tokenizes the prompt, asks the engine for a continuation, decodes prompt + response with
``skip_special_tokens=False`` and fetches the reward over HTTP (a URL) or from ``reward_func`` in a
Python file (a path ending in ``.py``). Here the engine is replaced by one that returns the known
responses' token ids; everything else is OpenRLHF's code. A failure inside the reward fetch is
caught by OpenRLHF, logged at INFO and leaves the reward ``None``: the rows show it.
"""

from __future__ import annotations

import asyncio
import io
import logging
from types import SimpleNamespace

import openrlhf  # noqa: F401 - the package under test
from cases import CASES, FAILURE, MAX_PREDICTION_CHARS, PROMPT, args, emit, env_for, expected, tiny_tokenizer
from openrlhf.utils.agent import SingleTurnAgentExecutor

A = args()
TOK = tiny_tokenizer()


class ScriptedEngine:
    """Stands in for the vLLM engine actor: ``generate`` returns a known response."""

    def __init__(self, response: str) -> None:
        self.response = response

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        text = self.response
        ids = TOK(text, add_special_tokens=False)["input_ids"]
        out = SimpleNamespace(token_ids=ids, text=text, finish_reason="stop", logprobs=None)
        return SimpleNamespace(outputs=[out])


async def _one(executor: SingleTurnAgentExecutor, case) -> object:
    engine = ScriptedEngine(case.response)
    params = SimpleNamespace(max_tokens=None, logprobs=None)
    out = await executor.execute(
        prompt=PROMPT,
        label=case.gold,
        sampling_params=params,
        max_length=8192,
        hf_tokenizer=TOK,
        llm_engine=engine,
    )
    r = out["reward"]
    if r is None:
        return None
    return float(r.reshape(-1)[0]) if hasattr(r, "reshape") else float(r[0] if isinstance(r, list) else r)


def rewards(remote_rm_url: str) -> list:
    executor = SingleTurnAgentExecutor(remote_rm_url)

    async def all_items():
        return await asyncio.gather(*(_one(executor, c) for c in CASES))

    return list(asyncio.run(all_items()))


def capture_openrlhf_log():
    """OpenRLHF's reward-path logger (``init_logger``: stdout, no propagation); also keep its lines here."""
    buf = io.StringIO()
    logging.getLogger("openrlhf.utils.agent").addHandler(logging.StreamHandler(buf))
    return buf


if __name__ == "__main__":
    import os

    os.environ["STAPO_VERIFIER_FAILURE_SCORE"] = str(FAILURE)
    url, token, dead, path = A["url"], A["token"], A["dead_url"], A["adapters_file"]
    log = capture_openrlhf_log()
    none = [None] * len(CASES)

    env_for(None, None)
    # The service's /get_reward answers 0 (not the failure value) for an item it could not grade,
    # with the per-sample flags in extra_logs.
    emit("HTTP /get_reward?token=", rewards(f"{url}/get_reward?token={token}"), expected(failure=0.0))
    # a non-answer and a too-large item through /get_reward: their extra_logs flags, as OpenRLHF gets them
    import httpx

    give_up, big = PROMPT + "I give up.", PROMPT + "x" * (MAX_PREDICTION_CHARS + 100) + " \\boxed{4}"
    body = {"query": [give_up, big], "prompts": [PROMPT, PROMPT], "labels": ["4", "4"]}
    logs = httpx.post(f"{url}/get_reward?token={token}", json=body, timeout=60).json()["extra_logs"]
    emit(
        "HTTP /get_reward: 'I give up.' and a too-large item, extra_logs flags",
        {k: logs[k] for k in ("verifier_no_answer", "verifier_too_large", "verifier_error")},
        {"verifier_no_answer": [0.0, 0.0], "verifier_too_large": [0.0, 1.0], "verifier_error": [0.0, 0.0]},
        "words with no math are graded (wrong), not counted as no answer",
    )
    env_for(url, token)
    emit("adapters file, service (token in header)", rewards(path), expected())
    env_for(None, None)
    emit("adapters file, in-process pool", rewards(path), expected())

    env_for(url, "wrong-token")
    before = log.tell()
    emit("adapters file, wrong token", rewards(path), none, "OpenRLHF logs the error at INFO, reward None")
    emit(
        "adapters file: token appears in OpenRLHF's log",
        "yes" if "wrong-token" in log.getvalue()[before:] else "no",
        "no",
        "the adapters send the token in a header",
    )
    env_for(dead, token)
    emit("adapters file, service down", rewards(path), none, "OpenRLHF logs the error at INFO, reward None")
    env_for(None, None)

    before = log.tell()
    emit("HTTP /get_reward, wrong token", rewards(f"{url}/get_reward?token=wrong-token"), none)
    emit(
        "HTTP: ?token= appears in OpenRLHF's log",
        "yes" if "token=wrong-token" in log.getvalue()[before:] else "no",
        "yes",
        "its retry log prints the full URL",
    )
    emit("HTTP /get_reward, service down", rewards(f"{dead}/get_reward"), none)
