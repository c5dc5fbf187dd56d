"""Token weightings: which tokens of a batch carry policy gradient, and with what weight.

A token weighting is a pure function ``fn(ctx: TokenContext, **params) -> TokenWeights``. It sees
the current policy's log-probs and entropies, the advantages and the valid mask, and returns
``weights`` (multiplies each token's loss; 0 = no gradient) and ``denom_mask`` (tokens counted in
the token-mean denominator). The policy loss never knows which weighting produced them.

    from stapo.core.algos import TokenContext, get_token_weighting
    ctx = TokenContext(logprobs, entropy, advantages, mask)          # [B, T] each
    tw = get_token_weighting("s2t")(ctx, tau_p=0.002, q=0.75)       # the paper's values
    tw.weights, tw.denom_mask, tw.info["tau_h"]

Batch statistics (entropy quantiles, top-k thresholds, mean entropy) are taken over the whole
global mini-batch: ``ctx.gather`` concatenates a 1-D tensor across data-parallel ranks and
``ctx.all_reduce_sum`` sums a tensor across ranks (``None`` = single process). With gradient
accumulation, call the weighting once on the whole optimizer mini-batch (the policy does not change
between its micro-batches) and slice the result, or pass a ``gather`` that returns the whole
mini-batch's values, or reuse ``info`` thresholds as absolute values. Logprobs and entropies are
treated as constants here: every weighting runs under ``torch.no_grad``.

Registered: ``none``, ``s2t`` (STAPO), ``top_entropy`` (20-Entropy), ``stare`` (STARE). Lp-Reg is
not a weighting (it adds a KL term, see ``lpreg`` and ``regularizers``). Formulas and sources:
docs/algorithms.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from stapo.core.batch import derive_seed
from stapo.core.weighting_options import (
    S2T_SILENCE,
    S2TOptions,
    StareOptions,
    TopEntropyOptions,
    WeightingOptions,
)

from .registry import Registry

Gather = Callable[[Tensor], Tensor]
AllReduceSum = Callable[[Tensor], Tensor]


def broadcast_advantages(advantages: Tensor, like: Tensor, *, name: str = "advantages") -> Tensor:
    """Return advantages as [B, T]: a [B] tensor is repeated over positions, [B, T] is checked."""
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ValueError(
                f"{name} has shape {tuple(advantages.shape)}; expected [B]={like.shape[0]} or [B, T]"
            )
        return advantages.unsqueeze(1).expand_as(like)  # [B, T]
    if advantages.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(advantages.shape)}; expected {tuple(like.shape)} or [B]")
    return advantages


def check_bt(name: str, x: Tensor, shape: torch.Size | None = None) -> None:
    """Raise a clear error unless ``x`` is a 2-D tensor (of ``shape`` when given)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B, T], got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape [B, T], got shape {tuple(x.shape)}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {tuple(shape)} like logprobs")


@dataclass(frozen=True)
class TokenContext:
    """Everything a token weighting may look at. Advantages [B] are broadcast to [B, T] on creation."""

    logprobs: Tensor  # [B, T] current-policy log-prob of each sampled token
    entropy: Tensor  # [B, T] entropy of the full next-token distribution
    advantages: Tensor  # [B, T] (or [B], broadcast)
    mask: Tensor  # [B, T] bool, valid response tokens
    gather: Gather | None = None  # concat a 1-D tensor across DP ranks
    all_reduce_sum: AllReduceSum | None = None  # sum a tensor across DP ranks
    seed: int | None = None  # a weighting's own randomness (S2T's random ablation), one per mini-batch
    rank: int = 0  # this data-parallel rank: separate random streams per rank

    def __post_init__(self) -> None:
        check_bt("logprobs", self.logprobs)
        check_bt("entropy", self.entropy, self.logprobs.shape)
        check_bt("mask", self.mask, self.logprobs.shape)
        if not isinstance(self.advantages, Tensor):
            raise TypeError(f"advantages must be a torch.Tensor, got {type(self.advantages).__name__}")
        object.__setattr__(self, "advantages", broadcast_advantages(self.advantages, self.logprobs))
        if self.mask.dtype != torch.bool:
            object.__setattr__(self, "mask", self.mask.bool())

    def gathered(self, values: Tensor) -> Tensor:
        """``values`` (1-D, this rank's) concatenated over ranks."""
        return self.gather(values) if self.gather is not None else values

    def summed(self, values: Tensor) -> Tensor:
        """``values`` summed over ranks."""
        return self.all_reduce_sum(values) if self.all_reduce_sum is not None else values

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.logprobs.dtype if torch.is_floating_point(self.logprobs) else torch.float32


