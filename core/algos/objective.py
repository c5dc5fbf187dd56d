"""The policy objective: per-token policy loss (+ additive token terms) x token weights ->
aggregated scalar, plus metrics that add up across micro-batches.

This is the one objective: the trainer's update calls it for every micro-batch (``MiniBatch.loss``
in ``stapo.core.train.update``) and the public ``stapo_loss`` calls it for a whole batch.

    tw = get_token_weighting(name)(ctx, **options)                          # whole mini-batch, sliced
    norm = global sum of get_aggregation(agg).normalizer(tw_k, mask_k)      # over micro-batches + ranks
    loss, metrics = compute_policy_objective(logp, old_logp, adv, mask, tw_k,
                                             policy_loss="ppo_clip", aggregation="token-mean",
                                             normalizer=norm)
    backend.backward(loss)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .aggregation import Aggregation, get_aggregation
from .losses import PolicyLossFn, get_policy_loss
from .regularizers import TokenTerm, add_terms, entropy_bonus
from .weights import TokenWeights


def per_token_objective(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                        policy_loss: str | PolicyLossFn, loss_kwargs: dict[str, Any],
                        terms: Sequence[TokenTerm] = ()) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token part of the objective [B, T]: the policy loss plus the additive terms, before
    any weighting or aggregation (the fused LM-head path weights it inside the chunked forward, the
    unfused one in :func:`compute_policy_objective`: both call this). ``loss_kwargs``: every keyword
    of the policy loss, the clip ranges included."""
    loss_fn = get_policy_loss(policy_loss) if isinstance(policy_loss, str) else policy_loss
    per_token, metrics = loss_fn(logprobs, old_logprobs, advantages, mask, **loss_kwargs)  # [B, T]
    return add_terms(per_token, logprobs, terms), metrics


def compute_policy_objective(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: TokenWeights,
    *,
    policy_loss: str | PolicyLossFn = "ppo_clip",
    aggregation: str | Aggregation = "token-mean",
    normalizer: float | Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: float | None = None,
    loss_kwargs: dict[str, Any] | None = None,
    terms: Sequence[TokenTerm] = (),
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss for one micro-batch and its summable metrics; every tensor [B, T].

    ``normalizer`` is the GLOBAL normalizer of the optimizer mini-batch (see ``aggregation``);
    None means "this call is the whole mini-batch" and uses the local one. ``policy_loss`` and
    ``aggregation`` are registry names or the registered objects (the update resolves them once). ``loss_kwargs`` are the
    policy loss's own options beyond the clip ranges (e.g. MASPO's). ``terms`` (KL to a reference,
    Lp-Reg's proxy KL: ``regularizers.TokenTerm``) are added to the per-token loss before it is
    weighted and aggregated, so a token the weighting removed carries no term gradient either and
    the normalizer is shared. ``entropy_coef`` > 0 subtracts ``entropy_coef * aggregate(entropy)``
    (the entropy bonus; ``entropy`` must carry gradient).
    """
    agg = get_aggregation(aggregation) if isinstance(aggregation, str) else aggregation
    kw = {"eps_low": eps_low, "eps_high": eps_high, "dual_clip_c": dual_clip_c, **(loss_kwargs or {})}
    per_token, metrics = per_token_objective(logprobs, old_logprobs, advantages, mask, policy_loss=policy_loss,
                                             loss_kwargs=kw, terms=terms)  # [B, T]
    if normalizer is None:
        normalizer = agg.normalizer(weights, mask)
    loss = agg.aggregate(per_token, weights, normalizer=normalizer)
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropies (with gradient)")
        loss = loss + entropy_bonus(entropy, weights, agg, normalizer, coef=entropy_coef)
    metrics = dict(metrics)
    with torch.no_grad():
        metrics["weight_sum"] = (weights.weights * mask).sum().to(per_token.dtype)
        metrics["denom_count"] = weights.denom_mask.sum().to(per_token.dtype)
    return loss, metrics
