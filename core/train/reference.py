"""Extra forward passes beside the policy's: the frozen reference model (KL penalty) and Lp-Reg's
min-p statistics of the sampling policy.

**ReferencePolicy** - a frozen copy of the policy as loaded (``algorithm.kl.reference: initial``),
made when the run starts (before a checkpoint is restored, so a resumed run keeps the true initial
weights). Memory: the copy is cast to ``algorithm.kl.dtype`` (bf16 by default: half of an fp32
policy's weights, no gradients, no optimizer state) and, with ``algorithm.kl.offload``, lives on
the CPU and visits the policy's device only for its no-grad forward, one micro-batch at a time.
Its log-probs come from the same ``compute_token_stats`` the backends use (same positions, logit
scale and temperature). Under ZeRO-3 the copy is partitioned like the policy: its own DeepSpeed
ZeRO-3 engine without an optimizer (``DeepSpeedBackend.frozen_copy``), as OpenRLHF and verl build
for their reference workers; each rank then holds 1/world of it, and every rank makes the same
number of reference forwards.

**minp_stats_batched** - per response position, log of the probability mass that survives the
min-p filter (p >= min_p * max p) and log of the max probability, from the hidden states and the
LM head in row chunks, never a [B, L, V] tensor; each micro-batch runs as the model's forward and
the head as the head module's forward (``forward_as``), so ZeRO-3's hooks gather the partitioned
weights. Data parallel: it runs the forwards it is given (``stapo.core.train.micro``: the same number on
every rank, padded with the batch's zero-weight row), so Lp-Reg runs under ZeRO-3 on several ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from stapo.core.algos.lpreg import minp_stats_from_logits
from stapo.core.batch import Batch
from stapo.core.train.micro import Micro
from stapo.core.trainer.base import (
    _final_hidden,
    compute_token_stats,
    forward_as,
    head_logit_transform,
    model_inputs,
    stat_targets,
)

__all__ = ["ReferencePolicy", "minp_stats_batched"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ReferencePolicy:
    """A frozen copy of a causal LM that answers per-token log-probs, [B, L] float32.

    ``partitioned_copy`` (ZeRO-3): a callable ``(dtype, offload=...) -> engine`` that builds the copy
    partitioned like the policy (``DeepSpeedBackend.frozen_copy``); without it the copy is a plain
    ``deepcopy`` (one device, or every rank's full replica at ZeRO 0-2)."""

    def __init__(self, model: torch.nn.Module, *, dtype: str = "bfloat16", offload: bool = False,
                 device: torch.device | None = None, chunk_size: int = 1024,
                 partitioned_copy: Callable[..., Any] | None = None) -> None:
        self.device = device if device is not None else next(model.parameters()).device
        self.chunk_size = chunk_size
        self.partitioned = partitioned_copy is not None
        if self.partitioned:
            # DeepSpeed moves the partitions itself (offload_param); the engine must stay referenced
            self.engine = partitioned_copy(_DTYPES.get(dtype), offload=offload)
            self.model = self.engine.module
            self.offload = False
            return
        self.offload = offload
        ref = copy.deepcopy(model)
        ref.requires_grad_(False)
        ref.eval()
        if dtype in _DTYPES:
            ref.to(_DTYPES[dtype])
        ref.to("cpu" if offload else self.device)
        self.model = ref

    def num_bytes(self) -> int:
        """Bytes of the copy's weights on this rank (its partitions, under ZeRO-3)."""
        return sum(_local_numel(p) * p.element_size() for p in self.model.parameters())

    @torch.no_grad()
    def logprobs(self, batch: Batch, micros: list[Micro], *, temperature: float) -> torch.Tensor:
        """log ref(o_t | context) at every response position of ``batch``, 0 elsewhere: [B, L].

        ``micros``: the pass's forwards over ``batch`` (``stapo.core.train.micro.micro_batches``, the old
        pass's: packed by tokens or rows, lockstep over ranks). A partitioned copy gathers its
        parameters in every forward, so it runs every one of them (the padding row's included, the
        same count on every rank); a plain copy issues no collective and skips the padding forwards.
        Each micro-batch runs as the copy's own forward (``forward_as``), so ZeRO-3's hooks fire.
        """
        if self.offload:
            self.model.to(self.device)
        try:
            out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)  # [B, L]

            def stats(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor,
                      pos: torch.Tensor | None) -> torch.Tensor:
                lp, _ = compute_token_stats(self.model, ids, attn, resp, chunk_size=self.chunk_size,
                                            temperature=temperature, position_ids=pos)
                return lp

            for m in micros:
                if m.padding and not self.partitioned:
                    continue
                dev = self.device
                pos = None if m.position_ids is None else m.position_ids.to(dev)
                with forward_as(self.model, stats):  # the root module's forward (and its hooks)
                    lp = self.model(m.input_ids.to(dev), m.attention_mask.to(dev), m.response_mask.to(dev), pos)
                out[m.rows.to(dev)] = m.to_rows(lp.float())
            return out
        finally:
            if self.offload:
                self.model.to("cpu")