@dataclass
class TokenWeights:
    """Output of a token weighting."""

    weights: Tensor  # [B, T] float, multiplies each token's loss; 0 = no gradient (0 outside mask)
    denom_mask: Tensor  # [B, T] bool, tokens that count in the token-mean denominator
    info: dict[str, float] = field(default_factory=dict)  # resolved thresholds etc.

    def select(self, index: slice | Tensor) -> TokenWeights:
        """Rows ``index`` of the weights (e.g. one micro-batch of a mini-batch-wide weighting)."""
        return TokenWeights(
            weights=self.weights[index], denom_mask=self.denom_mask[index], info=dict(self.info)
        )


class TokenWeightingFn(Protocol):
    """Contract of a token weighting's function: the batch's statistics in, weights out; its keyword
    arguments are the fields of its registration's options model."""

    def __call__(self, ctx: TokenContext, **params: float | str | None) -> TokenWeights: ...


@dataclass(frozen=True)
class TokenWeighting:
    """A registered token weighting with its contract.

    ``options``: the pydantic model (a ``stapo.core.weighting_options.WeightingOptions``) whose fields
    are the function's keywords, None when it takes none; the config holds one instance of it.
    ``reads_stats``: whether the weights depend on the log-probs / entropies; one that reads none gets
    its weights before any forward (one forward + backward per micro-batch, no kept graphs)."""

    fn: TokenWeightingFn
    options: type[WeightingOptions] | None
    reads_stats: bool


TOKEN_WEIGHTS: Registry[TokenWeighting] = Registry("token weighting")


def register_token_weighting(
    name: str, *, options: type[WeightingOptions] | None, reads_stats: bool
) -> Callable[[TokenWeightingFn], TokenWeightingFn]:
    """Decorator: register a weighting function under ``name`` with its options model and what it reads.

        @register_token_weighting("half", options=HalfOptions, reads_stats=False)
        def half(ctx, *, scale): ...

    Then ``algorithm.token_weighting: half`` trains with it; its options come from
    ``algorithm.weighting_options`` (checked by ``HalfOptions`` when the config is built)."""

    def decorator(fn: TokenWeightingFn) -> TokenWeightingFn:
        TOKEN_WEIGHTS.add(name, TokenWeighting(fn, options, bool(reads_stats)))
        return fn

    return decorator


# ----------------------------------------------------------------------------- batch statistics


