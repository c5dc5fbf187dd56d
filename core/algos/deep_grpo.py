"""DEEP-GRPO (Guo et al. 2026, arXiv 2602.14169) pure parts: pivot utility, the online logistic
recoverability model, pivot sampling, branch masks and the local (branch) loss.

The paper picks *pivots* in failed rollouts, states deep enough to be worth branching from and still
recoverable, with the utility

    Q(t) ∝ P(success | r_t) · r_t^gamma,   r_t = t / T   (t: prefix length, T: the rollout's length)

where P is a 1-D logistic regression on r_t, refit online on a sliding window of branch outcomes
(r, success). K branches are resampled from each pivot's prefix and trained with a *local* loss
that is added to the global GRPO loss with weight lambda; the prefix the branches share is masked
out of the local term (its tokens already carry the global term's gradient).

Details from the authors' code (github.com/AgentCombo/DEEP-GRPO, ``recipe/deep_grpo/
branching_strategy.py``, ``UtilitySamplingStrategy``): the window holds the last 10000 outcomes; the
model is refit before each selection once the window holds more than 10 outcomes of both classes
(until then P = 1, i.e. depth alone decides); pivots are drawn *without replacement* with
probability Q / sum Q; gamma (``position_bias``) = 0.1; K (``branches_per_point``) = 8; one pivot
per failed chain (``n_branch_points``) and lambda (``branch_chain_loss_lambda``) = 1.0. The
authors' logistic model is scikit-learn's default (L2, C = 1, intercept not penalized); ours fits
the same objective by Newton's method, so scikit-learn is not a dependency.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "OnlineLogistic",
    "pivot_utility",
    "sample_pivot",
    "suffix_mask",
    "branch_ratio",
    "pivot_outcomes",
    "local_advantages",
    "LOCAL_ADVANTAGES",
]


class OnlineLogistic:
    """P(success | r) = sigmoid(w r + b), refit on a sliding window of (r, success) outcomes.

    ``fit`` minimizes sum_i logloss_i + 0.5 w^2 (scikit-learn's default L2 with C = 1, intercept
    unpenalized) by Newton's method; ``predict`` returns 1 until a fit happened (the authors' rule).
    """

    def __init__(self, window: int = 10000, min_samples: int = 10) -> None:
        self.r: deque[float] = deque(maxlen=window)
        self.y: deque[int] = deque(maxlen=window)
        self.min_samples = min_samples
        self.w, self.b = 0.0, 0.0
        self.fitted = False

    def update(self, r: Sequence[float], success: Sequence[bool]) -> None:
        for ri, si in zip(r, success, strict=True):
            if not 0.0 < ri <= 1.0:
                raise ValueError(f"OnlineLogistic: r must be in (0, 1], got {ri}")
            self.r.append(float(ri))
            self.y.append(int(bool(si)))

    def ready(self) -> bool:
        return len(self.y) > self.min_samples and 0 < sum(self.y) < len(self.y)

    def fit(self, iters: int = 50, tol: float = 1e-10) -> bool:
        """Refit if the window allows it (see class doc); returns whether a fit is in place."""
        if not self.ready():
            return self.fitted
        x = np.asarray(self.r, dtype=np.float64)
        y = np.asarray(self.y, dtype=np.float64)
        w, b = self.w, self.b
        for _ in range(iters):
            p = 1.0 / (1.0 + np.exp(-(w * x + b)))
            s = p * (1.0 - p)
            gw = float(np.sum((p - y) * x)) + w  # + d(0.5 w^2)/dw
            gb = float(np.sum(p - y))
            hww = float(np.sum(s * x * x)) + 1.0
            hwb = float(np.sum(s * x))
            hbb = float(np.sum(s)) + 1e-12
            det = hww * hbb - hwb * hwb
            dw = (hbb * gw - hwb * gb) / det
            db = (hww * gb - hwb * gw) / det
            w, b = w - dw, b - db
            if abs(dw) + abs(db) < tol:
                break
        self.w, self.b, self.fitted = float(w), float(b), True
        return True

    def predict(self, r: np.ndarray) -> np.ndarray:
        if not self.fitted:
            return np.ones_like(r, dtype=np.float64)
        return 1.0 / (1.0 + np.exp(-(self.w * np.asarray(r, dtype=np.float64) + self.b)))

    def state_dict(self) -> dict[str, object]:
        return {"r": list(self.r), "y": list(self.y), "w": self.w, "b": self.b, "fitted": self.fitted}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if not state:
            return
        self.r.clear()
        self.y.clear()
        self.r.extend(float(v) for v in state["r"])  # type: ignore[union-attr]
        self.y.extend(int(v) for v in state["y"])  # type: ignore[union-attr]
        self.w, self.b, self.fitted = float(state["w"]), float(state["b"]), bool(state["fitted"])  # type: ignore[arg-type]


def pivot_utility(ratios: np.ndarray, p_success: np.ndarray, gamma: float) -> np.ndarray:
    """Normalized Q = P(success | r) r^gamma over candidate pivots (a distribution over them)."""
    q = np.asarray(p_success, dtype=np.float64) * np.power(np.asarray(ratios, dtype=np.float64), gamma)
    total = q.sum()
    if not total > 0:
        raise ValueError("pivot_utility: every candidate has zero utility")
    return q / total


def sample_pivot(length: int, model: OnlineLogistic, gamma: float, rng: np.random.Generator) -> int:
    """A pivot t in 1..length-1 (the prefix is response[:t]) drawn with probability Q(t).

    Candidates: every proper, non-empty prefix of the failed response (token granularity; the
    authors segment responses into steps first, ``partition_strategy.py``: ours is the finest split).
    """
    if length < 2:
        raise ValueError(f"sample_pivot: a response of {length} token(s) has no proper prefix to branch from")
    t = np.arange(1, length)
    q = pivot_utility(t / length, model.predict(t / length), gamma)
    return int(rng.choice(t, p=q))


def suffix_mask(response_mask: Tensor, prefix_len: Tensor) -> Tensor:
    """The response positions past each row's shared prefix: [N, L] bool.

    ``response_mask`` [N, L] marks a row's response tokens (prefix + continuation, contiguous);
    ``prefix_len`` [N] is how many of them the row shares with its pivot's rollout.
    """
    pos = torch.cumsum(response_mask.long(), dim=1)  # [N, L]: 1-based index within the response
    return response_mask & (pos > prefix_len.unsqueeze(1))


def branch_ratio(t: int, length: int) -> float:
    """r_t = t / T."""
    if not 0 < t <= length:
        raise ValueError(f"branch_ratio: need 0 < t <= T, got t={t}, T={length}")
    return t / length



def pivot_outcomes(
    ratios: Sequence[float], pivots: Sequence[int], valid: Sequence[bool], correct: Sequence[bool], mode: str
) -> tuple[list[float], list[bool]]:
    """The (t/T, success) samples one step's branches add to the recoverability model.

    Per branch i: its pivot's ratio, pivot id, whether its grade is valid and correct. ``any_of_k``
    (the authors' ``BranchingFeedback``): one sample per pivot, success = any of its branches
    succeeded (pivots whose branches all failed to grade add nothing). ``per_branch`` (ours): one
    sample per validly graded branch. Order: pivots (or branches) as they first appear."""
    if not len(ratios) == len(pivots) == len(valid) == len(correct):
        raise ValueError("pivot_outcomes: ratios, pivots, valid and correct must have the same length")
    if mode == "per_branch":
        keep = [i for i, v in enumerate(valid) if v]
        return [float(ratios[i]) for i in keep], [bool(correct[i]) for i in keep]
    if mode != "any_of_k":
        raise ValueError(f"deep_grpo.outcome: unknown {mode!r}; valid: any_of_k, per_branch")
    order: dict[int, tuple[float, bool]] = {}
    for r, p, v, c in zip(ratios, pivots, valid, correct, strict=True):
        if not v:
            continue
        prev = order.get(p)
        order[p] = (float(r), bool(c) or (prev[1] if prev else False))
    return [r for r, _ in order.values()], [y for _, y in order.values()]


#: ``deep_grpo.local_advantage`` -> the advantage estimator (``stapo.core.algos.ADVANTAGES``) over a
#: pivot's K branch rewards; ``None`` = the run's own ``algorithm.advantage``. ``mean_baseline`` is
#: the authors' ``reward - mean(rewards of all continuations)``, i.e. Dr. GRPO's estimator.
LOCAL_ADVANTAGES: dict[str, str | None] = {"mean_baseline": "dr_grpo", "grpo": None}


def local_advantages(rewards: Tensor, mode: str, run_advantage: str, eps: float = 1e-6) -> Tensor:
    """Branch advantages [P, K] from the branch rewards [P, K] (one row per pivot) for ``mode``."""
    from .advantages import get_advantage

    if mode not in LOCAL_ADVANTAGES:
        raise ValueError(f"deep_grpo.local_advantage: unknown {mode!r}; valid: {', '.join(LOCAL_ADVANTAGES)}")
    return get_advantage(LOCAL_ADVANTAGES[mode] or run_advantage)(rewards, eps=eps)
