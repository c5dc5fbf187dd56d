"""The S2T silenced rate, watched during training: one warning when the mask is inert or wild.

Whether S2T silences anything near the paper's ~1e-4 of tokens depends on the model by orders of
magnitude (docs/algorithms.md, "S2T thresholds"). A run whose mask never fires trains like DAPO; one
that silences percents of its tokens is not STAPO either. The loop's ``s2t_watch`` hook
(``stapo.core.extras``) feeds each step's GLOBAL counts (``stapo/silenced_count`` and the step's
valid tokens x PPO epochs: the update's own, summed over ranks) into :class:`RateWatch`, which
judges windows of ``algorithm.s2t.watch_steps`` steps, never a step alone:

- too low: the window silenced nothing where ``watch_min_rate`` predicts at least 5 tokens (a window
  too small for that keeps growing until it is not);
- too high: the window's silenced fraction exceeds ``watch_max_rate``.

Each kind warns at most once per run, naming the thresholds, the measured rate and `stapo calibrate`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["MIN_EXPECTED", "RateWatch"]

MIN_EXPECTED = 5.0
"""Silenced tokens ``watch_min_rate`` must predict before a window with none is judged inert."""


@dataclass
class RateWatch:
    """Windowed silenced-rate check; :meth:`add` returns the warnings to log (each kind once)."""

    steps: int
    min_rate: float
    max_rate: float
    thresholds: str  # how tau_p / tau_h are set, for the message
    n: int = 0  # steps in the open window
    silenced: float = 0.0
    tokens: float = 0.0
    tau_sum: float = 0.0  # sum of the steps' mean tau_h (nats)
    warned_low: bool = False
    warned_high: bool = False

    def add(self, silenced: float, tokens: float, tau_h: float) -> list[str]:
        """One step's global counts (tokens = valid tokens x PPO epochs) and its mean tau_h."""
        self.n += 1
        self.silenced += silenced
        self.tokens += tokens
        self.tau_sum += tau_h
        if self.n < self.steps or self.tokens <= 0:
            return []
        expected = self.min_rate * self.tokens
        if self.silenced == 0 and expected < MIN_EXPECTED:
            return []  # too few tokens to call zero implausible: the window grows
        rate = self.silenced / self.tokens
        where = (f"over the last {self.n} steps ({self.tokens:,.0f} response tokens; {self.thresholds}, "
                 f"tau_h {self.tau_sum / self.n:.3g} nats on average)")
        out = []
        if self.silenced == 0 and self.min_rate > 0 and not self.warned_low:
            self.warned_low = True
            out.append(f"S2T silenced no token {where}, where algorithm.s2t.watch_min_rate={self.min_rate:g} "
                       f"predicts {expected:.0f}: the mask is inert and the run trains like DAPO. Measure the rate "
                       "on this model with `stapo calibrate` and set the thresholds from it (docs/algorithms.md).")
        if rate > self.max_rate and not self.warned_high:
            self.warned_high = True
            out.append(f"S2T silenced {rate:.2e} of the tokens {where}, above algorithm.s2t.watch_max_rate="
                       f"{self.max_rate:g} (the paper silences ~1e-4): check the thresholds with `stapo calibrate`.")
        self.n, self.silenced, self.tokens, self.tau_sum = 0, 0.0, 0.0, 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k in ("n", "silenced", "tokens", "tau_sum", "warned_low", "warned_high"):
                setattr(self, k, v)


def describe_thresholds(s2t: Any) -> str:
    """``tau_p=0.01, tau_h=quantile 0.05`` (or the absolute / rate-targeted form) of a config section."""
    if s2t.target_rate is not None:
        how = f"target_rate {s2t.target_rate:g}"
    elif s2t.tau_h is not None:
        how = f"{s2t.tau_h:g} nats"
    else:
        how = f"quantile {s2t.tau_h_quantile:g}"
    return f"tau_p={s2t.tau_p:g}, tau_h={how}"
