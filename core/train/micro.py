"""Micro-batches: how a batch's rows become forwards, written once for every pass over a batch.

Every forward over a step's batch goes through :func:`micro_batches`: the actor's no-grad pass
(old statistics), the token dump's distribution, the update's mini-batches, DEEP-GRPO's local loss,
the KL reference and Lp-Reg's proxy pass, `stapo calibrate`. Three rules live here and nowhere else:

- **layout** (:class:`MicroSpec`): ``trainer.micro_batch_tokens`` packs rows into forwards of at most
  that many tokens, longest first, each into the first forward with room (first-fit decreasing; a
  longer row alone): one row of concatenated sequences whose position ids restart at 0 per sequence
  (no padding computed). Otherwise ``trainer.micro_batch_size`` consecutive rows per forward, padded to
  the rows' real column span.
- **the way back** (:meth:`Micro.to_rows`): per-token results return to the batch's [rows, L] layout
  (an index_put that keeps the graph), so weightings, losses and aggregations see the padded path's
  tensors whatever the packing.
- **lockstep** under data parallelism: every rank makes the busiest rank's number of forwards for
  each group of rows (ZeRO-3 gathers parameters in every forward: a rank that stops early hangs the
  job); forwards past a rank's real rows run on its zero-weight padding row (``Micro.padding``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stapo.core.batch import Batch
from stapo.core.config import Config

__all__ = ["Micro", "MicroSpec", "micro_batches", "micro_spec", "pack_rows", "row_slices"]


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


@dataclass(frozen=True)
class Micro:
    """One forward's inputs and the map from its layout back to the batch's rows.

    ``rows`` are batch row indices [b]; the forward sees ``input_ids`` etc. in its own layout: [b, W]
    (padded rows, W the rows' real column span) or [1, T] (packed: rows' real tokens back to back,
    ``position_ids`` restarting per row). ``src`` (packed) holds, per packed token, (row in this
    micro-batch, column in the batch); ``cols`` (padded) the batch columns kept. ``padding``: a
    lockstep forward on the rank's zero-weight padding row (it carries no real row).
    """

    rows: torch.Tensor  # [b]
    input_ids: torch.Tensor  # [b, W] or [1, T]
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    position_ids: torch.Tensor | None
    width: int  # L of the batch
    cols: slice | None = None
    src: tuple[torch.Tensor, torch.Tensor] | None = None
    padding: bool = False

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


def micro_batches(batch: Batch, groups: Sequence[torch.Tensor], spec: MicroSpec, *, dp: Any = None,
                  pad_row: int | None = None, min_forwards: int = 1) -> list[list[Micro]]:
    """Each group of this rank's real rows (batch indices [n_g]) as its forwards, in order.

    Every group gets at least ``min_forwards`` forwards and, with ``dp``
    (``stapo.core.trainer.distributed.DataParallel``) over more than one rank, the busiest rank's number (one
    all_gather for all groups); forwards past this rank's rows run on ``pad_row`` (``Micro.padding``).
    ``dp`` None: no collective (a pass only this rank makes). A group's rows come back in forward
    order: ``torch.cat([m.rows for m in ms])``.
    """
    lengths = batch.attention_mask.sum(1).cpu()  # [N] real tokens per row
    sets = [_split(g, lengths, spec) for g in groups]
    real = [len(s) for s in sets]
    calls = [max(min_forwards, k) for k in real]
    if dp is not None and dp.multi:
        calls = [int(max(col)) for col in zip(*dp.gather_rows([float(c) for c in calls]), strict=True)]
    if pad_row is None and any(c > k for c, k in zip(calls, real, strict=True)):
        raise ValueError("micro_batches: more forwards than this rank's rows needs its padding row (pad_row)")
    sets = [s + [torch.tensor([pad_row])] * (c - len(s)) if c > len(s) else s for s, c in zip(sets, calls, strict=True)]
    return [[_build(batch, rows, spec.packed, padding=i >= k) for i, rows in enumerate(s)]
            for s, k in zip(sets, real, strict=True)]


def row_slices(micros: Sequence[Micro]) -> list[slice]:
    """Each forward's rows within ``torch.cat([m.rows for m in micros])``."""
    out, start = [], 0
    for m in micros:
        out.append(slice(start, start + m.rows.numel()))
        start += m.rows.numel()
    return out


def _split(rows: torch.Tensor, lengths: torch.Tensor, spec: MicroSpec) -> list[torch.Tensor]:
    """``rows`` (batch indices) as forwards: packed by tokens, or consecutive chunks of ``spec.rows``."""
    if not rows.numel():
        return []
    if spec.tokens is None:
        return list(rows.split(spec.rows))
    lens = lengths[rows].tolist()
    return [rows[torch.tensor(b, dtype=torch.long)] for b in pack_rows(lens, spec.tokens)]


def _build(batch: Batch, rows: torch.Tensor, packed: bool, *, padding: bool) -> Micro:
    rows = rows.to(batch.input_ids.device)
    ids, attn, resp = batch.input_ids[rows], batch.attention_mask[rows], batch.response_mask[rows]
    L = ids.shape[1]
    if not packed:
        cols = attn.bool().any(0).nonzero()
        span = slice(int(cols[0]), int(cols[-1]) + 1) if cols.numel() else slice(0, L)
        return Micro(rows, ids[:, span], attn[:, span], resp[:, span], None, L, cols=span, padding=padding)
    r, c = attn.bool().nonzero(as_tuple=True)  # row-major: each row's real tokens in order
    starts = torch.zeros_like(r)
    first = torch.ones_like(r, dtype=torch.bool)
    first[1:] = r[1:] != r[:-1]
    starts[first] = torch.arange(r.numel(), device=r.device)[first]
    starts = torch.cummax(starts, 0).values
    pos = (torch.arange(r.numel(), device=r.device) - starts).unsqueeze(0)  # [1, T]: 0.. per row
    return Micro(rows, ids[r, c].unsqueeze(0), torch.ones_like(attn[r, c]).unsqueeze(0), resp[r, c].unsqueeze(0),
                 pos, L, src=(r, c), padding=padding)
