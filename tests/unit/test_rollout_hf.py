"""Tests of the rollout contract and the transformers engine on a tiny random Llama (CPU, ~seconds).

Expectations come from independent computations: a hand-written greedy loop of full forward passes
(no KV cache, no padding) and a teacher-forced forward over prompt + completion for the log-probs.
The tiny model's weights are re-drawn with a large std so its next-token distributions are peaked
and depend on the context (the default 0.02 init makes every step nearly uniform and greedy
decoding a constant token, which would let a padding or position bug pass unnoticed).
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from stapo.core.config import ModelConfig, TinyModel, config_from_dict
from stapo.core.rollout import (
    ENGINES,
    Completion,
    RolloutEngine,
    SamplingParams,
    build_rollout_engine,
    get_engine_class,
    register_engine,
)
from stapo.core.rollout.hf import HFRolloutEngine, SampledLogprobRecorder
from stapo.core.trainer.models import build_tiny_model, build_tiny_tokenizer

pytestmark = pytest.mark.timeout(60)


def _sharpen(model: torch.nn.Module, seed: int, std: float = 0.25) -> torch.nn.Module:
    """Re-draw every matrix with a large std (norm weights stay 1) so outputs depend on the context."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def base_model(tok):
    model = build_tiny_model(
        TinyModel(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, seed=0), tok
    )
    return _sharpen(model, seed=1).eval()


@pytest.fixture()
def model(base_model):
    return copy.deepcopy(base_model)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode("12+7="), tok.encode("what is 3*4? answer:"), tok.encode("9-")]


def _manual_greedy(model, prompt: list[int], steps: int, eos: set[int]) -> list[int]:
    """Greedy decoding by full forward passes on the unpadded prompt (the reference)."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]  # [V]
            t = int(logits.argmax())
            out.append(t)
            ids.append(t)
            if t in eos:
                break
    return out


def _teacher_forced_logprobs(
    model, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token given everything before it, [S]."""
    ids = torch.tensor([prompt + completion])  # [1, P+S]
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # [P+S, V]
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)  # positions predicting completion
    lp = torch.log_softmax(logits[pos] / temperature, dim=-1)  # [S, V]
    return lp.gather(1, torch.tensor(completion)[:, None]).squeeze(1)  # [S]


# ----------------------------------------------------------------------------- SamplingParams and registry


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_registry_lists_engines_and_rejects_duplicates_and_misses():
    assert ENGINES == {
        "hf": "stapo.core.rollout.hf:HFRolloutEngine",
        "vllm": "stapo.core.rollout.vllm:VLLMRolloutEngine",
        "vllm_server": "stapo.core.rollout.vllm_server:ServerRolloutEngine",
    }
    assert get_engine_class("hf") is HFRolloutEngine
    with pytest.raises(KeyError, match="valid names: hf, vllm, vllm_server"):
        get_engine_class("sglang")
    with pytest.raises(ValueError, match="already registered"):
        register_engine("hf", "x.y:Z")


def test_build_rollout_engine_hf_shares_the_given_model(model, tok):
    cfg = config_from_dict(
        {"model": {"name_or_path": "tiny-random"}, "rollout": {"engine": "hf", "batch_size": 3}}
    )
    engine = build_rollout_engine(cfg, model=model, tokenizer=tok)
    assert isinstance(engine, HFRolloutEngine) and isinstance(engine, RolloutEngine)
    assert engine.model is model and engine.batch_size == 3
    with pytest.raises(ValueError, match="model= and tokenizer="):
        build_rollout_engine(cfg)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_engine_without_vllm_says_how_to_install(tmp_path):
    cls = get_engine_class("vllm")  # importing the module must not need vllm
    with pytest.raises(ImportError, match=r"pip install 'stapo\[vllm\]'"):
        cls(str(tmp_path))


# ----------------------------------------------------------------------------- generation


def test_shapes_counts_and_finish_reasons(model, tok, prompts):
    engine = HFRolloutEngine(model, tok, batch_size=5)  # 12 sequences -> chunks of 5, 5, 2 across prompts
    groups = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=7, seed=0))
    assert len(groups) == 3 and all(len(g) == 4 for g in groups)
    eos = tok.eos_token_id
    for g in groups:
        for c in g:
            assert isinstance(c, Completion)
            assert 1 <= len(c.token_ids) <= 7 and len(c.logprobs) == len(c.token_ids)
            assert all(lp <= 0.0 for lp in c.logprobs)
            assert eos not in c.token_ids[:-1]  # cut at the first eos, nothing after it
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == eos
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 7
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert engine.generate([], SamplingParams()) == []


