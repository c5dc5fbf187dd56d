"""Padding-free attention for packed rows: causal attention per sequence, at the cost of each sequence.

A packed forward (``trainer.micro_batch_tokens``) is one row of several sequences back to back, with
position ids restarting at 0 at each sequence and no 2-D mask (:func:`stapo.core.trainer.base.
model_inputs`). Attention must stay within each sequence. Two ways to get there:

* transformers' own ``sdpa`` / ``eager`` attention build a block-diagonal causal [T, T] mask from
  the position ids (``masking_utils``) and run attention over the WHOLE packed row: correct, but the
  cost is T^2 per layer, not the sum of each sequence's length squared, and the masked-out blocks are
  computed and thrown away. With a 16k-token budget of ~300-token sequences that is ~50x the work.
* ``flash_attention_2`` (GPU, the ``flash-attn`` package) runs its variable-length kernel from
  ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``
  (transformers' ``FlashAttentionKwargs``): cost per sequence.

:data:`VARLEN_SDPA` (``"sdpa_varlen"``) gives the second on any device through transformers'
public extension points (``AttentionInterface.register`` and ``AttentionMaskInterface.register``):
for a packed row it runs torch's ``scaled_dot_product_attention`` causally on each sequence's slice
(:func:`sdpa_varlen_attention`; segments from the same ``cu_seq_lens_*`` keywords flash-attention
reads, which the models hand to the attention function untouched), and builds no [T, T] mask
(:func:`sdpa_varlen_mask`). Ordinary padded rows (a 2-D mask) and generation go to transformers' own
``sdpa`` function and mask unchanged, so one model serves rollouts, padded and packed training.

Our packed forwards always pass :func:`varlen_kwargs` (computed once per forward from the position
ids), so ``flash_attention_2`` on GPU and ``sdpa_varlen`` on CPU read the same segments; with
``sdpa`` or ``eager`` the keywords are ignored and the block-diagonal mask does the job.

Scope: causal decoder LMs whose layers attend globally (Llama, Qwen2/2.5/3, Mistral without a
sliding window, SmolLM2, ...). A packed row on a sliding-window layer is rejected with an error
naming the setting (per-sequence windows are not implemented); unpacked rows on such layers go to
transformers' sdpa as usual.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "VARLEN_SDPA",
    "register_varlen_sdpa",
    "varlen_kwargs",
    "cu_seq_lens_from_position_ids",
    "sdpa_varlen_attention",
    "sdpa_varlen_mask",
    "attention_implementations",
    "resolve_attn_implementation",
    "use_attention",
]

VARLEN_SDPA = "sdpa_varlen"


def cu_seq_lens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cumulative sequence starts [S + 1] int32, longest sequence) of one packed row.

    ``position_ids`` [1, T] restart at 0 at each sequence: ``[0 1 2 0 1 0 1 2 3]`` ->
    ``([0, 3, 5, 9], 4)``. int32 because flash-attention's varlen kernels take int32 offsets.
    """
    if position_ids.ndim != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"packed position_ids must be one row [1, T], got shape {tuple(position_ids.shape)}")
    pos = position_ids[0]  # [T]
    if pos.numel() == 0 or int(pos[0]) != 0:
        raise ValueError("packed position_ids must start at 0 (each sequence counts from 0)")
    starts = (pos == 0).nonzero().view(-1)  # [S]
    total = torch.tensor([pos.numel()], device=pos.device)
    cu = torch.cat([starts, total]).to(torch.int32)  # [S + 1]
    return cu, int((cu[1:] - cu[:-1]).max())


