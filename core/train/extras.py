"""The loop's extras: one typed hook interface, a registry by name, and the stability layers' hooks.

``stapo.core.train.loop.train`` is a straight line (sample -> grade -> advantages -> old pass -> update ->
sync -> log/checkpoint). Everything some recipes need and others do not is a :class:`LoopHook`,
registered by name in :data:`HOOKS` and built once per run (a factory returns None when its config
switch is off, so a plain recipe runs no hook code at all). The loop calls every built hook at named
phases, in registry order, with one :class:`StepState` that the phases read and add to. The
phases that may log (``on_batch``, ``before_update``, ``after_update``) return their metrics and the
loop merges them into the step's; a hook never edits ``StepState.metrics``:

==================  =====================================================================
phase               when / what a hook may do there
==================  =====================================================================
``sample``          instead of the loop's round-0 sampling (asynchronous rollouts); the
                    first hook that returns rollouts wins
``on_batch``        after grading, advantages and dynamic sampling, before collate: learn
                    from the step (Goldilocks), sample more (DEEP-GRPO's branches), drop rows
                    from ``kept`` (DAPO's overlong filter); returns metrics
``needs_old_stats`` whether the step must run the no-grad pass over its batch
``before_update``   after the old pass: the step's constants (reference / proxy log-probs,
                    STARE's controller, KL in the reward, off-policy weights) and
                    ``contributions`` (rows the actor adds to its optimizer steps: DEEP-GRPO's
                    local loss); returns metrics; only on steps with an update
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

Registered, in this order (the order of every phase, hence of every collective under data
parallelism; each built only when its own config keys switch it on):

====================  ===============================  ==============================================
hook                  switched on by                   what
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

Why this order: the update sums the additive terms in registry order, KL then Lp-Reg (a
floating-point sum depends on its order; this is the order the tested numerics were fixed with),
and ``kl_in_reward`` needs the target ``kl_reference`` published in ``StepState.ref_lp`` and rewrites
the advantages only after the layers before it have read them (Lp-Reg logs its selection on the
sampled advantages). ``tests/unit/test_hooks.py`` checks this table against the registry.

A new extra is a subclass of :class:`LoopHook` plus ``@register_hook("name")`` on its factory;
``train()`` does not change. A factory reads what it needs from the run (``cfg``, ``backend``,
``sampler``, ...); the run's :class:`Hooks` go to the update (``stapo.core.train.update.Actor``), which
asks them for the in-update phases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from stapo.core.algos import get_advantage
from stapo.core.algos.dapo import overlong_filter_keep
from stapo.core.algos.losses import get_kl_estimator
from stapo.core.algos.lpreg import lp_reg_select, minp_proxy_logprobs
from stapo.core.algos.regularizers import (
    TokenTerm,
    kl_reward_penalty,
    kl_token_term,
    lp_reg_token_term,
)
from stapo.core.algos.stare import StareSchedule
from stapo.core.config import Config
from stapo.core.rollout.async_rollout import async_rollouts
from stapo.core.train.micro import Micro
from stapo.core.train.off_policy import off_policy_step
from stapo.core.train.reference import ReferencePolicy, minp_stats_batched
from stapo.core.train.s2t_watch import RateWatch, candidate_counts, cannot_act, describe_thresholds
from stapo.core.trainer.distributed import DataParallel

if TYPE_CHECKING:
    from stapo.core.train.update import Contribution  # (the update imports this module's Hooks)

__all__ = [
    "HOOKS", "Hooks", "KLInReward", "KLReference", "LoopHook", "LpReg", "OverlongFilter", "StareController",
    "StepState", "build_hooks", "legacy_hook_state", "register_hook",
]


# ----------------------------------------------------------------------------- the hook interface


@dataclass
class StepState:
    """One training step as the loop builds it; hooks read it and add to it at each phase."""

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
    contributions: list[Contribution] = field(default_factory=list)  # rows added to optimizer steps (DEEP-GRPO)
    off_policy: Any = None  # train.off_policy.OffPolicyStep: stale rows' corrections for the update
    ref_lp: torch.Tensor | None = None  # [N, L] the step's KL target (kl_reference's before_update)


class LoopHook:
    """One extra of the training loop. Every phase is optional: the defaults do nothing.

    Under data parallelism every rank builds the same hooks (from the config) and runs every phase,
    so a phase that issues a collective must issue it on every rank whatever its rows.
    """

    name: ClassVar[str] = ""

    def sample(self, step: int) -> tuple[list[Any], dict[str, float]] | None:
        """Round 0's graded rollouts of ``step`` instead of the loop's own sampling, or None."""
        return None

    def on_batch(self, st: StepState) -> dict[str, float]:
        """After grading, advantages and dynamic sampling, before the batch is collated; its metrics."""
        return {}

    def needs_old_stats(self, st: StepState) -> bool:
        """Whether this step's update needs the no-grad pass (``st.old_lp`` / ``st.old_ent``)."""
        return False

    def before_update(self, st: StepState) -> dict[str, float]:
        """After the old pass (when one ran), before the first optimizer step (steps with an update
        only); its metrics."""
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


