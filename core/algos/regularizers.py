"""Additive terms beside the policy gradient: KL to a reference, Lp-Reg's proxy KL, the entropy bonus.

A :class:`TokenTerm` is ``coef_t * k(logp_t, target_t)`` per token, with ``coef`` and ``target``
constants of the step (computed without gradient) and ``k`` a per-token KL estimator. It is added
to the per-token policy loss BEFORE aggregation, so it shares the token weights and the global
normalizer (verl adds its KL loss with the same ``agg_loss``; Lp-Reg writes its term into
``pg_losses``). It is elementwise in ``logp``, so the fused loss path can evaluate it inside the
chunked LM-head pass.

    terms = [kl_token_term(ref_lp, mask, coef=0.001, estimator="k3")]          # [N, L] each
    per_tok = add_terms(per_tok, logp, [t.rows(idx) for t in terms])
    loss = agg.aggregate(per_tok, tw, normalizer=norm) + entropy_bonus(ent, tw, agg, norm, coef=1e-3)

KL in the reward instead (verl ``use_kl_in_reward`` with an outcome advantage): each response's
reward loses ``coef * sum_t k(old_t, ref_t)`` before the group advantages: :func:`kl_reward_penalty`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .aggregation import Aggregation
from .losses import get_kl_estimator
from .weights import TokenWeights

__all__ = [
    "TokenTerm",
    "add_terms",
    "entropy_bonus",
    "kl_reward_penalty",
    "kl_token_term",
    "lp_reg_token_term",
    "masked_mean",
]


@dataclass(frozen=True)
class TokenTerm:
    """``coef * k(logp, target)`` where ``coef != 0`` (and, with ``below_only``, logp < target); else 0."""

    name: str
    target: Tensor  # [N, L] (or any shape matching logp)
    coef: Tensor  # same shape, float; 0 = term off at that token
    estimator: str = "k3"
    below_only: bool = False

    def rows(self, index: slice | Tensor) -> TokenTerm:
        """The term restricted to rows ``index`` (a mini- or micro-batch)."""
        return TokenTerm(self.name, self.target[index], self.coef[index], self.estimator, self.below_only)

    def flat(self, index: Tensor) -> TokenTerm:
        """The term at flat positions ``index`` [n] of its [b, L] tensors, as [1, n] (the fused path's
        indexing: one row of the chunk's tokens, the registered losses' [B, T] layout)."""
        target, coef = self.target.reshape(-1)[index].unsqueeze(0), self.coef.reshape(-1)[index].unsqueeze(0)
        return TokenTerm(self.name, target, coef, self.estimator, self.below_only)

    def __call__(self, logprobs: Tensor) -> Tensor:
        if logprobs.shape != self.coef.shape:
            raise ValueError(f"{self.name}: logprobs shape {tuple(logprobs.shape)} != term shape {tuple(self.coef.shape)}")
        on = self.coef != 0
        if self.below_only:
            on = on & (logprobs.detach() < self.target)
        target = torch.where(on, self.target.to(logprobs.dtype), logprobs.detach())  # finite where off
        value = self.coef.to(logprobs.dtype) * get_kl_estimator(self.estimator)(logprobs, target)
        return torch.where(on, value, torch.zeros_like(logprobs))


def add_terms(per_token_loss: Tensor, logprobs: Tensor, terms: Sequence[TokenTerm]) -> Tensor:
    """per_token_loss + sum of the terms at ``logprobs`` (shapes equal)."""
    for term in terms:
        per_token_loss = per_token_loss + term(logprobs)
    return per_token_loss


def kl_token_term(ref_logprobs: Tensor, mask: Tensor, *, coef: float, estimator: str = "k3") -> TokenTerm:
    """KL(pi || ref) penalty on every valid token, weight ``coef`` (GRPO's beta)."""
    return TokenTerm("kl", ref_logprobs.detach().float(), coef * mask.to(torch.float32), estimator)


def lp_reg_token_term(proxy_logprobs: Tensor, selected: Tensor, *, coef: float, estimator: str = "k3") -> TokenTerm:
    """Lp-Reg's term: KL toward the min-p proxy on ``selected`` tokens whose log-prob is below the proxy's."""
    return TokenTerm("lp_reg", proxy_logprobs.detach().float(), coef * selected.to(torch.float32), estimator, True)


def kl_reward_penalty(
    old_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, *, coef: float, estimator: str = "k3"
) -> Tensor:
    """[N] = coef * sum over valid tokens of k(old, ref): what each response's reward loses."""
    with torch.no_grad():
        k = get_kl_estimator(estimator)(old_logprobs.float(), ref_logprobs.float())  # [N, L]
        return coef * torch.where(mask.bool(), k, torch.zeros_like(k)).sum(dim=-1)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over ``mask`` (0 when empty), as a 0-d float64 tensor (sum and count summable)."""
    m = mask.bool()
    return values.detach().double()[m].sum() / m.sum().clamp_min(1)


def entropy_bonus(
    entropy: Tensor, weights: TokenWeights, agg: Aggregation, normalizer: float | Tensor, *, coef: float
) -> Tensor:
    """-coef * aggregate(entropy): added to the loss, its gradient RAISES the entropy (verl
    ``policy_loss = pg_loss - entropy_coeff * entropy_loss``). ``entropy`` must carry gradient."""
    return -coef * agg.aggregate(entropy, weights, normalizer=normalizer)
