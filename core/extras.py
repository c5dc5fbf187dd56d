"""The loop's extras: one typed hook interface, a registry by name, and the regularizers' hook.

``stapo.core.loop.train`` is a straight line (sample -> grade -> advantages -> old pass -> update ->
sync -> log/checkpoint). Everything some recipes need and others do not is a :class:`LoopHook`,
registered by name in :data:`HOOKS` and built once per run (a factory returns None when its config
switch is off, so a plain recipe runs no hook code at all). The loop calls every built hook at named
phases, in registry order, with one :class:`StepState` that the phases read and add to:

==================  =====================================================================
phase               when / what a hook may do there
==================  =====================================================================
``sample``          instead of the loop's round-0 sampling (asynchronous rollouts); the
                    first hook that returns rollouts wins
``on_batch``        after grading, advantages and dynamic sampling, before collate: learn
                    from the step (Goldilocks), sample more (DEEP-GRPO's branches), drop rows
                    from ``kept`` (DAPO's overlong filter), add metrics
``needs_old_stats`` whether the step must run the no-grad pass over its batch
``before_update``   after the old pass: the step's constants (reference / proxy log-probs,
                    STARE's controller, KL in the reward, off-policy weights) and callables
                    for ``before_step`` (run right before each optimizer step: DEEP-GRPO's
                    local loss); only on steps with an update
``weighting_params``,
``terms``,
``terms_read_stats``  inside the update, per mini-batch: live keywords for the token weighting
                    (STARE), additive per-token terms (KL, Lp-Reg) and whether those read p
``after_update``    after the optimizer steps: metrics (only on steps with an update)
``after_sync``      after the weights reached the rollout engine (async: publish them)
``state_dict`` /
``load_state_dict`` what survives a resume (saved under the hook's name in the checkpoint)
``close``           end of the run (also on error)
==================  =====================================================================

Registered, in this order (the order of every phase, hence of every collective under data
parallelism): ``async`` (producer process + off-policy corrections), ``sampler`` (the prompt
sampler's per-step update and state: Goldilocks), ``deep_grpo`` (pivot branches and their local
loss), ``regularizers`` (:class:`StepExtras`: the frozen KL reference, Lp-Reg's proxy, STARE's
controller, DAPO's overlong filter). A new extra is a subclass of :class:`LoopHook` plus
``@register_hook("name")`` on its factory; ``train()`` does not change.

``StepExtras`` holds the regularizers' per-run state: the frozen reference model
(``algorithm.kl.reference: initial``) and each step's reference log-probs, for the KL penalty (in the
loss, or in the reward with ``algorithm.kl.in_reward``); Lp-Reg's proxy log-probs of the sampled
tokens (``algorithm.lp_reg.enabled``); STARE's closed-loop controller (gate and adaptive W, M),
advanced once per step; DAPO's overlong filter. They share the old pass's statistics, so they are
one hook.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

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
from stapo.core.update import MicroSpec

__all__ = ["HOOKS", "Hooks", "LoopHook", "StepExtras", "StepState", "build_hooks", "extras_of", "register_hook"]


# ----------------------------------------------------------------------------- the hook interface


@dataclass
class StepState:
    """One training step as the loop builds it; hooks read it and add to it at each phase."""

    step: int
    seqs: list[Any]  # every sequence sampled this step (all rounds), graded and shaped (loop.Sequence_)
    kept: list[Any]  # the rows that enter the update, in batch order (on_batch may drop some)
    metrics: dict[str, float]  # the step's logged metrics; phases add theirs
    counts: list[int] = field(default_factory=list)  # kept rows of every rank (set after on_batch)
    batch: Any = None  # loop.Batch of ``kept`` (+ the zero-weight padding row under data parallelism)
    pad_row: int | None = None  # this rank's padding row (data parallel), else None
    spec: MicroSpec | None = None  # the old pass's micro-batching (the update's)
    calls: int | None = None  # forwards of the old pass on every rank (ZeRO-3 lockstep)
    temperature: float = 1.0  # the sampling temperature the statistics are taken at
    old_lp: torch.Tensor | None = None  # [N, L] sampling policy's log-probs (None: no old pass ran)
    old_ent: torch.Tensor | None = None  # [N, L] its entropies
    before_step: list[Callable[[int, bool], None]] = field(default_factory=list)  # before each optimizer step
    off_policy: Any = None  # async_rollout.OffPolicyStep: stale rows' corrections for the update


class LoopHook:
    """One extra of the training loop. Every phase is optional: the defaults do nothing.

    Under data parallelism every rank builds the same hooks (from the config) and runs every phase,
    so a phase that issues a collective must issue it on every rank whatever its rows.
    """

    name: ClassVar[str] = ""

    def sample(self, step: int) -> tuple[list[Any], dict[str, float]] | None:
        """Round 0's graded rollouts of ``step`` instead of the loop's own sampling, or None."""
        return None

    def on_batch(self, st: StepState) -> None:
        """After grading, advantages and dynamic sampling, before the batch is collated."""

    def needs_old_stats(self, st: StepState) -> bool:
        """Whether this step's update needs the no-grad pass (``st.old_lp`` / ``st.old_ent``)."""
        return False

    def before_update(self, st: StepState) -> None:
        """After the old pass (when one ran), before the first optimizer step; steps with an update only."""

    # inside the update (stapo.core.update.update_policy), per mini-batch
    terms_read_stats: bool = False  # the additive terms read the current policy's p

    def weighting_params(self) -> dict[str, float]:
        """Live keywords for the token weighting."""
        return {}

    def terms(self, ctx: Any, rows: torch.Tensor, old_lp: torch.Tensor | None) -> list[TokenTerm]:
        """Additive per-token terms for the mini-batch ``rows`` (``ctx``: its TokenContext)."""
        return []

    def after_update(self, st: StepState) -> None:
        """After the step's optimizer steps (steps with an update only)."""

    def after_sync(self, st: StepState) -> None:
        """After the new weights reached the rollout engine."""

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
    """A run's built hooks, called phase by phase in registry order."""

    def __init__(self, hooks: dict[str, LoopHook]) -> None:
        self.by_name = dict(hooks)

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

    def on_batch(self, st: StepState) -> None:
        for h in self:
            h.on_batch(st)

    def needs_old_stats(self, st: StepState) -> bool:
        return any([h.needs_old_stats(st) for h in self])  # (every hook asked: none has side effects)

    def before_update(self, st: StepState) -> None:
        for h in self:
            h.before_update(st)

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

    def after_update(self, st: StepState) -> None:
        for h in self:
            h.after_update(st)

    def after_sync(self, st: StepState) -> None:
        for h in self:
            h.after_sync(st)

    def state_dict(self) -> dict[str, Any]:
        return {name: h.state_dict() for name, h in self.by_name.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, h in self.by_name.items():
            h.load_state_dict(state.get(name, {}))

    def close(self) -> None:
        for h in self:
            h.close()


def build_hooks(run: Any) -> Hooks:
    """The run's hooks: every registered factory, in order, that returns one for this config."""
    built = {name: factory(run) for name, factory in HOOKS.items()}
    return Hooks({name: h for name, h in built.items() if h is not None})


def legacy_hook_state(extra: dict[str, Any]) -> dict[str, Any]:
    """Hook states from a checkpoint written before the hooks had names (``extras`` / ``layers``)."""
    if "hooks" in extra:
        return dict(extra["hooks"])
    layers = extra.get("layers", {})
    return {"regularizers": extra.get("extras", {}), "sampler": layers.get("sampler", {}),
            "deep_grpo": layers.get("deep_grpo", {})}


class StepExtras(LoopHook):
    """Reference model, Lp-Reg proxy, STARE schedule and overlong filter of one run (hook ``regularizers``).

    Its phases: ``on_batch`` drops the rows DAPO's overlong filter leaves out of the loss;
    ``needs_old_stats`` asks for the old pass when any of KL / Lp-Reg / STARE is on;
    ``before_update`` runs :meth:`prepare` and :meth:`apply_kl_in_reward` on the old pass's
    statistics; inside the update :meth:`weighting_params` and :meth:`terms`.
    """

    name: ClassVar[str] = "regularizers"

    def __init__(self, cfg: Config, backend: Any | None = None) -> None:
        self.cfg = cfg
        a = cfg.algorithm
        self.backend = backend
        self.reference = None
        if backend is not None and a.kl_coef > 0 and a.kl.reference == "initial":
            from stapo.core.reference import ReferencePolicy

            zero3 = getattr(backend, "zero_stage", 0) == 3  # partitioned like the policy (its own engine)
            self.reference = ReferencePolicy(
                backend.model, dtype=a.kl.dtype, offload=a.kl.offload, device=backend.device,
                chunk_size=cfg.trainer.logits_chunk_size, partitioned_copy=backend.frozen_copy if zero3 else None,
            )
        self.stare = None
        if a.token_weighting == "stare":
            s = a.stare
            self.stare = StareSchedule(w=s.w, m=s.m, target_entropy=s.target_entropy, adaptive=s.adaptive,
                                       alpha=s.alpha, w_max=s.w_max, m_min=s.m_min)
        self.ref_lp: torch.Tensor | None = None  # [N, L] this step's KL target (reference or sampler)
        self.proxy_lp: torch.Tensor | None = None  # [N, L] Lp-Reg proxy log-probs of the sampled tokens

    # ------------------------------------------------------------------ what the update must provide

    def needs_old_stats(self, st: StepState | None = None) -> bool:
        """The step's extras read the sampling policy's statistics before the update (the KL
        penalty and its metric, Lp-Reg's proxy, STARE's controller): the step runs the no-grad pass."""
        a = self.cfg.algorithm
        return a.kl_coef > 0 or a.lp_reg.enabled or self.stare is not None

    @property  # type: ignore[override]
    def terms_read_stats(self) -> bool:
        """The additive terms read the current policy's p (Lp-Reg's selection): the update takes
        every micro-batch's statistics before the mini-batch's backward, as for such weightings."""
        return self.cfg.algorithm.lp_reg.enabled

    # ------------------------------------------------------------------ loop phases

    def on_batch(self, st: StepState) -> None:
        """DAPO's overlong filter: truncated rows leave ``st.kept`` (no-op unless configured)."""
        if self.cfg.algorithm.overlong.filter:
            st.kept = [s for s, k in zip(st.kept, self.loss_rows(st.kept).tolist(), strict=True) if k]

    def before_update(self, st: StepState) -> None:
        """The step's constants from the old pass's statistics (every rank; nothing without an old pass)."""
        if st.old_lp is None or st.old_ent is None:
            return
        assert st.spec is not None
        st.metrics.update(self.prepare(st.batch, st.old_lp, st.old_ent, micro_batch=st.spec,
                                       temperature=st.temperature, calls=st.calls, pad_row=st.pad_row))
        st.metrics.update(self.apply_kl_in_reward(st.kept, st.batch, st.old_lp))

    # ------------------------------------------------------------------ per step

    def loss_rows(self, seqs: Sequence[Any]) -> torch.Tensor:
        """[N] bool: rows that stay in the loss (DAPO overlong filtering drops truncated ones)."""
        if not self.cfg.algorithm.overlong.filter:
            return torch.ones(len(seqs), dtype=torch.bool)
        return overlong_filter_keep([s.finish_reason for s in seqs])

    def prepare(self, batch: Any, old_lp: torch.Tensor, old_ent: torch.Tensor, *, micro_batch: int | MicroSpec,
                temperature: float, calls: int | None = None, pad_row: int | None = None) -> dict[str, float]:
        """Compute this step's constants (reference / proxy log-probs, STARE state); return metrics.

        Data parallel: every rank must call this (the metrics are all-reduced, Lp-Reg's selection
        all-gathered, in a fixed order that depends on the config only). ``pad_row`` / ``calls`` are
        those of the step's old-log-prob pass (``update.token_stats_batched``, same micro-batches): the Lp-Reg proxy pass
        over the policy and the ZeRO-3 reference (partitioned like the policy) make exactly ``calls``
        forwards on every rank (ZeRO-3 gathers parameters in each); a plain reference copy (ZeRO 0-2,
        one device) issues no collective and runs on the real rows only.
        """
        a, metrics = self.cfg.algorithm, {}
        mask = batch.response_mask
        self.ref_lp = self.proxy_lp = None
        if a.kl_coef > 0:
            if self.reference is not None:
                self.ref_lp = self.reference.logprobs(  # [N, L]; the padding row has no response: 0
                    batch.input_ids, batch.attention_mask, mask, micro_batch=micro_batch, temperature=temperature,
                    calls=calls, pad_row=pad_row,
                ).to(old_lp.device)
            else:
                self.ref_lp = old_lp  # kl.reference=none: KL to the policy that sampled
            if self.reference is not None:  # to the sampler itself the KL is 0 before the update
                k = get_kl_estimator(a.kl.estimator)(old_lp, self.ref_lp)
                metrics["actor/kl"] = self._global_mean(k, mask)
        if a.lp_reg.enabled:
            from stapo.core.reference import minp_stats_batched

            kept, pmax = minp_stats_batched(
                self.backend.model, batch.input_ids, batch.attention_mask, mask, min_p=a.lp_reg.min_p,
                micro_batch=micro_batch, temperature=temperature, chunk_size=self.cfg.trainer.logits_chunk_size,
                calls=calls, pad_row=pad_row,
            )
            self.proxy_lp = minp_proxy_logprobs(old_lp, kept, pmax, min_p=a.lp_reg.min_p)
            metrics["lp_reg/below_floor_frac"] = self._global_mean((self.proxy_lp <= -1e3).double(), mask)
            # what the first update regularizes (the sampling policy is the current one then)
            sel = lp_reg_select(old_lp, batch.advantages, mask, rho=a.lp_reg.rho, gather=self._gather())
            metrics["lp_reg/regularized_frac"] = self._global_mean((sel & (old_lp < self.proxy_lp)).double(), mask)
        if self.stare is not None:
            self.stare.update(self._global_mean(old_ent, mask))
            metrics.update(self.stare.metrics())
        return metrics

    def apply_kl_in_reward(self, seqs: Sequence[Any], batch: Any, old_lp: torch.Tensor) -> dict[str, float]:
        """``kl.in_reward``: reward_i -= kl_coef * sum_t k(old, ref); group advantages again; the
        batch's advantages rewritten in place. No-op otherwise. Call after :meth:`prepare`.

        Data parallel: every rank calls it (the logged mean penalty is all-reduced); groups never
        span ranks (whole groups are kept), so the advantages are recomputed locally. Groups are the
        step's groups as collated: dynamic sampling already chose them (on accuracy),
        and with DAPO's overlong filter the truncated rows are no longer in the batch, so they do not
        enter the recomputed group statistics (our choice: their tokens have no KL to charge).
        """
        a = self.cfg.algorithm
        if not (a.kl.in_reward and a.kl_coef > 0 and self.ref_lp is not None):
            return {}
        from stapo.core.algos import get_advantage

        n = len(seqs)  # data parallel: the batch may end with a zero-weight padding row (not a sequence)
        pen = kl_reward_penalty(old_lp[:n], self.ref_lp[:n], batch.response_mask[:n], coef=a.kl_coef,
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
        if self._multi():
            stats = self.backend.all_reduce_sum(stats)
        return {"actor/kl_reward_penalty": float(stats[0] / stats[1].clamp_min(1.0))}

    # ------------------------------------------------------------------ inside update_policy

    def weighting_params(self) -> dict[str, float]:
        """Live keywords for the token weighting (STARE's scheduled W, M and gate entropy)."""
        return self.stare.params() if self.stare is not None else {}

    def terms(self, ctx: Any, rows: torch.Tensor, old_lp: torch.Tensor | None) -> list[TokenTerm]:
        """Additive per-token terms for the mini-batch ``rows`` (``ctx``: its TokenContext at the
        current policy; ``old_lp``: the whole step batch's sampling log-probs, [N, L])."""
        a, out = self.cfg.algorithm, []
        if a.kl_coef > 0 and not a.kl.in_reward:
            ref = self.ref_lp if self.ref_lp is not None else old_lp  # unprepared: kl.reference=none
            out.append(kl_token_term(ref[rows], ctx.mask, coef=a.kl_coef, estimator=a.kl.estimator))
        if self.proxy_lp is not None:
            sel = lp_reg_select(ctx.logprobs, ctx.advantages, ctx.mask, rho=a.lp_reg.rho, gather=ctx.gather)
            out.append(lp_reg_token_term(self.proxy_lp[rows], sel, coef=a.lp_reg.coef, estimator=a.lp_reg.estimator))
        return out

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """What must survive a resume: STARE's scheduled W, M (JSON-able; in the checkpoint's meta)."""
        if self.stare is None:
            return {}
        return {"stare": {"w": self.stare.w, "m": self.stare.m, "current_entropy": self.stare.current_entropy}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        st = state.get("stare")
        if self.stare is not None and st:
            self.stare.w, self.stare.m = float(st["w"]), float(st["m"])
            self.stare.current_entropy = float(st.get("current_entropy", float("nan")))

    # ------------------------------------------------------------------ helpers

    def _gather(self) -> Any:
        return self.backend.all_gather_1d if self._multi() else None

    def _multi(self) -> bool:
        """Several data-parallel ranks (the backend's collectives are then needed)."""
        return self.backend is not None and self.backend.world_size > 1

    def _global_mean(self, values: torch.Tensor, mask: torch.Tensor) -> float:
        m = mask.bool()
        stats = torch.stack([values.detach().double()[m].sum(), m.sum().double()])
        if self._multi():
            stats = self.backend.all_reduce_sum(stats)
        return float(stats[0] / stats[1].clamp_min(1.0))


def extras_of(run: Any) -> Hooks | StepExtras:
    """What the update asks for its in-update phases: the run's hooks; a run-like object without
    them (tests drive update_policy directly) may carry a ``StepExtras`` as ``extras``, else none."""
    hooks = getattr(run, "hooks", None)
    if hooks is not None:
        return hooks
    ex = getattr(run, "extras", None)
    return ex if ex is not None else StepExtras(run.cfg, None)


# ----------------------------------------------------------------------------- the registered hooks


class AsyncHook(LoopHook):
    """Asynchronous rollouts (``rollout.async.enabled``, docs/async.md): a producer process samples and
    grades round 0 of the coming steps (``sample``); stale rows, or VCPO's baseline, need the proximal
    policy's log-probs (``needs_old_stats``) and get their off-policy corrections (``before_update``);
    the weights after each step go to the producer (``after_sync``). The producer starts at the first
    ``sample`` (after a resume's checkpoint and the first validation), from the weights of that moment."""

    name: ClassVar[str] = "async"

    def __init__(self, run: Any) -> None:
        from stapo.core.async_rollout import check_supported

        check_supported(run.cfg, int(getattr(run, "world_size", 1)))
        self.run = run
        self.learner: Any = None

    def sample(self, step: int) -> tuple[list[Any], dict[str, float]]:
        if self.learner is None:
            from stapo.core.async_rollout import AsyncLearner

            self.learner = AsyncLearner(self.run, step - 1)
        return self.learner.rollouts(step)

    def needs_old_stats(self, st: StepState) -> bool:
        stale = any(s.version is not None and s.version < st.step - 1 for s in st.kept)
        return stale or self.run.cfg.algorithm.off_policy.min_variance_baseline

    def before_update(self, st: StepState) -> None:
        if st.old_lp is None:
            return
        from stapo.core.async_rollout import off_policy_step

        st.off_policy = off_policy_step(self.run, st.kept, st.batch, st.old_lp, st.step, st.temperature)
        st.metrics.update(st.off_policy.metrics if st.off_policy is not None else {})

    def after_sync(self, st: StepState) -> None:
        if self.learner is not None:
            self.learner.publish(st.step)  # version `step` to the producer

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()


class SamplerHook(LoopHook):
    """The prompt sampler's end of step (Goldilocks: the teacher's update and metrics, every rank) and
    its state on resume. The sampler itself is ``run.sampler`` (the loop's sampling asks it)."""

    name: ClassVar[str] = "sampler"

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def on_batch(self, st: StepState) -> None:
        st.metrics.update(self.sampler.end_step(st.step))

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
    from stapo.core.deep_grpo import DeepGRPO

    return DeepGRPO(run.cfg, run) if run.cfg.algorithm.deep_grpo.enabled else None


@register_hook("regularizers")
def _regularizers_hook(run: Any) -> LoopHook | None:
    return StepExtras(run.cfg, run.backend)
