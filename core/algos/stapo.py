"""STAPO for users of other trainers: one function for the mask, one for the loss.

    from stapo.core.algos import s2t_mask, stapo_loss, resolve_tau_h
    tau_h = resolve_tau_h(entropy, mask, tau_h_quantile=0.05)            # or an absolute value
    loss, metrics = stapo_loss(logprobs, old_logprobs, advantages, entropy, mask, tau_p=0.01, tau_h=tau_h)

``stapo_loss`` is built from the registry pieces (the ``s2t`` weighting, the ``ppo_clip`` loss and
the ``token-mean`` aggregation): sum(m * l) / sum(m) over this call's tokens, where m = 0 for
silenced tokens (advantage > 0, p < tau_p, H < tau_h) and l is the clip-higher PPO loss. It calls
``compute_policy_objective``, the function the trainer calls per micro-batch; for gradient
accumulation, call that with the mini-batch's global normalizer instead.
"""

from __future__ import annotations

from torch import Tensor

from .objective import compute_policy_objective
from .weights import TokenContext, get_token_weighting, resolve_tau_h, s2t_mask

__all__ = ["s2t_mask", "stapo_loss", "resolve_tau_h"]


def stapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    entropy: Tensor,
    mask: Tensor,
    *,
    tau_p: float,
    tau_h: float,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[Tensor, dict[str, Tensor]]:
    """STAPO loss (token-mean over this call's un-silenced tokens) and its metrics."""
    ctx = TokenContext(logprobs, entropy, advantages, mask)
    tw = get_token_weighting("s2t")(ctx, tau_p=tau_p, tau_h=tau_h)
    loss, metrics = compute_policy_objective(  # the trainer's objective, over this call's tokens
        logprobs, old_logprobs, ctx.advantages, ctx.mask, tw,
        policy_loss="ppo_clip", aggregation="token-mean", eps_low=eps_low, eps_high=eps_high,
    )
    metrics["silenced_count"] = metrics["token_count"] - metrics["denom_count"]
    return loss, metrics
