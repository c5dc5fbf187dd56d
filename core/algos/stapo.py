"""STAPO for users of other trainers: the paper's threshold, the mask, and the loss.

    from stapo.core.algos import s2t_tau_h, s2t_mask, stapo_loss
    loss, metrics = stapo_loss(logprobs, old_logprobs, advantages, entropy, mask)   # tau_p 0.002, q 0.75
    metrics["tau_h"], metrics["silenced_count"]

``stapo_loss`` computes the paper's tau_h^(q) itself (:func:`s2t_tau_h`: the q-th quantile of the
entropies of this call's candidates, the valid tokens with A > 0 and p < tau_p) and is built from
the registry pieces (the ``s2t`` weighting, the ``ppo_clip`` loss and the ``token-mean``
aggregation): sum(m * l) / sum(m) over this call's tokens, where m = 0 for silenced tokens and l is
the clip-higher PPO loss. Call it once per optimizer mini-batch (Algorithm 1 takes the quantile over
the mini-batch); under data parallelism pass ``gather`` (concatenate a 1-D tensor over ranks) so the
quantile is the global mini-batch's. For gradient accumulation, call the weighting once on the whole
mini-batch and ``compute_policy_objective`` per micro-batch with the mini-batch's global normalizer,
as the trainer does.
"""

from __future__ import annotations

from torch import Tensor

from .objective import compute_policy_objective
from .weights import Gather, TokenContext, get_token_weighting, s2t_mask, s2t_tau_h

__all__ = ["s2t_mask", "s2t_tau_h", "stapo_loss"]


def stapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    entropy: Tensor,
    mask: Tensor,
    *,
    tau_p: float = 0.002,
    q: float = 0.75,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    gather: Gather | None = None,
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """STAPO loss (token-mean over this call's un-silenced tokens) and its metrics; defaults are the
    paper's (tau_p 0.002, q 75%, clip 0.2 / 0.28: arXiv 2602.15620v1, appendix table).

    Worked example (one response, A = +1, 6 tokens; p and H of each)::

        p = [0.9, 0.001, 0.0015, 0.001, 0.3, 0.0005]      H = [0.2, 0.4, 1.2, 2.0, 0.9, 0.1]
        candidates (p < 0.002): tokens 1, 2, 3, 5 with H = [0.4, 1.2, 2.0, 0.1]
        tau_h^(0.75) = quantile([0.1, 0.4, 1.2, 2.0], 0.75) = 1.2 + 0.25 * (2.0 - 1.2) = 1.4
        silenced (H < 1.4): tokens 1, 2, 5     kept: tokens 0, 3, 4 -> loss = mean of their 3 losses

    With A <= 0 nothing is a candidate and the loss is the plain clip-higher token mean.
    ``metrics`` adds ``tau_h`` (NaN when there is no candidate), ``candidates`` and ``silenced_count``.
    """
    ctx = TokenContext(logprobs, entropy, advantages, mask, gather=gather)
    tw = get_token_weighting("s2t")(ctx, tau_p=tau_p, q=q)
    loss, metrics = compute_policy_objective(  # the trainer's objective, over this call's tokens
        logprobs, old_logprobs, ctx.advantages, ctx.mask, tw,
        policy_loss="ppo_clip", aggregation="token-mean", eps_low=eps_low, eps_high=eps_high,
    )
    metrics["silenced_count"] = metrics["token_count"] - metrics["denom_count"]
    metrics["tau_h"] = tw.info["tau_h"]
    metrics["candidates"] = tw.info["candidates"]
    return loss, metrics
