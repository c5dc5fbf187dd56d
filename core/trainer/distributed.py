"""Data-parallel decisions and reductions for the RL loop: every rank runs the same collectives.

Under data parallelism (the DeepSpeed backend on N ranks) each rank samples its share of a step's
prompts, so after dynamic sampling and invalid-group dropping the ranks hold different numbers of
sequences. Every collective of the update (ZeRO-3 parameter gathers in each forward and backward,
the token weighting's all_gather, the normalizer's all_reduce, the optimizer step) must still be
issued by every rank the same number of times, or the run hangs or silently mixes tensors. So:

* decisions about the batch are global (:meth:`DataParallel.total` of the kept counts decides
  whether another dynamic-sampling round runs; :func:`balanced_quota` trims the global surplus);
* the optimizer mini-batches are drawn from ONE global permutation of the global batch
  (:func:`minibatch_rows`), and each rank runs, per mini-batch, as many micro-batches as the busiest
  rank needs (``stapo.core.train.update``); a rank short of rows pads with zero-weight rows (no response token: no loss, no
  gradient), so a rank with nothing kept still joins every collective;
* logged metrics are global sums / maxima (:meth:`DataParallel.gather_rows`).

With one process every function here is the identity and the plan reproduces the single-process
loop exactly (same permutation, same mini-batches, same micro-batches).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from stapo.core.trainer.base import TrainerBackend

__all__ = ["DataParallel", "balanced_quota", "check_minibatches", "group_minibatches", "minibatch_rows", "even_shard"]


class DataParallel:
    """Global reductions over the learner's data-parallel ranks (identity with one rank).

    Built on the backend's ``all_gather_1d`` (the DeepSpeed backend's gloo/NCCL group), plus
    ``torch.distributed.all_gather_object`` for small Python objects (token-dump records).
    """

    def __init__(self, backend: TrainerBackend) -> None:
        self.rank = int(backend.rank)
        self.world_size = int(backend.world_size)
        self._gather = backend.all_gather_1d

    @property
    def multi(self) -> bool:
        return self.world_size > 1

    def gather_rows(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's ``values`` (same length on each rank), in rank order: [world][k]."""
        local = torch.tensor([float(v) for v in values], dtype=torch.float64)  # [k]
        if not self.multi:
            return [local.tolist()]
        allv = self._gather(local)  # [world * k]
        return allv.reshape(self.world_size, len(values)).tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks."""
        rows = self.gather_rows(values)
        return [math.fsum(col) for col in zip(*rows, strict=True)] if rows and values else list(values)

    def total(self, n: float) -> float:
        return self.sum([n])[0]

    def counts(self, n: int) -> list[int]:
        """``n`` of every rank, in rank order."""
        return [int(r[0]) for r in self.gather_rows([n])]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (a list of one with one rank)."""
        if not self.multi:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def even_shard(items: Sequence[Any], rank: int, world_size: int) -> tuple[list[Any], int]:
    """(this rank's strided share padded to the largest share's length, number of real items).

    Padding repeats the share's first item (or the list's first item for an empty share), so every
    rank makes the same number of generate calls; the caller drops the padded results.
    """
    share = list(items[rank::world_size])
    size = math.ceil(len(items) / world_size) if items else 0
    real = len(share)
    filler = share[0] if share else (items[0] if items else None)
    return share + [filler] * (size - real), real


def balanced_quota(counts: Sequence[int], want: int) -> list[int]:
    """How many of its kept groups each rank keeps so that the global total is ``min(want, sum)``.

    Water-filling: groups are handed out one at a time to the rank with the fewest so far that
    still has one (lowest rank first on ties), which keeps per-rank micro-batch counts as equal as
    possible. Deterministic from the counts, so every rank computes the same quota.
    """
    quota = [0] * len(counts)
    left = min(int(want), int(sum(counts)))
    while left > 0:
        r = min((q, i) for i, q in enumerate(quota) if q < counts[i])[1]
        quota[r] += 1
        left -= 1
    return quota


def global_minibatches(counts: Sequence[int], mini_batches: int, generator: torch.Generator) -> list[torch.Tensor]:
    """GLOBAL row indices of each optimizer mini-batch: ONE seeded permutation of the global batch
    (rows in rank order: global row g belongs to rank r when ``offset_r <= g < offset_r +
    counts[r]``), split into exactly ``mini_batches`` parts whose sizes differ by at most one: the
    same sets of sequences whatever the number of ranks. (``chunk`` would give fewer parts when
    N < K^2: 100 rows in 16 chunks of 7 make 15 optimizer steps.) With fewer rows than
    mini-batches the last parts are empty; the policy update refuses that (:func:`check_minibatches`)."""
    perm = torch.randperm(int(sum(counts)), generator=generator)  # [N]
    return list(torch.tensor_split(perm, mini_batches))  # K parts, sizes ceil(N/K) then floor(N/K)


def group_minibatches(groups: Sequence[int], mini_batches: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Row indices of each optimizer mini-batch with every prompt group whole in one (VCPO's
    baseline weighs a group's rows against each other at one set of weights; one process): a
    seeded permutation of the groups split into exactly ``mini_batches`` parts of as equal a group
    count as possible, each part's rows in group order. Fewer groups than mini-batches is refused."""
    ids = list(dict.fromkeys(int(g) for g in groups))  # distinct groups, first-seen order
    if len(ids) < mini_batches:
        raise ValueError(
            f"the step's batch has {len(ids)} prompt groups for algorithm.mini_batches={mini_batches}: "
            "algorithm.off_policy.min_variance_baseline keeps each group in one mini-batch; lower "
            "algorithm.mini_batches or raise rollout.prompts_per_step"
        )
    rows: dict[int, list[int]] = {g: [] for g in ids}
    for i, g in enumerate(groups):
        rows[int(g)].append(i)
    order = torch.randperm(len(ids), generator=generator)  # [P]
    return [torch.tensor([i for k in part.tolist() for i in rows[ids[k]]], dtype=torch.long)
            for part in torch.tensor_split(order, mini_batches)]


def check_minibatches(rows: int, mini_batches: int) -> None:
    """Refuse an update whose batch has fewer rows than optimizer steps (an empty mini-batch has no
    loss to step on), naming the keys that set both numbers."""
    if rows < mini_batches:
        raise ValueError(
            f"the step's batch has {rows} rows for algorithm.mini_batches={mini_batches} optimizer steps: lower "
            "algorithm.mini_batches or raise rollout.prompts_per_step x rollout.n (DAPO's dynamic sampling and "
            "algorithm.overlong.filter can leave fewer rows than prompts_per_step x n)"
        )


def local_rows(chunk: torch.Tensor, counts: Sequence[int], rank: int) -> torch.Tensor:
    """This rank's local row indices among the global rows ``chunk``."""
    offset = sum(counts[:rank])
    return chunk[(chunk >= offset) & (chunk < offset + counts[rank])] - offset


def minibatch_rows(counts: Sequence[int], rank: int, mini_batches: int,
                   generator: torch.Generator) -> list[torch.Tensor]:
    """This rank's real local rows of each global optimizer mini-batch (:func:`global_minibatches`);
    with one rank exactly the single-process split. How many forwards each rank then runs per
    mini-batch (the busiest rank's count, padding-row forwards elsewhere) is ``stapo.core.train.update``'s
    business."""
    return [local_rows(c, counts, rank) for c in global_minibatches(counts, mini_batches, generator)]
