"""The extras' no-grad passes make a rank-independent number of forwards (data parallel, one process).

Under ZeRO-3 every policy forward all-gathers parameters, so each rank must make the same number of
them whatever it holds: ``minp_stats_batched`` (Lp-Reg's proxy pass) runs every forward of the
old pass (``stapo.core.train.micro.micro_batches``: padded to the busiest rank's count with the batch's
zero-weight padding row, like ``Actor.old_stats``); so does the frozen reference when it is
partitioned like the policy (ZeRO-3), while a plain reference copy (ZeRO 0-2) is a local module and
runs on real rows only. The 2-rank equivalence of the whole update
is tests/e2e/test_multirank_extras.py.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from hook_driver import before_update, forwards, run_hooks
from transformers import LlamaConfig, LlamaForCausalLM

from stapo.core.batch import collate, collate_with_pad_row
from stapo.core.config import config_from_dict
from stapo.core.train import loop
from stapo.core.train.reference import minp_stats_batched
from stapo.core.trainer.base import compute_token_stats


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=32, initializer_range=0.2))


def _seqs(n: int) -> list[loop.Sequence_]:
    g = torch.Generator().manual_seed(1)
    return [loop.Sequence_(torch.randint(1, 32, (3,), generator=g).tolist(),
                           torch.randint(1, 32, (2 + i,), generator=g).tolist(), "stop", "", "", group=0, advantage=-1.0)
            for i in range(n)]


class _Counter:
    """Counts calls of a module (its forward pre-hook fires once per ``module(...)``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.n = 0
        self.handle = module.register_forward_pre_hook(lambda *_: self._inc())

    def _inc(self) -> None:
        self.n += 1


@pytest.mark.parametrize("n_real", [3, 0])
def test_minp_pass_makes_exactly_calls_forwards_and_pads_with_the_padding_row(n_real):
    model = _tiny()
    batch = collate_with_pad_row(_seqs(n_real), 0, pad=True)  # [n_real + 1, L], last row: padding
    counter = _Counter(model)
    kept, pmax = minp_stats_batched(model, batch, forwards(batch, 2, calls=4, pad_row=n_real), min_p=0.3,
                                    temperature=1.0, chunk_size=4)
    assert counter.n == 4  # the busiest rank's count, not this rank's ceil(n_real / 2)
    assert kept[n_real].abs().sum() == 0 and pmax[n_real].abs().sum() == 0  # the padding row: no response
    if n_real:  # real rows: the same statistics as an unpadded pass, row by row
        plain = collate(_seqs(n_real), 0)
        k1, m1 = minp_stats_batched(model, plain, forwards(plain, 1), min_p=0.3, temperature=1.0, chunk_size=4)
        torch.testing.assert_close(kept[:n_real], k1)
        torch.testing.assert_close(pmax[:n_real], m1)
        assert (kept[:n_real] != 0).sum() == plain.response_mask.sum()
    with pytest.raises(ValueError, match="pad_row"):  # more forwards than rows, and no padding row to run them on
        forwards(batch, 2, calls=9)


@pytest.mark.parametrize("n_real", [3, 0])
def test_prepare_with_padding_row_reference_on_real_rows_and_proxy_pass_padded(n_real):
    cfg = config_from_dict({"trainer": {"micro_batch_size": 2},
                            "algorithm": {"kl_coef": 0.1, "kl": {"reference": "initial", "dtype": "float32"},
                                          "lp_reg": {"enabled": True, "min_p": 0.3, "rho": 1.0}}})
    policy = _tiny()
    backend = type("B", (), {"model": policy, "device": torch.device("cpu"), "world_size": 1})()
    hooks = run_hooks(cfg, backend)
    reference = hooks.get("kl_reference").reference
    with torch.no_grad():
        for p in reference.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = collate_with_pad_row(_seqs(n_real), 0, pad=True)
    with torch.no_grad():
        old_lp, old_ent = compute_token_stats(policy, batch.input_ids, batch.attention_mask, batch.response_mask,
                                              chunk_size=4)
    ref_calls, pol_calls = _Counter(reference.model.model), _Counter(policy.model)  # the decoders
    st, m = before_update(hooks, batch, old_lp, old_ent, micro_batch=2, calls=3, pad_row=n_real)
    assert pol_calls.n == 3 and ref_calls.n == -(-n_real // 2)
    assert st.ref_lp[n_real].abs().sum() == 0
    if n_real:  # the reference's log-probs of the real rows, by an unpadded call
        plain = loop.Batch(batch.input_ids[:n_real], batch.attention_mask[:n_real], batch.response_mask[:n_real],
                           batch.advantages[:n_real])
        want = reference.logprobs(plain, forwards(plain, 1), temperature=1.0)
        torch.testing.assert_close(st.ref_lp[:n_real], want)
        assert m["actor/kl"] > 0


@pytest.mark.parametrize("n_real", [3, 0])
def test_partitioned_reference_makes_exactly_calls_forwards(n_real):
    """A partitioned reference (ZeRO-3 gathers in each forward) pads to ``calls`` like the policy's
    passes. The partitioning itself is DeepSpeed's (tests/e2e/test_multirank_extras.py); here the
    copy is a plain module behind the same ``partitioned_copy`` seam, so only the lockstep is tested."""
    cfg = config_from_dict({"trainer": {"micro_batch_size": 2},
                            "algorithm": {"kl_coef": 0.1, "kl": {"reference": "initial", "dtype": "float32"}}})
    policy = _tiny()
    made = []

    def frozen_copy(dtype, *, offload):
        made.append((dtype, offload))
        return SimpleNamespace(module=copy.deepcopy(policy).to(dtype).eval())

    backend = SimpleNamespace(model=policy, device=torch.device("cpu"), world_size=1, zero_stage=3,
                              frozen_copy=frozen_copy)
    hooks = run_hooks(cfg, backend)
    reference = hooks.get("kl_reference").reference
    assert made == [(torch.float32, False)] and reference.partitioned
    batch = collate_with_pad_row(_seqs(n_real), 0, pad=True)
    with torch.no_grad():
        old_lp, old_ent = compute_token_stats(policy, batch.input_ids, batch.attention_mask, batch.response_mask,
                                              chunk_size=4)
    ref_calls = _Counter(reference.model.model)
    st, _ = before_update(hooks, batch, old_lp, old_ent, micro_batch=2, calls=3, pad_row=n_real)
    assert ref_calls.n == 3  # the busiest rank's count, whatever this rank holds
    # the copy equals the policy here: its log-probs are the policy's, the padding row is 0
    torch.testing.assert_close(st.ref_lp, old_lp)
    assert st.ref_lp[n_real].abs().sum() == 0
