"""The policy update: one implementation, padding-free micro-batches, statistics from the gradient forward.

The loop builds one :class:`Actor` per run (config, trainer backend, the run's hooks) and calls
``actor.update(UpdateInputs(batch, old_lp, old_ent, step, ...))`` once per step; the actor owns the
micro-batching, the token weights, the loss, the diagnostics and the optimizer steps, and returns
the update's metrics. One step's update, for every weighting x policy loss x aggregation::

    old pass     (no grad, only where needed: see needs_old_pass) -> pi_old log-probs, step entropies
    for each PPO epoch, for each optimizer mini-batch (one global permutation, all ranks in lockstep):
        micro-batches   rows packed into token-budget forwards (trainer.micro_batch_tokens) or
                        fixed row counts (trainer.micro_batch_size), same count on every rank
        weights first?  a weighting that reads no statistics (registry: reads_stats=False, e.g. `none`)
                        gets its weights and the GLOBAL normalizer from the mask before any forward:
                        each micro-batch runs forward+backward at once (fused LM-head loss where the
                        policy loss is elementwise);
        stats first?    a weighting that reads p / H (s2t, top_entropy, stare) or an additive term
                        that does (Lp-Reg's selection) needs the whole mini-batch's statistics for its
                        thresholds and normalizer: every micro-batch's gradient forward runs first and
                        its graph is KEPT until the weights are known, then each is backpropagated.
                        p and H come from that forward itself: no separate no-grad pass.
        bounded?        the same weighting when the kept graphs would not fit the GPU
                        (``trainer.update_memory: bounded``, or ``auto`` where the memory plan of
                        stapo.core.train.plan says so): a no-grad statistics pass over the mini-batch's
                        micro-batches gives the weights, then each micro-batch runs forward +
                        backward at once, one graph alive (one extra forward per micro-batch).
        optimizer step  (after the contributions' rows: DEEP-GRPO's local loss)

**When a no-grad pass runs** (:func:`needs_old_pass`): the ratio pi_theta / pi_old needs pi_old on
every mini-batch after the first, so an off-policy update (``ppo_epochs * mini_batches > 1``) runs
ONE no-grad pass over the step batch before any gradient forward. So does a step whose extras read
the sampling policy's statistics before the update (the KL penalty and its metric, Lp-Reg's proxy,
STARE's controller). Nothing else runs a no-grad policy forward in the update: an on-policy update (1 epoch, 1 mini-batch)
runs none, its ratio is exp(lp - sg(lp)) = 1 with gradient d lp (tests/unit/test_update.py counts).

**Packing** (``trainer.micro_batch_tokens``): a mini-batch's rows (each: its prompt + response
tokens, no padding) go into forwards of at most that many tokens, longest first, each into the first
forward with room (first-fit decreasing; a row longer than the budget gets a forward of its own).
A packed forward is ONE row of concatenated sequences whose position ids restart at 0 at each
sequence (:func:`stapo.core.trainer.base.model_inputs`: no 2-D mask, the sequence boundaries as
``cu_seq_lens``; attention runs per sequence with ``sdpa_varlen``, our default when packing, and
with flash-attention's varlen kernels: :mod:`stapo.core.trainer.attention`).
Per-token results go back to the batch's [rows, L] layout (``Micro.to_rows``, an index_put that
keeps the graph), so weightings, losses and aggregations see exactly the tensors of the padded
path, and every aggregation's global normalizer stays exact under any packing and rank count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from stapo.core.algos import (
    TokenContext,
    compute_policy_objective,
    fractions_from_counts,
    get_aggregation,
    phase_cells,
    policy_loss_spec,
    quantile,
    s2t_tau_h,
    token_counts,
    token_weighting_spec,
)
from stapo.core.algos.objective import per_token_objective
from stapo.core.batch import Batch, derive_seed, mean_or_nan
from stapo.core.config import Config
from stapo.core.train.hooks import Contribution, ExtraRows, Hooks
from stapo.core.train.micro import Micro, MicroSpec, micro_batches, micro_spec, row_slices
from stapo.core.train.off_policy import MinVarianceBaseline, OffPolicyStep, with_row_advantages
from stapo.core.trainer.distributed import DataParallel, check_minibatches, group_minibatches, minibatch_rows

if TYPE_CHECKING:
    from stapo.core.trainer.base import TrainerBackend

__all__ = [
    "Actor",
    "Contribution",
    "ExtraRows",
    "UpdateInputs",
    "UpdateRecord",
    "UpdateParts",
    "add_loss_sums",
    "loss_sums",
    "needs_old_pass",
    "step_entropies",
    "step_p05",
    "update_diagnostics",
    "update_metrics",
    "update_parts",
]

# ----------------------------------------------------------------------------- the configured parts


def weighting_params(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of the configured token weighting: what its options model gives."""
    options = cfg.algorithm.token_weighting_options()
    return options.arguments() if options is not None else {}


