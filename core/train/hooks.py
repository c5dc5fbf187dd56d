"""The loop's hook interface: :class:`LoopHook`, the step it sees (:class:`StepState`), the run's built
hooks (:class:`Hooks`), and the registry with its one explicit order (:data:`HOOK_ORDER`).

``stapo.core.train.loop.train`` is a straight line (sample -> grade -> advantages -> old pass -> update ->
sync -> log/checkpoint). Everything some recipes need and others do not is a :class:`LoopHook`, defined
beside the code of its concern and registered there by name (``@register_hook("name")`` on its factory;
``stapo.core.train.extras`` imports those modules and builds a run's hooks). A factory returns None when
its config switch is off, so a plain recipe runs no hook code at all. The loop calls every built hook at
named phases, in :data:`HOOK_ORDER`, with one :class:`StepState`, frozen: a hook reads the step and
returns what it adds (:class:`Added`), which :class:`Hooks` applies before asking the next hook. The
phases that may log (``on_batch``, ``before_update``, ``after_update``) return their metrics and the
loop merges them into the step's:

==================  =====================================================================
phase               when / what a hook may do there
==================  =====================================================================
``sample``          instead of the loop's round-0 sampling (asynchronous rollouts); the
                    first hook that returns rollouts wins
``on_batch``        after grading, advantages and dynamic sampling, before collate: learn
                    from the step (Goldilocks), sample more (DEEP-GRPO's branches), drop rows
                    from ``kept`` (DAPO's overlong filter: ``Added.keep``); returns metrics
``needs_old_stats`` whether the step must run the no-grad pass over its batch
``before_update``   after the old pass: the step's constants (reference / proxy log-probs,
                    STARE's controller, KL in the reward, off-policy weights) and
                    ``contributions`` (rows the actor adds to its optimizer steps: DEEP-GRPO's
                    local loss), returned in an ``Added``; only on steps with an update
``weighting_params``,
``terms``,
``terms_read_stats``  inside the update, per mini-batch: live keywords for the token weighting
                    (STARE), additive per-token terms (KL, Lp-Reg) and whether those read p
``after_update``    after the optimizer steps: returns metrics (only on steps with an update)
``after_sync``      after the weights reached the rollout engine (async: the next version)
``state_dict`` /
``load_state_dict`` what survives a resume (saved under the hook's name in the checkpoint)
``close``           end of the run (also on error)
==================  =====================================================================

Registered, in this order (:data:`HOOK_ORDER`: the order of every phase, hence of every collective
under data parallelism; each built only when its own config keys switch it on):

====================  ===============================  ==============================================
hook                  switched on by                   what (module)
====================  ===============================  ==============================================
``async``             ``rollout.async.enabled``        rollouts ahead of the update + off-policy fixes
``sampler``           always                           the prompt sampler's step and state (Goldilocks)
``deep_grpo``         ``algorithm.deep_grpo.enabled``  pivot branches and their local loss
``overlong_filter``   ``algorithm.overlong.filter``    DAPO: truncated rows leave the loss
``kl_reference``      ``algorithm.kl_coef > 0``        reference log-probs, ``actor/kl``, the KL term
``lp_reg``            ``algorithm.lp_reg.enabled``     Lp-Reg's min-p proxy and its term
``stare``             ``token_weighting: stare``       STARE's gate and adaptive (W, M)
``kl_in_reward``      ``algorithm.kl.in_reward``       the KL charged to the reward instead
``s2t_watch``         ``token_weighting: s2t``         the run's silenced rate against the paper's (summary.json)
====================  ===============================  ==============================================

Why this order: the update sums the additive terms in this order, KL then Lp-Reg (a floating-point
sum depends on its order; this is the order the tested numerics were fixed with), and
``kl_in_reward`` needs the target ``kl_reference`` returned (``StepState.ref_lp`` once applied) and rewrites the
advantages only after the layers before it have read them (Lp-Reg logs its selection on the sampled
advantages). The order is :data:`HOOK_ORDER`, not the order modules happen to be imported in:
registering a name it does not hold is an error, and so is building hooks while a name it holds has no
factory. ``tests/unit/test_hooks.py`` checks this table against it.

A new extra is a subclass of :class:`LoopHook`, ``@register_hook("name")`` on its factory, and its name
in :data:`HOOK_ORDER` where its phases must run; ``train()`` does not change. A factory reads what it
needs from the run (``cfg``, ``backend``, ``sampler``, ...); the run's :class:`Hooks` go to the update
(``stapo.core.train.update.Actor``), which asks them for the in-update phases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import torch

from stapo.core.algos.regularizers import TokenTerm
from stapo.core.batch import Batch
from stapo.core.train.micro import Micro

__all__ = [
    "HOOKS", "HOOK_ORDER", "Added", "Contribution", "ExtraRows", "Hooks", "LoopHook", "StepState", "build_hooks",
    "register_hook",
]

#: The order of every phase (and of every collective on N ranks): the one place that decides it.
HOOK_ORDER: tuple[str, ...] = (
    "async", "sampler", "deep_grpo", "overlong_filter", "kl_reference", "lp_reg", "stare", "kl_in_reward",
    "s2t_watch",
)


# ----------------------------------------------------------------------------- what a hook adds to the update


@dataclass(frozen=True)
class ExtraRows:
    """Rows another objective adds to one optimizer step (DEEP-GRPO's local branch loss): they run
    through the actor's own mini-batch pass (the configured weighting, loss and aggregation, the
    weighting's statistics from the gradient forwards, a global normalizer of their own), their loss
    scaled by ``scale``, and join the step's gradient before the optimizer step."""

    batch: Batch  # its rows; ``response_mask`` marks the tokens the term trains, ``advantages`` their A
    micros: list[Micro]  # this rank's forwards over its rows of this step (``stapo.core.train.micro``, lockstep)
    old_lp: torch.Tensor  # [N, L] the sampling policy's log-probs of ``batch``
    scale: float  # the term's weight in the objective
    seed: int  # the weighting's own randomness for these rows


class Contribution(Protocol):
    """A term that adds rows to the update's optimizer steps. Before each optimizer step (``update``
    counts them over the step's epochs and mini-batches, from 0) the actor asks for this step's rows,
    runs them and hands back what they cost; a contribution never runs a forward itself."""

    def rows(self, update: int) -> ExtraRows | None: ...

    def done(self, update: int, loss: float, tokens: float) -> None: ...



@dataclass(frozen=True)
class StepState:
    """One training step as the loop builds it, read-only to hooks (frozen): the loop makes each next
    state with ``dataclasses.replace`` (the counts, the batch, the old pass), and :class:`Hooks` makes
    the one after each hook's :class:`Added` (``kept``, ``ref_lp``, ``off_policy``, ``contributions``)."""

    step: int
    seqs: list[Any]  # every sequence sampled this step (all rounds), graded and shaped (loop.Sequence_)
    kept: list[Any]  # the rows that enter the update, in batch order (on_batch may drop some)
    metrics: dict[str, float]  # the step's logged metrics (the loop merges what the phases return)
    counts: list[int] = field(default_factory=list)  # kept rows of every rank (set after on_batch)
    batch: Any = None  # loop.Batch of ``kept`` (+ the zero-weight padding row under data parallelism)
    pad_row: int | None = None  # this rank's padding row (data parallel), else None
    micros: list[Micro] | None = None  # the old pass's forwards over ``batch`` (lockstep; set when it runs)
    temperature: float = 1.0  # the sampling temperature the statistics are taken at
    old_lp: torch.Tensor | None = None  # [N, L] sampling policy's log-probs (None: no old pass ran)
    old_ent: torch.Tensor | None = None  # [N, L] its entropies
    contributions: tuple[Contribution, ...] = ()  # rows added to optimizer steps (DEEP-GRPO)
    off_policy: Any = None  # train.off_policy.OffPolicyStep: stale rows' corrections for the update
    ref_lp: torch.Tensor | None = None  # [N, L] the step's KL target (kl_reference's before_update)


@dataclass(frozen=True)
class Added:
    """What one hook's ``on_batch`` or ``before_update`` adds to the step, returned instead of written
    into :class:`StepState`. :class:`Hooks` applies each hook's to the step in :data:`HOOK_ORDER` before
    it asks the next hook, so a later hook reads what an earlier one added (``kl_in_reward`` the target
    ``kl_reference`` set) and one place decides how additions combine: ``keep`` masks compose, the
    contributions queue in order, and a KL target or off-policy correction set by two hooks is an error.
    A phase that adds nothing but metrics may return them as a plain dict."""

    metrics: Mapping[str, float] = field(default_factory=dict)  # logged with the step's
    keep: tuple[bool, ...] | None = None  # on_batch: [len(st.kept)] rows that stay in the update (None: all)
    ref_lp: torch.Tensor | None = None  # before_update: [N, L] the step's KL target (``st.ref_lp``)
    off_policy: Any = None  # before_update: stale rows' corrections (train.off_policy.OffPolicyStep)
    contributions: tuple[Contribution, ...] = ()  # before_update: rows added to the optimizer steps


def _apply(st: StepState, added: Added, name: str) -> StepState:
    """The step with one hook's additions (the one place that writes the fields hooks add to)."""
    new: dict[str, Any] = {}
    if added.keep is not None:
        if len(added.keep) != len(st.kept):
            raise ValueError(f"hook {name!r} kept {len(added.keep)} flags for {len(st.kept)} rows")
        new["kept"] = [s for s, k in zip(st.kept, added.keep, strict=True) if k]
    for key in ("ref_lp", "off_policy"):
        value = getattr(added, key)
        if value is not None:
            if getattr(st, key) is not None:
                raise ValueError(f"hook {name!r} sets the step's {key}, which an earlier hook set")
            new[key] = value
    if added.contributions:
        new["contributions"] = (*st.contributions, *added.contributions)
    return replace(st, **new) if new else st


class LoopHook:
    """One extra of the training loop. Every phase is optional: the defaults do nothing.

    Under data parallelism every rank builds the same hooks (from the config) and runs every phase,
    so a phase that issues a collective must issue it on every rank whatever its rows.
    """

    name: ClassVar[str] = ""

    def sample(self, step: int) -> tuple[list[Any], dict[str, float]] | None:
        """Round 0's graded rollouts of ``step`` instead of the loop's own sampling, or None."""
        return None

    def on_batch(self, st: StepState) -> dict[str, float] | Added:
        """After grading, advantages and dynamic sampling, before the batch is collated: its metrics,
        or an :class:`Added` (rows that leave ``kept``)."""
        return {}

    def needs_old_stats(self, st: StepState) -> bool:
        """Whether this step's update needs the no-grad pass (``st.old_lp`` / ``st.old_ent``)."""
        return False

    def before_update(self, st: StepState) -> dict[str, float] | Added:
        """After the old pass (when one ran), before the first optimizer step (steps with an update
        only): its metrics, or an :class:`Added` (the KL target, off-policy corrections, contributions)."""
        return {}

    # inside the update (stapo.core.train.update.Actor.update), per mini-batch
    terms_read_stats: bool = False  # the additive terms read the current policy's p

    def weighting_params(self) -> dict[str, float]:
        """Live keywords for the token weighting."""
        return {}

    def terms(self, ctx: Any, rows: torch.Tensor, old_lp: torch.Tensor | None) -> list[TokenTerm]:
        """Additive per-token terms for the mini-batch ``rows`` (``ctx``: its TokenContext)."""
        return []

    def after_update(self, st: StepState) -> dict[str, float]:
        """After the step's optimizer steps (steps with an update only); its metrics."""
        return {}

    def after_sync(self, st: StepState) -> None:
        """After the new weights reached the rollout engine."""

    def summary(self) -> dict[str, Any]:
        """What the run's summary.json carries from this hook (JSON-safe; rank 0 writes it)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What must survive a resume (JSON-safe: it goes in the checkpoint's meta)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""

    def close(self) -> None:
        """End of the run (also after an error)."""


#: name -> factory(run) -> the run's hook, or None when its config switch is off. The phases run in
#: :data:`HOOK_ORDER`, whatever order the factories registered in.
HOOKS: dict[str, Callable[[Any], LoopHook | None]] = {}


def register_hook(name: str) -> Callable[[Callable[[Any], LoopHook | None]], Callable[[Any], LoopHook | None]]:
    """Register a hook factory under ``name``, a name :data:`HOOK_ORDER` holds (its place there is its
    place in every phase)."""
    if name not in HOOK_ORDER:
        raise ValueError(f"hook {name!r} has no place in HOOK_ORDER (stapo.core.train.hooks): add it where its "
                         "phases must run")

    def deco(factory: Callable[[Any], LoopHook | None]) -> Callable[[Any], LoopHook | None]:
        if name in HOOKS:
            raise ValueError(f"hook {name!r} is already registered")
        HOOKS[name] = factory
        return factory

    return deco


class Hooks:
    """A run's built hooks (``Hooks()``: none), called phase by phase in :data:`HOOK_ORDER`."""

    def __init__(self, hooks: dict[str, LoopHook] | None = None) -> None:
        self.by_name = dict(hooks or {})

    def __iter__(self) -> Iterator[LoopHook]:
        return iter(self.by_name.values())

    def get(self, name: str) -> LoopHook | None:
        return self.by_name.get(name)

    def sample(self, step: int) -> tuple[list[Any], dict[str, float]] | None:
        for h in self:
            out = h.sample(step)
            if out is not None:
                return out
        return None

    def on_batch(self, st: StepState) -> tuple[StepState, dict[str, float]]:
        """Each hook's ``on_batch`` in order, each seeing the step with the additions of those before it:
        (the step with every hook's additions, the phase's metrics)."""
        return self._adding(st, "on_batch")

    def needs_old_stats(self, st: StepState) -> bool:
        return any([h.needs_old_stats(st) for h in self])  # (every hook asked: none has side effects)

    def before_update(self, st: StepState) -> tuple[StepState, dict[str, float]]:
        """Each hook's ``before_update`` in order, as :meth:`on_batch`: (the step, the phase's metrics)."""
        return self._adding(st, "before_update")

    def _adding(self, st: StepState, phase: str) -> tuple[StepState, dict[str, float]]:
        out: dict[str, float] = {}
        for name, h in self.by_name.items():
            added = getattr(h, phase)(st)
            added = added if isinstance(added, Added) else Added(metrics=added or {})
            st = _apply(st, added, name)
            out.update(added.metrics)
        return st, out

    @property
    def terms_read_stats(self) -> bool:
        return any(h.terms_read_stats for h in self)

    def weighting_params(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for h in self:
            out.update(h.weighting_params())
        return out

    def terms(self, ctx: Any, rows: torch.Tensor, old_lp: torch.Tensor | None) -> list[TokenTerm]:
        return [t for h in self for t in h.terms(ctx, rows, old_lp)]

    def after_update(self, st: StepState) -> dict[str, float]:
        return _merged(h.after_update(st) for h in self)

    def after_sync(self, st: StepState) -> None:
        for h in self:
            h.after_sync(st)

    def state_dict(self) -> dict[str, Any]:
        return {name: h.state_dict() for name, h in self.by_name.items()}

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for h in self:
            out.update(h.summary())
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, h in self.by_name.items():
            h.load_state_dict(state.get(name, {}))

    def close(self) -> None:
        for h in self:
            h.close()


def _merged(parts: Iterator[dict[str, float] | None]) -> dict[str, float]:
    """The phase's metrics, hook by hook in :data:`HOOK_ORDER` (a hook that returns None logs nothing)."""
    out: dict[str, float] = {}
    for m in parts:
        out.update(m or {})
    return out


def build_hooks(run: Any) -> Hooks:
    """The run's hooks: every factory, in :data:`HOOK_ORDER`, that returns one for this config. A name
    of the order with no factory is an error (the module that registers it was not imported), not a
    hook silently left out."""
    missing = [name for name in HOOK_ORDER if name not in HOOKS]
    if missing:
        raise ValueError(f"hooks {missing} are in HOOK_ORDER but not registered: import their modules "
                         "(stapo.core.train.extras imports every one)")
    built = {name: HOOKS[name](run) for name in HOOK_ORDER}
    return Hooks({name: h for name, h in built.items() if h is not None})
