"""The S2T silenced rate, watched during training: the run's rate beside the paper's, and one
warning when the mask never fires.

The paper's rule (tau_p 0.002, q 75% of each mini-batch's candidates) silences "mostly < 0.01%" of
the tokens on Qwen3 base models (arXiv 2602.15620v1); on another model the same rule can silence
orders of magnitude more (a small model samples many low-probability tokens) or nothing (no correct
response, or no token below tau_p). The rate is an outcome of the model, not a setting: the loop's
``s2t_watch`` hook (``stapo.core.train.extras``) feeds each step's GLOBAL counts (the update's own:
``stapo/silenced_count``, ``stapo/candidates`` and the valid tokens x PPO epochs) into
:class:`RateWatch`, which judges windows of ``algorithm.s2t.watch_steps`` steps, never a step alone:

- zero: a window silenced nothing: one warning, saying whether there were candidates at all (the
  rule silences about a q share of a mini-batch's candidates, so a silent window means the run had
  next to none: it trains like its baseline);
- far above: the run's rate so far exceeds :data:`FAR_ABOVE` times the paper's: one note.

:meth:`RateWatch.summary` is the whole run's rate and the note, for summary.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["FAR_ABOVE", "PAPER_RATE", "RateWatch", "describe_thresholds", "rate_note"]

PAPER_RATE = 1e-4
"""The paper's observed silenced share ("mostly < 0.01%" of tokens, Qwen3 1.7B / 8B / 14B base)."""
FAR_ABOVE = 10.0
"""A run's rate above this many times :data:`PAPER_RATE` gets the note."""


def rate_note(rate: float) -> str | None:
    """The note for a whole-run silenced ``rate`` far above the paper's, else None."""
    if rate <= FAR_ABOVE * PAPER_RATE:
        return None
    return (f"S2T silenced {rate:.2e} of the response tokens, far above the paper's ~1e-4 (Qwen3 base models): "
            "your model samples many low-probability tokens. The rule is the paper's; the rate is this model's "
            "(`stapo calibrate` shows which tokens and their share of the gradient).")


@dataclass
class RateWatch:
    """Windowed silenced-rate check; :meth:`add` returns the lines to log ("warning: ..." / "note: ...",
    each kind once per run)."""

    steps: int
    thresholds: str  # how tau_p / q are set, for the message
    n: int = 0  # steps in the open window
    silenced: float = 0.0
    tokens: float = 0.0
    candidates: float = 0.0
    tau_sum: float = 0.0  # sum of the steps' mean tau_h (nats; NaN-free steps only)
    tau_n: int = 0
    run_silenced: float = 0.0
    run_tokens: float = 0.0
    run_candidates: float = 0.0
    warned_zero: bool = False
    noted_high: bool = False

    def add(self, silenced: float, tokens: float, candidates: float, tau_h: float) -> list[str]:
        """One step's global counts (tokens = valid tokens x PPO epochs) and its mean tau_h."""
        self.n += 1
        self.silenced += silenced
        self.tokens += tokens
        self.candidates += candidates
        self.run_silenced += silenced
        self.run_tokens += tokens
        self.run_candidates += candidates
        if tau_h == tau_h:  # not NaN (a step without candidates has no tau_h)
            self.tau_sum += tau_h
            self.tau_n += 1
        if self.n < self.steps or self.tokens <= 0:
            return []  # too few steps (or no token yet) to judge: the window grows
        tau = f"tau_h^(q) {self.tau_sum / self.tau_n:.3g} nats on average" if self.tau_n else "no tau_h^(q)"
        where = f"over the last {self.n} steps ({self.tokens:,.0f} response tokens; {self.thresholds}, {tau})"
        out = []
        if self.silenced == 0 and not self.warned_zero:
            self.warned_zero = True
            why = ("no token was a candidate (A > 0 and p < tau_p): no correct response sampled a token that rare"
                   if self.candidates == 0 else
                   f"{self.candidates:,.0f} candidates, none below tau_h^(q)")
            out.append(f"warning: S2T silenced no token {where}: {why}; the run trains like its baseline.")
        note = rate_note(self.run_silenced / self.run_tokens)
        if note is not None and not self.noted_high:
            self.noted_high = True
            out.append(f"note: {note}")
        self.n, self.silenced, self.tokens, self.candidates, self.tau_sum, self.tau_n = 0, 0.0, 0.0, 0.0, 0.0, 0
        return out

    def summary(self) -> dict[str, Any]:
        """The whole run's counts and rate (silenced / valid tokens x epochs) and the note, if any."""
        rate = self.run_silenced / self.run_tokens if self.run_tokens else float("nan")
        return {"s2t_silenced": self.run_silenced, "s2t_candidates": self.run_candidates,
                "s2t_tokens": self.run_tokens, "s2t_silenced_rate": rate, "s2t_paper_rate": PAPER_RATE,
                "s2t_note": rate_note(rate) if self.run_tokens else None}

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k not in ("steps", "thresholds") and hasattr(self, k):
                setattr(self, k, v)


def describe_thresholds(s2t: Any) -> str:
    """``tau_p=0.002, q=0.75`` (and the ablation, when not the paper's rule) of a config section."""
    how = f"tau_p={s2t.tau_p:g}, q={s2t.q:g}"
    return how if s2t.silence == "lowest_entropy" else f"{how}, silence={s2t.silence}"
