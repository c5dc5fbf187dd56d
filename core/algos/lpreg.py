"""Lp-Reg: low-probability regularization (Huang et al. 2025, arXiv 2510.03222; code
github.com/CarlanLark/Lp-Reg-dev, ``compute_policy_loss_lp_reg`` and ``apply_min_p``).

The policy-gradient term stays. On top of it, a few negative-advantage tokens get a KL penalty that
pulls the policy toward a *proxy* distribution, so the negative update cannot crush low-probability
"reasoning sparks" while noise tokens are left alone:

1. proxy (per position, from the sampling policy, detached): min-p filtering with a RELATIVE floor,
   keep tokens with p_v >= min_p * max_v p_v, drop the rest, renormalize. For the sampled token:
   log pi_proxy(o_t) = log p(o_t) - log(sum of kept p_v), or "minus infinity" when o_t is below the
   floor (the authors set its logit to -1e4: we use -1e4 too, see ``PROXY_FLOOR``).
2. selection: among valid tokens with A < 0, the k = max(1, int(n * rho)) with the lowest current
   log-prob (n counted over the whole batch), applied only when k > 1 (as the authors' code does);
   of those, only tokens whose current log-prob is below the proxy's (``log_prob < tgt_log_prob``):
   a token under the floor never qualifies (its proxy is -1e4).
3. term: coef * k(logp, proxy_logp) with k the per-token KL estimator (authors: ``low_var_kl`` = k3),
   added to the token's policy loss before aggregation (token-mean in their recipe).

Departures (documented in docs/algorithms.md): the authors replace the selected tokens' clipped
surrogate by the unclipped -A * ratio; we keep the configured clip. With their recipe's clip range
(eps_low 1.0, eps_high 9.0) the two coincide for negative advantages, except their dual-clip c=10,
which we apply to every token. Their selection runs per micro-batch (dynamic batch size); ours over
the optimizer mini-batch, gathered across ranks. Ties at the k-th log-prob are all selected.

    stats = minp_stats_from_logits(logits, min_p=0.02)          # per position: (log kept mass, log p_max)
    proxy = minp_proxy_logprobs(old_logp, *stats, min_p=0.02)   # [B, T]
    sel = lp_reg_select(logp, adv, mask, rho=0.01)              # [B, T] bool
    term = lp_reg_token_term(proxy, sel, coef=1.0)            # regularizers.TokenTerm, added to the loss
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .weights import broadcast_advantages, check_bt, top_fraction_threshold

__all__ = [
    "PROXY_FLOOR",
    "minp_stats_from_logits",
    "minp_proxy_logprobs",
    "lp_reg_count",
    "lp_reg_select",
]

PROXY_FLOOR = -1.0e4  # proxy log-prob of a token below the min-p floor (the authors' -1e4 logit)


def minp_stats_from_logits(logits: Tensor, *, min_p: float) -> tuple[Tensor, Tensor]:
    """(log of the kept probability mass [n], log of the max probability [n]) for logits [n, V].

    Kept: p_v >= min_p * max p, i.e. logit_v >= max logit + log(min_p). Computed in float32.
    """
    if not 0.0 < min_p < 1.0:
        raise ValueError(f"min_p must be in (0, 1), got {min_p}")
    z = logits.detach().float()  # [n, V]
    lse = torch.logsumexp(z, dim=-1)  # [n]
    zmax = z.max(dim=-1).values  # [n]
    kept = z >= (zmax + math.log(min_p)).unsqueeze(-1)  # [n, V]
    lse_kept = torch.logsumexp(torch.where(kept, z, torch.full_like(z, -math.inf)), dim=-1)  # [n]
    return lse_kept - lse, zmax - lse


def minp_proxy_logprobs(
    logprobs: Tensor, log_kept_mass: Tensor, log_pmax: Tensor, *, min_p: float
) -> Tensor:
    """log pi_proxy of each sampled token (same shape as ``logprobs``): logp - log kept mass when the
    token is above the floor (p >= min_p * p_max), else ``PROXY_FLOOR``."""
    lp = logprobs.detach().float()
    above = lp >= log_pmax + math.log(min_p) - 1e-6  # tolerance: the sampled token may BE the max
    return torch.where(above, lp - log_kept_mass, torch.full_like(lp, PROXY_FLOOR))


def lp_reg_count(n: int, rho: float) -> int:
    """The authors' k = max(1, int(n * rho)); the term is applied only when k > 1 (0 returned then)."""
    k = max(1, int(n * rho))
    return k if k > 1 else 0


def lp_reg_select(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    rho: float,
    gather: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """[B, T] bool: the lowest-log-prob ``rho`` fraction of valid negative-advantage tokens."""
    check_bt("logprobs", logprobs)
    check_bt("mask", mask, logprobs.shape)
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1], got {rho}")
    with torch.no_grad():
        adv = broadcast_advantages(advantages.detach(), logprobs)
        neg = mask.bool() & (adv < 0)  # [B, T]
        values = logprobs.detach()[neg]  # [n_local]
        allv = gather(values) if gather is not None else values
        k = lp_reg_count(int(allv.numel()), rho)
        if k == 0:
            return torch.zeros_like(neg)
        thr = top_fraction_threshold(allv, k / allv.numel(), largest=False)
        return neg & (logprobs.detach() <= thr)

