"""Single-device trainer backend: plain PyTorch AdamW on one CPU or one GPU.

The portable learner: tests, the CPU demo and small single-GPU runs use it. It holds the HF model
in float32 (master weights), runs forward/backward under bf16 autocast on CUDA only (CPU stays in
fp32: bf16 matmuls are slow on most CPUs and fp32 keeps CPU runs deterministic), accumulates
gradients over micro-batches, and on ``step()`` clips the global norm, steps AdamW and the LR
schedule, and zeroes the gradients.

    backend = TorchBackend(cfg, model, total_optimizer_steps=cfg.trainer.max_steps)
    lp, ent = backend.token_stats(ids, attn, grad=True)      # [B, L] each
    backend.backward(loss)                                     # per micro-batch
    loss, lp, ent = backend.token_loss(ids, attn, resp, fn)    # or: fused loss (per-token losses)
    backend.step()                                             # once per mini-batch

Non-finite updates: when the global grad norm is inf/nan and ``trainer.skip_nonfinite`` is set, the
update is dropped (weights, optimizer moments and the LR schedule untouched), the gradients are
zeroed, and ``step()`` returns ``{"grad_norm": nan, "skipped": 1.0, ...}`` for the loop to log.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from stapo.core.lazy import no_progress_bars
from stapo.core.placement import resolve_device
from stapo.core.trainer.attention import use_attention
from stapo.core.trainer.base import (
    adamw_param_groups,
    apply_optimizer_settings,
    check_token_batch,
    compute_token_distribution,
    compute_token_loss,
    compute_token_stats,
    enable_activation_checkpointing,
    make_lr_scheduler,
    make_readable,
    scaled_lr,
    stat_targets,
)
from stapo.core.trainer.prefix import can_share_prefix, prefix_shared_token_stats

__all__ = ["TorchBackend"]

log = logging.getLogger(__name__)

_STATE_FILE = "trainer_state.pt"


class TorchBackend:
    """One device, torch AdamW, LR warmup + decay, global-norm clipping, optional grad checkpointing."""

    world_size = 1
    rank = 0

    def __init__(self, cfg: Any, model: torch.nn.Module, total_optimizer_steps: int) -> None:
        if total_optimizer_steps < 1:
            raise ValueError(f"total_optimizer_steps must be >= 1, got {total_optimizer_steps}")
        self.cfg = cfg
        self.tcfg = cfg.trainer
        self.device = resolve_device(self.tcfg.device)
        self.total_optimizer_steps = total_optimizer_steps
        # fp32 master weights; bf16 compute comes from autocast on CUDA.
        if any(p.dtype != torch.float32 for p in model.parameters()):
            log.info(
                "torch backend: casting the policy to float32 master weights (autocast gives bf16 compute)"
            )
            model = model.float()
        self.model = model.to(self.device)
        # the attention set on the model (None: its own), see stapo.core.trainer.attention
        self.attn_implementation = use_attention(model, self.tcfg.attn_implementation, packed=self.tcfg.micro_batch_tokens is not None)
        if cfg.model.gradient_checkpointing:
            enable_activation_checkpointing(model)
        if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
            model.config.use_cache = False
        self.optimizer = torch.optim.AdamW(
            adamw_param_groups(model, self.tcfg.weight_decay),
            lr=self.tcfg.lr,
            betas=tuple(self.tcfg.betas),
            eps=self.tcfg.adam_eps,
        )
        self.scheduler = make_lr_scheduler(self.optimizer, self.tcfg, total_optimizer_steps)
        self.updates_applied = 0
        self.updates_skipped = 0

    # ------------------------------------------------------------------ forward

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def token_stats(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor | None = None,
        *,
        grad: bool,
        temperature: float = 1.0,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [B, L], entropy [B, L]) fp32 on ``self.device``; see ``compute_token_stats``.

        Padded rows whose responses follow a shared prompt run each distinct prompt once
        (``trainer.share_prompt_prefix``, :mod:`stapo.core.trainer.prefix`): same values.
        """
        # train() for grad passes (gradient checkpointing only acts in training mode); eval() for the
        # no-grad passes. RL policies run with dropout 0, so both modes compute the same function.
        self.model.train(grad)
        ctx = torch.enable_grad() if grad else torch.no_grad()
        check_token_batch(input_ids, attention_mask, response_mask)
        ids, attn = input_ids.to(self.device), attention_mask.to(self.device)
        resp = None if response_mask is None else response_mask.to(self.device)
        with ctx, self._autocast():
            if self._shares_prefix(resp, position_ids):
                return prefix_shared_token_stats(
                    self.model, ids, attn, resp, chunk_size=self.tcfg.logits_chunk_size,
                    entropy_grad=self.tcfg.entropy_grad, temperature=temperature,
                )
            return compute_token_stats(
                self.model, ids, attn, resp,
                chunk_size=self.tcfg.logits_chunk_size,
                entropy_grad=self.tcfg.entropy_grad,
                temperature=temperature,
                position_ids=None if position_ids is None else position_ids.to(self.device),
            )

    def _shares_prefix(self, response_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> bool:
        """Prefix sharing applies: switched on, padded rows (not packed), KV cache usable (HF turns it
        off under activation checkpointing), a prompt before the responses."""
        return (
            self.tcfg.share_prompt_prefix and position_ids is None and response_mask is not None
            and not self.cfg.model.gradient_checkpointing and can_share_prefix(self.model, response_mask)
        )

    def token_distribution(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor | None = None,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        position_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """No-grad p, H, sum q^2 and top-k of one forward; see ``compute_token_distribution``."""
        self.model.train(False)
        with torch.no_grad(), self._autocast():
            return compute_token_distribution(
                self.model,
                input_ids.to(self.device),
                attention_mask.to(self.device),
                None if response_mask is None else response_mask.to(self.device),
                chunk_size=self.tcfg.logits_chunk_size,
                temperature=temperature,
                top_k=top_k,
                position_ids=None if position_ids is None else position_ids.to(self.device),
            )

    def token_loss(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor,
        token_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        temperature: float = 1.0,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused training pass -> (loss, logprobs [B, L], entropy [B, L]); see ``compute_token_loss``.

        Where prefix sharing applies (:meth:`token_stats`), the shared forward's log-probs go through
        ``token_loss_fn`` instead (same loss; the head's gradient then comes from autograd)."""
        self.model.train(True)
        check_token_batch(input_ids, attention_mask, response_mask)
        resp = response_mask.to(self.device)
        if self._shares_prefix(resp, position_ids):
            with torch.enable_grad(), self._autocast():
                lp, ent = prefix_shared_token_stats(
                    self.model, input_ids.to(self.device), attention_mask.to(self.device), resp,
                    chunk_size=self.tcfg.logits_chunk_size, temperature=temperature,
                )
            where = stat_targets(attention_mask.to(self.device), resp).nonzero(as_tuple=True)
            flat = where[0] * lp.shape[1] + where[1]  # [N] flat positions, as compute_token_loss gives them
            return token_loss_fn(lp[where], flat).sum(), lp.detach(), ent.detach()
        with torch.enable_grad(), self._autocast():
            return compute_token_loss(
                self.model,
                input_ids.to(self.device),
                attention_mask.to(self.device),
                None if response_mask is None else response_mask.to(self.device),
                token_loss_fn,
                chunk_size=self.tcfg.logits_chunk_size,
                temperature=temperature,
                position_ids=None if position_ids is None else position_ids.to(self.device),
            )

    # ------------------------------------------------------------------ update

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate d(loss)/d(params). The loss is used as is: no averaging over micro-batches."""
        if loss.ndim != 0:
            raise ValueError(f"loss must be a scalar tensor, got shape {tuple(loss.shape)}")
        loss.backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def current_lr(self) -> float:
        """LR the next update will use (group 0's)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, *, lr_scale: float = 1.0) -> dict[str, float]:
        """Clip, AdamW step, LR schedule step, zero grads. ``grad_norm`` is the pre-clip global norm;
        ``lr_scale``: this step's LR multiplier (``TrainerBackend.step``)."""
        with scaled_lr(self.optimizer, lr_scale):
            return self._step()

    def _step(self) -> dict[str, float]:
        lr = self.current_lr()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.tcfg.max_grad_norm))
        if not math.isfinite(norm) and self.tcfg.skip_nonfinite:
            self.zero_grad()
            self.updates_skipped += 1
            log.warning("torch backend: non-finite grad norm (%s); update skipped", norm)
            return {"grad_norm": float("nan"), "lr": lr, "skipped": 1.0}
        self.optimizer.step()
        self.scheduler.step()
        self.zero_grad()
        self.updates_applied += 1
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}

    # ------------------------------------------------------------------ weights out

    def named_parameters_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named parameter tensors (detached views, no copy) for the rollout engine."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def export_hf(self, path: Path, tokenizer: Any) -> None:
        """Write the current policy (and tokenizer, when given) in ``save_pretrained`` format."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with no_progress_bars():
            self.model.save_pretrained(path, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        make_readable(path)

    # ------------------------------------------------------------------ data parallel (identities)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over data-parallel ranks: one rank here, so ``t`` itself."""
        return t

    def all_gather_1d(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate a 1-D tensor over ranks: one rank here, so ``t`` itself."""
        if t.ndim != 1:
            raise ValueError(f"all_gather_1d expects a 1-D tensor, got shape {tuple(t.shape)}")
        return t

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: Path) -> None:
        """Model, optimizer and scheduler state in ``path/trainer_state.pt`` (written, then renamed)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "updates_applied": self.updates_applied,
            "updates_skipped": self.updates_skipped,
        }
        tmp = path / (_STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path / _STATE_FILE)

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote (tensors land on this backend's device)."""
        file = Path(path) / _STATE_FILE
        if not file.is_file():
            raise FileNotFoundError(f"no torch trainer state at {file}")
        state = torch.load(file, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        apply_optimizer_settings(self.scheduler, self.tcfg, self.total_optimizer_steps)
        self.updates_applied = int(state.get("updates_applied", 0))
        self.updates_skipped = int(state.get("updates_skipped", 0))
        self.zero_grad()
