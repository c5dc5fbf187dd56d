"""DAPO's batch-level pieces (Yu et al. 2025, arXiv 2503.14476): dynamic sampling, soft overlong
punishment and overlong filtering. Clip-higher and token-level aggregation live in ``losses`` and
``aggregation``.

    values = dynamic_sampling_values(rewards, correct, metric="acc")  # [P, G]: what must differ
    keep = dynamic_sampling_filter(values)                             # -> keep [P] bool
    shaped = rewards + overlong_penalty(lengths, max_len=4096, buffer=512)
    in_loss = overlong_filter_keep(finish_reasons)                     # [N] bool, False = truncated

Why accuracy and not the shaped reward: DAPO keeps the groups whose *accuracy* is neither 0 nor 1
(paper eq. 11: 0 < |{o_i correct}| < G; verl's ``algorithm.filter_groups.metric=acc``). Filtering on
the shaped reward would keep all-correct groups whose lengths differ, whose advantages then come
only from the overlong penalty.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dynamic_sampling_filter(rewards: Tensor) -> Tensor:
    """Keep [P] bool: True for groups whose G rewards are not all equal.

    A group where every response got the same reward has zero advantage everywhere under GRPO, so
    it adds no gradient and only dilutes the batch; DAPO drops such groups and samples more.
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 2:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a tensor of shape [P, G], got {shape}")
    if torch.is_floating_point(rewards) and not torch.isfinite(rewards).all():
        raise ValueError("rewards contains NaN or inf")
    if rewards.shape[1] == 0:
        return torch.zeros(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    return (rewards != rewards[:, :1]).any(dim=1)  # [P]


DYNAMIC_SAMPLING_METRICS = ("acc", "reward")


def dynamic_sampling_values(rewards: Tensor, correct: Tensor, *, metric: str = "acc") -> Tensor:
    """The per-response values dynamic sampling compares within a group, [P, G] float.

    ``acc``: correctness as 0/1 (DAPO); ``reward``: the (shaped) reward itself.
    """
    if metric not in DYNAMIC_SAMPLING_METRICS:
        raise ValueError(f"algorithm.dynamic_sampling_metric: unknown {metric!r}; valid: acc, reward")
    if rewards.shape != correct.shape:
        raise ValueError(f"correct has shape {tuple(correct.shape)}; expected {tuple(rewards.shape)} like rewards")
    return correct.to(torch.float32) if metric == "acc" else rewards.to(torch.float32)


def overlong_filter_keep(finish_reasons: list[str]) -> Tensor:
    """DAPO overlong filtering, [N] bool: False for truncated responses (finish reason ``length``).

    A truncated response never reached an answer, so its reward says nothing about its reasoning;
    DAPO masks its tokens out of the loss (Table 1's "Overlong Filtering" row). It still counts in
    its group's advantages (the group statistics are computed before the mask).
    """
    return torch.tensor([r != "length" for r in finish_reasons], dtype=torch.bool)


def overlong_penalty(lengths: Tensor, *, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment, added to the reward, [N] float:

    0                                  if L <= max_len - buffer
    -penalty * (L - (max_len - buffer)) / buffer   if max_len - buffer < L <= max_len (linear ramp)
    -penalty                           if L > max_len
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    if not 0 < buffer <= max_len:
        raise ValueError(f"buffer must be in (0, max_len={max_len}], got {buffer}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0 (it is subtracted), got {penalty}")
    lengths_f = torch.as_tensor(lengths).to(torch.float32)  # [N]
    start = float(max_len - buffer)
    ramp = -penalty * (lengths_f - start) / float(buffer)  # [N]
    out = torch.where(lengths_f <= start, torch.zeros_like(lengths_f), ramp)
    return torch.where(lengths_f > max_len, torch.full_like(lengths_f, -penalty), out)
