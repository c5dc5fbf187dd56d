"""VCPO's corrections of one update on stale rows, and AReaL's behaviour weights applied to it.

The tensor formulas live in :mod:`stapo.core.algos.offpolicy`; this module binds them to one
update: which rows are stale (:func:`behaviour_logprobs`), the per-token behaviour weights and the
per-mini-batch ESS-scaled LR (:class:`OffPolicyStep`), and VCPO's minimum-variance baseline taken at
the current weights at the start of each optimizer mini-batch (:class:`MinVarianceBaseline`,
:func:`stapo.core.algos.offpolicy.grouped_min_variance_advantages`). It runs no pass over the policy: the actor
(``stapo.core.train.update.Actor``) takes the per-row gradient norms the baseline reads
(``Actor.row_grad_sq_norms``, through the one micro-batch iterator), gives each mini-batch the
advantages the baseline returns, and steps the backend at the multiplier this step hands it
(``backend.step(lr_scale=...)``). Nothing here knows where the rows came from: a row carries the
``version`` that sampled it and its ``behaviour_logprobs`` (asynchronous rollouts,
``stapo.core.rollout.async_rollout``, set both; ``stapo.core.train.async_hook.AsyncHook`` builds the step
with :func:`off_policy_step`); docs/async.md, "The update on stale rows".

Sources: VCPO, Huang et al. 2026, arXiv 2602.17616, and the authors' code
(github.com/mit-han-lab/vcpo: ``compute_ess_info``, ``compute_opob_baseline``,
``MegatronPPOActor.update_policy_per_traj``); AReaL, Fu et al. 2025, arXiv 2505.24298
(``ppo_actor_loss_fn``'s behaviour importance weight and its cap).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from stapo.core.algos.offpolicy import (
    behaviour_weights,
    effective_sample_size,
    ess_lr_scale,
    grouped_min_variance_advantages,
    ratio_stats,
    sequence_importance_weights,
    with_behaviour_weights,
)

__all__ = ["MinVarianceBaseline", "OffPolicyStep", "behaviour_logprobs", "off_policy_step",
           "with_row_advantages"]


@dataclass
class OffPolicyStep:
    """What one update needs to correct for stale rows: each token's behaviour weight (1 on rows the
    current weights sampled), each row's sequence importance weight, and VCPO's LR rule.

    The LR multiplier is taken **per optimizer step**, from the ESS of that step's mini-batch (the
    rows :meth:`weigh` was given), as the authors' code does: ``MegatronPPOActor`` calls
    ``compute_ess_info`` on each mini-batch's trajectory records in ``_optimizer_step_with_buffer``
    and scales that step's LR (github.com/mit-han-lab/vcpo, verl/workers/actor/megatron_actor.py).
    With one mini-batch it is the batch's ESS. Data parallel: the ESS sums are taken over every
    rank's rows of the mini-batch (``sum_ranks``), so every rank steps with the same LR.
    """

    token_weights: torch.Tensor  # [N, L] sg[pi_prox / mu], 0 outside responses and above the cap
    seq_weights: torch.Tensor  # [n] sequence importance weights of the real rows (1: on-policy row)
    base_metrics: dict[str, float]
    lr_rule: Any = None  # ESS / N -> LR multiplier (VCPO); None: the LR is left alone
    sum_ranks: Any = None  # list[float] -> element-wise sums over data-parallel ranks; None: one rank
    scales: list[float] = field(default_factory=list)  # the multipliers applied, one per optimizer step
    baseline: MinVarianceBaseline | None = None  # VCPO's baseline, taken per mini-batch by the update
    _next: float = 1.0

    def weigh(self, tw: Any, rows: torch.Tensor) -> Any:
        """The token weighting's output on mini-batch ``rows``, times the rows' behaviour weights;
        sets the LR multiplier of the optimizer step that follows (this mini-batch's ESS)."""
        self._next = self.minibatch_lr_scale(rows)
        w = self.token_weights[rows.to(self.token_weights.device)]  # [b, L]
        if w.shape[0] < tw.weights.shape[0]:  # zero-weight padding rows of a data-parallel plan
            w = torch.cat([w, torch.zeros_like(tw.weights[w.shape[0]:], dtype=w.dtype)])
        return with_behaviour_weights(tw, w.to(tw.weights.device))

    def minibatch_lr_scale(self, rows: torch.Tensor) -> float:
        """VCPO's multiplier for the mini-batch of ``rows`` (this rank's; padding rows ignored).
        Every rank calls it once per mini-batch: the ESS sums are global."""
        if self.lr_rule is None:
            return 1.0
        r = rows.cpu()
        w = self.seq_weights[r[r < self.seq_weights.shape[0]]]  # [b_real]
        reduce = None
        if self.sum_ranks is not None:
            def reduce(t: torch.Tensor) -> torch.Tensor:
                return torch.tensor(self.sum_ranks(t.tolist()), dtype=t.dtype)
        _, ratio = effective_sample_size(w, all_reduce_sum=reduce)
        return float(self.lr_rule(ratio))

    def take_lr_scale(self) -> float:
        """The LR multiplier of the optimizer step about to run (this mini-batch's, from :meth:`weigh`;
        1 without the rule), recorded for the metrics. The actor passes it to
        ``backend.step(lr_scale=...)``, which applies it to that one step only."""
        scale, self._next = self._next, 1.0
        self.scales.append(scale)
        return scale

    @property
    def metrics(self) -> dict[str, float]:
        """The step's off-policy statistics; after the update, the LR multipliers it applied (mean
        and minimum over optimizer steps; 1 before any step)."""
        sc = self.scales or [1.0]
        extra = self.baseline.metrics if self.baseline is not None else {}
        return {**self.base_metrics, **extra, "offpolicy/lr_scale": sum(sc) / len(sc), "offpolicy/lr_scale_min": min(sc)}


def behaviour_logprobs(seqs: list[Any], batch: Any, proximal: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, L] behaviour log-probs aligned with the batch, [N] bool stale rows).

    A row sampled by an older version than the weights this step starts from (``step - 1``) gets
    the log-probs recorded at generation; a row the current weights sampled gets the proximal
    log-probs themselves: its behaviour policy *is* the proximal policy, and the recorded values
    would only add the sampler's float noise (an exact 1 is what makes ``max_staleness=0`` the
    synchronous update).
    """
    beh = proximal.detach().clone()  # [N, L]
    stale = torch.zeros(proximal.shape[0], dtype=torch.bool)
    for i, s in enumerate(seqs):
        v = getattr(s, "version", None)
        if v is None or v >= step - 1:
            continue
        pos = batch.response_mask[i].nonzero().squeeze(1)  # [r] response positions, in order
        lp = torch.tensor(s.behaviour_logprobs, dtype=beh.dtype, device=beh.device)
        if lp.shape[0] != pos.shape[0]:
            raise ValueError(f"row {i}: {lp.shape[0]} behaviour log-probs for {pos.shape[0]} response tokens")
        beh[i, pos] = lp
        stale[i] = True
    return beh, stale


def with_row_advantages(adv: torch.Tensor, mask: torch.Tensor, rows_adv: torch.Tensor) -> torch.Tensor:
    """A new [b, L] advantage tensor: the first ``len(rows_adv)`` rows of ``adv`` [b, L] take
    ``rows_adv`` [k] on their response tokens (``mask`` [b, L]); the other tokens and rows (a
    data-parallel plan's padding rows) keep ``adv``'s values."""
    k = rows_adv.shape[0]
    out = adv.clone()  # [b, L]
    new = rows_adv.to(device=adv.device, dtype=adv.dtype).unsqueeze(1).expand_as(adv[:k])  # [k, L]
    out[:k] = torch.where(mask[:k], new, adv[:k])
    return out


@dataclass
class MinVarianceBaseline:
    """VCPO's minimum-variance baseline as the authors' code computes it (github.com/mit-han-lab/vcpo:
    ``MegatronPPOActor.update_policy_per_traj`` with ``grad_baselining``, ``compute_grad_info``,
    ``compute_opob_baseline``): at the start of each optimizer mini-batch, at the current weights,
    W_i = w_i^2 ||g_i||^2 (w_i unclipped; g_i the gradient of min(w_i, C) * sum_t l_t(A = 1), the
    configured per-token policy loss at advantage 1 summed over the row's response tokens, ratio to
    pi_prox: the authors' per-trajectory backward with ``rollout_is: sequence``, whose
    ``_compute_grad_norms`` undoes the token mean and the 1/N micro-batch scale),
    b = sum W R / sum W per group (every group whole in one mini-batch:
    ``stapo.core.trainer.distributed.group_minibatches``), and A_i = (R_i - b) / population std of the
    group's rewards (GRPO; unscaled where the std is <= 1e-8, and for Dr. GRPO). It applies to fresh
    batches too: with w = 1 it still weighs each sequence by its gradient norm.

    The actor takes ||g_i||^2 (``Actor.row_grad_sq_norms``, at :meth:`grad_weights`) and asks
    :meth:`advantages` for the mini-batch's advantages; the batch itself is never rewritten."""

    rewards: torch.Tensor  # [n] shaped rewards of the real rows
    groups: list[int]  # [n] prompt group of each row
    seq_weights: torch.Tensor  # [n] w_i = pi_prox / mu per sequence, unclipped (1 on fresh rows)
    is_cap: float  # C: the truncation of w_i inside g_i
    scale_by_std: bool
    group_adv: torch.Tensor  # [n] the group-mean advantages the baseline replaces (for the shift metric)
    shift: float = 0.0
    rows_done: int = 0
    time_s: float = 0.0

    def grad_weights(self, rows: list[int]) -> torch.Tensor:
        """min(w_i, C) of ``rows`` [len(rows)] float64: the factor of each row's loss inside g_i."""
        return self.seq_weights[rows].double().clamp(max=self.is_cap)

    def advantages(self, rows: list[int], grad_sq_norms: torch.Tensor, seconds: float = 0.0) -> torch.Tensor:
        """The advantages [len(rows)] (float64) of ``rows`` (one mini-batch's real rows, whole groups)
        from their ||g_i||^2 [len(rows)] at the current weights
        (:func:`stapo.core.algos.offpolicy.grouped_min_variance_advantages`);
        ``seconds``: what taking them cost, for ``time/baseline_s``."""
        for g in {self.groups[i] for i in rows}:
            if sum(1 for i in rows if self.groups[i] == g) != sum(1 for x in self.groups if x == g):
                raise ValueError("VCPO's baseline needs each group whole in one mini-batch")
        out = grouped_min_variance_advantages(self.rewards[rows], [self.groups[i] for i in rows],
                                              self.seq_weights[rows], grad_sq_norms, scale_by_std=self.scale_by_std)
        for i, a in zip(rows, out.tolist(), strict=True):
            self.shift += abs(a - float(self.group_adv[i]))
        self.rows_done += len(rows)
        self.time_s += seconds
        return out

    @property
    def metrics(self) -> dict[str, float]:
        return {"offpolicy/baseline_shift": self.shift / max(self.rows_done, 1), "time/baseline_s": self.time_s}


def off_policy_step(op: Any, seqs: list[Any], batch: Any, proximal: torch.Tensor, step: int, *,
                    scale_by_std: bool, dp: Any = None) -> OffPolicyStep | None:
    """The off-policy corrections of this step's update (None when every row is on-policy and no
    baseline is configured: the update is then exactly the synchronous one).

    ``op`` is the config's ``algorithm.off_policy``; ``scale_by_std`` whether the advantage divides
    by the group's std (``grpo``). Rows are ``seqs`` (this rank's real rows, in order). With
    ``min_variance_baseline`` the step carries VCPO's baseline (:class:`MinVarianceBaseline`): the
    update takes the rows' advantages from it at the start of each mini-batch, on fresh batches too. With data
    parallelism (``dp``: stapo.core.trainer.distributed.DataParallel) the decisions are global: whether
    any row is stale, the ESS and so the LR multiplier (a rank stepping with another LR would
    update its ZeRO partition differently), and the logged statistics.
    """
    n = len(seqs)
    mask = batch.response_mask[:n]
    beh, stale = behaviour_logprobs(seqs, batch, proximal, step)
    prox = proximal[:n]
    beh = beh[:n]
    w_seq = sequence_importance_weights(prox, beh, mask)  # [n]
    rs = ratio_stats(prox, beh, mask)
    local = [float(stale.sum()), float(n), rs["count"], rs["sum"], rs["k3_sum"]]
    n_stale, n_all, count, ratio_sum, k3_sum = dp.sum(local) if dp is not None else local
    if n_stale == 0 and not op.min_variance_baseline:
        return None
    peaks = [rs["max"], -rs["min"], float(w_seq.max()) if n else float("nan")]  # maxima, NaN on a rank without rows
    rows = dp.gather_rows(peaks) if dp is not None else [peaks]
    ratio_max, neg_ratio_min, w_max = (max((v for v in col if not math.isnan(v)), default=float("nan"))
                                       for col in zip(*rows, strict=True))
    sum_ranks = dp.sum if dp is not None else None
    reduce = None
    if sum_ranks is not None:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            return torch.tensor(sum_ranks(t.tolist()), dtype=t.dtype)
    ess, ess_ratio = effective_sample_size(w_seq, all_reduce_sum=reduce)  # the step's batch (logged)
    rule = (functools.partial(ess_lr_scale, rule=op.ess_rule, base_ratio=op.ess_base_ratio)
            if op.ess_lr_scaling else None)
    metrics = {
        "offpolicy/stale_frac": n_stale / n_all if n_all else 0.0,
        "offpolicy/ess": ess,
        "offpolicy/ess_ratio": ess_ratio,
        "offpolicy/ratio_mean": ratio_sum / max(count, 1.0),
        "offpolicy/ratio_max": ratio_max,
        "offpolicy/ratio_min": -neg_ratio_min,
        "offpolicy/kl_behaviour": k3_sum / max(count, 1.0),
        "offpolicy/seq_weight_max": w_max,
    }
    baseline = None
    if op.min_variance_baseline:
        baseline = MinVarianceBaseline(
            rewards=torch.tensor([s.reward for s in seqs], dtype=torch.float64), groups=[s.group for s in seqs],
            seq_weights=w_seq.detach().cpu(), is_cap=op.baseline_is_cap,
            scale_by_std=scale_by_std,
            group_adv=torch.tensor([s.advantage for s in seqs], dtype=torch.float64))
    token_w = torch.zeros_like(proximal)
    token_w[:n] = behaviour_weights(prox, beh, mask, cap=op.behaviour_weight_cap)
    return OffPolicyStep(token_w, w_seq, metrics, lr_rule=rule, sum_ranks=sum_ranks, baseline=baseline)
