"""Token diagnostics from the same pass as the weighting: silenced fraction, STAPO's phase
diagram cells, entropy and probability summaries. Global across ranks when the context carries
``all_reduce_sum`` / ``gather``.

    m = token_metrics(ctx, tw, tau_p=0.01, tau_h=tw.info["tau_h"])
    m["stapo/silenced_frac"], m["phase/lowp_lowh_pos"], m["entropy/p05"]

Phase cells split valid tokens by probability (low: p < tau_p), entropy (low: H < tau_h) and
advantage sign (pos: A > 0, neg: A <= 0); the 8 fractions sum to 1. The S2T-silenced tokens are
exactly the ``phase/lowp_lowh_pos`` cell when the weighting is ``s2t`` with the same thresholds.
"""

from __future__ import annotations

import numpy as np
import torch

from .weights import TokenContext, TokenWeights, below_thresholds, quantile

PHASE_KEYS = tuple(
    f"phase/{p}_{h}_{a}" for p in ("lowp", "highp") for h in ("lowh", "highh") for a in ("pos", "neg")
)


def phase_cells(ctx: TokenContext, *, tau_p: float, tau_h: float) -> torch.Tensor:
    """[B, T] int8 index into :data:`PHASE_KEYS` of every token (meaningful where ``ctx.mask``):
    ``highp * 4 + highh * 2 + neg`` with highp = p >= tau_p, highh = H >= tau_h, neg = A <= 0."""
    with torch.no_grad():
        lowp, lowh = below_thresholds(ctx.logprobs, ctx.entropy, tau_p=tau_p, tau_h=tau_h)  # as the mask
        highp = (~lowp).to(torch.int8)
        highh = (~lowh).to(torch.int8)
        neg = (ctx.advantages <= 0).to(torch.int8)
        return highp * 4 + highh * 2 + neg  # [B, T]


COUNT_KEYS = ("tokens", "silenced", "candidates", "entropy_sum", "prob_sum", *PHASE_KEYS)


def token_counts(
    ctx: TokenContext, weights: TokenWeights, *, tau_p: float, tau_h: float
) -> dict[str, float]:
    """GLOBAL sums over valid tokens (one all-reduce when the context has ``all_reduce_sum``):
    ``tokens``, ``silenced`` (valid tokens the weighting gave weight 0), ``candidates`` (S2T's:
    valid, A > 0, p < tau_p), ``entropy_sum``,
    ``prob_sum`` and the 8 phase-cell counts (keys ``phase/...``) at absolute thresholds.

    Counts, not fractions, so the loop can add them over the mini-batches of an update and divide
    once: what it logs is then exactly what the update's weightings produced.
    """
    with torch.no_grad():
        mask = ctx.mask
        ent = ctx.entropy.detach().double()
        p = ctx.logprobs.detach().double().exp()
        lowp, lowh = below_thresholds(ctx.logprobs, ctx.entropy, tau_p=tau_p, tau_h=tau_h)  # as the mask
        pos = ctx.advantages > 0
        cells = []
        for pm in (lowp, ~lowp):
            for hm in (lowh, ~lowh):
                for am in (pos, ~pos):
                    cells.append((mask & pm & hm & am).sum())
        silenced = (mask & (weights.weights == 0)).sum()
        candidates = (mask & lowp & pos).sum()
        sums = torch.stack(
            [mask.sum().double(), silenced.double(), candidates.double(), (ent * mask).sum(), (p * mask).sum()]
            + [c.double() for c in cells]
        )  # [5 + 8]
        sums = ctx.summed(sums)
        return {k: float(v) for k, v in zip(COUNT_KEYS, sums.tolist(), strict=True)}


def fractions_from_counts(counts: dict[str, float]) -> dict[str, float]:
    """``stapo/silenced_frac``, ``entropy/mean``, ``prob/mean``, ``tokens/valid`` and the phase
    fractions from (summed) :func:`token_counts`."""
    n = counts["tokens"]
    denom = max(n, 1.0)
    out = {
        "stapo/silenced_frac": counts["silenced"] / denom,
        "entropy/mean": counts["entropy_sum"] / denom,
        "prob/mean": counts["prob_sum"] / denom,
        "tokens/valid": n,
    }
    for key in PHASE_KEYS:
        out[key] = counts[key] / denom
    return out


def token_metrics(
    ctx: TokenContext, weights: TokenWeights, *, tau_p: float, tau_h: float | None = None
) -> dict[str, float]:
    """Fractions over valid tokens (see module doc). ``tau_h`` is absolute; None = the batch's 5th
    entropy percentile (STAPO's reported choice)."""
    with torch.no_grad():
        valid_ent = ctx.gathered(ctx.entropy.detach()[ctx.mask])
        p05 = quantile(valid_ent, 0.05)
        th = p05 if tau_h is None else float(tau_h)
        out = fractions_from_counts(token_counts(ctx, weights, tau_p=tau_p, tau_h=th))
        out["entropy/p05"] = p05
        return out


def grad_norms(prob: np.ndarray, entropy: np.ndarray, advantage: np.ndarray, sum_q2: np.ndarray,
               ratio: float | np.ndarray = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(measured, theorem) per-token gradient norms w.r.t. the logits, shape [N] each (``stapo
    calibrate``'s taxonomy, ``stapo inspect``'s Theorem 3.1 check).

    measured = |A w| sqrt(1 - 2p + sum_q q^2)   (exact for the loss -w A log-prob of the sampled token)
    theorem  = |A w| sqrt(1 - 2p + e^{-H})       (Theorem 3.1's form)
    The radicands are clamped at 0 against float round-off (p ~ 1 gives 1 - 2p + p^2 ~ 0).
    """
    scale = np.abs(advantage * ratio)  # [N]
    measured = scale * np.sqrt(np.clip(1.0 - 2.0 * prob + sum_q2, 0.0, None))
    theorem = scale * np.sqrt(np.clip(1.0 - 2.0 * prob + np.exp(-entropy), 0.0, None))
    return measured, theorem
