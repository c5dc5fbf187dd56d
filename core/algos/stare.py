"""STARE's closed-loop controller (arXiv 2606.19236, code github.com/hp-luo/STARE): the target-entropy
gate (Section 4.3) and the adaptive schedule of its weights (W, M) (Section 4.4).

The token weighting itself (``stare`` in ``weights``) reweights the top surprisal tokens; this
module owns what persists across steps. Once per step, with the step batch's mean entropy H_k
(valid tokens, all ranks, at the sampling policy; the authors take it from the old-log-prob pass),
and BEFORE that step's update (the authors update the controller, then run the actor):

    gate_k = 1[H_k < H_tgt]
    adaptive only:  s = sgn(H_tgt - H_k)
                    W_{k+1} = clip(W_k + alpha * s, [1, w_max])
                    M_{k+1} = clip(M_k - alpha * s, [m_min, 1])

and the step's weighting uses the updated (W, M) and gate_k. A non-finite H_k leaves the state
unchanged (the authors skip the update). Without ``adaptive`` (or alpha = 0) W and M stay fixed.

    sched = StareSchedule(w=1.1, m=0.9, target_entropy=0.3, adaptive=True)
    params = sched.update(batch_entropy)   # {"w": ..., "m": ..., "current_entropy": ...}
    tw = get_token_weighting("stare")(ctx, top_ratio=0.1, variant="O1", target_entropy=0.3, **params)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["StareSchedule", "stare_schedule_step"]


def stare_schedule_step(
    w: float, m: float, entropy: float, *, target_entropy: float, alpha: float, w_max: float, m_min: float
) -> tuple[float, float]:
    """One adaptive step: (W, M) -> (clip(W + a s, [1, w_max]), clip(M - a s, [m_min, 1])), s = sgn(H_tgt - H)."""
    if not math.isfinite(entropy):
        return w, m
    diff = target_entropy - entropy
    s = 0.0 if diff == 0 else math.copysign(1.0, diff)  # numpy.sign: sgn(0) = 0
    return min(max(w + alpha * s, 1.0), w_max), min(max(m - alpha * s, m_min), 1.0)


@dataclass
class StareSchedule:
    """Mutable STARE controller state: current (W, M), the last entropy and gate."""

    w: float = 1.1
    m: float = 0.9
    target_entropy: float = 0.3
    adaptive: bool = False
    alpha: float = 0.01
    w_max: float = 1.5
    m_min: float = 0.5
    current_entropy: float = math.nan

    def update(self, entropy: float) -> dict[str, float]:
        """Advance one step with the step's mean entropy; returns the weighting's live keywords."""
        if math.isfinite(entropy):
            self.current_entropy = float(entropy)
            if self.adaptive and self.alpha > 0:
                self.w, self.m = stare_schedule_step(
                    self.w, self.m, entropy, target_entropy=self.target_entropy, alpha=self.alpha,
                    w_max=self.w_max, m_min=self.m_min,
                )
        return self.params()

    def params(self) -> dict[str, float]:
        """Keywords for the ``stare`` weighting: the live W, M and the entropy its gate compares."""
        out = {"w": self.w, "m": self.m}
        if math.isfinite(self.current_entropy):
            out["current_entropy"] = self.current_entropy
        return out

    def metrics(self) -> dict[str, float]:
        return {
            "stare/reweight_w": self.w,
            "stare/reweight_m": self.m,
            "stare/batch_entropy": self.current_entropy,
            "stare/gate_on": float(self.current_entropy < self.target_entropy),
        }
