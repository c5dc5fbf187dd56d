"""Per-token policy losses (PPO clip-higher with optional dual-clip, GSPO), registered by name.

A policy loss returns the *per-token* loss [B, T] (0 at invalid positions) and metrics; how tokens
are weighted and averaged is the job of the token weighting and the aggregation, so every loss
composes with every weighting:

    from stapo.core.algos import get_policy_loss
    per_tok, m = get_policy_loss("ppo_clip")(logprobs, old_logprobs, adv, mask, eps_low=0.2, eps_high=0.28)

Metrics are micro-batch *sums* (detached tensors) so the loop can add them across micro-batches and
ranks: ``clip_low_count``, ``clip_high_count``, ``dual_clip_count``, ``token_count``, ``ratio_sum``,
``approx_kl_sum`` (sums), ``ratio_max`` / ``ratio_min`` (reduce with max / min, not sum).

Clip counters (TRL's and the brief's definitions; see docs/algorithms.md for the mapping to verl):
``clip_low`` = ratio < 1 - eps_low with A < 0, ``clip_high`` = ratio > 1 + eps_high with A > 0;
these are exactly the tokens whose gradient the clip removes, and clip_low + clip_high is verl's
``pg_clipfrac`` numerator. ``dual_clip_count`` = A < 0 and ratio > c (verl's ``pg_clipfrac_lower``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from .registry import Registry
from .weights import broadcast_advantages, check_bt

if TYPE_CHECKING:
    from stapo.core.loss_options import PolicyLossOptions

Metrics = dict[str, Tensor]

# exp() of a log-ratio beyond this is inf in float32 territory; verl clamps the same way.
_LOG_RATIO_CLAMP = 20.0


class PolicyLossFn(Protocol):
    """Contract of a per-token policy loss."""

    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        eps_low: float = 0.2,
        eps_high: float = 0.28,
        dual_clip_c: float | None = None,
        **kw: object,
    ) -> tuple[Tensor, Metrics]: ...


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss with its contract.

    ``options``: the pydantic model (a ``stapo.core.loss_options.PolicyLossOptions``) whose fields are
    the function's keywords beyond the clip ranges, None when it takes none; the config holds one
    instance of it (``AlgorithmConfig.policy_loss_options``). ``elementwise``: token t's loss depends
    on its own log-prob only, so the loss can run fused inside the chunked LM-head pass (GSPO's
    sequence ratio couples a sequence's tokens: it cannot)."""

    fn: PolicyLossFn
    options: type[PolicyLossOptions] | None
    elementwise: bool


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_policy_loss(
    name: str, *, options: type[PolicyLossOptions] | None, elementwise: bool
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a per-token policy loss under ``name`` with its options model and whether
    it is elementwise (state ``False`` when unsure: the unfused path is right for every loss)."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.add(name, PolicyLoss(fn, options, bool(elementwise)))
        return fn

    return decorator


def _check_inputs(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    check_bt("logprobs", logprobs)
    check_bt("old_logprobs", old_logprobs, logprobs.shape)
    check_bt("mask", mask, logprobs.shape)
    if not 0.0 <= eps_low <= 1.0:
        raise ValueError(f"eps_low must be in [0, 1], got {eps_low}")
    if eps_high < 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    adv = broadcast_advantages(advantages, logprobs).to(logprobs.dtype)  # [B, T]
    return adv, mask.bool()


def _ratio_metrics(
    ratio: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> Metrics:
    with torch.no_grad():
        r = ratio.detach()
        f = mask.to(r.dtype)
        n = mask.sum()
        inf = torch.tensor(float("inf"), dtype=r.dtype, device=r.device)
        return {
            "clip_low_count": (mask & (adv < 0) & (r < 1.0 - eps_low)).sum().to(r.dtype),
            "clip_high_count": (mask & (adv > 0) & (r > 1.0 + eps_high)).sum().to(r.dtype),
            "token_count": n.to(r.dtype),
            "ratio_sum": (r * f).sum(),
            "ratio_max": torch.where(mask, r, -inf).max() if r.numel() else -inf,
            "ratio_min": torch.where(mask, r, inf).min() if r.numel() else inf,
            "approx_kl_sum": (-log_ratio.detach() * f).sum(),  # sum of log(old/new): verl's ppo_kl numerator
        }


@register_policy_loss("ppo_clip", options=None, elementwise=True)
def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: float | None = None,
    **kw: object,
) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate with DAPO's asymmetric clip-higher, per token:

    l = -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A),  w = exp(logp - old_logp).
    With ``dual_clip_c`` = c (> 1, e.g. 3.0; Ye et al. 2020, as in verl) a negative-advantage
    token's loss is further capped at -c A, so a huge ratio cannot blow up the update.
    """
    adv, mask = _check_inputs(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    log_ratio = torch.clamp(logprobs - old_logprobs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    loss_unclipped = -adv * ratio  # [B, T]
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # [B, T]
    loss = torch.maximum(loss_unclipped, loss_clipped)  # [B, T] = -min(wA, clip(w)A)
    metrics = _ratio_metrics(ratio, log_ratio, adv, mask, eps_low, eps_high)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (e.g. 3.0), got {dual_clip_c}")
        loss_dual = -adv * dual_clip_c  # [B, T]
        loss = torch.where(adv < 0, torch.minimum(loss, loss_dual), loss)
        with torch.no_grad():
            metrics["dual_clip_count"] = (
                (mask & (adv < 0) & (ratio.detach() > dual_clip_c)).sum().to(ratio.dtype)
            )
    else:
        metrics["dual_clip_count"] = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    loss = torch.where(mask, loss, torch.zeros_like(loss))  # [B, T]
    return loss, metrics


@register_policy_loss("gspo", options=None, elementwise=False)  # the sequence ratio couples a sequence's tokens
def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip_c: float | None = None,
    **kw: object,
) -> tuple[Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071), token-level straight-through form.

    s_i = exp(mean_t (logp - old_logp)) over the valid tokens of sequence i, and per token
    s_it = sg[s_i] * pi_t / sg[pi_t] (value s_i, gradient sg[s_i] * grad log pi_t), clipped with the
    *passed* eps (the paper's ranges are tiny, 3e-4 / 4e-4; the config must set them). Use the
    ``seq-mean-token-mean`` aggregation to get the paper's objective. No dual clip.
    """
    if dual_clip_c is not None:
        raise ValueError("gspo has no dual clip; set dual_clip_c=None")
    adv, mask = _check_inputs(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    f = mask.to(logprobs.dtype)  # [B, T]
    lengths = f.sum(dim=-1).clamp_min(1.0)  # [B]
    log_ratio_tok = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))  # [B, T]
    log_s = log_ratio_tok.sum(dim=-1) / lengths  # [B]
    log_s_tok = logprobs - logprobs.detach() + log_s.detach().unsqueeze(-1)  # [B, T]
    log_s_tok = torch.clamp(log_s_tok, max=10.0)  # verl clamps the same way for stability
    s = torch.exp(log_s_tok)  # [B, T]
    loss = torch.maximum(-adv * s, -adv * torch.clamp(s, 1.0 - eps_low, 1.0 + eps_high))  # [B, T]
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    metrics = _ratio_metrics(s, log_ratio_tok, adv, mask, eps_low, eps_high)
    metrics["dual_clip_count"] = torch.zeros((), dtype=s.dtype, device=s.device)
    return loss, metrics