#: name -> factory(run) -> the run's hook, or None when its config switch is off. Registry order is
#: the order of every phase.
HOOKS: dict[str, Callable[[Any], LoopHook | None]] = {}


def register_hook(name: str) -> Callable[[Callable[[Any], LoopHook | None]], Callable[[Any], LoopHook | None]]:
    """Register a hook factory under ``name`` (phases run in registration order)."""

    def deco(factory: Callable[[Any], LoopHook | None]) -> Callable[[Any], LoopHook | None]:
        if name in HOOKS:
            raise ValueError(f"hook {name!r} is already registered")
        HOOKS[name] = factory
        return factory

    return deco


class Hooks:
    """A run's built hooks (``Hooks()``: none), called phase by phase in registry order."""

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

    def on_batch(self, st: StepState) -> dict[str, float]:
        return _merged(h.on_batch(st) for h in self)

    def needs_old_stats(self, st: StepState) -> bool:
        return any([h.needs_old_stats(st) for h in self])  # (every hook asked: none has side effects)

    def before_update(self, st: StepState) -> dict[str, float]:
        return _merged(h.before_update(st) for h in self)

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
    """The phase's metrics, hook by hook in registry order (a hook that returns None logs nothing)."""
    out: dict[str, float] = {}
    for m in parts:
        out.update(m or {})
    return out


def build_hooks(run: Any) -> Hooks:
    """The run's hooks: every registered factory, in order, that returns one for this config."""
    built = {name: factory(run) for name, factory in HOOKS.items()}
    return Hooks({name: h for name, h in built.items() if h is not None})


def legacy_hook_state(extra: dict[str, Any]) -> dict[str, Any]:
    """Hook states by name from a checkpoint's ``extra``, also one written by an older layout.

    Older checkpoints kept the states under ``extras`` / ``layers`` (before the hooks had names), or
    under ``hooks`` with one ``regularizers`` hook bundling the KL reference, Lp-Reg, STARE and the
    overlong filter; of those only STARE's controller had state (``{"stare": {w, m, ...}}``), which
    is now the ``stare`` hook's own."""
    if "hooks" in extra:
        hooks = dict(extra["hooks"])
    else:
        layers = extra.get("layers", {})
        hooks = {"regularizers": extra.get("extras", {}), "sampler": layers.get("sampler", {}),
                 "deep_grpo": layers.get("deep_grpo", {})}
    bundled = hooks.pop("regularizers", None) or {}
    if bundled.get("stare") and not hooks.get("stare"):
        hooks["stare"] = dict(bundled["stare"])
    return hooks


# ----------------------------------------------------------------------------- shared helpers


def _multi(backend: Any) -> bool:
    """Several data-parallel ranks (the backend's collectives are then needed)."""
    return backend is not None and backend.world_size > 1


