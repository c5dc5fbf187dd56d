"""The S2T silenced rate, watched during training: the run's rate beside the paper's, and one
warning when the mask never fires.

The paper's rule (tau_p 0.002, q 75% of each mini-batch's candidates) silences "mostly < 0.01%" of
the tokens on Qwen3 base models (arXiv 2602.15620v1); on another model the same rule can silence
orders of magnitude more (a small model samples many low-probability tokens) or nothing (no correct
response, or no token below tau_p). The rate is an outcome of the model, not a setting: the loop's
``s2t_watch`` hook (:class:`S2TWatch`, below) feeds each step's GLOBAL counts (the update's own:
``stapo/silenced_count``, ``stapo/candidates`` and the valid tokens x PPO epochs) into
:class:`RateWatch`, which judges windows of ``algorithm.s2t.watch_steps`` steps, never a step alone:

- zero: a window silenced nothing: one warning, saying whether there were candidates at all (the
  rule silences about a q share of a mini-batch's candidates, so a silent window means the run had
  next to none: it trains like its baseline);
- far above: the run's rate so far exceeds :data:`FAR_ABOVE` times the paper's: one note.

:meth:`RateWatch.summary` is the whole run's rate and the note, for summary.json: a run that
silenced nothing at all gets a note too, so a run shorter than one window (3 tiny steps) still says
it trained like its baseline.

Before the first update the hook also asks whether the rule can act at all at this scale
(:func:`candidate_counts`, :func:`cannot_act`): a weak-enough policy gives every token of a correct
response a probability above tau_p (the tiny random model: p ~0.07 against the paper's 0.002), so
there is no candidate and S2T and its ablations silence nothing. That is said at once, with the
tau_p at which this batch would have candidates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from stapo.core.algos.weights import s2t_candidates
from stapo.core.train.hooks import LoopHook, StepState, register_hook
from stapo.core.trainer.distributed import DataParallel

__all__ = ["FAR_ABOVE", "PAPER_RATE", "TAU_P_STEPS", "RateWatch", "candidate_counts", "cannot_act",
           "describe_thresholds", "rate_note"]

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


TAU_P_STEPS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
"""The tau_p values :func:`cannot_act` may suggest, smallest first. [ours: round values]"""
ENOUGH_CANDIDATES = 0.01
"""The suggested tau_p is the smallest of :data:`TAU_P_STEPS` that makes at least this share of the
correct responses' tokens candidates. [ours: with q 75%, >= 0.75% of them silenced, which a short run
on a small batch still sees]"""


def candidate_counts(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     tau_p: float) -> list[float]:
    """``[tokens of correct responses (A > 0), candidates at tau_p, candidates at each of TAU_P_STEPS]``
    of one batch (``logprobs``, ``advantages`` and ``mask`` [N, L]), counted as the mask counts them
    (:func:`stapo.core.algos.weights.s2t_candidates`); a list of floats, so data-parallel ranks sum it."""
    correct = mask.bool() & (advantages > 0)  # [N, L]
    return [float(correct.sum()),
            *(float(s2t_candidates(logprobs, advantages, mask, tau_p=t).sum()) for t in (tau_p, *TAU_P_STEPS))]


def cannot_act(counts: list[float], step: int, thresholds: str) -> str | None:
    """The warning when a batch's :func:`candidate_counts` leave S2T nothing to act on: correct
    responses, but none of their tokens below tau_p. None when there are candidates, or no correct
    response to judge by (the watch's windows judge those steps)."""
    correct, found, *by_step = counts
    if found > 0 or correct == 0:
        return None
    fits = [(t, n) for t, n in zip(TAU_P_STEPS, by_step, strict=True) if n >= ENOUGH_CANDIDATES * correct]
    fix = (f"--set algorithm.s2t.tau_p={fits[0][0]:g} makes {fits[0][1] / correct:.0%} of them candidates on this "
           "model" if fits else f"even tau_p {TAU_P_STEPS[-1]:g} leaves too few of them candidates on this model")
    return (f"warning: S2T cannot act at this scale: at step {step} no token was a candidate (A > 0 and p < tau_p) "
            f"among the {correct:,.0f} tokens of correct responses ({thresholds}), so nothing is silenced and the "
            f"run trains like its baseline; {fix} (`stapo calibrate` measures the rule on your model and prompts).")


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
    run_steps: int = 0
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
        self.run_steps += 1
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
        """The whole run's counts and rate (silenced / valid tokens x epochs) and the note, if any: far
        above the paper's rate, or nothing silenced in the whole run (however short)."""
        rate = self.run_silenced / self.run_tokens if self.run_tokens else float("nan")
        note = rate_note(rate) if self.run_tokens else None
        if self.run_tokens and self.run_silenced == 0:
            why = ("no token was a candidate (A > 0 and p < tau_p)" if self.run_candidates == 0 else
                   f"{self.run_candidates:,.0f} candidates, none silenced")
            steps = f"{self.run_steps} step{'s' if self.run_steps != 1 else ''}"
            note = (f"S2T silenced no token in this run's {steps} ({self.run_tokens:,.0f} response "
                    f"tokens; {self.thresholds}): {why}, so the run trained like its baseline.")
        return {"s2t_silenced": self.run_silenced, "s2t_candidates": self.run_candidates,
                "s2t_tokens": self.run_tokens, "s2t_silenced_rate": rate, "s2t_paper_rate": PAPER_RATE,
                "s2t_note": note}

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


class S2TWatch(LoopHook):
    """Feeds each step's global silenced count into :class:`RateWatch`; rank 0
    logs its warnings (every rank holds the same global counts, so every rank's state agrees).

    Before the first update it counts that batch's candidates under the sampling policy (the old pass's
    log-probs when the step ran one, else one no-grad pass over the batch: once per run, never again)
    and warns when correct responses hold none (:func:`cannot_act`); that
    warning stands for the window's "silenced no token" one. A first batch without a correct response
    says nothing here: the window's count (the update's own metrics) speaks for later steps."""

    name: ClassVar[str] = "s2t_watch"

    def __init__(self, run: Any) -> None:
        s2t = run.cfg.algorithm.s2t
        self.run, self.tau_p = run, s2t.tau_p
        self.watch = RateWatch(s2t.watch_steps, describe_thresholds(s2t))
        self.epochs = run.cfg.algorithm.ppo_epochs
        self.log = getattr(run, "log", print) if getattr(run, "rank", 0) == 0 else None
        self.checked = False  # the first batch was counted

    def before_update(self, st: StepState) -> dict[str, float]:
        if self.checked or getattr(self.run, "actor", None) is None:  # (hooks driven without a run's actor)
            return {}
        batch = st.batch
        lp = st.old_lp if st.old_lp is not None else self.run.actor.old_stats(batch, st.counts)[0]  # [N, L]
        counts = DataParallel(self.run.backend).sum(candidate_counts(lp, batch.advantages, batch.response_mask,
                                                                     self.tau_p))
        self.checked = True  # once per run: an extra forward every step would cost a GPU run real time
        warning = cannot_act(counts, st.step, self.watch.thresholds)
        if warning is not None:
            self.watch.warned_zero = True  # one "silences nothing" warning per run
            if self.log is not None:
                self.log(warning)
        return {}

    def after_update(self, st: StepState) -> dict[str, float]:
        m = st.metrics  # the update's metrics (the loop merged them before this phase)
        for msg in self.watch.add(m["stapo/silenced_count"], m["tokens/valid"] * self.epochs,
                                  m["stapo/candidates"], m["stapo/tau_h"]):
            if self.log is not None:
                self.log(msg)
        return {}

    def summary(self) -> dict[str, Any]:
        """The whole run's rate for summary.json; its note, once, when no warning or note said it yet."""
        out = self.watch.summary()
        said = self.watch.warned_zero if out["s2t_silenced"] == 0 else self.watch.noted_high
        if out["s2t_note"] and not said:
            self.watch.noted_high = True
            if self.log is not None:
                self.log(f"note: {out['s2t_note']}")
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.watch.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.watch.load_state_dict(state)


@register_hook("s2t_watch")
def _s2t_watch_hook(run: Any) -> LoopHook | None:
    return S2TWatch(run) if run.cfg.algorithm.token_weighting == "s2t" else None

