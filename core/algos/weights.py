"""Token weightings: which tokens of a batch carry policy gradient, and with what weight.

A token weighting is a pure function ``fn(ctx: TokenContext, **params) -> TokenWeights``. It sees
the current policy's log-probs and entropies, the advantages and the valid mask, and returns
``weights`` (multiplies each token's loss; 0 = no gradient) and ``denom_mask`` (tokens counted in
the token-mean denominator). The policy loss never knows which weighting produced them.

    from stapo.core.algos import TokenContext, get_token_weighting
    ctx = TokenContext(logprobs, entropy, advantages, mask)          # [B, T] each
    tw = get_token_weighting("s2t")(ctx, tau_p=0.01, tau_h_quantile=0.05)
    tw.weights, tw.denom_mask, tw.info["tau_h"]

Batch statistics (entropy quantiles, top-k thresholds, mean entropy) are taken over the whole
global batch: ``ctx.gather`` concatenates a 1-D tensor across data-parallel ranks and
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

from stapo.core.weighting_options import S2TOptions, StareOptions, TopEntropyOptions, WeightingOptions

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


def resolve_tau_h(
    entropy: Tensor,
    mask: Tensor,
    *,
    tau_h: float | None = None,
    tau_h_quantile: float | None = None,
    gather: Gather | None = None,
) -> float:
    """The absolute entropy threshold for S2T: ``tau_h`` itself, or the ``tau_h_quantile`` quantile
    of the valid-token entropies gathered over all ranks (STAPO reports the 5th percentile)."""
    if (tau_h is None) == (tau_h_quantile is None):
        raise ValueError(
            f"give exactly one of tau_h (absolute) or tau_h_quantile (in [0, 1]); got tau_h={tau_h}, "
            f"tau_h_quantile={tau_h_quantile}"
        )
    if tau_h is not None:
        return float(tau_h)
    assert tau_h_quantile is not None
    if not 0.0 <= tau_h_quantile <= 1.0:
        raise ValueError(f"tau_h_quantile must be in [0, 1], got {tau_h_quantile}")
    check_bt("entropy", entropy)
    check_bt("mask", mask, entropy.shape)
    with torch.no_grad():
        local = entropy.detach()[mask.bool()]  # [n_valid]
        allv = gather(local) if gather is not None else local
    return quantile(allv, tau_h_quantile)


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
    """STAPO's S2T mask: True where a token is silenced (spurious).

    silenced = mask & (A > 0) & (exp(logprob) < tau_p) & (entropy < tau_h), compared in float64
    (:func:`below_thresholds`). Computed under no_grad: the probability and entropy only select
    tokens, they carry no gradient. ``advantages`` may be [B] or [B, T]. ``tau_h`` is absolute here;
    see :func:`resolve_tau_h` for the quantile form and :func:`tau_h_for_rate` for the rate-targeted one.
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


def tau_h_for_rate(ctx: TokenContext, *, tau_p: float, rate: float) -> float:
    """The absolute tau_h at which S2T silences ``rate`` of the valid tokens (our extension).

    Candidates are the tokens S2T would silence at tau_h = +inf (valid, A > 0, p < tau_p: the same
    :func:`s2t_mask`); with n valid tokens over all ranks and k = round(rate * n), tau_h is the
    (k+1)-th smallest candidate entropy, so the k lowest-entropy candidates fall strictly below it
    (fewer on ties; every candidate when there are at most k: tau_h just above the largest). k = 0
    gives the smallest candidate entropy, and no candidate gives 0.0: nothing is silenced. One gather
    of the candidates' entropies and one all-reduce of n, on every rank.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"target_rate must be in [0, 1], got {rate}")
    with torch.no_grad():
        cand = s2t_mask(ctx.logprobs, ctx.entropy, ctx.advantages, ctx.mask, tau_p=tau_p, tau_h=math.inf)
        ents = ctx.gathered(ctx.entropy.detach()[cand].double())  # [n_cand] over all ranks
        n = float(ctx.summed(ctx.mask.sum().double().reshape(1))[0])
        k = int(round(rate * n))
        if ents.numel() == 0:
            return 0.0
        if ents.numel() <= k:
            return math.nextafter(float(ents.max()), math.inf)
        return float(torch.kthvalue(ents.cpu(), k + 1).values)


@register_token_weighting("s2t", options=S2TOptions, reads_stats=True)
def s2t_weighting(
    ctx: TokenContext,
    *,
    tau_p: float,
    tau_h: float | None = None,
    tau_h_quantile: float | None = None,
    target_rate: float | None = None,
) -> TokenWeights:
    """STAPO (arXiv 2602.15620): silence positive-advantage tokens with low probability and low
    entropy; silenced tokens get weight 0 AND leave the denominator. ``target_rate`` (instead of
    ``tau_h`` / ``tau_h_quantile``; our extension, not the paper's) picks tau_h on this call's
    tokens so that about that fraction of them is silenced (:func:`tau_h_for_rate`)."""
    with torch.no_grad():
        if target_rate is not None:
            if tau_h is not None or tau_h_quantile is not None:
                raise ValueError("give one of tau_h, tau_h_quantile or target_rate, not several")
            tau = tau_h_for_rate(ctx, tau_p=tau_p, rate=target_rate)
        else:
            tau = resolve_tau_h(
                ctx.entropy, ctx.mask, tau_h=tau_h, tau_h_quantile=tau_h_quantile, gather=ctx.gather
            )
        silenced = s2t_mask(
            ctx.logprobs, ctx.entropy, ctx.advantages, ctx.mask, tau_p=tau_p, tau_h=tau
        )  # [B, T]
        keep = ctx.mask & ~silenced  # [B, T]
        return TokenWeights(
            weights=keep.to(ctx.weight_dtype),
            denom_mask=keep,
            info={"tau_p": float(tau_p), "tau_h": float(tau), "silenced_count": float(silenced.sum())},
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
