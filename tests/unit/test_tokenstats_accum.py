"""The chunked LM-head gradient is summed over chunks in float32 whatever the weight's dtype.

Why: with bf16 parameters (DeepSpeed bf16), a weight gradient summed chunk by chunk in bf16 keeps
8 mantissa bits: once the running sum is large, the next chunks' contributions are rounded away. The check: bf16 weights and hidden states, many chunks,
against an independent float64 computation of the same gradient from the same bf16 values; the
result may differ by bf16 precision (the logits are formed by a bf16 matmul, the result is rounded
to bf16), normwise 2^-8. Summing in bf16 over 1024 one-token chunks is off by ~9x that.
"""

from __future__ import annotations

import pytest
import torch

from stapo.core.tokenstats import fused_token_loss_from_hidden, token_logprobs_entropy_from_hidden

N, D, V = 1024, 16, 32


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(N, D, generator=g) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(V, D, generator=g) * 0.5).to(torch.bfloat16)
    labels = torch.randint(0, V, (N,), generator=g)
    coef = torch.rand(N, generator=g, dtype=torch.float64) + 0.5  # [N] per-token loss weights
    return hidden, weight, labels, coef


def _reference_grad_w(hidden, weight, labels, coef) -> torch.Tensor:
    """d sum_i coef_i * log p_i / dW in float64, autograd on the full log-softmax (independent path)."""
    w = weight.double().requires_grad_(True)
    logp = torch.log_softmax(hidden.double() @ w.t(), dim=-1).gather(1, labels.unsqueeze(1)).squeeze(1)
    (coef * logp).sum().backward()
    return w.grad


def _assert_bf16_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Normwise relative error within bf16 precision (2^-8). Rounding the exact gradient to bf16
    alone costs ~2^-9.4 here; elementwise bounds would be unfair to entries that cancel."""
    assert got.dtype == torch.bfloat16
    rel = float((got.double() - ref).norm() / ref.norm())
    assert rel <= 2.0**-8, f"weight gradient relative error {rel:.2e} > bf16 precision {2.0**-8:.2e}"


@pytest.mark.parametrize("chunk_size", [1, 8])
def test_recompute_path_bf16_weight_grad_is_fp32_accurate(chunk_size):
    hidden, weight, labels, coef = _inputs()
    w = weight.clone().requires_grad_(True)
    lp, _ = token_logprobs_entropy_from_hidden(hidden, w, labels, chunk_size=chunk_size)
    (lp * coef.float()).sum().backward()
    _assert_bf16_close(w.grad, _reference_grad_w(hidden, weight, labels, coef))


@pytest.mark.parametrize("chunk_size", [1, 8])
def test_fused_path_bf16_weight_grad_is_fp32_accurate(chunk_size):
    hidden, weight, labels, coef = _inputs()
    w = weight.clone().requires_grad_(True)
    c = coef.float()

    def token_loss(logp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return c[index] * logp

    loss, _, _ = fused_token_loss_from_hidden(hidden, w, labels, token_loss, chunk_size=chunk_size)
    loss.backward()
    _assert_bf16_close(w.grad, _reference_grad_w(hidden, weight, labels, coef))
