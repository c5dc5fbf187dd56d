"""The stability layers, each a loop hook switched on by its own config keys: DAPO's overlong filter,
the KL penalty toward a reference, Lp-Reg, STARE's controller and the KL charged to the reward. Each
registers itself here (``stapo.core.train.hooks``); :data:`stapo.core.train.hooks.HOOK_ORDER` places
them, KL before Lp-Reg (the update sums their terms in that order) and ``kl_in_reward`` last of them
(it reads the target ``kl_reference`` published and rewrites the advantages the others read)."""

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
from stapo.core.train.hooks import Added, LoopHook, StepState, register_hook
from stapo.core.train.reference import ReferencePolicy, minp_stats_batched

__all__ = ["KLInReward", "KLReference", "LpReg", "OverlongFilter", "StareController"]


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
    paper puts it). ``on_batch`` drops them from ``st.kept`` (its :class:`Added` ``keep``) before the
    global counts, so the mini-batch plan and the padding rows of every rank see the filtered batch."""

    name: ClassVar[str] = "overlong_filter"

    def keep(self, seqs: Sequence[Any]) -> torch.Tensor:
        """[N] bool: rows that stay in the loss."""
        return overlong_filter_keep([s.finish_reason for s in seqs])

    def on_batch(self, st: StepState) -> Added:
        return Added(keep=tuple(self.keep(st.kept).tolist()))


class KLReference(LoopHook):
    """The KL penalty toward a reference policy (``algorithm.kl_coef > 0``; ``algorithm.kl``).

    GRPO's beta * KL(pi || ref) (arXiv 2402.03300, eq. 3; verl ``use_kl_loss`` with
    ``kl_loss_type``): ``kl.reference: initial`` keeps a frozen copy of the policy as loaded (its
    log-probs of the step's batch are taken in ``before_update``, from the old pass's micro-batches),
    ``none`` takes the KL to the policy that sampled the batch. The per-token term
    ``kl_coef * k(logp, ref)`` joins the loss before aggregation (``terms``), unless
    ``kl.in_reward``: then :class:`KLInReward` charges it to the reward instead. It publishes the
    step's target (``Added.ref_lp``: ``st.ref_lp`` for the hooks after it) and logs ``actor/kl`` (the sampler's KL to the frozen reference).
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

    def before_update(self, st: StepState) -> Added | dict[str, float]:
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
        return Added(metrics=metrics, ref_lp=self.ref_lp)

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
    :class:`KLReference` returned this step) and the group advantages are computed again; the
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