def test_stop_when_an_eos_is_produced_and_length_otherwise(model, tok, prompts):
    ref = _manual_greedy(model, prompts[0], 6, eos={tok.eos_token_id})
    assert len(ref) == 6, "the reference prompt should not hit the real eos within 6 tokens"
    engine = HFRolloutEngine(model, tok)
    ((c,),) = engine.generate([prompts[0]], SamplingParams(temperature=0, max_new_tokens=6))
    assert c.finish_reason == "length" and c.token_ids == ref

    # Declare the greedy token at position 3 an extra eos: generation must stop there with "stop".
    stop_tok = ref[3]
    first = ref.index(stop_tok)
    model.generation_config.eos_token_id = [tok.eos_token_id, stop_tok]
    engine = HFRolloutEngine(model, tok)
    ((c,),) = engine.generate([prompts[0]], SamplingParams(temperature=0, max_new_tokens=6))
    assert c.finish_reason == "stop"
    assert c.token_ids == ref[: first + 1]
    assert len(c.logprobs) == first + 1


def test_greedy_equals_manual_argmax_decoding(model, tok, prompts):
    engine = HFRolloutEngine(model, tok, batch_size=8)
    groups = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=8))
    for p, g in zip(prompts, groups, strict=True):
        ref = _manual_greedy(model, p, 8, eos={tok.eos_token_id})
        assert g[0].token_ids == ref
        assert g[1].token_ids == ref and g[1] is not g[0]  # n copies, independent objects
    # the greedy reference is not a constant token (the test model is context dependent)
    assert len({t for g in groups for t in g[0].token_ids}) > 3


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_logprobs_match_a_teacher_forced_forward(model, tok, prompts, temperature, top_p):
    engine = HFRolloutEngine(model, tok, batch_size=16)
    groups = engine.generate(
        prompts, SamplingParams(n=3, temperature=temperature, top_p=top_p, max_new_tokens=9, seed=11)
    )
    t_eff = temperature if temperature > 0 else 1.0
    for p, g in zip(prompts, groups, strict=True):
        for c in g:
            ref = _teacher_forced_logprobs(model, p, c.token_ids, t_eff)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_top_p_samples_only_from_the_nucleus(model, tok, prompts):
    """Every token sampled with top_p=0.5 lies in the smallest set of top tokens holding >= 0.5 mass."""
    engine = HFRolloutEngine(model, tok, batch_size=32)
    groups = engine.generate(
        prompts, SamplingParams(n=8, temperature=1.0, top_p=0.5, max_new_tokens=5, seed=3)
    )
    for p, g in zip(prompts, groups, strict=True):
        for c in g:
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                probs = torch.softmax(model(ids).logits[0].float(), dim=-1)  # [L, V]
            for k, t in enumerate(c.token_ids):
                row = probs[len(p) - 1 + k]
                sorted_p, order = row.sort(descending=True)
                keep = int((sorted_p.cumsum(0) < 0.5).sum()) + 1  # tokens up to and including crossing 0.5
                assert t in order[:keep].tolist()


def test_seed_determinism_and_caller_rng_untouched(model, tok, prompts):
    engine = HFRolloutEngine(model, tok, batch_size=4)
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=123)
    torch.manual_seed(2024)
    expected_next = torch.rand(3)
    torch.manual_seed(2024)
    a = engine.generate(prompts, sp)
    after = torch.rand(3)
    torch.testing.assert_close(after, expected_next)  # generate(seed=...) did not consume the caller's stream
    b = engine.generate(prompts, sp)
    assert a == b
    c = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=124))
    assert [x.token_ids for g in a for x in g] != [x.token_ids for g in c for x in g]
    # samples within a group differ (n copies are not one sample repeated)
    assert len({tuple(x.token_ids) for x in a[1]}) > 1