def varlen_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """The ``FlashAttentionKwargs`` of a packed row, for the model's forward (self-attention: q = k)."""
    cu, longest = cu_seq_lens_from_position_ids(position_ids)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def packed_segments(position_ids: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``cu_seq_lens`` [S + 1] when ``position_ids`` restart inside a row (a packed row), else None."""
    if position_ids is None or position_ids.shape[-1] < 2:
        return None
    if not bool((position_ids.diff(dim=-1) != 1).any()):
        return None  # one sequence per row (or a KV cache's continuing positions)
    if batch != 1 or position_ids.shape[0] != 1:
        raise ValueError(f"{VARLEN_SDPA}: packed rows must be one row [1, T], got {batch} rows")
    return cu_seq_lens_from_position_ids(position_ids)[0]


def _segments(cu_seq_lens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seq_lens.tolist()
    return [(s, e) for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s]


def sdpa_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D] packed, or [B, H, L, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    *,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers' ``AttentionInterface``: (output [B, L, H, D], no weights).

    With ``cu_seq_lens_q`` (a packed row): causal sdpa on each sequence's slice of the row, outputs
    concatenated back in order, so a token attends to its own sequence's earlier tokens only and
    the cost is the sum of the sequences' squares. Without it: transformers' ``sdpa`` function as is
    (padded rows with their 4-D mask, generation with a KV cache).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None and attention_mask is None and query.shape[2] > 1:
        # a packed row whose caller passed no segments: take them from the position ids, never
        # attend across sequences
        cu_seq_lens_q = packed_segments(kwargs.get("position_ids"), query.shape[0])
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{VARLEN_SDPA}: packed attention needs one row of self-attention, got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)} (a KV cache cannot be combined with packed rows)")
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError(f"{VARLEN_SDPA}: cu_seq_lens_k must equal cu_seq_lens_q (self-attention)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"{VARLEN_SDPA}: packed rows on a sliding-window layer are not supported; use "
            "trainer.attn_implementation: sdpa (block-diagonal mask) or flash_attention_2, or row micro-batches")
    if int(cu_seq_lens_q[-1]) != query.shape[2]:
        raise ValueError(f"{VARLEN_SDPA}: cu_seq_lens_q ends at {int(cu_seq_lens_q[-1])}, the row has "
                         f"{query.shape[2]} tokens")
    kwargs.pop("is_causal", None)
    outs = [
        sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None,
                               is_causal=True, **kwargs)[0]  # [1, e - s, H, D]
        for s, e in _segments(cu_seq_lens_q)
    ]
    return torch.cat(outs, dim=1), None  # [1, T, H, D]


def sdpa_varlen_mask(*, attention_mask: torch.Tensor | None = None, allow_is_causal_skip: bool = True,
                     **kwargs: Any) -> torch.Tensor | None:
    """Mask builder for transformers' ``AttentionMaskInterface``: transformers' ``sdpa_mask``, except
    for a packed row (position ids restarting), which gets no [T, T] mask: the attention splits it by
    sequence. transformers also switches the causal shortcut off for a static cache's decode step and
    for extra mask functions (``or_mask_function`` / ``and_mask_function``); those get their mask
    (:func:`packed_row_mask`)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and not allow_is_causal_skip and packed_row_mask(**kwargs):
        return None
    return sdpa_mask(attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def packed_row_mask(*, batch_size: int = 1, q_length: int = 0, kv_length: int = 0, q_offset: int = 0,
                    kv_offset: int = 0, mask_function: Any = None, use_vmap: bool = False,
                    device: torch.device | str = "cpu", **_: Any) -> bool:
    """Whether transformers' mask arguments describe one packed row of self-attention: one row, no
    cache prefix (q and kv the same T positions from 0), no user mask function (``use_vmap``), and a
    mask function that cuts at least one token off its predecessor, which only packing's
    same-sequence condition does (a causal mask keeps every (t, t - 1) pair; ``or`` masks only add).
    O(T): the mask function is evaluated on the T - 1 adjacent pairs only."""
    if batch_size != 1 or use_vmap or mask_function is None or q_length < 2:
        return False
    if q_length != kv_length or q_offset != 0 or kv_offset != 0:
        return False  # a KV cache (a static cache's decode step: q_length 1 over the cache's slots)
    q = torch.arange(1, q_length, device=device)  # [T - 1]
    zero = torch.zeros_like(q)
    kept = mask_function(zero, zero, q, q - 1)  # [T - 1] token t may attend to t - 1
    return not bool(torch.as_tensor(kept).all())


def register_varlen_sdpa() -> None:
    """Make ``"sdpa_varlen"`` a valid ``attn_implementation`` (idempotent; transformers-wide)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, sdpa_varlen_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, sdpa_varlen_mask)


def attention_implementations() -> list[str]:
    """Names ``trainer.attn_implementation`` accepts: ``eager`` and every registered implementation."""
    from transformers import AttentionInterface

    register_varlen_sdpa()
    return sorted({"eager", *AttentionInterface().valid_keys()})


def resolve_attn_implementation(name: str | None, *, packed: bool) -> str | None:
    """``trainer.attn_implementation`` -> the name to set, or None to keep the model's own.

    ``None`` (auto): ``sdpa_varlen`` when micro-batches are packed (per-sequence attention on any
    device; on GPU ``flash_attention_2`` is the faster choice where installed: name it), else keep
    what transformers chose at load time. An explicit name is checked against the registry.
    """
    if name is None:
        return VARLEN_SDPA if packed else None
    valid = attention_implementations()
    if name not in valid:
        raise ValueError(f"trainer.attn_implementation: unknown attention {name!r}; valid: {', '.join(valid)}")
    return name


def use_attention(model: torch.nn.Module, name: str | None, *, packed: bool) -> str | None:
    """Set the model's attention implementation (public ``set_attn_implementation``) per
    :func:`resolve_attn_implementation` and return the name set (None: the model keeps its own;
    also for a model without that method, unless a name was asked for, which is then an error)."""
    chosen = resolve_attn_implementation(name, packed=packed)
    if chosen is None:
        return None
    register_varlen_sdpa()
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        if name is not None:
            raise ValueError(f"trainer.attn_implementation: {type(model).__name__} cannot switch attention "
                             "(no set_attn_implementation)")
        return None
    setter(chosen)
    return chosen