def policy_loss_params(cfg: Config) -> dict[str, Any]:
    """Extra keyword arguments of the configured policy loss: what its registration's options model
    gives (``algorithm.maspo`` for ``maspo``), beyond the clip ranges every loss gets."""
    options = cfg.algorithm.policy_loss_options()
    return options.arguments() if options is not None else {}


def stats_temperature(cfg: Config) -> float:
    """Log-probs and entropies are those of the sampling policy: logits / T (T=0 means greedy: 1)."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


@dataclass(frozen=True)
class UpdateParts:
    """The configured pieces of an update, resolved once from the registries, with what they read."""

    weigh: Any  # the TOKEN_WEIGHTS entry's function
    loss_fn: Any  # the POLICY_LOSSES entry's function
    agg: Any  # AGGREGATIONS entry
    params: dict[str, Any]  # the weighting's keywords
    loss_kw: dict[str, Any]  # the policy loss's keywords
    spec: MicroSpec
    temperature: float
    reads_stats: bool  # the weighting reads p / H (registry declaration)
    fused: bool  # fused LM-head loss possible (elementwise loss, no entropy gradient, switched on)


def update_parts(cfg: Config, extra_params: dict[str, Any] | None = None) -> UpdateParts:
    a = cfg.algorithm
    spec, loss = token_weighting_spec(a.token_weighting), policy_loss_spec(a.policy_loss)
    return UpdateParts(
        weigh=spec.fn,
        loss_fn=loss.fn,
        agg=get_aggregation(a.aggregation),
        params={**weighting_params(cfg), **(extra_params or {})},
        loss_kw={"eps_low": a.eps_low, "eps_high": a.eps_high, "dual_clip_c": a.dual_clip_c, **policy_loss_params(cfg)},
        spec=micro_spec(cfg),
        temperature=stats_temperature(cfg),
        reads_stats=spec.reads_stats,
        fused=cfg.trainer.fused_loss and loss.elementwise and not cfg.trainer.entropy_grad,
    )


def needs_old_pass(cfg: Config, extras_need_stats: bool = False) -> bool:
    """Whether a step runs the no-grad pass over its batch before the update (module docstring)."""
    a = cfg.algorithm
    return a.ppo_epochs * a.mini_batches > 1 or extras_need_stats


# ----------------------------------------------------------------------------- the update


@dataclass(frozen=True)
class UpdateInputs:
    """One step's update, as the loop hands it over (verl's ``DataProto`` to ``update_policy``).

    ``old_lp`` / ``old_ent`` [N, L]: the no-grad pass's statistics (the sampling policy,
    :meth:`Actor.old_stats`), or None for an on-policy update without one (:func:`needs_old_pass`).
    ``counts``: every rank's number of real rows under data parallelism (this rank's batch then ends
    with one zero-weight padding row when it has more rows than ``counts[rank]``); None: one process,
    every row real. ``record``: where the update stores its token weightings per row for the token
    dump. ``contributions``: terms that add rows to optimizer steps (:class:`Contribution`: DEEP-GRPO's
    local loss). ``off_policy`` (``stapo.core.train.off_policy.OffPolicyStep``), for stale asynchronous
    rows: the loss sees each token's weight times its behaviour weight sg[pi_prox / mu] (AReaL's
    decoupled objective, with ``old_lp`` the proximal policy), the diagnostics the weighting's own
    output, every optimizer step runs at VCPO's ESS-scaled LR (``backend.step(lr_scale=...)``), and
    with VCPO's baseline each mini-batch's advantages are the baseline's at the weights it starts
    from (the batch's own stay as they are).
    """

    batch: Batch
    old_lp: torch.Tensor | None  # [N, L]
    old_ent: torch.Tensor | None  # [N, L]
    step: int
    counts: Sequence[int] | None = None
    record: UpdateRecord | None = None
    contributions: Sequence[Contribution] = ()
    off_policy: OffPolicyStep | None = None


class Actor:
    """Every pass over the policy, end to end (verl's ``DataParallelPPOActor`` as the model, which owns
    ``compute_log_prob`` and ``update_policy``): built once per run from the config, the trainer backend
    and the run's hooks (``stapo.core.train.extras.build_hooks``, in ``stapo.core.train.hooks.HOOK_ORDER``; the update asks them for the in-update
    phases: the weighting's live keywords, the additive per-token terms and whether those read p).
    :meth:`old_stats` is the no-grad pass, :meth:`distribution` the token dump's and calibrate's,
    :meth:`update` the step's update; all micro-batch through ``stapo.core.train.micro``."""

    def __init__(self, cfg: Config, backend: TrainerBackend, hooks: Hooks | None = None) -> None:
        self.cfg, self.backend = cfg, backend
        self.hooks = hooks if hooks is not None else Hooks()  # none: calibrate, benchmarks
        self.spec = micro_spec(cfg)
        self.temperature = stats_temperature(cfg)

    def forwards(self, batch: Batch, counts: Sequence[int] | None = None) -> list[Micro]:
        """The forwards of a pass over this rank's real rows of ``batch`` (the same count on every rank
        under data parallelism: ``counts`` as in :class:`UpdateInputs`)."""
        dp = DataParallel(self.backend)
        pad_row = _pad_row(batch, counts, dp.rank)
        real = batch.input_ids.shape[0] if pad_row is None else pad_row
        return micro_batches(batch, [torch.arange(real)], self.spec, dp=dp, pad_row=pad_row)[0]

    def old_stats(self, batch: Batch, counts: Sequence[int] | None = None, *,
                  micros: list[Micro] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """No-grad log-probs and entropies [N, L] of the batch's rows under the current policy at the
        sampling temperature (the old pass: pi_old of an off-policy update, the statistics extras read).
        ``counts`` as in :class:`UpdateInputs`; ``micros``: :meth:`forwards` of the batch, when the
        caller holds them already."""
        lp_all = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)  # [N, L]
        ent_all = torch.zeros_like(lp_all)  # [N, L]
        for m in micros if micros is not None else self.forwards(batch, counts):
            lp_all[m.rows], ent_all[m.rows] = _nograd_stats(self.backend, m, self.temperature)
        return lp_all, ent_all

    def distribution(self, batch: Batch, rows: Sequence[int], *, top_k: int = 0,
                     pad: bool = False) -> dict[str, torch.Tensor]:
        """The full distribution's statistics of ``rows`` under the current policy at the sampling
        temperature, one no-grad forward per micro-batch (``backend.token_distribution``): ``logprobs``,
        ``entropy``, ``sum_q2`` and with ``top_k`` ``top_prob`` / ``top_ids``, each [len(rows), L, ...]
        in the order of ``rows``. ``pad``: the batch ends with this rank's padding row, and every rank
        makes the busiest rank's number of forwards (data parallel)."""
        dp = DataParallel(self.backend)
        pad_row = batch.input_ids.shape[0] - 1 if pad and dp.multi else None
        (micros,) = micro_batches(batch, [torch.tensor(list(rows), dtype=torch.long)], self.spec,
                                  dp=dp if pad else None, pad_row=pad_row)
        where = {r: i for i, r in enumerate(rows)}
        out: dict[str, torch.Tensor] = {}
        for m in micros:
            dist = self.backend.token_distribution(m.input_ids, m.attention_mask, m.response_mask,
                                                   temperature=self.temperature, top_k=top_k,
                                                   position_ids=m.position_ids)
            for k, v in dist.items():
                v = m.to_rows(v.detach())  # [b, L, ...]
                if k not in out:
                    out[k] = torch.zeros((len(rows), *v.shape[1:]), dtype=v.dtype, device=batch.input_ids.device)
                if not m.padding:  # (padding-row forwards carry nothing)
                    out[k][torch.tensor([where[r] for r in m.rows.tolist()])] = v.to(out[k].device)
        return out

    def update(self, inputs: UpdateInputs) -> dict[str, float]:
        """K mini-batch updates with the configured token weighting, loss and aggregation -> metrics.

        Data parallel (``inputs.counts``): mini-batches come from one global permutation and every
        rank runs, per mini-batch, the busiest rank's number of micro-batches (extra ones on the
        padding row), so collectives stay in lockstep.

        Diagnostics are the update's own: at every mini-batch the weighting's output is counted
        (global) and, with ``inputs.record``, stored per row for the token dump.
        ``stapo/candidates``, ``stapo/silenced_count`` and the phase cells sum over every mini-batch
        of every PPO epoch; ``stapo/tau_h`` is the mean of the mini-batches' tau_h^(q) (S2T's rule,
        computed for the diagnostics under any weighting; mini-batches without a candidate have none).
        """
        cfg, backend, hooks = self.cfg, self.backend, self.hooks
        batch, old_lp, old_ent, step = inputs.batch, inputs.old_lp, inputs.old_ent, inputs.step
        record, off_policy = inputs.record, inputs.off_policy
        a = cfg.algorithm
        parts = update_parts(cfg, hooks.weighting_params())  # STARE: the scheduled W, M
        if old_lp is None and a.ppo_epochs * a.mini_batches > 1:
            raise ValueError("update: an off-policy update (ppo_epochs * mini_batches > 1) needs old_lp")
        dp = DataParallel(backend)
        n = batch.input_ids.shape[0]
        counts = [n] if inputs.counts is None else [int(c) for c in inputs.counts]
        pad_row = _pad_row(batch, inputs.counts, dp.rank)
        check_minibatches(sum(counts), a.mini_batches)
        gather, reduce = backend.all_gather_1d, backend.all_reduce_sum
        p05 = None  # the step's 5th entropy percentile under the sampling policy (a logged diagnostic)
        if old_ent is not None:
            p05 = step_p05(old_ent, batch.response_mask, gather)
        reads = parts.reads_stats or hooks.terms_read_stats
        bounded = reads and cfg.trainer.update_memory == "bounded"  # "auto" was resolved by the memory plan
        keep_graphs = reads and not bounded
        diag: dict[str, float] = {}
        taus: list[float] = []
        sums = loss_sums()
        step_out: list[dict[str, float]] = []
        dev = batch.input_ids.device
        mode = _Mode(keep_graphs=keep_graphs, bounded=bounded, fused=parts.fused and not keep_graphs)

        for epoch in range(a.ppo_epochs):
            gen = torch.Generator().manual_seed(derive_seed(cfg.trainer.seed, step, epoch))
            baseline = off_policy.baseline if off_policy is not None else None  # VCPO's: whole groups per mini-batch
            rows = (group_minibatches(baseline.groups, a.mini_batches, gen) if baseline is not None
                    else minibatch_rows(counts, dp.rank, a.mini_batches, gen))
            plan = micro_batches(batch, rows, parts.spec, dp=dp, pad_row=pad_row)
            for mb_index, micros in enumerate(plan):
                mb_rows = torch.cat([m.rows for m in micros]).to(dev)  # [n_mb] batch rows, real ones first
                n_real = sum(int(m.rows.numel()) for m in micros if not m.padding)
                adv = batch.advantages[mb_rows]  # [n_mb, L]
                if baseline is not None:  # VCPO: this mini-batch's advantages at the current weights
                    adv = with_row_advantages(adv, batch.response_mask[mb_rows],
                                              self.baseline_advantages(baseline, batch, mb_rows[:n_real].tolist(),
                                                                       old_lp, parts))
                mb = MiniBatch(parts, parts.params, adv, batch.response_mask[mb_rows],
                               old_lp[mb_rows] if old_lp is not None else None, gather, reduce, a.entropy_coef,
                               seed=derive_seed(cfg.trainer.seed, step, epoch, mb_index, 0x52), rank=dp.rank)
                ctx, tw = self._minibatch(micros, mb, mode, sums,
                                          weigh=(lambda tw, r=mb_rows: off_policy.weigh(tw, r)) if off_policy is not None
                                          else None,
                                          terms=lambda c, r=mb_rows: hooks.terms(c, r, old_lp))
                if p05 is None:  # no old pass: this (only) mini-batch's forward saw the sampling policy
                    p05 = step_p05(ctx.entropy, ctx.mask, gather)
                tau_mb = update_diagnostics(cfg, ctx, tw, diag)
                taus.append(tau_mb)
                if record is not None:
                    record.put(epoch, mb_index, mb_rows[:n_real], ctx, tw, tau_mb, a.s2t.tau_p)
                for c in inputs.contributions:  # e.g. DEEP-GRPO: lambda * local branch loss joins this step
                    self.contribute(c, len(step_out), parts)
                step_out.append(backend.step(lr_scale=off_policy.take_lr_scale() if off_policy is not None else 1.0))
        # Global, like every logged metric: each rank's loss is its share of the global objective (the
        # normalizer is all-reduced), so the ranks' losses and clip counts add up (one gather, every rank).
        keys = ("loss", "clip_low", "clip_high", "tokens", "ratio_sum")
        sums = dict(zip(keys, dp.sum([sums[k] for k in keys]), strict=True))
        return update_metrics(diag, taus, float("nan") if p05 is None else p05, sums, step_out, a.ppo_epochs)

    def row_grad_sq_norms(self, batch: Batch, rows: Sequence[int], old_lp: torch.Tensor, weights: torch.Tensor,
                          parts: UpdateParts) -> torch.Tensor:
        """||g_i||^2 of each of ``rows`` at the CURRENT weights -> [len(rows)] float64, g_i the gradient
        of weights[i] * sum_t l_t(A = 1): the configured per-token policy loss at advantage 1 (ratio to
        ``old_lp`` [N, L]) summed over row i's response tokens (VCPO's baseline reads it:
        ``stapo.core.train.off_policy.MinVarianceBaseline``). One forward per row (a micro-batch of one
        row from :func:`stapo.core.train.micro.micro_batches`: one gradient per row), each taken with
        ``torch.autograd.grad``, so the gradients the update accumulates are untouched. A pass only
        this rank makes (no lockstep)."""
        params = [p for p in self.backend.model.parameters() if p.requires_grad]
        out = torch.zeros(len(rows), dtype=torch.float64)  # [b]
        (micros,) = micro_batches(batch, [torch.tensor(list(rows), dtype=torch.long)], MicroSpec(rows=1))
        for j, m in enumerate(micros):
            lp, _ = self.backend.token_stats(m.input_ids, m.attention_mask, m.response_mask, grad=True,
                                             temperature=parts.temperature, position_ids=m.position_ids)
            lp = m.to_rows(lp)  # [1, L]
            mask = batch.response_mask[m.rows]  # [1, L]
            ones = torch.ones_like(lp)  # [1, L] advantage 1
            per_tok, _ = parts.loss_fn(lp, old_lp[m.rows].to(lp.dtype), ones, mask, **parts.loss_kw)  # [1, L]
            loss = float(weights[j]) * torch.where(mask, per_tok, torch.zeros_like(per_tok)).sum()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            out[j] = sum(float(g.double().square().sum()) for g in grads if g is not None)
        return out

    def baseline_advantages(self, baseline: MinVarianceBaseline, batch: Batch, rows: list[int],
                            old_lp: torch.Tensor, parts: UpdateParts) -> torch.Tensor:
        """VCPO's advantages [len(rows)] of one mini-batch's real ``rows`` at the current weights: the
        baseline's function of the rows' gradient norms (:meth:`row_grad_sq_norms`)."""
        t0 = time.time()
        g2 = self.row_grad_sq_norms(batch, rows, old_lp, baseline.grad_weights(rows), parts)  # [b]
        return baseline.advantages(rows, g2, seconds=time.time() - t0)

    def contribute(self, c: Contribution, update: int, parts: UpdateParts | None = None) -> None:
        """Add a contribution's rows for optimizer step ``update`` to the accumulated gradient through
        the mini-batch pass (no additive terms, no entropy bonus, no fused path: the term's own
        objective), then tell it their cost. :meth:`update` calls it before each optimizer step."""
        parts = parts if parts is not None else update_parts(self.cfg, self.hooks.weighting_params())
        extra = c.rows(update)
        if extra is None:
            return
        idx = torch.cat([m.rows for m in extra.micros]).to(extra.batch.input_ids.device)  # [b] in forward order
        mb = MiniBatch(parts, parts.params, extra.batch.advantages[idx], extra.batch.response_mask[idx],
                       extra.old_lp[idx], self.backend.all_gather_1d, self.backend.all_reduce_sum,
                       seed=extra.seed, rank=DataParallel(self.backend).rank)
        sums = loss_sums()
        self._minibatch(extra.micros, mb, _Mode(keep_graphs=parts.reads_stats, bounded=False, fused=False), sums,
                        scale=extra.scale)
        c.done(update, sums["loss"], float(mb.mask.sum()))

    def _minibatch(self, micros: list[Micro], mb: MiniBatch, mode: _Mode, sums: dict[str, float], *,
                   weigh: Callable[[Any], Any] | None = None, terms: Callable[[Any], list[Any]] | None = None,
                   scale: float = 1.0) -> tuple[Any, Any]:
        """One optimizer mini-batch's forwards and backwards (``mb``'s rows in ``micros``' order) ->
        (TokenContext at the forwards' p and H, the weighting's TokenWeights). ``weigh``: the loss's
        weights from the weighting's (async's behaviour weights); ``terms``: the additive per-token
        terms at a context; ``scale``: the loss's factor. The loss sums go to ``sums``."""
        backend, p = self.backend, mb.parts
        slices = row_slices(micros)
        dev = mb.mask.device

        def forward(m: Micro) -> tuple[torch.Tensor, torch.Tensor]:
            lp, ent = backend.token_stats(m.input_ids, m.attention_mask, m.response_mask, grad=True,
                                          temperature=p.temperature, position_ids=m.position_ids)
            return m.to_rows(lp), m.to_rows(ent)  # [b, L] each, graph kept

        def scaled(loss: torch.Tensor) -> torch.Tensor:
            return loss if scale == 1.0 else scale * loss

        if mode.keep_graphs:  # statistics first: every forward's graph kept until the weights are known
            graphs = [forward(m) for m in micros]
            ctx, tw, norm = mb.weights(torch.cat([g[0].detach() for g in graphs]),
                                       torch.cat([g[1].detach() for g in graphs]))
            tw_loss = weigh(tw) if weigh is not None else tw
            ts = terms(ctx) if terms is not None else []
            losses = []
            for sl, (lp, ent) in zip(slices, graphs, strict=True):
                loss, mets = mb.loss(sl, lp, ent, tw_loss, norm, ts)
                losses.append(scaled(loss))
                add_loss_sums(sums, losses[-1], mets)
            # ONE backward through every kept graph: a backend pairs each backward with the forwards
            # before it (DeepSpeed's micro-step bookkeeping; ZeRO-3 re-gathers parameters for it)
            backend.backward(torch.stack(losses).sum())
            del graphs, losses
            return ctx, tw
        # weights first (from the mask alone, or bounded: a no-grad statistics pass), then each
        # micro-batch forward + backward at once
        if mode.bounded:
            stats = [_nograd_stats(backend, m, p.temperature) for m in micros]
            ctx0, tw, norm = mb.weights(torch.cat([s[0] for s in stats]), torch.cat([s[1] for s in stats]))
            del stats
        else:
            zeros = torch.zeros(mb.mask.shape, dtype=torch.float32, device=dev)
            ctx0, tw, norm = mb.weights(zeros, zeros)
        tw_loss = weigh(tw) if weigh is not None else tw
        ts = terms(ctx0) if terms is not None else []
        lps: list[torch.Tensor] = []
        ents: list[torch.Tensor] = []
        for m, sl in zip(micros, slices, strict=True):
            if mode.fused:
                loss, lp, ent = mb.fused(backend, m, sl, tw_loss, norm, ts)
                with torch.no_grad():  # the clip metrics, from the pass's own (detached) log-probs
                    old = mb.old[sl] if mb.old is not None else lp
                    _, mets = p.loss_fn(lp, old, mb.adv[sl], mb.mask[sl], **p.loss_kw)
            else:
                lp, ent = forward(m)
                loss, mets = mb.loss(sl, lp, ent, tw_loss, norm, ts)
            loss = scaled(loss)
            backend.backward(loss)
            add_loss_sums(sums, loss, mets)
            lps.append(lp.detach().float())
            ents.append(ent.detach().float())
        return mb.context(torch.cat(lps), torch.cat(ents)), tw


@dataclass(frozen=True)
class _Mode:
    """How a mini-batch's gradient forwards run (module docstring): graphs kept until the weights are
    known, bounded (a no-grad statistics pass first), or fused (the LM head's gradient in the forward)."""

    keep_graphs: bool
    bounded: bool
    fused: bool


def _pad_row(batch: Batch, counts: Sequence[int] | None, rank: int) -> int | None:
    """This rank's zero-weight padding row (the batch's last) when it holds more rows than its real
    ones (``counts[rank]``, data parallel), else None."""
    n = batch.input_ids.shape[0]
    return counts[rank] if counts is not None and n > counts[rank] else None


def _nograd_stats(backend: TrainerBackend, m: Micro, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad log-probs and entropies of one micro-batch in batch layout [b, L] each (float32)."""
    lp, ent = backend.token_stats(m.input_ids, m.attention_mask, m.response_mask, grad=False,
                                  temperature=temperature, position_ids=m.position_ids)
    dev = m.response_mask.device
    return m.to_rows(lp.detach().float().to(dev)), m.to_rows(ent.detach().float().to(dev))


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer mini-batch's constants [n_mb, L] (rows in micro-batch order) and its loss."""

    parts: UpdateParts
    params: dict[str, Any]  # the weighting's keywords for this update
    adv: torch.Tensor  # [n_mb, L]
    mask: torch.Tensor  # [n_mb, L] bool
    old: torch.Tensor | None  # [n_mb, L] pi_old log-probs, None: on-policy (old = sg(lp))
    gather: Callable[[torch.Tensor], torch.Tensor]
    reduce: Callable[[torch.Tensor], torch.Tensor]
    entropy_coef: float = 0.0
    seed: int | None = None  # the weighting's own randomness for this mini-batch (S2T's random ablation)
    rank: int = 0

    def context(self, lp: torch.Tensor, ent: torch.Tensor) -> Any:
        return TokenContext(logprobs=lp, entropy=ent, advantages=self.adv, mask=self.mask, gather=self.gather,
                            all_reduce_sum=self.reduce, seed=self.seed, rank=self.rank)

    def weights(self, lp: torch.Tensor, ent: torch.Tensor) -> tuple[Any, Any, Any]:
        """(TokenContext, TokenWeights, GLOBAL normalizer) of the mini-batch at (lp, ent)."""
        ctx = self.context(lp, ent)
        tw = self.parts.weigh(ctx, **self.params)
        return ctx, tw, self.reduce(self.parts.agg.normalizer(tw, self.mask))

    def loss(self, sl: slice, lp: torch.Tensor, ent: torch.Tensor, tw: Any, norm: Any,
             terms: list[Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batch ``sl``'s share of the mini-batch loss from its log-probs with graph [b, L]."""
        p = self.parts
        old = self.old[sl] if self.old is not None else lp.detach()
        # the entropy bonus needs trainer.entropy_grad (checked by the config)
        return compute_policy_objective(lp, old, self.adv[sl], self.mask[sl], tw.select(sl),
                                        policy_loss=p.loss_fn, aggregation=p.agg, normalizer=norm,
                                        loss_kwargs=p.loss_kw, terms=[t.rows(sl) for t in terms], entropy=ent,
                                        entropy_coef=self.entropy_coef)

    def fused(self, backend: TrainerBackend, m: Micro, sl: slice, tw: Any, norm: Any,
              terms: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One ``backend.token_loss`` call: loss = sum_i coef_i * (l_i(logp_i) + terms_i), where
        coef_i = d(aggregate)/d(l_i) is taken once by autograd on a ones tensor (every aggregation
        is linear in the per-token losses), so the LM head's gradient is formed inside the chunked
        forward. Returns (loss, logprobs [b, L], entropy [b, L]), the last two detached."""
        p = self.parts
        x = torch.ones(self.mask[sl].shape, dtype=torch.float32, device=self.mask.device, requires_grad=True)
        with torch.enable_grad():
            (coef,) = torch.autograd.grad(p.agg.aggregate(x, tw.select(sl), normalizer=norm), x, allow_unused=True)
        coef = torch.zeros_like(x) if coef is None else coef.detach()  # [b, L]
        fwd = m.to_forward
        old_f = fwd(self.old[sl]).reshape(-1) if self.old is not None else None
        adv_f, mask_f, coef_f = fwd(self.adv[sl]).reshape(-1), fwd(self.mask[sl]).reshape(-1), fwd(coef).reshape(-1)
        terms_f = [replace(t, target=fwd(t.target[sl]), coef=fwd(t.coef[sl])) for t in terms]
        loss_fn, loss_kw = p.loss_fn, p.loss_kw

        def token_loss_fn(lp: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            lp2 = lp.unsqueeze(0)  # [1, n]: the registered loss works on [B, T] tensors
            old = old_f[idx].unsqueeze(0).to(lp.dtype) if old_f is not None else lp2.detach()
            per_tok, _ = per_token_objective(lp2, old, adv_f[idx].unsqueeze(0), mask_f[idx].unsqueeze(0),
                                             policy_loss=loss_fn, loss_kwargs=loss_kw,
                                             terms=[t.flat(idx) for t in terms_f])
            per_tok1 = per_tok[0]  # [n]
            c = coef_f[idx].to(per_tok1.dtype)  # [n]
            return torch.where(c != 0, c * per_tok1, torch.zeros_like(c))  # as aggregate: 0 where w == 0

        loss, lp, ent = backend.token_loss(m.input_ids, m.attention_mask, m.response_mask, token_loss_fn,
                                           temperature=p.temperature, position_ids=m.position_ids)
        return loss, m.to_rows(lp.detach().float()), m.to_rows(ent.detach().float())



# ----------------------------------------------------------------------------- the update's diagnostics


def step_entropies(old_ent: torch.Tensor, mask: torch.Tensor,
                   gather: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """Every valid response token's entropy in the step's GLOBAL batch [n_valid] (one all_gather)."""
    with torch.no_grad():
        local = old_ent.detach()[mask.bool()]  # [n_valid]
        return gather(local) if gather is not None else local


def step_p05(ent: torch.Tensor, mask: torch.Tensor,
             gather: Callable[[torch.Tensor], torch.Tensor] | None) -> float:
    """The 5th percentile of every valid response token's entropy in the step's GLOBAL batch
    (``entropy/p05``, a diagnostic of how peaked the policy is). One all_gather, on every rank."""
    return quantile(step_entropies(ent, mask, gather), 0.05)


def update_diagnostics(cfg: Config, ctx: Any, tw: Any, diag: dict[str, float]) -> float:
    """Add one mini-batch's global token counts (from the weighting's own output) to ``diag``;
    returns the tau_h of the phase cells: the S2T weighting's own, else the paper's tau_h^(q) of this
    mini-batch at ``algorithm.s2t`` (what S2T would use here), so every weighting logs the same cells."""
    s2t = cfg.algorithm.s2t
    tau = tw.info.get("tau_h")
    if tau is None:
        tau = s2t_tau_h(ctx.logprobs, ctx.entropy, ctx.advantages, ctx.mask, tau_p=s2t.tau_p, q=s2t.q,
                        gather=ctx.gather)
    for k, v in token_counts(ctx, tw, tau_p=s2t.tau_p, tau_h=float(tau)).items():
        diag[k] = diag.get(k, 0.0) + v
    return float(tau)


@dataclass
class UpdateRecord:
    """What the update's own token weightings produced, per local row, for the token dump.

    ``weights[e, i]`` is the weight row i got in PPO epoch e (the weighting's output on the
    mini-batch that held row i, under the policy of that moment); ``tau_h[e, i]`` that mini-batch's
    entropy threshold.
    """

    weights: torch.Tensor  # [E, N, L]
    tau_h: torch.Tensor  # [E, N] float64 (NaN: the mini-batch had no candidate)
    cells: torch.Tensor  # [E, N, L] int8 phase cell (index into PHASE_KEYS) the update's counts used
    minibatch: torch.Tensor  # [E, N] int64 index of the optimizer mini-batch that held the row (-1: none)
    logprobs: torch.Tensor  # [E, N, L] float32 log p the weighting compared (its p is exp in float64)
    entropy: torch.Tensor  # [E, N, L] float32 H the weighting compared

    @staticmethod
    def empty(epochs: int, batch: Batch) -> UpdateRecord:
        n, L = batch.input_ids.shape
        return UpdateRecord(torch.ones(epochs, n, L), torch.full((epochs, n), float("nan"), dtype=torch.float64),
                            torch.full((epochs, n, L), -1, dtype=torch.int8),
                            torch.full((epochs, n), -1, dtype=torch.int64), torch.zeros(epochs, n, L),
                            torch.zeros(epochs, n, L))

    def put(self, epoch: int, minibatch: int, rows: torch.Tensor, ctx: Any, tw: Any, tau_h: float,
            tau_p: float) -> None:
        """Store what one mini-batch's weighting gave its first ``len(rows)`` rows (the real ones;
        padding rows come after them): applied weights, tau_h, and each token's phase cell."""
        k = len(rows)
        rows = rows.cpu()
        self.weights[epoch, rows] = tw.weights[:k].detach().float().cpu()
        self.tau_h[epoch, rows] = tau_h
        self.minibatch[epoch, rows] = minibatch
        self.cells[epoch, rows] = phase_cells(ctx, tau_p=tau_p, tau_h=tau_h)[:k].cpu()  # [k, L]
        self.logprobs[epoch, rows] = ctx.logprobs[:k].detach().float().cpu()
        self.entropy[epoch, rows] = ctx.entropy[:k].detach().float().cpu()


def loss_sums() -> dict[str, float]:
    """Empty running sums of one update's loss terms (``add_loss_sums`` fills, ``update_metrics`` reads)."""
    return {"loss": 0.0, "clip_low": 0.0, "clip_high": 0.0, "tokens": 0.0, "ratio_sum": 0.0}


def add_loss_sums(sums: dict[str, float], loss: torch.Tensor, m: dict[str, Any]) -> None:
    """Add one micro-batch's loss and its policy loss's counts to ``sums`` (both update paths)."""
    sums["loss"] += float(loss.detach())
    sums["clip_low"] += float(m["clip_low_count"])
    sums["clip_high"] += float(m["clip_high_count"])
    sums["tokens"] += float(m["token_count"])
    sums["ratio_sum"] += float(m["ratio_sum"])


def update_metrics(diag: dict[str, float], taus: Sequence[float], p05: float, sums: dict[str, float],
                   step_out: Sequence[dict[str, float]], epochs: int) -> dict[str, float]:
    """The update's logged metrics: token diagnostics counted from its own weightings (``diag``,
    summed over mini-batches and epochs), the thresholds it used, and the loss / clip sums and
    optimizer outputs (``step_out``: one per optimizer step), as :meth:`Actor.update` logs them."""
    tokens = max(sums["tokens"], 1.0)
    token_diag = fractions_from_counts(diag)
    token_diag["tokens/valid"] = diag["tokens"] / epochs  # every epoch sees each row once
    return {
        **token_diag,
        "stapo/candidates": diag["candidates"],
        "stapo/silenced_count": diag["silenced"],
        "stapo/tau_h": mean_or_nan([t for t in taus if math.isfinite(t)]),  # mini-batches with candidates
        "entropy/p05": p05,
        "actor/loss": sums["loss"] / len(step_out),
        "actor/grad_norm": mean_or_nan([o.get("grad_norm", float("nan")) for o in step_out]),
        "actor/lr": step_out[-1].get("lr", float("nan")),
        "actor/skipped_updates": float(sum(o.get("skipped", 0.0) for o in step_out)),
        "actor/clip_frac_low": sums["clip_low"] / tokens,
        "actor/clip_frac_high": sums["clip_high"] / tokens,
        "actor/ratio_mean": sums["ratio_sum"] / tokens,
    }
