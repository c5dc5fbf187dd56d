"""Per-sequence attention for packed rows (stapo.core.trainer.attention) against independent computations.

* The attention function on tiny tensors equals a hand computation: per sequence, per head,
  softmax(q k^T * scale + causal) v (also with grouped key/value heads).
* No leak: changing one packed sequence's tokens (keys/values) leaves every other sequence's output
  unchanged, and the same check fails for attention that ignores the segments.
* Through a tiny random Llama (grouped KV heads, uneven lengths): packed with ``sdpa_varlen`` vs
  padded rows vs one sequence per forward give the same log-probs, entropies (1e-5) and gradients;
  transformers' own sdpa on the packed row (block-diagonal mask) agrees too.
* Segments from the position ids, the backends' choice of implementation and the config error.
"""

from __future__ import annotations

import copy

import pytest
import torch

from stapo.core.trainer import attention as va
from stapo.core.trainer.base import compute_token_stats, model_inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LENS = (5, 1, 8, 3)  # uneven, one single-token sequence


def positions(lens=LENS) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)  # [1, T]


def test_segments_from_position_ids():
    cu, longest = va.cu_seq_lens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4
    kw = va.varlen_kwargs(positions())
    assert kw["cu_seq_lens_q"].tolist() == [0, 5, 6, 14, 17] and kw["max_length_q"] == 8
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    # what every packed forward hands the model: no mask, positions, the same segments
    inputs = model_inputs(torch.ones(1, sum(LENS), dtype=torch.long), positions())
    assert inputs["attention_mask"] is None and inputs["cu_seq_lens_k"].tolist() == [0, 5, 6, 14, 17]
    padded = model_inputs(torch.tensor([[0, 1, 1]]), None)  # padded rows: the mask, no segments
    assert padded["position_ids"].tolist() == [[0, 0, 1]] and "cu_seq_lens_q" not in padded
    with pytest.raises(ValueError, match="one row"):
        va.cu_seq_lens_from_position_ids(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="start at 0"):
        va.cu_seq_lens_from_position_ids(torch.tensor([[3, 4, 0]]))


