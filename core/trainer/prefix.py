"""Prompt-prefix sharing in training forwards (``trainer.share_prompt_prefix``, torch backend, rows
micro-batches).

The G responses of a group share their prompt, and on short-answer workloads the prompt is most of
each row (the demo: ~40 prompt tokens, <= 16 response tokens). A forward then runs the distinct
prompts once (batch = groups), repeats their KV cache G times along the batch (``index_select``:
differentiable, so the prompt tokens' gradient is the sum over the G responses, as in the full-row
forward), runs the responses on top of it, and takes the first response token's prediction from the
prompt's last hidden state. Same log-probs, entropies and gradients as the full rows up to float
rounding (tests/unit/test_update.py).

The KV cache goes in under the keyword the installed transformers reads (:func:`cache_kwargs`):
``cache`` in the minors that renamed it (5.24 has no ``past_key_values`` in its forwards), and
``past_key_values`` in the earlier ones the supported range includes (5.16: ``cache`` there is an
unknown keyword that ``generate`` rejects).

Packed micro-batches (``trainer.micro_batch_tokens``) do not share prefixes: packing already removes
the padding, and a shared prefix would need a cache per packed segment. On long responses (real RL)
packing is the saving that matters; on the demo's short answers sharing is.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from stapo.core import tokenstats as ts
from stapo.core.trainer.base import forward_as, head_logit_transform, position_ids_from_mask, stat_targets

__all__ = ["prompt_groups", "trim_columns", "can_share_prefix", "prefix_shared_token_stats", "cache_kwargs"]


def cache_kwargs(module: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``module``'s forward (and ``generate``, which checks keywords against
    it): ``cache`` where the forward declares it, else ``past_key_values``. Read from the signature,
    not the version number, so a minor that renames it again fails loudly in the prefix tests."""
    params = inspect.signature(type(module).forward).parameters
    return {("cache" if "cache" in params else "past_key_values"): cache}


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, p_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row holding each distinct prompt [U], index of every row's prompt in that list [B]).

    Rows are compared on their first ``p_len`` columns (prompt, left-padded) and mask; equal
    prompts need not be adjacent. Prompts are listed in order of first appearance.
    """
    key = torch.cat([input_ids[:, :p_len], attention_mask[:, :p_len].to(input_ids.dtype)], dim=1)  # [B, 2P]
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # [B] into sorted distinct rows
    B = key.shape[0]
    rows = torch.arange(B, device=key.device)
    first_of = torch.full((int(inverse.max()) + 1,), B, device=key.device).scatter_reduce(0, inverse, rows, "amin")
    order = torch.argsort(first_of)  # distinct prompts by first appearance
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=key.device)
    return first_of[order], rank[inverse]


def trim_columns(attention_mask: torch.Tensor) -> slice:
    """The columns holding any real token: a micro-batch drops padding the whole batch needed."""
    cols = attention_mask.bool().any(0).nonzero()
    if not cols.numel():
        return slice(0, attention_mask.shape[1])
    return slice(int(cols[0]), int(cols[-1]) + 1)


def _prompt_len(response_mask: torch.Tensor) -> int | None:
    """Column where responses start (collate: prompts left-padded to P, responses from P on)."""
    cols = response_mask.any(0).nonzero()
    return int(cols[0]) if cols.numel() else None


def can_share_prefix(model: Any, response_mask: torch.Tensor) -> bool:
    base = getattr(model, "base_model", None)
    p_len = _prompt_len(response_mask)
    return (
        base is not None and base is not model and p_len is not None and p_len >= 1
        and not head_logit_transform(model)[1] and model.get_output_embeddings() is not None
    )


def prefix_shared_token_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L]: prompts left-padded to P columns, responses from column P
    attention_mask: torch.Tensor,  # [B, L]
    response_mask: torch.Tensor,  # [B, L] bool, True only at columns >= P
    *,
    chunk_size: int,
    entropy_grad: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_token_stats`` restricted to the response, with each distinct prompt run once.

    Returns (logprobs [B, L], entropy [B, L]) fp32, zero outside the response: the same values as
    ``compute_token_stats(model, ids, attn, response_mask)``. Gradient flows (when enabled) into the
    prompt's forward through the repeated KV cache.
    """
    from transformers import DynamicCache

    p_len = _prompt_len(response_mask)
    if p_len is None or p_len < 1:
        raise ValueError("prefix_shared_token_stats: response_mask must mark responses after a prompt")
    if response_mask[:, :p_len].any():
        raise ValueError("prefix_shared_token_stats: response_mask marks prompt columns")
    B, L = input_ids.shape
    attention_mask = attention_mask.to(input_ids.device)
    first, group = prompt_groups(input_ids, attention_mask, p_len)  # [U], [B]
    positions = position_ids_from_mask(attention_mask)  # [B, L]
    base = model.base_model
    cache = DynamicCache(config=model.config)
    out = base(
        input_ids=input_ids[first, :p_len], attention_mask=attention_mask[first, :p_len],
        position_ids=positions[first, :p_len], use_cache=True, **cache_kwargs(base, cache),
    )
    h_last = out.last_hidden_state[:, -1]  # [U, D]: predicts each response's first token
    cache.batch_select_indices(group)  # [U, ...] -> [B, ...]: differentiable repeat
    out2 = base(
        input_ids=input_ids[:, p_len:], attention_mask=attention_mask, position_ids=positions[:, p_len:],
        use_cache=True, **cache_kwargs(base, cache),
    )
    h_resp = out2.last_hidden_state  # [B, R, D]
    hidden = torch.cat([h_last[group].unsqueeze(1), h_resp[:, :-1]], dim=1)  # [B, R, D]: predicts column P + j
    target = stat_targets(attention_mask, response_mask)  # [B, L]
    tgt = target[:, p_len:]  # [B, R]
    h = hidden[tgt]  # [N, D]
    labels = input_ids[:, p_len:][tgt]  # [N]
    head = model.get_output_embeddings()
    scale, _ = head_logit_transform(model)

    def _stats(h_: torch.Tensor, labels_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ts.token_logprobs_entropy_from_hidden(
            h_, head.weight, labels_, chunk_size=chunk_size, entropy_grad=entropy_grad,
            bias=getattr(head, "bias", None), temperature=temperature / scale,
        )

    with forward_as(head, _stats):
        lp, ent = head(h, labels)  # [N], [N]
    where = target.nonzero(as_tuple=True)  # row-major, all at columns >= P: the order of hidden[tgt]
    logprobs = torch.zeros(B, L, dtype=torch.float32, device=input_ids.device).index_put(where, lp.float())
    entropy = torch.zeros(B, L, dtype=torch.float32, device=input_ids.device).index_put(where, ent.float())
    return logprobs, entropy
