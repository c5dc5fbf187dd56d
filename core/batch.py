"""The data of one step: sampled sequences, their padded batch, and the seeds that pick them.

``Sequence_`` is one sampled response with its reward and advantage; ``collate`` pads a step's
sequences into a :class:`Batch` (prompts left-padded, responses right-padded) for the update. Every
phase of a step (rollout, update, the loop hooks) speaks these shapes; ``derive_seed`` gives each of
them a stable seed from (seed, step, ...) so a run reproduces on any number of processes.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Batch", "Sequence_", "collate", "collate_with_pad_row", "derive_seed", "group_sequences",
           "mean_or_nan", "seed_everything"]


def derive_seed(*parts: int, bits: int = 31) -> int:
    """A stable ``bits``-bit seed from integers (Python's hash() is salted per process); at most 64 bits,
    31 by default (what every seeded library here takes; a rollout engine's call seed takes 63)."""
    digest = hashlib.sha256(",".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << bits) - 1)



def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)



@dataclass

class Sequence_:
    """One sampled response with everything the update needs."""

    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: str
    text: str
    gold: str
    group: int
    reward: float = 0.0
    correct: bool = False
    valid: bool = True
    advantage: float = 0.0
    # asynchronous rollouts (stapo.core.rollout.async_rollout): the policy version that sampled it (None: the
    # weights this step starts from) and the log-probs its sampler recorded
    version: int | None = None
    behaviour_logprobs: list[float] | None = None



@dataclass

class Batch:
    """Padded tensors: prompts left-padded, responses right-padded, one row per sequence."""

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    response_mask: torch.Tensor  # [N, L] bool
    advantages: torch.Tensor  # [N, L] (advantage broadcast over the response)

    def rows(self, idx: torch.Tensor) -> Batch:
        return Batch(self.input_ids[idx], self.attention_mask[idx], self.response_mask[idx], self.advantages[idx])

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.response_mask, self.advantages)))



def collate(seqs: Sequence[Sequence_], pad_id: int) -> Batch:
    p_len = max(len(s.prompt_ids) for s in seqs)
    r_len = max(max(len(s.response_ids) for s in seqs), 1)
    n = len(seqs)
    ids = torch.full((n, p_len + r_len), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p_len + r_len), dtype=torch.long)
    resp = torch.zeros((n, p_len + r_len), dtype=torch.bool)
    adv = torch.zeros((n, p_len + r_len), dtype=torch.float32)
    for i, s in enumerate(seqs):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[i, p_len - p : p_len] = torch.tensor(s.prompt_ids)
        ids[i, p_len : p_len + r] = torch.tensor(s.response_ids, dtype=torch.long)
        attn[i, p_len - p : p_len + r] = 1
        resp[i, p_len : p_len + r] = True
        adv[i, p_len : p_len + r] = s.advantage
    return Batch(ids, attn, resp, adv)



def collate_with_pad_row(seqs: Sequence[Sequence_], pad_id: int, *, pad: bool) -> Batch:
    """``collate`` plus, when ``pad``, one trailing zero-weight row (data parallel).

    The padding row is a real token sequence (the first kept one, or two pad tokens on a rank that
    kept nothing) with an all-False response mask and advantage 0: forwards through it are ordinary
    (no fully masked attention row, so no NaN), and it carries no loss and no gradient. A rank runs
    it whenever it has fewer rows than the busiest rank, so every rank joins every collective.
    """
    if not pad:
        return collate(seqs, pad_id)
    if not seqs:
        return Batch(torch.full((1, 2), pad_id, dtype=torch.long), torch.ones((1, 2), dtype=torch.long),
                     torch.zeros((1, 2), dtype=torch.bool), torch.zeros((1, 2), dtype=torch.float32))
    b = collate(seqs, pad_id)  # [N, L] each; the padding row copies row 0's tokens, nothing else
    return Batch(
        torch.cat([b.input_ids, b.input_ids[:1]]),
        torch.cat([b.attention_mask, b.attention_mask[:1]]),
        torch.cat([b.response_mask, torch.zeros_like(b.response_mask[:1])]),
        torch.cat([b.advantages, torch.zeros_like(b.advantages[:1])]),
    )



def group_sequences(seqs: Sequence[Sequence_]) -> dict[int, list[Sequence_]]:
    """Sequences by group id, groups and members in order of first appearance."""
    by_group: dict[int, list[Sequence_]] = {}
    for s in seqs:
        by_group.setdefault(s.group, []).append(s)
    return by_group



def mean_or_nan(xs: Sequence[float]) -> float:
    """Mean of ``xs``; NaN for none (a metric of an empty step)."""
    return float(sum(xs) / len(xs)) if xs else float("nan")