def _local_numel(p: torch.nn.Parameter) -> int:
    """Elements this rank stores: a ZeRO-3 partitioned parameter's ``ds_tensor``, else the tensor."""
    local = getattr(p, "ds_tensor", None)
    return int(local.numel()) if local is not None else p.numel()


@torch.no_grad()
def minp_stats_batched(model: torch.nn.Module, batch: Batch, micros: list[Micro], *, min_p: float,
                       temperature: float, chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(log kept mass [B, L], log max prob [B, L]) at the response positions of ``batch`` (0 elsewhere).

    ``micros``: the pass's forwards (``stapo.core.train.micro.micro_batches``, the old pass's: packed by
    tokens or rows, the same count on every rank, past a rank's rows on its zero-weight padding row,
    which has no response position: nothing is written). Each micro-batch runs as the model's own
    forward (``forward_as``), so the root module's hooks fire as in any forward (ZeRO-3: the
    start-of-forward step reset, then each submodule's parameter gather): under ZeRO-3 every rank
    must make the same number of calls, which the lockstep forwards guarantee.
    """
    B, L = batch.input_ids.shape
    device = batch.input_ids.device
    kept = torch.zeros(B, L, dtype=torch.float32, device=device)
    pmax = torch.zeros(B, L, dtype=torch.float32, device=device)
    scale, needs_logits = head_logit_transform(model)
    head = model.get_output_embeddings()
    bias = getattr(head, "bias", None)

    def _run(h_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def proj(x: torch.Tensor) -> torch.Tensor:
            z = x @ head.weight.t()
            return (z + bias if bias is not None else z) * scale

        return _stats_in_chunks(proj, h_, min_p, temperature, chunk_size)

    def micro_stats(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor,
                    pos_in: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log kept mass [n], log max prob [n]) at the micro-batch's target positions, in order."""
        inputs = model_inputs(attn, pos_in)  # packed rows: no 2-D mask, positions + segments
        tgt = stat_targets(attn, resp)[:, 1:]  # [b, L-1]
        if needs_logits:  # soft-capped heads: the model's own logits, row chunk by row chunk
            logits = type(model).forward(model, input_ids=ids, **inputs,
                                         use_cache=False).logits[:, :-1][tgt]  # [n, V]
            return _stats_in_chunks(lambda x: x, logits, min_p, temperature, chunk_size)
        h = _final_hidden(model, ids, inputs)[:, :-1][tgt]  # [n, D]
        with forward_as(head, _run):
            return head(h)

    was_training = model.training
    model.eval()
    try:
        for m in micros:
            ids, attn, resp = m.input_ids, m.attention_mask, m.response_mask
            with forward_as(model, micro_stats):  # the root module's forward (and its hooks)
                lk, lm = model(ids, attn, resp, m.position_ids)
            where = stat_targets(attn, resp).nonzero(as_tuple=True)
            block_k = torch.zeros(ids.shape, dtype=torch.float32, device=device)  # forward layout
            block_m = torch.zeros_like(block_k)
            block_k[where], block_m[where] = lk.float(), lm.float()
            kept[m.rows], pmax[m.rows] = m.to_rows(block_k), m.to_rows(block_m)
    finally:
        model.train(was_training)
    return kept, pmax


def _stats_in_chunks(proj: Any, x: torch.Tensor, min_p: float, temperature: float,
                     chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    outs_k, outs_m = [], []
    for c in range(0, x.shape[0], chunk_size):
        z = proj(x[c : c + chunk_size]).float() / temperature  # [c, V]
        k, m = minp_stats_from_logits(z, min_p=min_p)
        outs_k.append(k)
        outs_m.append(m)
    if not outs_k:
        empty = torch.zeros(0, device=x.device)
        return empty, empty
    return torch.cat(outs_k), torch.cat(outs_m)
