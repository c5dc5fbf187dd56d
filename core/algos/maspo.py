"""MASPO (Fu et al. 2026, arXiv 2602.17550): a soft, mass-adaptive, asymmetric trust region in
place of PPO's hard clip. Registered as the policy loss ``maspo`` next to ``ppo_clip`` and ``gspo``:

    per_tok, m = get_policy_loss("maspo")(logp, old_logp, adv, mask,
                                          sigma_base=1.0, alpha=0.3, beta_pos=0.03, beta_neg=0.03)

Three pieces, each a small pure function below (formulas from the authors' released code,
github.com/VenomRose-Juri/MASPO-RL, ``verl/trainer/ppo/core_algos.py``, ``ratio_mode: maspo``; the
stored material held the paper's abstract and introduction but not its method section, so the
code is the reference for every formula here):

1. **Soft Gaussian gate** (gradient utilization). Where the hard clip would cut the gradient (A > 0
   and w > 1, or A < 0 and w < 1: the side on which the update pushes the ratio further away from
   1), the ratio is multiplied by a *detached* gate g = exp(-(w - 1)^2 / (2 sigma^2)); elsewhere it
   is left alone. Per token: l = -A * g * w, so dl/dlogp = -A * g * w: the gradient fades smoothly
   instead of dropping to 0 at 1 +- eps.
2. **Mass-adaptive limiter** (probability mass). sigma_mass = clamp(sigma_base / p_old^alpha,
   sigma_base, sigma_high): low-probability tokens (long tail) get a wider region, high-probability
   tokens the base width.
3. **Asymmetric risk controller** (signal reliability). sigma = sigma_mass * c(A) with
   c(A) = clamp(1 + beta_pos A, adv_low, adv_high) for A > 0 and clamp(1 / (1 - beta_neg A),
   adv_low, adv_high) for A < 0: a confident positive signal widens the region, a strongly
   negative one narrows it.

Limit cases (tested): sigma -> infinity gives the unclipped importance-sampled policy gradient
(g = 1); sigma -> 0 gives PPO's hard clip with eps_low = eps_high = 0 (no gradient on the
gated side, the unclipped gradient on the other). Like the authors' code MASPO has no dual clip.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stapo.core.loss_options import MaspoOptions

from .losses import (
    _LOG_RATIO_CLAMP,
    Metrics,
    _check_inputs,
    _ratio_metrics,
    register_policy_loss,
)


def mass_adaptive_sigma(old_prob: Tensor, *, sigma_base: float, alpha: float, sigma_high: float) -> Tensor:
    """sigma_base / p_old^alpha clamped to [sigma_base, sigma_high] (elementwise, same shape)."""
    return torch.clamp(sigma_base / old_prob.clamp_min(1e-30) ** alpha, sigma_base, sigma_high)


def risk_factor(adv: Tensor, *, beta_pos: float, beta_neg: float, adv_low: float, adv_high: float) -> Tensor:
    """Asymmetric width multiplier c(A): 1 + beta_pos A for A > 0, 1 / (1 - beta_neg A) for A <= 0,
    clamped to [adv_low, adv_high] (elementwise)."""
    pos = torch.clamp(1.0 + beta_pos * adv, adv_low, adv_high)
    neg = torch.clamp(1.0 / (1.0 - beta_neg * adv).clamp_min(1e-12), adv_low, adv_high)
    return torch.where(adv > 0, pos, neg)


def gaussian_gate(ratio: Tensor, sigma: Tensor) -> Tensor:
    """exp(-(w - 1)^2 / (2 sigma^2)) in (0, 1]; 1 at w = 1."""
    return torch.exp(-((ratio - 1.0) ** 2) / (2.0 * sigma**2))


def gated_side(ratio: Tensor, adv: Tensor) -> Tensor:
    """True where the hard clip would act: A > 0 and w > 1, or A < 0 and w < 1 (bool, same shape)."""
    return ((adv > 0) & (ratio > 1.0)) | ((adv < 0) & (ratio < 1.0))


# elementwise: each token's soft trust region reads its own log-prob only
@register_policy_loss("maspo", options=MaspoOptions, elementwise=True)
def maspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: float | None = None,
    sigma_base: float = 1.0,
    alpha: float = 0.3,
    sigma_high: float = 10.0,
    beta_pos: float = 0.03,
    beta_neg: float = 0.03,
    adv_low: float = 0.1,
    adv_high: float = 10.0,
    **kw: object,
) -> tuple[Tensor, Metrics]:
    """Per-token MASPO loss [B, T] (0 at invalid positions) and summable metrics.

    ``eps_low`` / ``eps_high`` are not used by the loss; they only define the ``clip_*_count``
    metrics (how many tokens the hard clip *would* have cut), so runs compare with ``ppo_clip``.
    Extra metrics: ``gate_sum`` (sum of g over gated valid tokens) and ``gated_count``.
    """
    if dual_clip_c is not None:
        raise ValueError("maspo has no dual clip (as in the authors' code); set algorithm.dual_clip_c=null")
    if sigma_base <= 0 or sigma_high < sigma_base:
        raise ValueError(f"maspo needs 0 < sigma_base <= sigma_high, got {sigma_base}, {sigma_high}")
    if not 0 < adv_low <= adv_high:
        raise ValueError(f"maspo needs 0 < adv_low <= adv_high, got {adv_low}, {adv_high}")
    adv, mask = _check_inputs(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    log_ratio = torch.clamp(logprobs - old_logprobs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    with torch.no_grad():
        sigma = mass_adaptive_sigma(
            torch.exp(old_logprobs.detach()), sigma_base=sigma_base, alpha=alpha, sigma_high=sigma_high
        ) * risk_factor(adv, beta_pos=beta_pos, beta_neg=beta_neg, adv_low=adv_low, adv_high=adv_high)  # [B, T]
        side = gated_side(ratio.detach(), adv)  # [B, T]
        gate = torch.where(side, gaussian_gate(ratio.detach(), sigma), torch.ones_like(ratio))  # [B, T]
    loss = -adv * (gate * ratio)  # [B, T]; gate is a constant: dl/dlogp = -A g w
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    metrics = _ratio_metrics(ratio, log_ratio, adv, mask, eps_low, eps_high)
    with torch.no_grad():
        gm = side & mask
        metrics["dual_clip_count"] = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        metrics["gate_sum"] = (gate * gm.to(gate.dtype)).sum()
        metrics["gated_count"] = gm.sum().to(ratio.dtype)
    return loss, metrics

