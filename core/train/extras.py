"""The run's hooks, assembled: the stability layers, the async, sampler and S2T-watch hooks and
their registration (``stapo.core.train.hooks`` holds the interface, the registry and :data:`HOOK_ORDER`,
the one order every phase runs in)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

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
from stapo.core.train.checkpoint import legacy_hook_state
from stapo.core.train.hooks import HOOKS, Hooks, LoopHook, StepState, build_hooks, register_hook
from stapo.core.train.off_policy import off_policy_step
from stapo.core.train.reference import ReferencePolicy, minp_stats_batched
from stapo.core.train.s2t_watch import RateWatch, candidate_counts, cannot_act, describe_thresholds
from stapo.core.trainer.distributed import DataParallel

__all__ = [
    "HOOKS", "Hooks", "KLInReward", "KLReference", "LoopHook", "LpReg", "OverlongFilter", "StareController",
    "StepState", "build_hooks", "legacy_hook_state", "register_hook",
]


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