def quantile(values: Tensor, q: float) -> float:
    """Linear-interpolation quantile of a 1-D tensor (same as ``torch.quantile``/numpy default).

    Selection-based (``kthvalue``) so it works past ``torch.quantile``'s 16M-element input limit (a
    global batch of long responses easily has more tokens). Empty input -> NaN (comparisons with NaN are False, so a
    NaN threshold selects nothing).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q must be in [0, 1], got {q}")
    n = values.numel()
    if n == 0:
        return float("nan")
    v = values.detach().reshape(-1)  # [n]
    pos = q * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    # two O(n) selections instead of an O(n log n) sort; kthvalue is 1-based
    v_lo = float(torch.kthvalue(v, lo + 1).values)
    v_hi = float(torch.kthvalue(v, hi + 1).values) if frac > 0 else v_lo
    return v_lo + (v_hi - v_lo) * frac


def _top_count(n: int, frac: float) -> int:
    """ceil(frac * n) clamped to [1, n] when frac > 0 (the top-k size both reference codes use)."""
    if n == 0 or frac <= 0.0:
        return 0
    return min(n, max(1, math.ceil(frac * n - 1e-9)))


def top_fraction_threshold(values: Tensor, frac: float, *, largest: bool = True) -> float:
    """Threshold that keeps the ceil(frac * n) largest (or smallest) of ``values``.

    Keep ``values >= thr`` (largest) or ``values <= thr`` (smallest); ties at the threshold are all
    kept. frac <= 0 keeps nothing (+inf / -inf), frac >= 1 keeps everything.
    """
    n = values.numel()
    k = _top_count(n, frac)
    if k == 0:
        return math.inf if largest else -math.inf
    v = values.detach().reshape(-1)
    if largest:
        return float(torch.topk(v, k, largest=True).values[-1])
    return float(torch.topk(v, k, largest=False).values[-1])


def _valid_weights(ctx: TokenContext) -> Tensor:
    return ctx.mask.to(ctx.weight_dtype)  # [B, T]


# ----------------------------------------------------------------------------- weightings


@register_token_weighting("none", options=None, reads_stats=False)  # the mask only
def no_weighting(ctx: TokenContext) -> TokenWeights:
    """Every valid token weighs 1 and counts in the denominator (GRPO / DAPO / JustRL)."""
    return TokenWeights(weights=_valid_weights(ctx), denom_mask=ctx.mask.clone(), info={})


def below_thresholds(logprobs: Tensor, entropy: Tensor, *, tau_p: float, tau_h: float) -> tuple[Tensor, Tensor]:
    """(p < tau_p, H < tau_h), both [B, T] bool: THE boundary comparison of S2T, in float64.

    Every place that says whether a token is below the thresholds (the mask, the phase cells, the
    logged counts; ``stapo inspect`` compares the dump's float64 values the same way) calls this, so
    a token on the boundary lands on the same side everywhere: p = exp(logprob) taken in float64
    (a float32 exp rounds p within 1e-7 relative of tau_p to either side, and float32(0.01) is below
    0.01), compared with the thresholds as float64 numbers.
    """
    with torch.no_grad():
        lowp = logprobs.detach().double().exp() < float(tau_p)  # [B, T]
        lowh = entropy.detach().double() < float(tau_h)  # [B, T]
    return lowp, lowh


def s2t_mask(
    logprobs: Tensor, entropy: Tensor, advantages: Tensor, mask: Tensor, *, tau_p: float, tau_h: float
) -> Tensor:
    """STAPO's S2T mask at given thresholds: True where a token is silenced (spurious).

    silenced = mask & (A > 0) & (exp(logprob) < tau_p) & (entropy < tau_h), compared in float64
    (:func:`below_thresholds`; strict, as the paper's Algorithm 1). Computed under no_grad: the
    probability and entropy only select tokens, they carry no gradient. ``advantages`` may be [B] or
    [B, T]. ``tau_h`` is the absolute threshold; the paper's tau_h^(q) comes from :func:`s2t_tau_h`.
    """
    check_bt("logprobs", logprobs)
    check_bt("entropy", entropy, logprobs.shape)
    check_bt("mask", mask, logprobs.shape)
    if not 0.0 < tau_p <= 1.0:
        raise ValueError(f"tau_p must be a probability in (0, 1], got {tau_p}")
    with torch.no_grad():
        adv = broadcast_advantages(advantages.detach(), logprobs)  # [B, T]
        lowp, lowh = below_thresholds(logprobs, entropy, tau_p=tau_p, tau_h=tau_h)
        return mask.bool() & (adv > 0) & lowp & lowh  # [B, T]


def s2t_candidates(logprobs: Tensor, advantages: Tensor, mask: Tensor, *, tau_p: float) -> Tensor:
    """[B, T] bool: the tokens S2T may silence, "the low-probability tokens within correct
    responses" (paper, Sec. 3): valid, A > 0 and p < tau_p (the float64 comparison of the mask)."""
    return s2t_mask(logprobs, logprobs, advantages, mask, tau_p=tau_p, tau_h=math.inf)


def s2t_tau_h(
    logprobs: Tensor,
    entropy: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    tau_p: float,
    q: float,
    gather: Gather | None = None,
) -> float:
    """The paper's tau_h^(q): the q-th quantile of the candidates' entropies (:func:`s2t_candidates`),
    over every rank's candidates when ``gather`` concatenates across data-parallel ranks.

    "computed dynamically over the low-probability tokens within correct responses in each
    mini-batch" (arXiv 2602.15620v1, Sec. 3 / Algorithm 1; q = 75% in every experiment). Call it once
    per optimizer mini-batch on the current policy's p and H. Linear-interpolation quantile
    (:func:`quantile`); no candidate gives NaN, which silences nothing (every comparison with NaN is
    False). One gather of the candidates' entropies, on every rank.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    with torch.no_grad():
        cand = s2t_candidates(logprobs, advantages, mask, tau_p=tau_p)  # [B, T]
        return quantile(candidate_entropies(entropy, cand, gather), q)


def candidate_entropies(entropy: Tensor, cand: Tensor, gather: Gather | None = None) -> Tensor:
    """[n_cand] float64: the entropies of the candidates ``cand`` [B, T], over every rank with
    ``gather`` (one all-gather): the population of S2T's quantiles."""
    local = entropy.detach()[cand].double()  # [n_cand] this rank's
    return gather(local) if gather is not None else local


def _random_share(ctx: TokenContext, cand: Tensor, k: int) -> Tensor:
    """[B, T] bool: k candidates drawn uniformly over every rank's candidates (seeded by ``ctx.seed``).

    Each rank draws a float64 key per local candidate from its own stream (seed, rank); the k smallest
    keys over all ranks are silenced: one gather, no rank offsets, reproducible for a seed."""
    if ctx.seed is None:
        raise ValueError("silence='random' needs TokenContext.seed (the update passes one per mini-batch)")
    gen = torch.Generator().manual_seed(derive_seed(ctx.seed, ctx.rank))
    n_local = int(cand.sum())
    keys = torch.rand(n_local, generator=gen, dtype=torch.float64)  # [n_local]
    out = torch.zeros_like(cand)
    allk = ctx.gathered(keys.to(cand.device))  # [n_cand] all ranks
    if k <= 0 or allk.numel() == 0:
        return out
    thr = float(torch.kthvalue(allk.cpu(), min(k, allk.numel())).values)
    out[cand] = keys.to(cand.device) <= thr
    return out


@register_token_weighting("s2t", options=S2TOptions, reads_stats=True)
def s2t_weighting(
    ctx: TokenContext, *, tau_p: float = 0.002, q: float = 0.75, silence: str = "lowest_entropy"
) -> TokenWeights:
    """STAPO (arXiv 2602.15620v1, Algorithm 1): among the candidates (valid, A > 0, p < tau_p, over
    every rank of this mini-batch) silence those with H < tau_h^(q), the q-th quantile of the
    candidates' entropies; silenced tokens get weight 0 AND leave the denominator.

    ``silence`` picks the paper's ablations over the same candidates: ``highest_entropy`` silences
    those with H > the (1 - q)-th quantile (the top-entropy q share); ``random`` silences as many
    candidates as ``lowest_entropy`` would, drawn at random (seeded); ``all`` silences every candidate
    (JustRL-FullMask). ``complement`` silences those with H >= tau_h^(q), exactly the candidates
    ``lowest_entropy`` keeps (the two partition the candidates; our reading of "high-entropy
    masking", beside the top-q mirror, since the paper does not define its threshold). ``info``: ``tau_h`` (the paper's tau_h^(q), whatever ``silence``),
    ``candidates`` and ``silenced_count`` (this rank's)."""
    if silence not in S2T_SILENCE:
        raise ValueError(f"silence must be one of {', '.join(S2T_SILENCE)}; got {silence!r}")
    with torch.no_grad():
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q}")
        cand = s2t_candidates(ctx.logprobs, ctx.advantages, ctx.mask, tau_p=tau_p)  # [B, T]
        ents = candidate_entropies(ctx.entropy, cand, ctx.gather)  # [n_cand] all ranks: one gather
        tau = quantile(ents, q)  # tau_h^(q), as s2t_tau_h
        _, lowh = below_thresholds(ctx.logprobs, ctx.entropy, tau_p=tau_p, tau_h=tau)  # the mask's comparison
        lowest = cand & lowh  # [B, T] = s2t_mask at tau_h^(q)
        if silence == "lowest_entropy":
            silenced = lowest
        elif silence == "all":
            silenced = cand
        elif silence == "complement":
            silenced = cand & ~lowh  # H >= tau_h^(q): what the paper's rule keeps, ties included
        elif silence == "highest_entropy":
            hi = quantile(ents, 1.0 - q)
            silenced = cand & (ctx.entropy.detach().double() > hi)  # the mirror of H < tau_h^(q)
        else:
            k = int(ctx.summed(lowest.sum().double().reshape(1))[0])  # the size lowest_entropy silences
            silenced = _random_share(ctx, cand, k)
        keep = ctx.mask & ~silenced  # [B, T]
        return TokenWeights(
            weights=keep.to(ctx.weight_dtype),
            denom_mask=keep,
            info={"tau_p": float(tau_p), "tau_h": float(tau), "candidates": float(cand.sum()),
                  "silenced_count": float(silenced.sum())},
        )


@register_token_weighting("top_entropy", options=TopEntropyOptions, reads_stats=True)
def top_entropy_weighting(ctx: TokenContext, *, rho: float = 0.2, denominator: str = "kept") -> TokenWeights:
    """20-Entropy (Wang et al. 2025, "Beyond the 80/20 Rule"): gradient only on the top-``rho``
    fraction of valid tokens by entropy, ranked over the whole (gathered) batch.

    ``denominator="kept"`` (default) follows the authors' released verl code, which aggregates with
    ``loss_mask = response_mask * entropy_top_mask`` so dropped tokens leave the token-mean
    denominator; ``"all"`` keeps every valid token in the denominator (TRL's entropy mask does this),
    which scales the gradient down by about ``rho``.
    """
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1], got {rho}")
    if denominator not in ("kept", "all"):
        raise ValueError(f"denominator must be 'kept' or 'all', got {denominator!r}")
    with torch.no_grad():
        local = ctx.entropy.detach()[ctx.mask]  # [n_valid]
        thr = top_fraction_threshold(ctx.gathered(local), rho, largest=True)
        kept = ctx.mask & (ctx.entropy.detach() >= thr)  # [B, T]
        denom = kept if denominator == "kept" else ctx.mask.clone()
        return TokenWeights(
            weights=kept.to(ctx.weight_dtype),
            denom_mask=denom,
            info={"entropy_threshold": thr, "kept_count": float(kept.sum())},
        )


