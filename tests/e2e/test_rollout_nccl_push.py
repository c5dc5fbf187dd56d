"""The fleet's weight pushes end with a prefix-cache reset that must succeed, before the version is named.

A rollout server (tests/service/vllm_fake.py, a real HTTP server sampling with a tiny model) takes
``rollout.server.weight_sync=nccl`` pushes through stand-ins of vLLM 0.33's weight-transfer modules
(tests/service/vllm_weight_transfer.py: the released base class, HTTP client and trainer engine, the
broadcast delivered in-process). What can fail here: the weights the server holds after a push are
not the learner's (its log-probs differ from the learner's own), the packed buffer size sent in the
init info is not ``bucket_mb``, the version is announced before ``/reset_prefix_cache`` answered
``success: true`` (the server would serve KV of the old weights under the new version), a
``success: false`` is taken as done or is not retried, or a server that never frees its blocks is
not named. The checkpoint push makes the same check. tests/e2e/test_vllm_weight_source_slow.py
(opt-in) runs vLLM 0.33.0's real modules in place of the stand-ins.
"""

from __future__ import annotations

import copy

import pytest
import torch

from stapo.core.rollout import SamplingParams
from stapo.core.rollout.vllm_server import RolloutServersUnavailable, ServerRolloutEngine
from tests.e2e import test_rollout_server as served
from tests.service import vllm_weight_transfer
from tests.service.vllm_fake import FakeVLLMServer

# the tiny policy and its perturbations, as the fleet's other tests build them
PROMPT, _perturbed, tok, model = served.PROMPT, served._perturbed, served.tok, served.model



def _learner_logprobs(learner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = learner(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()  # [T, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]  # [T]


def _nccl_engine(srv, tok, learner, **kw) -> ServerRolloutEngine:
    return ServerRolloutEngine([srv.url], tokenizer=tok, weight_sync="nccl", nccl_master="127.0.0.1:29555",
                               learner=learner, bucket_mb=64, backoff_s=0.01, **kw)


def test_nccl_push_delivers_the_learners_weights_then_resets_the_cache_then_names_the_version(
        monkeypatch, model, tok):
    learner = copy.deepcopy(model)
    with FakeVLLMServer(copy.deepcopy(model), tok) as srv:
        vllm_weight_transfer.install(monkeypatch, srv)
        engine = _nccl_engine(srv, tok, learner)
        for version in (0, 1):  # the second push reuses the metadata the server holds
            learner.load_state_dict(_perturbed(model, seed=version + 1).state_dict())  # an update, in place
            engine.load_weights(learner.named_parameters())
            tail = srv.events[-3:]
            assert [e[0] for e in tail] == ["finish", "reset", "version"] and tail[1][1] is True, srv.events
            assert tail[0][1] == [n for n, _ in learner.named_parameters()] and tail[2][1] == str(version)
            served = srv.model.state_dict()
            assert all(torch.equal(served[n], p) for n, p in learner.named_parameters())
            (c,) = engine.generate([PROMPT], SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=3))[0]
            assert c.version == version
            assert torch.allclose(torch.tensor(c.logprobs), _learner_logprobs(learner, PROMPT, c.token_ids), atol=1e-5)
        assert srv.transfer_init["packed_buffer_size_bytes"] == 64 << 20  # bucket_mb: what the plan charges
        assert srv.transfer_init["world_size"] == 2  # learner rank 0 + the server's one worker


def test_a_reset_that_answers_false_is_retried_before_the_version_is_named(monkeypatch, model, tok):
    with FakeVLLMServer(copy.deepcopy(model), tok) as srv:
        vllm_weight_transfer.install(monkeypatch, srv)
        srv.prefix_busy = 1  # blocks still held once, as while requests drain
        _nccl_engine(srv, tok, model).load_weights(model.named_parameters(), version=0)
        assert [e for e in srv.events if e[0] in ("reset", "version")] == [
            ("reset", False), ("reset", True), ("version", "0")]


def test_a_server_whose_cache_never_frees_is_named_and_keeps_its_old_version(monkeypatch, model, tok):
    with FakeVLLMServer(copy.deepcopy(model), tok) as srv:
        vllm_weight_transfer.install(monkeypatch, srv)
        srv.prefix_busy = 10**6
        engine = _nccl_engine(srv, tok, model, reset_wait_s=0.3)
        with pytest.raises(RolloutServersUnavailable, match=rf"{srv.url}: RuntimeError: POST /reset_prefix_cache "
                                                            r"answered success=false for 0.3 s"):
            engine.load_weights(model.named_parameters(), version=0)
        assert srv.weight_version is None and not any(e[0] == "version" for e in srv.events)


def test_checkpoint_push_checks_the_reset_too(tmp_path, model, tok):
    with FakeVLLMServer(copy.deepcopy(model), tok) as a, FakeVLLMServer(copy.deepcopy(model), tok) as b:
        a.prefix_busy, b.prefix_busy = 1, 10**6  # a drains after one refusal; b never does
        engine = ServerRolloutEngine([a.url, b.url], tokenizer=tok, weights_dir=tmp_path, reset_wait_s=0.3)
        engine.load_weights(model.named_parameters(), version=4)
        assert [e for e in a.events if e[0] in ("reset", "version")] == [("reset", False), ("reset", True), ("version", "4")]
        assert b.weight_version is None and engine.pool.in_rotation() == [a.url]  # b is out until it frees
