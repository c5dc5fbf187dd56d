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