def _global_mean(backend: Any, values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` [N, L] over ``mask`` and every rank (one all_reduce under data parallelism)."""
    m = mask.bool()
    stats = torch.stack([values.detach().double()[m].sum(), m.sum().double()])
    if _multi(backend):
        stats = backend.all_reduce_sum(stats)
    return float(stats[0] / stats[1].clamp_min(1.0))


# ----------------------------------------------------------------------------- the stability layers


class OverlongFilter(LoopHook):
    """DAPO's overlong filtering (arXiv 2503.14476, Section 3.4; ``algorithm.overlong.filter``):
    truncated responses (finish reason ``length``) leave the loss, because the punishment a truncated
    response gets for its length alone is reward noise (sound reasoning may just have run long, as the
    paper puts it). ``on_batch`` drops them from ``st.kept`` before the global
    counts, so the mini-batch plan and the padding rows of every rank see the filtered batch."""

    name: ClassVar[str] = "overlong_filter"

    def keep(self, seqs: Sequence[Any]) -> torch.Tensor:
        """[N] bool: rows that stay in the loss."""
        return overlong_filter_keep([s.finish_reason for s in seqs])

    def on_batch(self, st: StepState) -> dict[str, float]:
        st.kept = [s for s, k in zip(st.kept, self.keep(st.kept).tolist(), strict=True) if k]
        return {}


class KLReference(LoopHook):
    """The KL penalty toward a reference policy (``algorithm.kl_coef > 0``; ``algorithm.kl``).

    GRPO's beta * KL(pi || ref) (arXiv 2402.03300, eq. 3; verl ``use_kl_loss`` with
    ``kl_loss_type``): ``kl.reference: initial`` keeps a frozen copy of the policy as loaded (its
    log-probs of the step's batch are taken in ``before_update``, from the old pass's micro-batches),
    ``none`` takes the KL to the policy that sampled the batch. The per-token term
    ``kl_coef * k(logp, ref)`` joins the loss before aggregation (``terms``), unless
    ``kl.in_reward``: then :class:`KLInReward` charges it to the reward instead. It publishes the
    step's target as ``st.ref_lp`` and logs ``actor/kl`` (the sampler's KL to the frozen reference).
    """

    name: ClassVar[str] = "kl_reference"

    def __init__(self, cfg: Config, backend: Any | None = None) -> None:
        a = cfg.algorithm
        self.cfg, self.backend, self.reference = cfg, backend, None
        if backend is not None and a.kl.reference == "initial":
            zero3 = getattr(backend, "zero_stage", 0) == 3  # partitioned like the policy (its own engine)
            self.reference = ReferencePolicy(
                backend.model, dtype=a.kl.dtype, offload=a.kl.offload, device=backend.device,
                chunk_size=cfg.trainer.logits_chunk_size, partitioned_copy=backend.frozen_copy if zero3 else None,
            )
        self.ref_lp: torch.Tensor | None = None  # [N, L] this step's KL target (reference or sampler)

    def needs_old_stats(self, st: StepState | None = None) -> bool:
        """The penalty's target (kl.reference=none) and its metric read the sampling policy."""
        return True

    def before_update(self, st: StepState) -> dict[str, float]:
        """The reference's log-probs of the step batch (the old pass's forwards ``st.micros``; ZeRO-3: all
        of them, the padding row's included; a plain copy runs the real rows only) and ``actor/kl``."""
        if st.old_lp is None or st.old_ent is None:
            return {}
        a, batch = self.cfg.algorithm, st.batch
        metrics: dict[str, float] = {}
        if self.reference is not None:
            self.ref_lp = self.reference.logprobs(  # [N, L]; the padding row has no response: 0
                batch, st.micros, temperature=st.temperature).to(st.old_lp.device)
            k = get_kl_estimator(a.kl.estimator)(st.old_lp, self.ref_lp)
            metrics["actor/kl"] = _global_mean(self.backend, k, batch.response_mask)
        else:  # kl.reference=none: KL to the policy that sampled (0 before the update: no metric)
            self.ref_lp = st.old_lp
        st.ref_lp = self.ref_lp
        return metrics

    def terms(self, ctx: Any, rows: torch.Tensor, old_lp: torch.Tensor | None) -> list[TokenTerm]:
        """``kl_coef * k(logp, ref)`` on the mini-batch ``rows`` (none with ``kl.in_reward``)."""
        a = self.cfg.algorithm
        if a.kl.in_reward:
            return []
        ref = self.ref_lp if self.ref_lp is not None else old_lp  # unprepared: kl.reference=none
        return [kl_token_term(ref[rows], ctx.mask, coef=a.kl_coef, estimator=a.kl.estimator)]


class LpReg(LoopHook):
    """Lp-Reg (Huang et al. 2025, arXiv 2510.03222; authors' code github.com/CarlanLark/Lp-Reg-dev,
    ``compute_policy_loss_lp_reg``; ``algorithm.lp_reg.enabled``): a KL pull toward a min-p proxy of
    the sampling policy on the lowest-probability negative-advantage tokens, so the negative update
    does not crush rare "reasoning sparks" (``stapo.core.algos.lpreg``).

    ``before_update``: the proxy pass over the policy (the old pass's forwards ``st.micros``) gives the proxy log-probs of the sampled tokens; ``terms``: the selection among the
    mini-batch's tokens at the CURRENT policy (so ``terms_read_stats``: the update takes each
    mini-batch's statistics before its backward) and the term itself.
    """

    name: ClassVar[str] = "lp_reg"
    terms_read_stats: bool = True

    def __init__(self, cfg: Config, backend: Any | None = None) -> None:
        self.cfg, self.backend = cfg, backend
        self.proxy_lp: torch.Tensor | None = None  # [N, L] proxy log-probs of the sampled tokens

    def needs_old_stats(self, st: StepState | None = None) -> bool:
        """The proxy is built from the sampling policy's log-probs."""
        return True

    def before_update(self, st: StepState) -> dict[str, float]:
        if st.old_lp is None or st.old_ent is None:
            return {}
        o, batch, old_lp = self.cfg.algorithm.lp_reg, st.batch, st.old_lp
        mask = batch.response_mask
        kept, pmax = minp_stats_batched(self.backend.model, batch, st.micros, min_p=o.min_p,
                                        temperature=st.temperature, chunk_size=self.cfg.trainer.logits_chunk_size)
        self.proxy_lp = minp_proxy_logprobs(old_lp, kept, pmax, min_p=o.min_p)
        below = _global_mean(self.backend, (self.proxy_lp <= -1e3).double(), mask)
        # what the first update regularizes (the sampling policy is the current one then)
        gather = self.backend.all_gather_1d if _multi(self.backend) else None
        sel = lp_reg_select(old_lp, batch.advantages, mask, rho=o.rho, gather=gather)
        regularized = _global_mean(self.backend, (sel & (old_lp < self.proxy_lp)).double(), mask)
        return {"lp_reg/below_floor_frac": below, "lp_reg/regularized_frac": regularized}

    def terms(self, ctx: Any, rows: torch.Tensor, old_lp: torch.Tensor | None) -> list[TokenTerm]:
        """The proxy KL on the selected tokens of the mini-batch ``rows`` (selection: global over ranks)."""
        if self.proxy_lp is None:
            return []
        o = self.cfg.algorithm.lp_reg
        sel = lp_reg_select(ctx.logprobs, ctx.advantages, ctx.mask, rho=o.rho, gather=ctx.gather)
        return [lp_reg_token_term(self.proxy_lp[rows], sel, coef=o.coef, estimator=o.estimator)]


class StareController(LoopHook):
    """STARE's closed-loop controller (arXiv 2606.19236, Sections 4.3-4.4; authors' code
    github.com/hp-luo/STARE; ``algorithm.token_weighting: stare``): once per step, before the update,
    the step's GLOBAL mean entropy at the sampling policy (the old pass's) sets the target-entropy
    gate and, with ``stare.adaptive``, steps the weights (W, M) (``stapo.core.algos.stare``). The
    ``stare`` weighting reads them through ``weighting_params``; they survive a resume
    (``state_dict``)."""

    name: ClassVar[str] = "stare"

    def __init__(self, cfg: Config, backend: Any | None = None) -> None:
        s = cfg.algorithm.stare
        self.backend = backend
        self.stare = StareSchedule(w=s.w, m=s.m, target_entropy=s.target_entropy, adaptive=s.adaptive,
                                   alpha=s.alpha, w_max=s.w_max, m_min=s.m_min)

    def needs_old_stats(self, st: StepState | None = None) -> bool:
        """The gate reads the step's entropy before the update."""
        return True

    def before_update(self, st: StepState) -> dict[str, float]:
        if st.old_lp is None or st.old_ent is None:
            return {}
        self.stare.update(_global_mean(self.backend, st.old_ent, st.batch.response_mask))
        return self.stare.metrics()

    def weighting_params(self) -> dict[str, float]:
        """STARE's scheduled W, M and the gate's entropy, as keywords of the ``stare`` weighting."""
        return self.stare.params()

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.stare.w, "m": self.stare.m, "current_entropy": self.stare.current_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """(W, M) come back only while they adapt; fixed weights are the config's (a resume may change them)."""
        if state:
            if self.stare.adaptive:
                self.stare.w, self.stare.m = float(state["w"]), float(state["m"])
            self.stare.current_entropy = float(state.get("current_entropy", float("nan")))


class KLInReward(LoopHook):
    """KL in the reward (verl ``use_kl_in_reward``; ``algorithm.kl.in_reward`` with ``kl_coef > 0``):
    each response's reward loses ``kl_coef * sum_t k(old_t, ref_t)`` (the target ``st.ref_lp`` that
    :class:`KLReference` published this step) and the group advantages are computed again; the
    batch's advantages are rewritten in place before the update.

    Registered last of the stability layers, so the layers before it read the step's advantages as
    sampled, before the penalty (Lp-Reg's logged selection). Data parallel: every rank
    joins the one all_reduce of the logged mean penalty; groups never span ranks (whole groups are
    kept), so the advantages are recomputed locally. Groups are the step's groups as collated:
    dynamic sampling already chose them (on accuracy), and with DAPO's overlong filter the truncated
    rows are no longer in the batch, so they do not enter the recomputed group statistics (our
    choice: their tokens have no KL to charge)."""

    name: ClassVar[str] = "kl_in_reward"

    def __init__(self, cfg: Config, backend: Any | None = None) -> None:
        self.cfg, self.backend = cfg, backend

    def needs_old_stats(self, st: StepState | None = None) -> bool:
        """The penalty is a KL of the sampling policy."""
        return True

    def before_update(self, st: StepState) -> dict[str, float]:
        if st.old_lp is None or st.old_ent is None or st.ref_lp is None:
            return {}
        return self.apply(st.kept, st.batch, st.old_lp, st.ref_lp)

    def apply(self, seqs: Sequence[Any], batch: Any, old_lp: torch.Tensor, ref_lp: torch.Tensor) -> dict[str, float]:
        """Rewrite the rewards, advantages and ``batch.advantages`` of ``seqs``; return the metric."""
        a = self.cfg.algorithm
        n = len(seqs)  # data parallel: the batch may end with a zero-weight padding row (not a sequence)
        pen = kl_reward_penalty(old_lp[:n], ref_lp[:n], batch.response_mask[:n], coef=a.kl_coef,
                                estimator=a.kl.estimator)
        by_group: dict[int, list[int]] = {}
        for i, (s, p) in enumerate(zip(seqs, pen.tolist(), strict=True)):
            s.reward -= p
            by_group.setdefault(s.group, []).append(i)
        adv = torch.zeros(len(seqs), dtype=torch.float32)
        fn = get_advantage(a.advantage)
        for idx in by_group.values():
            rewards = torch.tensor([[seqs[i].reward for i in idx]], dtype=torch.float32)  # [1, G]
            adv[idx] = fn(rewards, eps=a.adv_eps)[0]
        for s, v in zip(seqs, adv.tolist(), strict=True):
            s.advantage = v
        adv_bl = adv.to(batch.advantages.device).unsqueeze(1).expand_as(batch.advantages[:n])  # [n, L]
        batch.advantages[:n] = torch.where(batch.response_mask[:n], adv_bl, torch.zeros_like(adv_bl))
        # global mean over every rank's sequences (a rank may hold none); every rank joins the reduce
        stats = torch.stack([pen.detach().double().sum(), torch.tensor(float(n), dtype=torch.float64)])
        if _multi(self.backend):
            stats = self.backend.all_reduce_sum(stats)
        return {"actor/kl_reward_penalty": float(stats[0] / stats[1].clamp_min(1.0))}


# ----------------------------------------------------------------------------- the registered hooks


class AsyncHook(LoopHook):
    """Asynchronous rollouts (``rollout.async.enabled``, docs/async.md): round 0 of the coming steps is
    sampled and graded while the learner updates (``sample``: ``stapo.core.rollout.async_rollout``, through
    the rollout servers or a producer process); stale rows, or VCPO's baseline, need the proximal
    policy's log-probs (``needs_old_stats``) and get their off-policy corrections (``before_update``:
    ``stapo.core.train.off_policy``); each step's weights become the next version (``after_sync``). The
    rollouts start at the first ``sample`` (after a resume's checkpoint and the first validation),
    from the weights of that moment."""

    name: ClassVar[str] = "async"

    def __init__(self, run: Any) -> None:  # (what async rollouts support: the run's preparation checks it)
        self.run = run
        self.dp = DataParallel(run.backend)  # the off-policy decisions are global over ranks
        self.rollouts: Any = None

    def sample(self, step: int) -> tuple[list[Any], dict[str, float]]:
        if self.rollouts is None:
            self.rollouts = async_rollouts(self.run, step - 1)
        return self.rollouts.rollouts(step)

    def needs_old_stats(self, st: StepState) -> bool:
        # whether the step's round 0 is stale is fixed by the step: the same answer on every rank
        return self.rollouts.stale(st.step) or self.run.cfg.algorithm.off_policy.min_variance_baseline

    def before_update(self, st: StepState) -> dict[str, float]:
        if st.old_lp is not None:
            cfg = self.run.cfg
            st.off_policy = off_policy_step(cfg.algorithm.off_policy, st.kept, st.batch, st.old_lp, st.step,
                                            scale_by_std=cfg.algorithm.advantage == "grpo", dp=self.dp)
        return {}

    def after_update(self, st: StepState) -> dict[str, float]:
        # with the LR multipliers the optimizer steps applied
        return dict(st.off_policy.metrics) if st.off_policy is not None else {}

    def after_sync(self, st: StepState) -> None:
        if self.rollouts is not None:
            self.rollouts.publish(st.step)  # version `step`

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()


class SamplerHook(LoopHook):
    """The prompt sampler's end of step (Goldilocks: the teacher's update and metrics, every rank) and
    its state on resume. The sampler itself is ``run.sampler`` (the loop's sampling asks it)."""

    name: ClassVar[str] = "sampler"

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def on_batch(self, st: StepState) -> dict[str, float]:
        return self.sampler.end_step(st.step)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


@register_hook("async")
def _async_hook(run: Any) -> LoopHook | None:
    return AsyncHook(run) if run.cfg.rollout.async_.enabled else None


@register_hook("sampler")
def _sampler_hook(run: Any) -> LoopHook | None:
    return SamplerHook(run.sampler)


@register_hook("deep_grpo")
def _deep_grpo_hook(run: Any) -> LoopHook | None:
    from stapo.core.train.deep_grpo import DeepGRPO  # here: deep_grpo.py imports LoopHook from this module

    return DeepGRPO(run.cfg, run) if run.cfg.algorithm.deep_grpo.enabled else None


@register_hook("overlong_filter")
def _overlong_filter_hook(run: Any) -> LoopHook | None:
    return OverlongFilter() if run.cfg.algorithm.overlong.filter else None


@register_hook("kl_reference")
def _kl_reference_hook(run: Any) -> LoopHook | None:
    return KLReference(run.cfg, run.backend) if run.cfg.algorithm.kl_coef > 0 else None


@register_hook("lp_reg")
def _lp_reg_hook(run: Any) -> LoopHook | None:
    return LpReg(run.cfg, run.backend) if run.cfg.algorithm.lp_reg.enabled else None


@register_hook("stare")
def _stare_hook(run: Any) -> LoopHook | None:
    return StareController(run.cfg, run.backend) if run.cfg.algorithm.token_weighting == "stare" else None


@register_hook("kl_in_reward")
def _kl_in_reward_hook(run: Any) -> LoopHook | None:
    a = run.cfg.algorithm
    return KLInReward(run.cfg, run.backend) if a.kl.in_reward and a.kl_coef > 0 else None


class S2TWatch(LoopHook):
    """Feeds each step's global silenced count into :class:`stapo.core.train.s2t_watch.RateWatch`; rank 0
    logs its warnings (every rank holds the same global counts, so every rank's state agrees).

    Before the first update it counts that batch's candidates under the sampling policy (the old pass's
    log-probs when the step ran one, else one no-grad pass over the batch: once per run, never again)
    and warns when correct responses hold none (:func:`stapo.core.train.s2t_watch.cannot_act`); that
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