@register_token_weighting("stare", options=StareOptions, reads_stats=True)
def stare_weighting(
    ctx: TokenContext,
    *,
    top_ratio: float = 0.1,
    w: float = 1.1,
    m: float = 0.9,
    variant: str = "O1",
    target_entropy: float = 0.3,
    current_entropy: float | None = None,
    adaptive: bool = False,
    alpha: float = 0.0,
    w_max: float = 1.5,
    m_min: float = 0.5,
) -> TokenWeights:
    """STARE (arXiv 2606.19236, code github.com/hp-luo/STARE): surprisal-guided advantage reweighting
    with a target-entropy gate.

    Among positive-advantage valid tokens, the top ``top_ratio`` by surprisal -log p (set L+) get
    weight ``w`` (> 1); with ``variant="C2"`` the top ``top_ratio`` of negative-advantage tokens (L-)
    also get weight ``m`` (< 1). Everything else weighs 1. The reweighting is on only while the
    batch mean entropy (valid tokens, all ranks; or ``current_entropy`` when the caller runs its own
    closed-loop controller) is below ``target_entropy``. The denominator is unchanged.

    ``adaptive``, ``alpha``, ``w_max``, ``m_min`` configure the cross-step schedule of (w, m)
    (``stare.StareSchedule``, which passes the live ``w``, ``m`` and ``current_entropy``); they are
    accepted here so the config section maps onto the keywords, and do nothing in a single call.
    """
    if variant not in ("O1", "C2"):
        raise ValueError(f"variant must be 'O1' (one-sided) or 'C2' (two-sided), got {variant!r}")
    if not 0.0 <= top_ratio <= 1.0:
        raise ValueError(f"top_ratio must be in [0, 1], got {top_ratio}")
    if w <= 0 or m <= 0:
        raise ValueError(f"weights must be positive (w={w}, m={m}); STARE keeps every gradient direction")
    with torch.no_grad():
        dtype = ctx.weight_dtype
        weights = _valid_weights(ctx)  # [B, T]
        ent = ctx.entropy.detach()
        if current_entropy is None:
            stats = torch.stack([(ent * ctx.mask).sum().double(), ctx.mask.sum().double()])  # [2]
            stats = ctx.summed(stats)
            batch_entropy = float(stats[0] / stats[1].clamp_min(1.0))
        else:
            batch_entropy = float(current_entropy)
        gate_on = batch_entropy < target_entropy
        surprisal = -ctx.logprobs.detach()  # [B, T]
        pos = ctx.mask & (ctx.advantages > 0)  # [B, T]
        neg = ctx.mask & (ctx.advantages < 0)  # [B, T]
        thr_pos = top_fraction_threshold(ctx.gathered(surprisal[pos]), top_ratio, largest=True)
        l_plus = pos & (surprisal >= thr_pos)
        info = {"gate_on": float(gate_on), "batch_entropy": batch_entropy, "surprisal_threshold_pos": thr_pos}
        l_minus = torch.zeros_like(ctx.mask)
        if variant == "C2":
            thr_neg = top_fraction_threshold(ctx.gathered(surprisal[neg]), top_ratio, largest=True)
            l_minus = neg & (surprisal >= thr_neg)
            info["surprisal_threshold_neg"] = thr_neg
        if gate_on:
            weights = torch.where(l_plus, torch.full_like(weights, w), weights)
            weights = torch.where(l_minus, torch.full_like(weights, m), weights)
        info["reweighted_count"] = float((l_plus | l_minus).sum()) if gate_on else 0.0
        return TokenWeights(weights=weights.to(dtype), denom_mask=ctx.mask.clone(), info=info)


def get_token_weighting(name: str) -> TokenWeightingFn:
    """The function of the token weighting registered as ``name`` (KeyError listing valid names on a miss)."""
    return TOKEN_WEIGHTS.get(name).fn


def token_weighting_spec(name: str) -> TokenWeighting:
    """The registration of ``name``: function, options model, what it reads (KeyError listing valid names)."""
    return TOKEN_WEIGHTS.get(name)