def test_padding_invariance(model, tok):
    short, long = tok.encode("7+"), tok.encode("a much longer prompt 5*5=")
    engine = HFRolloutEngine(model, tok, batch_size=8)
    sp = SamplingParams(temperature=0, max_new_tokens=8)
    ((alone,),) = engine.generate([short], sp)
    batched = engine.generate([long, short], sp)
    assert batched[1][0].token_ids == alone.token_ids
    torch.testing.assert_close(
        torch.tensor(batched[1][0].logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=0
    )


def test_mode_generation_config_and_tokenizer_restored(model, tok, prompts):
    model.train()
    gen_config = model.generation_config
    side = tok.padding_side
    engine = HFRolloutEngine(model, tok)
    engine.generate(prompts, SamplingParams(n=2, max_new_tokens=3, seed=0))
    assert model.training is True
    assert model.generation_config is gen_config
    assert tok.padding_side == side
    assert all(p.grad is None for p in model.parameters())


def test_checkpoint_sampling_defaults_do_not_leak_in(model, tok, prompts):
    """A generation_config.json with top_k / repetition_penalty must not change what the engine samples."""
    engine = HFRolloutEngine(model, tok)
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    clean = engine.generate(prompts, sp)
    model.generation_config.top_k = 1
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.temperature = 0.1
    assert engine.generate(prompts, sp) == clean


# ----------------------------------------------------------------------------- weights


def test_load_weights_copies_into_a_separate_model_and_restores(model, tok, prompts):
    learner = copy.deepcopy(model)
    engine = HFRolloutEngine(model, tok)  # the engine's own copy (not the learner's object)
    sp = SamplingParams(n=1, temperature=0, max_new_tokens=8)
    before = engine.generate(prompts, sp)
    original = {k: v.clone() for k, v in learner.state_dict().items()}

    with torch.no_grad():
        learner.lm_head.weight.add_(
            torch.randn_like(learner.lm_head.weight, generator=torch.Generator().manual_seed(9))
        )
    engine.load_weights(learner.named_parameters())
    assert engine.last_sync["copied"] > 0 and engine.last_sync["shared"] == 0
    after = engine.generate(prompts, sp)
    assert [g[0].logprobs for g in after] != [g[0].logprobs for g in before]
    torch.testing.assert_close(model.lm_head.weight, learner.lm_head.weight)

    engine.load_weights(original.items())
    assert engine.generate(prompts, sp) == before


def test_load_weights_on_the_shared_model_copies_nothing(model, tok):
    engine = HFRolloutEngine(model, tok)
    engine.load_weights(model.named_parameters())
    assert engine.last_sync == {"copied": 0, "shared": len(list(model.named_parameters()))}


def test_load_weights_rejects_unknown_names_and_shape_mismatches(model, tok):
    engine = HFRolloutEngine(model, tok)
    with pytest.raises(ValueError, match=r"unknown parameter names: module\.lm_head\.weight"):
        engine.load_weights([("module.lm_head.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"shape mismatches: model\.norm\.weight"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


def test_sleep_and_wake_are_harmless_no_ops(model, tok, prompts):
    engine = HFRolloutEngine(model, tok)
    sp = SamplingParams(temperature=0, max_new_tokens=4)
    a = engine.generate(prompts, sp)
    engine.sleep()
    engine.wake()
    assert engine.generate(prompts, sp) == a


def test_bad_prompts_are_rejected_with_the_index(model, tok):
    engine = HFRolloutEngine(model, tok)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] must be a non-empty"):
        engine.generate([[1, 2], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] holds 100000"):
        engine.generate([[1, 100000]], SamplingParams())


def test_recorder_gathers_the_token_chosen_one_step_later():
    """Hand-computed: two steps over a 3-token vocabulary, T = 1."""
    rec = SampledLogprobRecorder(temperature=1.0)
    s0 = torch.tensor([[0.0, 0.0, 0.0]])  # uniform -> log(1/3)
    s1 = torch.tensor([[0.0, 0.0, 1.0]])  # token 2: e / (2 + e)
    rec(torch.tensor([[5]]), s0)
    rec(torch.tensor([[5, 1]]), s1)  # the step-0 token was 1
    out = rec.finish(torch.tensor([[5, 1, 2]]))  # the step-1 token was 2
    e = torch.e
    expected = torch.tensor([[torch.log(torch.tensor(1 / 3)), torch.log(torch.tensor(e / (2 + e)))]])
    torch.testing.assert_close(out, expected)


def test_load_policy_tiny_random_end_to_end():
    from stapo.core.trainer.models import load_policy

    model, tok = load_policy(ModelConfig(name_or_path="tiny-random"))
    engine = HFRolloutEngine(model, tok)
    groups = engine.generate([tok.encode("1+1=")], SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert len(groups[0]) == 2 and all(len(c.token_ids) <= 4 for c in groups[0])


def test_vllm_model_path_exports_a_code_built_model(model, tok, tmp_path):
    """vLLM reads HF folders only: a `tiny-random` policy is saved once and that folder is used."""
    from stapo.core.rollout import _vllm_model_path

    cfg = config_from_dict({"model": {"name_or_path": "tiny-random"}, "rollout": {"engine": "vllm"}})
    out = _vllm_model_path(cfg, model, tok)
    names = {p.name for p in Path(out).iterdir()}
    shutil.rmtree(out)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    with pytest.raises(ValueError, match="model_path="):
        _vllm_model_path(cfg, None, None)
    hub = config_from_dict(
        {"model": {"name_or_path": "Qwen/Qwen2.5-Math-1.5B"}, "rollout": {"engine": "vllm"}}
    )
    assert _vllm_model_path(hub, None, None) == "Qwen/Qwen2.5-Math-1.5B"