def hand_attention(q, k, v, lens, scale):
    """Per sequence and head: softmax(q k^T * scale, causal) v, with plain loops. q [H, T, D], k/v [Hkv, T, D]."""
    H, T, D = q.shape
    rep = H // k.shape[0]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    start = 0
    for n in lens:
        for h in range(H):
            kh, vh = k[h // rep].double(), v[h // rep].double()
            for i in range(start, start + n):
                scores = torch.stack([q[h, i].double() @ kh[j] * scale for j in range(start, i + 1)])
                w = torch.softmax(scores, 0)
                out[i, h] = sum(w[j - start] * vh[j] for j in range(start, i + 1))
        start += n
    return out  # [T, H, D]


class Attn(torch.nn.Module):
    """What transformers' attention functions read from the module: the KV-group count and causality."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_equals_hand_computation(kv_heads):
    g = torch.Generator().manual_seed(0)
    T, H, D = sum(LENS), 4, 3
    q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (H, kv_heads, kv_heads))
    kw = va.varlen_kwargs(positions())
    out, weights = va.sdpa_varlen_attention(Attn(H // kv_heads), q, k, v, None, dropout=0.0, scaling=0.7, **kw)
    assert weights is None and out.shape == (1, T, H, D)
    torch.testing.assert_close(out[0].double(), hand_attention(q[0], k[0], v[0], LENS, 0.7), atol=1e-6, rtol=0)
    # without the keywords, segments come from the position ids the layers also pass on
    out2, _ = va.sdpa_varlen_attention(Attn(H // kv_heads), q, k, v, None, scaling=0.7, position_ids=positions())
    torch.testing.assert_close(out2, out, atol=0, rtol=0)


def test_no_attention_across_sequences():
    """Perturb sequence 2's keys/values: sequences 0, 1, 3 keep their outputs, sequence 2's change.
    The same check on attention that ignores the segments (one causal sequence) detects the leak."""
    g = torch.Generator().manual_seed(1)
    T, H, D = sum(LENS), 2, 4
    q, k, v = (torch.randn(1, H, T, D, generator=g) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    s, e = 6, 14  # sequence 2
    k2[:, :, s:e] += 3.0
    v2[:, :, s:e] -= 2.0
    kw = va.varlen_kwargs(positions())

    def run(kk, vv, **extra):
        return va.sdpa_varlen_attention(Attn(1), q, kk, vv, None, scaling=0.5, **extra)[0][0]  # [T, H, D]

    a, b = run(k, v, **kw), run(k2, v2, **kw)
    others = torch.ones(T, dtype=torch.bool)
    others[s:e] = False
    torch.testing.assert_close(a[others], b[others], atol=0, rtol=0)
    assert float((a[s:e] - b[s:e]).abs().min()) > 0  # the perturbed sequence did change
    leaky_a, leaky_b = run(k, v), run(k2, v2)  # no segments, no restarting positions: one sequence
    assert float((leaky_a[e:] - leaky_b[e:]).abs().max()) > 1e-3


def test_packed_row_rejects_sliding_window_and_cache_shapes():
    q = torch.randn(1, 2, 6, 4)
    kw = va.varlen_kwargs(torch.tensor([[0, 1, 2, 0, 1, 2]]))
    with pytest.raises(ValueError, match="sliding-window"):
        va.sdpa_varlen_attention(Attn(1), q, q, q, None, sliding_window=4, **kw)
    with pytest.raises(ValueError, match="self-attention"):
        va.sdpa_varlen_attention(Attn(1), q, torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4), None, **kw)
    with pytest.raises(ValueError, match="one row"):
        va.sdpa_varlen_attention(Attn(1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1),
                                 q.expand(2, -1, -1, -1), None, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]] * 2))


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(1, 40, (n + 2,), generator=g) for n in LENS]  # 7, 3, 10, 5 tokens
    return model, seqs


def stats_and_grads(model, ids, attn, resp, position_ids=None, weights=None):
    """(log-probs at the response, entropies there, gradients of a loss reading both)."""
    model.zero_grad()
    lp, ent = compute_token_stats(model, ids, attn, resp, chunk_size=5, entropy_grad=True, position_ids=position_ids)
    lp, ent = lp[resp], ent[resp]  # [N]: sequence by sequence in every layout (row-major)
    w = torch.linspace(-1.0, 1.0, lp.numel()) if weights is None else weights  # one weight per token
    ((lp * w).sum() + (ent * (0.3 - w * w)).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return lp.detach(), ent.detach(), grads


def test_packed_varlen_matches_padded_and_single_rows(llama):
    base, seqs = llama
    resp = [torch.arange(s.numel()) >= 2 for s in seqs]  # 2 prompt tokens, the rest is the response
    # one sequence per forward: no padding, no packing (the independent reference); each response
    # token gets the loss weight the batched layouts give it (sequence by sequence, in order)
    n_tok = [int(r.sum()) for r in resp]
    w_all = torch.linspace(-1.0, 1.0, sum(n_tok))
    offs = [sum(n_tok[:i]) for i in range(len(seqs))]
    single = [stats_and_grads(base, s[None], torch.ones(1, s.numel(), dtype=torch.long), r[None],
                              weights=w_all[o : o + n])
              for s, r, o, n in zip(seqs, resp, offs, n_tok, strict=True)]
    lp_ref = torch.cat([x[0] for x in single])
    ent_ref = torch.cat([x[1] for x in single])
    g_ref = {n: sum(x[2][n] for x in single) for n in single[0][2]}
    # padded rows (left padding), the model's sdpa
    L = max(s.numel() for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    attn, rmask = torch.zeros_like(ids), torch.zeros(len(seqs), L, dtype=torch.bool)
    for i, (s, r) in enumerate(zip(seqs, resp, strict=True)):
        ids[i, L - s.numel():], attn[i, L - s.numel():], rmask[i, L - s.numel():] = s, 1, r
    # the padded layout orders response tokens row by row, as the packed one does
    padded = stats_and_grads(base, ids, attn, rmask)
    # packed: one row, positions restarting per sequence
    packed_ids, packed_resp = torch.cat(seqs)[None], torch.cat(resp)[None]
    pos = torch.cat([torch.arange(s.numel()) for s in seqs])[None]
    varlen = copy.deepcopy(base)
    assert va.use_attention(varlen, None, packed=True) == va.VARLEN_SDPA
    runs = {"padded": padded,
            "packed_varlen": stats_and_grads(varlen, packed_ids, torch.ones_like(packed_ids), packed_resp, pos),
            "packed_sdpa_block_mask": stats_and_grads(base, packed_ids, torch.ones_like(packed_ids), packed_resp, pos)}
    for name, (lp, ent, g) in runs.items():
        torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0, msg=name)
        for n in g_ref:
            torch.testing.assert_close(g[n], g_ref[n], atol=1e-5, rtol=0, msg=f"{name}: {n}")


def test_varlen_model_never_leaks_even_with_a_cache(llama):
    """A packed row through the model with a KV cache and no segment keywords: transformers' sdpa
    builds no packed mask when a cache is given (it leaks); sdpa_varlen still splits by the position
    ids. This also shows that the implementation use_attention sets is the one that runs."""
    base, seqs = llama
    varlen = copy.deepcopy(base).eval()
    va.use_attention(varlen, va.VARLEN_SDPA, packed=True)
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(s.numel()) for s in seqs])[None]
    with torch.no_grad():
        ref = torch.cat([base(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
        out = varlen(input_ids=ids, position_ids=pos, use_cache=True).logits[0]
        leaky = base(input_ids=ids, position_ids=pos, use_cache=True).logits[0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert float((leaky - ref).abs().max()) > 1e-3


def test_backend_picks_the_attention(llama):
    from stapo.core.config import config_from_dict
    from stapo.core.trainer.torch_backend import TorchBackend

    base, _ = llama

    def chosen(**trainer):
        cfg = config_from_dict({"model": {"name_or_path": "tiny-random"}, "trainer": {"device": "cpu", **trainer}})
        return TorchBackend(cfg, copy.deepcopy(base), total_optimizer_steps=1).attn_implementation

    assert chosen(micro_batch_tokens=64) == va.VARLEN_SDPA
    assert chosen() is None  # rows: the model keeps what transformers chose at load time
    assert chosen(micro_batch_tokens=64, attn_implementation="eager") == "eager"
    with pytest.raises(ValueError, match="trainer.attn_implementation: unknown attention 'flash_attn_2'"):
        chosen(attn_implementation="flash_attn_2")


def test_mask_builder_skips_the_mask_only_for_packed_rows():
    """transformers' ``create_causal_mask`` with ``sdpa_varlen``: no [T, T] mask for a packed row;
    its own mask, exactly as ``sdpa``'s, for a static cache's decode step (no 2-D mask: without one
    the query would attend to the cache's empty slots) and for an extra mask function."""
    from transformers import LlamaConfig, StaticCache
    from transformers.masking_utils import create_causal_mask, sliding_window_overlay

    va.register_varlen_sdpa()
    cfg = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                      vocab_size=16, intermediate_size=16)

    import inspect

    # the cache's keyword: `cache` from transformers 5.24, `past_key_values` before
    cache_kw = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

    def both(embeds, cache, **kw):
        kw[cache_kw] = cache
        out = {}
        for name in (va.VARLEN_SDPA, "sdpa"):
            cfg._attn_implementation = name
            out[name] = create_causal_mask(cfg, embeds, None, **kw)
        return out[va.VARLEN_SDPA], out["sdpa"]

    t = sum(LENS)
    ours, theirs = both(torch.zeros(1, t, 8), cache=None, position_ids=positions())
    assert ours is None and theirs is not None  # packed: the attention splits by sequence
    cache = StaticCache(config=cfg, max_cache_len=12)
    cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)  # 5 tokens cached, 7 slots empty
    ours, theirs = both(torch.zeros(1, 1, 8), cache=cache, position_ids=torch.tensor([[5]]))
    assert ours is not None and torch.equal(ours, theirs)
    assert ours[0, 0, 0].tolist() == [True] * 6 + [False] * 6  # the 5 cached tokens and itself
    ours, theirs = both(torch.zeros(1, 6, 8), cache=None, position_ids=torch.arange(6).unsqueeze(0),
                        and_mask_function=sliding_window_overlay(2))
    assert ours is not None and torch.equal(ours, theirs) and not bool(ours[0, 0, 5, 2])  # window of 2
    assert not va.packed_row_mask(q_length=4, kv_length=4, mask_function=lambda b, h, q, kv: kv <= q)
