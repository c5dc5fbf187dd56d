"""The hf engine's shared prompt prefill (``share_prefix``) against generating every row in full.

Same seed, same prompts (of different lengths, so rows are left-padded), n samples each: the
shared-prefill run must sample the same tokens with the same log-probs as the unshared one, and
the log-probs must match a teacher-forced forward over prompt + completion (independent check).
"""

from __future__ import annotations

import pytest
import torch

from stapo.core.config import TinyModel
from stapo.core.rollout import SamplingParams
from stapo.core.rollout.hf import HFRolloutEngine
from stapo.core.trainer.models import build_tiny_model, build_tiny_tokenizer

pytestmark = pytest.mark.timeout(120)


def _model():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, seed=0), tok)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # peaked, context-dependent distributions (see test_rollout_hf._sharpen)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
    return model.eval(), tok


def test_shared_prefill_samples_what_full_rows_sample():
    model, tok = _model()
    prompts = [[5, 9, 12, 7, 30], [40, 3], [8, 8, 21, 14]]
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=11)
    calls = []  # a hook, not a forward wrapper: generate inspects forward's signature
    hook = model.register_forward_pre_hook(lambda m, a, k: calls.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    shared = HFRolloutEngine(model, tok, batch_size=12, share_prefix=True).generate(prompts, sampling)
    hook.remove()
    assert calls[0] == (3, 4)  # one prefill row per distinct prompt, all columns but the last
    assert calls[1] == (12, 1)  # then generate runs only the last prompt column of every row
    full = HFRolloutEngine(model, tok, batch_size=12, share_prefix=False).generate(prompts, sampling)
    n_tokens = 0
    for p, gs, gf in zip(prompts, shared, full, strict=True):
        for cs, cf in zip(gs, gf, strict=True):
            assert cs.token_ids == cf.token_ids
            torch.testing.assert_close(torch.tensor(cs.logprobs), torch.tensor(cf.logprobs), atol=1e-5, rtol=0)
            ids = torch.tensor([p + cs.token_ids])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits[0, len(p) - 1 : -1].float(), -1)
            want = lp.gather(1, torch.tensor(cs.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(cs.logprobs), want, atol=1e-5, rtol=0)
            n_tokens += len(cs.token_ids)
    assert n_tokens > 12