def get_policy_loss(name: str) -> PolicyLossFn:
    """The function of the policy loss registered as ``name`` (KeyError listing valid names on a miss)."""
    return POLICY_LOSSES.get(name).fn


def policy_loss_spec(name: str) -> PolicyLoss:
    """The registration of ``name``: function, options model, whether elementwise (KeyError listing valid names)."""
    return POLICY_LOSSES.get(name)


#: verl ``low_var_kl`` clamps the k3 value to [-10, 10] (``core_algos.kl_penalty_forward``): one token
#: whose policy fell far below the reference (log(pi / ref) = -6 gives k3 = e^6 - 7 ~ 396) would
#: otherwise dominate the step's penalty and its gradient (1 - e^6 ~ -402 per unit weight). Past the
#: clamp the token adds a constant and no gradient, as in verl.
K3_CLAMP = 10.0


def kl_k3_unclamped(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 KL estimator (Schulman 2020): exp(ref - logp) - (ref - logp) - 1 >= 0, [B, T].

    Unbiased for KL(pi || ref) under samples from pi. No clamp on the value (TRL's ``GRPOTrainer``
    computes it this way); only the log-ratio is held to +-20 so exp cannot overflow (verl does the same).
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs has shape {tuple(ref_logprobs.shape)}; expected {tuple(logprobs.shape)}"
        )
    d = torch.clamp(ref_logprobs - logprobs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T] log(ref / pi)
    return torch.exp(d) - d - 1.0


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 as verl's ``low_var_kl``: :func:`kl_k3_unclamped` clamped to [-10, 10] (:data:`K3_CLAMP`), [B, T].

    A clamped token contributes the constant 10 and zero gradient (``torch.clamp``'s gradient outside
    the range), exactly as in verl. Off by default in every recipe (kl_coef 0)."""
    return torch.clamp(kl_k3_unclamped(logprobs, ref_logprobs), -K3_CLAMP, K3_CLAMP)


# ----------------------------------------------------------------------------- KL estimators

KLEstimatorFn = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimatorFn] = Registry("KL estimator")


def _kl_log_ratio(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs has shape {tuple(ref_logprobs.shape)}; expected {tuple(logprobs.shape)}"
        )
    return torch.clamp(logprobs - ref_logprobs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # log(pi / ref)


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log(pi / ref), [B, T]: unbiased for KL(pi || ref) under samples from pi, high variance,
    can be negative; as a loss its gradient is the score function times 1 (verl ``kl``)."""
    return _kl_log_ratio(logprobs, ref_logprobs)


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (log(pi / ref))^2 / 2 >= 0, [B, T]: biased, low variance (verl ``mse``)."""
    return 0.5 * _kl_log_ratio(logprobs, ref_logprobs).square()


KL_ESTIMATORS.add("k3", kl_k3)
KL_ESTIMATORS.add("k3_unclamped", kl_k3_unclamped)


def get_kl_estimator(name: str) -> KLEstimatorFn:
    """The per-token KL estimator registered as ``name``: k1, k2, k3 (clamped as verl), k3_unclamped (as TRL)."""
    return KL_ESTIMATORS.get(name)
