"""The algorithm's per-run state beyond the policy, behind three short call sites in the loop.

``StepExtras`` holds what some recipes need and others do not:

- the frozen reference model (``algorithm.kl.reference: initial``) and each step's reference
  log-probs, for the KL penalty (in the loss, or in the reward with ``algorithm.kl.in_reward``);
- Lp-Reg's proxy log-probs of the sampled tokens (``algorithm.lp_reg.enabled``);
- STARE's closed-loop controller (gate and adaptive W, M), advanced once per step;
- DAPO's overlong filter (which rows of the step batch stay in the loss).

The loop calls, per step: ``loss_rows(seqs)`` (after collate), ``prepare(...)`` (after the old
log-probs: computes the step's constants and returns metrics such as ``actor/kl``), and inside
``update_policy`` ``weighting_params()`` / ``terms(ctx, rows)``. A recipe that uses none of these
costs nothing: every method is then a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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

__all__ = ["StepExtras", "extras_of"]


class StepExtras:
    """Reference model, Lp-Reg proxy, STARE schedule and overlong filter of one run."""

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

    @property
    def needs_old_stats(self) -> bool:
        """The step's extras read the sampling policy's statistics before the update (the KL
        penalty and its metric, Lp-Reg's proxy, STARE's controller): the step runs the no-grad pass."""
        a = self.cfg.algorithm
        return a.kl_coef > 0 or a.lp_reg.enabled or self.stare is not None

    @property
    def terms_read_stats(self) -> bool:
        """The additive terms read the current policy's p (Lp-Reg's selection): the update takes
        every micro-batch's statistics before the mini-batch's backward, as for such weightings."""
        return self.cfg.algorithm.lp_reg.enabled

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

    def terms(self, ctx: Any, rows: torch.Tensor, old_lp: torch.Tensor) -> list[TokenTerm]:
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


def extras_of(run: Any) -> StepExtras:
    """The run's StepExtras; a no-op one for run-like objects without (tests drive update_policy directly)."""
    ex = getattr(run, "extras", None)
    return ex if ex is not None else StepExtras(run.cfg, None)

