"""The one call the trainer makes per micro-batch: per-token policy loss x token weights ->
aggregated scalar, plus metrics that add up across micro-batches.

    tw = get_token_weighting(cfg.weighting)(ctx, **cfg.weighting_params)    # whole mini-batch, sliced
    norm = global sum of get_aggregation(cfg.agg).normalizer(tw_k, mask_k)  # over micro-batches + ranks
    loss, metrics = compute_policy_objective(logp, old_logp, adv, mask, tw_k,
                                             policy_loss="ppo_clip", aggregation="token-mean",
                                             normalizer=norm)
    backend.backward(loss)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .aggregation import get_aggregation
from .losses import get_kl_estimator, get_policy_loss
from .weights import TokenWeights


def compute_policy_objective(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: TokenWeights,
    *,
    policy_loss: str = "ppo_clip",
    aggregation: str = "token-mean",
    normalizer: float | Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: float | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    loss_kwargs: dict[str, Any] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss for one micro-batch and its summable metrics.

    ``normalizer`` is the GLOBAL normalizer of the optimizer mini-batch (see ``aggregation``);
    None means "this call is the whole mini-batch" and uses the local one. The optional KL
    term (``kl_coef`` > 0 with ``ref_logprobs``; estimator k1 / k2 / k3, default k3) is weighted and aggregated exactly like the policy
    loss, so a token the weighting removed carries no KL gradient either and the normalizer is shared.
    """
    agg = get_aggregation(aggregation)
    loss_fn = get_policy_loss(policy_loss)
    per_token, metrics = loss_fn(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip_c=dual_clip_c,
        **(loss_kwargs or {}),
    )  # [B, T]
    if normalizer is None:
        normalizer = agg.normalizer(weights, mask)
    loss = agg.aggregate(per_token, weights, normalizer=normalizer)
    metrics = dict(metrics)
    metrics["pg_loss"] = loss.detach()
    if kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's log-probs)")
        kl = agg.aggregate(get_kl_estimator(kl_estimator)(logprobs, ref_logprobs), weights, normalizer=normalizer)
        loss = loss + kl_coef * kl
        metrics["kl_loss"] = kl.detach()
    with torch.no_grad():
        metrics["weight_sum"] = (weights.weights * mask).sum().to(per_token.dtype)
        metrics["denom_count"] = weights.denom_mask.sum().to(per_token.dtype)
    return loss, metrics
