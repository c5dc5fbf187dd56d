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
        optimizer step  (after the ``before_step`` hook: DEEP-GRPO's local loss)

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
from stapo.core.algos.regularizers import add_terms
from stapo.core.batch import Batch, derive_seed, mean_or_nan
from stapo.core.config import Config
from stapo.core.trainer.distributed import DataParallel, check_minibatches, group_minibatches, minibatch_rows

if TYPE_CHECKING:
    from stapo.core.train.extras import Hooks
    from stapo.core.trainer.base import TrainerBackend

__all__ = [
    "Actor",
    "UpdateInputs",
    "UpdateRecord",
    "add_loss_sums",
    "loss_sums",
    "step_entropies",
    "step_p05",
    "update_diagnostics",
    "update_metrics",
    "MicroSpec",
    "Micro",
    "UpdateParts",
    "micro_spec",
    "needs_old_pass",
    "pack_rows",
    "split_rows",
    "build_micro",
    "nograd_stats",
    "token_stats_batched",
    "update_parts",
]

# ----------------------------------------------------------------------------- micro-batches


@dataclass(frozen=True)
class MicroSpec:
    """How rows become forwards: ``tokens`` set = packed, at most that many tokens per forward (a
    longer row alone); else ``rows`` sequences per forward, padded to the longest."""

    rows: int
    tokens: int | None = None

    @property
    def packed(self) -> bool:
        return self.tokens is not None


def micro_spec(cfg: Config) -> MicroSpec:
    return MicroSpec(cfg.trainer.micro_batch_size, cfg.trainer.micro_batch_tokens)


def pack_rows(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: indices into ``lengths`` grouped so each group's total is <= budget
    (a single longer item gets its own group). Deterministic: ties keep index order."""
    if budget < 1:
        raise ValueError(f"trainer.micro_batch_tokens must be >= 1, got {budget}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = int(lengths[i])
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def split_rows(rows: torch.Tensor, lengths: torch.Tensor, spec: MicroSpec) -> list[torch.Tensor]:
    """This rank's real ``rows`` (batch indices) as micro-batches: packed by tokens, or consecutive
    chunks of ``spec.rows`` (the mini-batch's order)."""
    if not rows.numel():
        return []
    if spec.tokens is None:
        return list(rows.split(spec.rows))
    lens = lengths[rows].tolist()
    return [rows[torch.tensor(b, dtype=torch.long)] for b in pack_rows(lens, spec.tokens)]


@dataclass(frozen=True)
class Micro:
    """One forward's inputs and the map from its layout back to the batch's rows.

    ``rows`` are batch row indices [b]; the forward sees ``input_ids`` etc. in its own layout: [b, W]
    (padded rows, W the rows' real column span) or [1, T] (packed: rows' real tokens back to back,
    ``position_ids`` restarting per row). ``src`` (packed) holds, per packed token, (row in this
    micro-batch, column in the batch); ``cols`` (padded) the batch columns kept.
    """

    rows: torch.Tensor  # [b]
    input_ids: torch.Tensor  # [b, W] or [1, T]
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    position_ids: torch.Tensor | None
    width: int  # L of the batch
    cols: slice | None = None
    src: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def tokens(self) -> int:
        """Tokens the forward computes (padding included): the cost of this micro-batch."""
        return int(self.input_ids.numel())

    def to_forward(self, x: torch.Tensor) -> torch.Tensor:
        """[b, L, ...] in batch layout -> the forward's layout."""
        if self.src is None:
            return x[:, self.cols]
        r, c = self.src
        return x[r, c].unsqueeze(0)

    def to_rows(self, y: torch.Tensor) -> torch.Tensor:
        """The forward's layout -> [b, L, ...] batch layout, zeros elsewhere; keeps the graph."""
        b = self.rows.numel()
        if self.src is None:
            pad = [0, 0] * (y.dim() - 2) + [self.cols.start, self.width - self.cols.stop]
            return torch.nn.functional.pad(y, pad)
        out = y.new_zeros((b, self.width, *y.shape[2:]))
        return out.index_put(self.src, y[0])


def build_micro(batch: Batch, rows: torch.Tensor, packed: bool) -> Micro:
    rows = rows.to(batch.input_ids.device)
    ids, attn, resp = batch.input_ids[rows], batch.attention_mask[rows], batch.response_mask[rows]
    L = ids.shape[1]
    if not packed:
        cols = attn.bool().any(0).nonzero()
        span = slice(int(cols[0]), int(cols[-1]) + 1) if cols.numel() else slice(0, L)
        return Micro(rows, ids[:, span], attn[:, span], resp[:, span], None, L, cols=span)
    where = attn.bool().nonzero(as_tuple=True)  # row-major: each row's real tokens in order
    r, c = where
    starts = torch.zeros_like(r)
    first = torch.ones_like(r, dtype=torch.bool)
    first[1:] = r[1:] != r[:-1]
    starts[first] = torch.arange(r.numel(), device=r.device)[first]
    starts = torch.cummax(starts, 0).values
    pos = (torch.arange(r.numel(), device=r.device) - starts).unsqueeze(0)  # [1, T]: 0.. per row
    return Micro(rows, ids[r, c].unsqueeze(0), torch.ones_like(attn[r, c]).unsqueeze(0), resp[r, c].unsqueeze(0),
                 pos, L, src=(r, c))


def lockstep(dp: Any, local: list[int]) -> list[int]:
    """Per entry, the largest count over ranks (one all_gather; identity on one rank)."""
    if not dp.multi:
        return local
    rows = dp.gather_rows([float(x) for x in local])
    return [int(max(col)) for col in zip(*rows, strict=True)] if local else []


def with_padding(sets: list[torch.Tensor], calls: int, pad_row: int | None, what: str) -> list[torch.Tensor]:
    """``sets`` plus micro-batches of the zero-weight padding row up to ``calls`` (data parallel)."""
    if calls > len(sets):
        if pad_row is None:
            raise ValueError(f"{what}: more forwards than micro-batches needs a padding row (pad_row)")
        sets = sets + [torch.tensor([pad_row])] * (calls - len(sets))
    return sets


def token_stats_batched(backend: TrainerBackend, batch: Batch, micro: int | MicroSpec, temperature: float, *,
                        calls: int | None = None, pad_row: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad log-probs and entropies of a whole batch [N, L] each, micro-batch by micro-batch.

    Data parallel: ``pad_row`` is the batch's zero-weight padding row (the last one) and ``calls``
    the number of forwards every rank makes (ZeRO-3 gathers parameters in each; :func:`lockstep`
    gives it); forwards past this rank's real rows run on the padding row.
    """
    spec = micro if isinstance(micro, MicroSpec) else MicroSpec(int(micro))
    n = batch.input_ids.shape[0]
    real = n if pad_row is None else pad_row
    lengths = batch.attention_mask.sum(1)
    sets = split_rows(torch.arange(real), lengths.cpu(), spec)
    sets = with_padding(sets, calls or 0, pad_row, "token_stats_batched")
    lp_all = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)  # [N, L]
    ent_all = torch.zeros_like(lp_all)  # [N, L]
    for rows in sets:
        m = build_micro(batch, rows, spec.packed)
        lp_all[m.rows], ent_all[m.rows] = nograd_stats(backend, m, temperature)
    return lp_all, ent_all


def nograd_stats(backend: TrainerBackend, m: Micro, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad log-probs and entropies of one micro-batch in batch layout [b, L] each (float32)."""
    lp, ent = backend.token_stats(m.input_ids, m.attention_mask, m.response_mask, grad=False,
                                  temperature=temperature, position_ids=m.position_ids)
    dev = m.response_mask.device
    return m.to_rows(lp.detach().float().to(dev)), m.to_rows(ent.detach().float().to(dev))


def old_pass_calls(dp: Any, batch: Batch, spec: MicroSpec, real: int) -> int:
    """Forwards every rank makes in a no-grad pass over its ``real`` rows (the busiest rank's count)."""
    local = len(split_rows(torch.arange(real), batch.attention_mask.sum(1).cpu(), spec))
    return max(1, lockstep(dp, [local])[0])


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

    ``old_lp`` / ``old_ent`` [N, L]: the no-grad pass's statistics (the sampling policy), or None
    for an on-policy update without one (:func:`needs_old_pass`). ``counts``: every rank's number of
    real rows under data parallelism (this rank's batch then ends with one zero-weight padding row
    when it has more rows than ``counts[rank]``); None: one process, every row real. ``record``:
    where the update stores its token weightings per row for the token dump. ``before_step(update_index,
    fresh)`` runs right before each optimizer step (DEEP-GRPO's local branch loss). ``off_policy``
    (``stapo.core.rollout.async_rollout.OffPolicyStep``), for stale asynchronous rows: the loss sees each
    token's weight times its behaviour weight sg[pi_prox / mu] (AReaL's decoupled objective, with
    ``old_lp`` the proximal policy), the diagnostics the weighting's own output, and every optimizer
    step runs at VCPO's ESS-scaled LR.
    """

    batch: Batch
    old_lp: torch.Tensor | None  # [N, L]
    old_ent: torch.Tensor | None  # [N, L]
    step: int
    counts: Sequence[int] | None = None
    record: UpdateRecord | None = None
    before_step: Callable[[int, bool], None] | None = None
    off_policy: Any = None


class Actor:
    """The policy's update, end to end (verl's ``DataParallelPPOActor`` as the model): built once per
    run from the config, the trainer backend and the run's hooks (``stapo.core.train.extras.build_hooks``;
    the update asks them for the in-update phases: the weighting's live keywords, the additive
    per-token terms and whether those read p), then :meth:`update` once per step."""

    def __init__(self, cfg: Config, backend: TrainerBackend, hooks: Hooks) -> None:
        self.cfg, self.backend, self.hooks = cfg, backend, hooks

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
        record, before_step, off_policy = inputs.record, inputs.before_step, inputs.off_policy
        a = cfg.algorithm
        parts = update_parts(cfg, hooks.weighting_params())  # STARE: the scheduled W, M
        loss_fn, loss_kw, params, temp = parts.loss_fn, parts.loss_kw, parts.params, parts.temperature
        if old_lp is None and a.ppo_epochs * a.mini_batches > 1:
            raise ValueError("update: an off-policy update (ppo_epochs * mini_batches > 1) needs old_lp")
        dp = DataParallel(backend)
        n = batch.input_ids.shape[0]
        counts = [n] if inputs.counts is None else [int(c) for c in inputs.counts]
        pad_row = counts[dp.rank] if n > counts[dp.rank] else None
        check_minibatches(sum(counts), a.mini_batches)
        gather, reduce = backend.all_gather_1d, backend.all_reduce_sum
        lengths = batch.attention_mask.sum(1).cpu()  # [N] real tokens per row
        p05 = None  # the step's 5th entropy percentile under the sampling policy (a logged diagnostic)
        if old_ent is not None:
            p05 = step_p05(old_ent, batch.response_mask, gather)
        reads = parts.reads_stats or hooks.terms_read_stats
        bounded = reads and cfg.trainer.update_memory == "bounded"  # "auto" was resolved by the memory plan
        keep_graphs = reads and not bounded
        fused = parts.fused and not keep_graphs
        diag: dict[str, float] = {}
        taus: list[float] = []
        sums = loss_sums()
        step_out: list[dict[str, float]] = []
        dev = batch.input_ids.device
        ctx: Any = None

        def forward(m: Micro) -> tuple[torch.Tensor, torch.Tensor]:
            lp, ent = backend.token_stats(m.input_ids, m.attention_mask, m.response_mask, grad=True,
                                          temperature=temp, position_ids=m.position_ids)
            return m.to_rows(lp), m.to_rows(ent)  # [b, L] each, graph kept

        fresh = True  # parameters unchanged since the step's statistics were taken
        for epoch in range(a.ppo_epochs):
            gen = torch.Generator().manual_seed(derive_seed(cfg.trainer.seed, step, epoch))
            baseline = off_policy.baseline if off_policy is not None else None  # VCPO's: whole groups per mini-batch
            rows = (group_minibatches(baseline.groups, a.mini_batches, gen) if baseline is not None
                    else minibatch_rows(counts, dp.rank, a.mini_batches, gen))
            plan = [split_rows(r, lengths, parts.spec) for r in rows]
            calls = lockstep(dp, [max(1, len(p)) for p in plan])
            for mb_index, (sets, k) in enumerate(zip(plan, calls, strict=True)):
                n_real = sum(int(s.numel()) for s in sets)
                micros = [build_micro(batch, s, parts.spec.packed)
                          for s in with_padding(sets, k, pad_row, "update")]
                mb_rows = torch.cat([m.rows for m in micros]).to(dev)  # [n_mb] batch rows, real ones first
                bounds = [0]
                for m in micros:
                    bounds.append(bounds[-1] + m.rows.numel())
                slices = [slice(s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
                if baseline is not None:  # VCPO: this mini-batch's advantages at the current weights
                    baseline.advantages(backend, batch, mb_rows[:n_real].tolist(), old_lp, parts)
                mb = MiniBatch(parts, params, batch.advantages[mb_rows], batch.response_mask[mb_rows],
                               old_lp[mb_rows] if old_lp is not None else None, gather, reduce, a.entropy_coef,
                               seed=derive_seed(cfg.trainer.seed, step, epoch, mb_index, 0x52), rank=dp.rank)
                if keep_graphs:  # statistics first: every forward's graph kept until the weights are known
                    graphs = [forward(m) for m in micros]
                    ctx, tw, norm = mb.weights(torch.cat([g[0].detach() for g in graphs]),
                                               torch.cat([g[1].detach() for g in graphs]))
                    tw_loss = off_policy.weigh(tw, mb_rows) if off_policy is not None else tw
                    terms = hooks.terms(ctx, mb_rows, old_lp)
                    losses = []
                    for sl, (lp, ent) in zip(slices, graphs, strict=True):
                        loss, mets = mb.loss(sl, lp, ent, tw_loss, norm, terms)
                        losses.append(loss)
                        add_loss_sums(sums, loss, mets)
                    # ONE backward through every kept graph: a backend pairs each backward with the forwards
                    # before it (DeepSpeed's micro-step bookkeeping; ZeRO-3 re-gathers parameters for it)
                    backend.backward(torch.stack(losses).sum())
                    del graphs, losses
                else:  # weights first (from the mask alone, or bounded: a no-grad statistics pass), then
                    # each micro-batch forward + backward at once
                    if bounded:
                        stats = [nograd_stats(backend, m, temp) for m in micros]
                        ctx0, tw, norm = mb.weights(torch.cat([s[0] for s in stats]), torch.cat([s[1] for s in stats]))
                        del stats
                    else:
                        zeros = torch.zeros(mb.mask.shape, dtype=torch.float32, device=dev)
                        ctx0, tw, norm = mb.weights(zeros, zeros)
                    tw_loss = off_policy.weigh(tw, mb_rows) if off_policy is not None else tw
                    terms = hooks.terms(ctx0, mb_rows, old_lp)
                    lps: list[torch.Tensor] = []
                    ents: list[torch.Tensor] = []
                    for m, sl in zip(micros, slices, strict=True):
                        if fused:
                            loss, lp, ent = mb.fused(backend, m, sl, tw_loss, norm, terms)
                            with torch.no_grad():  # the clip metrics, from the pass's own (detached) log-probs
                                old = mb.old[sl] if mb.old is not None else lp
                                _, mets = loss_fn(lp, old, mb.adv[sl], mb.mask[sl], **loss_kw)
                        else:
                            lp, ent = forward(m)
                            loss, mets = mb.loss(sl, lp, ent, tw_loss, norm, terms)
                        backend.backward(loss)
                        add_loss_sums(sums, loss, mets)
                        lps.append(lp.detach().float())
                        ents.append(ent.detach().float())
                    ctx = mb.context(torch.cat(lps), torch.cat(ents))
                if p05 is None:  # no old pass: this (only) mini-batch's forward saw the sampling policy
                    p05 = step_p05(ctx.entropy, ctx.mask, gather)
                tau_mb = update_diagnostics(cfg, ctx, tw, diag)
                taus.append(tau_mb)
                if record is not None:
                    record.put(epoch, mb_index, mb_rows[:n_real], ctx, tw, tau_mb, a.s2t.tau_p)
                if before_step is not None:  # DEEP-GRPO: lambda * local branch loss joins this update
                    before_step(len(step_out), fresh)
                step_out.append(off_policy.step(backend) if off_policy is not None else backend.step())
                fresh = False
        # Global, like every logged metric: each rank's loss is its share of the global objective (the
        # normalizer is all-reduced), so the ranks' losses and clip counts add up (one gather, every rank).
        keys = ("loss", "clip_low", "clip_high", "tokens", "ratio_sum")
        sums = dict(zip(keys, dp.sum([sums[k] for k in keys]), strict=True))
        return update_metrics(diag, taus, float("nan") if p05 is None else p05, sums, step_out, a.ppo_epochs)


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
            per_tok, _ = loss_fn(lp2, old, adv_f[idx].unsqueeze(0), mask_f[idx].unsqueeze(0), **loss_kw)
            per_tok1 = add_terms(per_tok[0], lp, [t.flat(idx) for t in terms_f])  # [n]
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
