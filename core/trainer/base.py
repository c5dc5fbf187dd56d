"""The ``TrainerBackend`` contract and the pieces both backends share.

A trainer backend owns the learner side of RL: the forward pass that yields per-token log-probs and
entropies, backward, the optimizer step (clipping, LR schedule, non-finite skip), weight export for
the rollout engine, and checkpoint state. The RL loop (``stapo.core.train.loop``) codes against
:class:`TrainerBackend` only, so ``torch`` (one device) and ``deepspeed`` (ZeRO 0-3, many GPUs and
nodes) are interchangeable.

What lives here, and why it is shared:

* :func:`compute_token_stats` - log-probs and entropies from the final hidden states and the LM head
  through :mod:`stapo.core.tokenstats`, so no ``[B, L, V]`` float32 logits are ever materialized.
  Both backends call it; the LM-head part runs *as the LM head module's forward* (see
  :func:`forward_as`) so that DeepSpeed ZeRO-3's module hooks gather the partitioned weight
  for the forward and gather it again for the backward, exactly as they do for ``lm_head(x)``.
* :func:`compute_token_loss` - the fused training pass behind ``token_loss``: same positions and
  model body, but the LM head runs :func:`stapo.core.tokenstats.fused_token_loss_from_hidden`, which
  forms the head and hidden-state gradients of an elementwise per-token loss inside the chunked
  forward (no logits recompute in backward).
* :func:`lr_multiplier` / :func:`make_lr_scheduler` / :func:`apply_optimizer_settings` - one LR schedule (linear warmup, then
  constant / cosine / linear decay) so both backends produce the same learning rates, and a resume
  that changes the optimizer's settings uses the new ones.
* :func:`adamw_param_groups` - the same AdamW parameter groups (no weight decay on 1-D tensors).

Usage (what the loop does)::

    backend = build_trainer_backend(cfg, model)               # stapo.core.trainer
    with torch.no_grad(): old_lp, _ = backend.token_stats(ids, attn, grad=False)
    for micro in mini_batch:                                   # loss already / GLOBAL normalizer
        lp, ent = backend.token_stats(micro.ids, micro.attn, grad=True)
        backend.backward(loss_fn(lp, ent, ...))
        # or, for an elementwise per-token loss (ppo_clip): fn(logp [n], flat index [n]) -> [n]
        loss, lp, ent = backend.token_loss(micro.ids, micro.attn, micro.resp, fn)
        backend.backward(loss)
    metrics = backend.step()                                   # {"grad_norm", "lr", "skipped"}
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from stapo.core import tokenstats as ts
from stapo.core.trainer.attention import varlen_kwargs

__all__ = [
    "TrainerBackend",
    "SCHEDULES",
    "lr_multiplier",
    "make_lr_scheduler",
    "apply_optimizer_settings",
    "RolloutStepLR",
    "begin_rollout_step",
    "scaled_lr",
    "planned_optimizer_steps",
    "adamw_param_groups",
    "position_ids_from_mask",
    "model_inputs",
    "compute_token_stats",
    "compute_token_loss",
    "compute_token_distribution",
    "make_readable",
    "stat_targets",
    "head_logit_transform",
    "check_token_batch",
    "enable_activation_checkpointing",
    "forward_as",
]


@runtime_checkable
class TrainerBackend(Protocol):
    """What the RL loop needs from a learner. Shapes: B sequences of L tokens (prompt + response)."""

    model: torch.nn.Module  # the unwrapped HF model: generation, weight sync, export
    device: torch.device
    world_size: int  # data-parallel ranks (1 for torch)
    rank: int

    def token_stats(
        self,
        input_ids: torch.Tensor,  # [B, L] long
        attention_mask: torch.Tensor,  # [B, L] 0/1
        response_mask: torch.Tensor | None = None,  # [B, L] bool; stats only where True (optional)
        *,
        grad: bool,
        temperature: float = 1.0,
        position_ids: torch.Tensor | None = None,  # [B, L] packed rows (see compute_token_stats)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [B, L], entropy [B, L]): position t holds log p(ids[t] | ids[<t]); position 0 is 0."""
        ...

    def token_loss(
        self,
        input_ids: torch.Tensor,  # [B, L] long
        attention_mask: torch.Tensor,  # [B, L] 0/1
        response_mask: torch.Tensor,  # [B, L] bool
        token_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        temperature: float = 1.0,
        position_ids: torch.Tensor | None = None,  # [B, L] packed rows
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused training pass -> (loss, logprobs [B, L], entropy [B, L]), the last two detached.

        ``loss = sum_i token_loss_fn(logp_i, index_i)`` over the positions ``token_stats`` fills;
        ``index`` are flat positions ``row * L + col``; the function must be elementwise. Gradients
        w.r.t. the LM head and hidden states are computed in the forward (no logits recompute);
        then call :meth:`backward` on ``loss`` as usual. See ``compute_token_loss``.
        """
        ...

    def token_distribution(
        self,
        input_ids: torch.Tensor,  # [B, L] long
        attention_mask: torch.Tensor,  # [B, L] 0/1
        response_mask: torch.Tensor | None = None,  # [B, L] bool
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        position_ids: torch.Tensor | None = None,  # [B, L] packed rows
    ) -> dict[str, torch.Tensor]:
        """No-grad Theorem 3.1 data (p, H, sum q^2, top-k) from one forward; every rank must call it
        under ZeRO-3 (it gathers parameters). See ``compute_token_distribution``."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of ``loss`` (already divided by the global normalizer); no step."""
        ...

    def step(self, *, lr_scale: float = 1.0) -> dict[str, float]:
        """Clip, optimizer step, scheduler step, zero grads -> {"grad_norm", "lr", "skipped"}.

        ``lr_scale``: this one step runs at every group's LR times it (VCPO's ESS-scaled LR), and
        the schedule's LR is back for the next (:func:`scaled_lr`); ``lr`` reports the LR used."""
        ...

    def zero_grad(self) -> None: ...

    def named_parameters_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors with HF names (gathered under ZeRO-3), for pushing into the rollout engine."""
        ...

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...

    def export_hf(self, path: Path, tokenizer: Any) -> None: ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather_1d(self, t: torch.Tensor) -> torch.Tensor: ...


# ----------------------------------------------------------------------------- LR schedule

SCHEDULES = ("constant", "cosine", "linear")


def make_readable(folder: Path) -> None:
    """Give the files in ``folder`` the mode any other file gets (0644 under the default umask 022).

    safetensors writes 0600 files, so an exported model would be readable by its writer only (under
    compose the trainer runs as uid 10001 and the host user could not read ``RUN/final``)."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    for f in Path(folder).iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the base LR used by optimizer update number ``step`` (0-based).

    Warmup is linear and never starts at zero: update ``s < warmup_steps`` uses ``(s + 1) / warmup``,
    so the first update already moves the weights and update ``warmup - 1`` uses the full LR.
    After warmup, ``progress = (s - warmup) / (total - warmup)`` goes from 0 towards 1 over the
    planned updates (clamped at 1 past the plan) and the multiplier is ``1`` (constant),
    ``1 - progress`` (linear) or ``(1 + cos(pi * progress)) / 2`` (cosine); the decay floor is 0.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"trainer.lr_schedule: unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def planned_optimizer_steps(cfg: Any) -> int:
    """Optimizer updates a run plans: ``max_steps * ppo_epochs * mini_batches`` (the schedule's length)."""
    return max(1, cfg.trainer.max_steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches)


class RolloutStepLR:
    """The LR multiplier with ``trainer.lr_schedule_unit: rollout_step``: a function of the rollout step.

    verl steps its scheduler once per rollout step (``update_actor``), so a verl recipe's warmup and
    decay count rollout steps, and every update of one rollout step uses the same LR. This callable
    ignores the update count ``LambdaLR`` passes it and reads ``rollout_index`` (0-based), which
    :func:`begin_rollout_step` sets at the start of each step; resuming needs nothing else, as the
    loop sets it from the step number. The warmup formula is :func:`lr_multiplier`'s ((r + 1) / warmup:
    the first step already trains; verl's own first step uses r / warmup = 0, our choice differs by
    that one step).
    """

    def __init__(self, warmup_steps: int, total_steps: int, schedule: str) -> None:
        self.warmup_steps, self.total_steps, self.schedule = warmup_steps, total_steps, schedule
        self.rollout_index = 0

    def __call__(self, _update: int) -> float:
        return lr_multiplier(self.rollout_index, warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                             schedule=self.schedule)


def _lr_lambda(trainer_cfg: Any, total_optimizer_steps: int) -> Callable[[int], float]:
    """The multiplier :func:`make_lr_scheduler` follows, built from ``trainer_cfg``."""
    warmup, schedule = trainer_cfg.warmup_steps, trainer_cfg.lr_schedule
    if getattr(trainer_cfg, "lr_schedule_unit", "optimizer_step") == "rollout_step":
        return RolloutStepLR(warmup, max(1, trainer_cfg.max_steps), schedule)

    def fn(step: int) -> float:
        return lr_multiplier(step, warmup_steps=warmup, total_steps=total_optimizer_steps, schedule=schedule)

    return fn


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer, trainer_cfg: Any, total_optimizer_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following :func:`lr_multiplier`; ``scheduler.step()`` once per applied update.

    With ``lr_schedule_unit: rollout_step`` the multiplier is :class:`RolloutStepLR` over
    ``trainer.max_steps`` rollout steps instead of the optimizer-update count."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(trainer_cfg, total_optimizer_steps))


def apply_optimizer_settings(
    scheduler: torch.optim.lr_scheduler.LambdaLR, trainer_cfg: Any, total_optimizer_steps: int
) -> None:
    """Put the config's optimizer settings back after a checkpoint load, keeping the checkpoint's position.

    torch's ``Optimizer.load_state_dict`` restores every group's hyper-parameters as they were saved
    (lr, betas, eps, weight decay) and ``LambdaLR.load_state_dict`` restores the base LRs and a
    callable multiplier's attributes (:class:`RolloutStepLR`'s warmup and length). A resume that
    changes ``trainer.lr``, ``betas``, ``adam_eps``, ``weight_decay``, ``warmup_steps``,
    ``lr_schedule``, ``lr_schedule_unit`` or ``max_steps`` would otherwise go on with the old values
    while its record says otherwise. What the checkpoint keeps: the moments, the update count
    (``last_epoch``) and so the place on the schedule; the LR of the next update is the new base LR
    times the new multiplier at that place. Decay groups are those :func:`adamw_param_groups` marks.
    Both backends call this at the end of ``load``; without a change it rewrites the same values.
    """
    optimizer = scheduler.optimizer
    lam = _lr_lambda(trainer_cfg, total_optimizer_steps)
    scheduler.base_lrs = [float(trainer_cfg.lr)] * len(optimizer.param_groups)
    old = list(scheduler.lr_lambdas)
    scheduler.lr_lambdas = [lam] * len(optimizer.param_groups)
    if isinstance(lam, RolloutStepLR) and old and isinstance(old[0], RolloutStepLR):
        lam.rollout_index = old[0].rollout_index
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["betas"] = tuple(trainer_cfg.betas)
        group["eps"] = float(trainer_cfg.adam_eps)
        if group.get("decay", group.get("weight_decay", 0.0) > 0):
            group["weight_decay"] = float(trainer_cfg.weight_decay)
        group["initial_lr"] = base
        group["lr"] = base * lam(scheduler.last_epoch)


@contextlib.contextmanager
def scaled_lr(optimizer: Any, scale: float) -> Iterator[None]:
    """Every param group's LR times ``scale`` inside the block (one optimizer step), the schedule's
    own afterwards: a group whose LR the block left at the scaled value (a skipped step, which does
    not move the schedule) gets its LR back; one the LR schedule set on an applied step keeps that,
    since the schedule computes it from its base LRs. ``scale`` 1: nothing is touched.
    ``optimizer``: anything with ``param_groups`` (torch's, DeepSpeed's engine optimizer)."""
    if scale == 1.0:
        yield
        return
    groups = optimizer.param_groups
    saved = [g["lr"] for g in groups]
    scaled = [lr * scale for lr in saved]
    for g, lr in zip(groups, scaled, strict=True):
        g["lr"] = lr
    try:
        yield
    finally:
        for g, lr0, lr1 in zip(groups, saved, scaled, strict=True):
            if g["lr"] == lr1:
                g["lr"] = lr0


def begin_rollout_step(backend: Any, step: int) -> None:
    """Set the LR of rollout step ``step`` (1-based) when the schedule counts rollout steps; else nothing.

    The loop calls it once at the start of every step, before any update of that step."""
    sched = getattr(backend, "scheduler", None)
    fns = list(getattr(sched, "lr_lambdas", []) or [])
    if sched is None or not fns or not all(isinstance(f, RolloutStepLR) for f in fns):
        return
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, fns, strict=True):
        fn.rollout_index = step - 1
        group["lr"] = base * fn(0)


def adamw_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on matrices only, none on 1-D tensors (norm gains, biases).

    Decaying a norm gain towards 0 shrinks a layer's output rather than regularizing it; this is the
    usual split (nanoGPT, HF Trainer). Frozen parameters are left out. Empty groups are dropped.
    A parameter partitioned by ZeRO-3's ``zero.Init`` is an empty 1-D placeholder: its own shape is
    ``ds_shape``.
    """
    def ndim(p: torch.nn.Parameter) -> int:
        return len(getattr(p, "ds_shape", p.shape))

    decay = [p for p in model.parameters() if p.requires_grad and ndim(p) >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and ndim(p) < 2]
    groups = [  # "decay" marks the group trainer.weight_decay governs (apply_optimizer_settings)
        {"params": decay, "weight_decay": weight_decay, "decay": True},
        {"params": no_decay, "weight_decay": 0.0, "decay": False},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("model has no trainable parameters (every requires_grad is False)")
    return groups


# ----------------------------------------------------------------------------- token statistics


def check_token_batch(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor | None
) -> None:
    """Reject malformed batches with an error naming the argument (shapes must all be [B, L])."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    if response_mask is not None and response_mask.shape != input_ids.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only: left padding does not shift the first real token.

    ``[0, 0, 1, 1, 1]`` -> ``[0, 0, 0, 1, 2]`` (pads are clamped to 0; they are masked anyway).
    This matches what ``generate`` used when the rollout was sampled from a left-padded prompt.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]


def model_inputs(attention_mask: torch.Tensor, position_ids: torch.Tensor | None) -> dict[str, Any]:
    """Keyword arguments that tell the model where each sequence is: mask, position ids, segments.

    Padded rows: the 0/1 mask and positions counted over real tokens (:func:`position_ids_from_mask`).
    Packed rows (``position_ids`` given, [1, T]: several sequences back to back, positions restarting
    at 0 at each sequence's first token, no padding): NO 2-D mask, plus the sequence boundaries as
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``
    (:func:`stapo.core.trainer.attention.varlen_kwargs`), which the models hand to their attention
    function. Attention then stays within each sequence on every implementation: ``sdpa_varlen``
    (our default when packing, CPU or GPU) runs sdpa per sequence; ``flash_attention_2`` (GPU) runs
    its varlen kernel on the same boundaries; ``sdpa`` / ``eager`` ignore them and build a
    block-diagonal causal [T, T] mask from the position ids (correct, cost T^2 per layer).
    """
    if position_ids is None:
        return {"attention_mask": attention_mask, "position_ids": position_ids_from_mask(attention_mask)}
    if position_ids.shape != attention_mask.shape:
        raise ValueError(f"position_ids shape {tuple(position_ids.shape)} != attention_mask shape "
                         f"{tuple(attention_mask.shape)}")
    pos = position_ids.to(attention_mask.device)
    return {"attention_mask": None, "position_ids": pos, **varlen_kwargs(pos)}


def head_logit_transform(model: torch.nn.Module) -> tuple[float, bool]:
    """How the model turns ``lm_head(h)`` into logits: (extra logit scale, needs full-logits path).

    Most causal LMs use the LM head's output as the logits. Some rescale it (Cohere ``logit_scale``
    multiplies, Granite ``logits_scaling`` divides): a scale folds into the temperature exactly
    (``softmax(s * z / T) = softmax(z / (T / s))``), so the memory-bounded hidden-state path stays
    valid. Soft-capping (Gemma-2/3 ``final_logit_softcapping``: ``c * tanh(z / c)``) is not a
    rescaling: such models go through the logits path (the model's own forward, then
    ``token_logprobs_entropy_from_logits`` in chunks), which costs a ``[B, L, V]`` logits tensor in
    the model's dtype.
    """
    config = getattr(model, "config", None)
    scale = 1.0
    if config is None:
        return scale, False
    softcap = getattr(config, "final_logit_softcapping", None)
    if getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        scale /= float(config.logits_scaling)
    return scale, softcap is not None


@contextlib.contextmanager
def forward_as(head: torch.nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """Temporarily make ``head(...)`` run ``fn`` instead of its own forward.

    Why: calling a *module* (rather than reading ``head.weight``) keeps every framework hook
    attached to it in play. For the LM head under DeepSpeed ZeRO-3, the pre-forward hook gathers
    the partitioned weight, the post-forward hook re-partitions it and registers backward hooks on
    the outputs that gather it again before autograd reaches our chunked log-softmax - the same
    protocol a plain ``lm_head(x)`` gets. The DeepSpeed backend also runs the whole token-stats
    computation as its engine's forward this way. On a plain module this is just a function call.
    """
    had_own = "forward" in head.__dict__
    saved = head.__dict__.get("forward")
    head.forward = fn  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had_own:
            head.forward = saved  # type: ignore[method-assign]
        else:
            del head.forward


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward (non-reentrant torch checkpoint).

    transformers 5 renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``;
    use whichever the installed version has. Also turns the KV cache off (useless in training).
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(
            f"model.gradient_checkpointing is set but {type(model).__name__} supports no activation checkpointing"
        )


def _final_hidden(model: torch.nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
    """Final (post-norm) hidden states [B, L, D] without running the LM head.

    HF causal LMs keep their decoder under ``model.base_model`` (``LlamaForCausalLM.model``); its
    ``last_hidden_state`` is what the LM head consumes. Models without a separate base model fall
    back to ``output_hidden_states=True`` (which also computes the logits: slower, same numbers).
    ``inputs`` are :func:`model_inputs`' keywords.
    """
    base = getattr(model, "base_model", None)
    if base is not None and base is not model:
        out = base(input_ids=input_ids, **inputs, use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    out = type(model).forward(  # the class's forward: the instance's may be overridden (forward_as)
        model,
        input_ids=input_ids,
        **inputs,
        use_cache=False,
        output_hidden_states=True,
    )
    return out.hidden_states[-1]


def stat_targets(attention_mask: torch.Tensor, response_mask: torch.Tensor | None) -> torch.Tensor:
    """Bool [B, L]: positions t that get a log-prob, i.e. t and t-1 are real tokens (and, when
    given, ``response_mask[t]``). Position 0 never does (nothing predicts it)."""
    valid = attention_mask.bool()
    target = torch.zeros_like(valid)  # [B, L]
    target[:, 1:] = valid[:, 1:] & valid[:, :-1]
    if response_mask is not None:
        target &= response_mask.to(target.device).bool()
    return target


def compute_token_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L]
    attention_mask: torch.Tensor,  # [B, L]
    response_mask: torch.Tensor | None = None,  # [B, L]
    *,
    chunk_size: int,
    entropy_grad: bool = False,
    temperature: float = 1.0,
    position_ids: torch.Tensor | None = None,  # [B, L] packed rows (see model_inputs)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob and entropy of a causal LM, memory-bounded. Returns ([B, L], [B, L]) fp32.

    Position t holds ``log p(ids[t] | ids[<t])`` and the entropy of that next-token distribution
    (at ``temperature``). It is computed only where both t and t-1 are real tokens (and, when given,
    ``response_mask[t]``); every other position, position 0 included, is 0. Restricting to the
    response skips the vocabulary projection for prompt tokens, which RL never uses.

    Gradient reaches the log-probs (and the entropies only with ``entropy_grad``) when called with
    grad enabled; the caller chooses ``torch.no_grad()``.

    Packed rows (``position_ids`` given, :func:`model_inputs`): each row holds several sequences
    back to back with ``attention_mask`` all 1; a position gets a statistic where ``response_mask``
    says so (a response never starts a sequence, so t - 1 is always the same sequence's token).
    """
    check_token_batch(input_ids, attention_mask, response_mask)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    B, L = input_ids.shape
    attention_mask = attention_mask.to(input_ids.device)
    inputs = model_inputs(attention_mask, position_ids)  # mask [B, L] / packed: positions + segments
    target = stat_targets(attention_mask, response_mask)  # [B, L]
    scale, needs_logits = head_logit_transform(model)
    eff_temperature = temperature / scale

    logprobs = torch.zeros(B, L, dtype=torch.float32, device=input_ids.device)  # [B, L]
    entropy = torch.zeros(B, L, dtype=torch.float32, device=input_ids.device)  # [B, L]
    tgt = target[:, 1:]  # [B, L-1] target t+1 predicted from position t
    labels = input_ids[:, 1:][tgt]  # [N]

    if needs_logits:
        # The class's own forward: `model.forward` may be overridden on the instance (see forward_as).
        out = type(model).forward(model, input_ids=input_ids, **inputs, use_cache=False)
        logits = out.logits[:, :-1][tgt]  # [N, V]
        lp, ent = ts.token_logprobs_entropy_from_logits(
            logits, labels, chunk_size=chunk_size, entropy_grad=entropy_grad, temperature=temperature
        )
    else:
        hidden = _final_hidden(model, input_ids, inputs)  # [B, L, D]
        h = hidden[:, :-1][tgt]  # [N, D]
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(
                f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None)"
            )

        def _stats(h_: torch.Tensor, labels_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return ts.token_logprobs_entropy_from_hidden(
                h_,
                head.weight,
                labels_,
                chunk_size=chunk_size,
                entropy_grad=entropy_grad,
                bias=getattr(head, "bias", None),
                temperature=eff_temperature,
            )

        with forward_as(head, _stats):
            lp, ent = head(h, labels)  # [N], [N]
    # index_put keeps the graph: gradient flows back into the selected positions only.
    where = target.nonzero(as_tuple=True)
    logprobs = logprobs.index_put(where, lp.float())
    entropy = entropy.index_put(where, ent.float())
    return logprobs, entropy


def compute_token_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L]
    attention_mask: torch.Tensor,  # [B, L]
    response_mask: torch.Tensor | None,  # [B, L]
    token_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    chunk_size: int,
    temperature: float = 1.0,
    position_ids: torch.Tensor | None = None,  # [B, L] packed rows (see model_inputs)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused training loss: (loss scalar, logprobs [B, L] detached, entropy [B, L] detached).

    ``loss = sum over stat positions (b, t) of token_loss_fn(logp, index)`` where ``index`` holds
    FLAT positions ``b * L + t`` into [B, L], so the caller gathers its per-position constants
    (old log-probs, advantages, aggregation coefficients) with ``x.reshape(-1)[index]``. Positions
    are those of :func:`compute_token_stats` (same model body, position ids, temperature and logit
    scale), and the returned log-probs / entropies equal its values.

    The LM head part is :func:`stapo.core.tokenstats.fused_token_loss_from_hidden` run as the head
    module's forward (ZeRO-3 hooks, see :func:`forward_as`): the gradients w.r.t. the hidden states
    and the head are computed in the forward, no logits are recomputed in backward. Soft-capped
    models (no hidden-state path) fall back to :func:`compute_token_stats` with gradient and then
    apply ``token_loss_fn`` to the log-probs: same loss, unfused cost. The entropy never carries
    gradient here (a loss with an entropy term must use ``token_stats(grad=True)``).
    """
    check_token_batch(input_ids, attention_mask, response_mask)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if not callable(token_loss_fn):
        raise ValueError(f"token_loss_fn must be callable (logp [n], index [n]) -> [n], got {token_loss_fn!r}")
    B, L = input_ids.shape
    attention_mask = attention_mask.to(input_ids.device)
    target = stat_targets(attention_mask, response_mask)  # [B, L]
    where = target.nonzero(as_tuple=True)  # row-major: the order of hidden[:, :-1][tgt] below
    flat = where[0] * L + where[1]  # [N] flat positions into [B, L]
    scale, needs_logits = head_logit_transform(model)

    if needs_logits:
        lp_bl, ent_bl = compute_token_stats(
            model, input_ids, attention_mask, response_mask, chunk_size=chunk_size, temperature=temperature,
            position_ids=position_ids,
        )
        lp = lp_bl[where]  # [N] with grad
        per_tok = token_loss_fn(lp, flat)  # [N]
        if tuple(per_tok.shape) != tuple(lp.shape):
            raise ValueError(f"token_loss_fn must return shape {tuple(lp.shape)}, got {tuple(per_tok.shape)}")
        return per_tok.sum(), lp_bl.detach(), ent_bl.detach()

    inputs = model_inputs(attention_mask, position_ids)  # mask [B, L] / packed: positions + segments
    hidden = _final_hidden(model, input_ids, inputs)  # [B, L, D]
    tgt = target[:, 1:]  # [B, L-1] target t+1 predicted from position t
    h = hidden[:, :-1][tgt]  # [N, D]
    labels = input_ids[:, 1:][tgt]  # [N]
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None)")

    def per_token(logp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return token_loss_fn(logp, flat[index])  # chunk positions in [0, N) -> flat [B, L] positions

    def _fused(h_: torch.Tensor, labels_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return ts.fused_token_loss_from_hidden(
            h_,
            head.weight,
            labels_,
            per_token,
            chunk_size=chunk_size,
            bias=getattr(head, "bias", None),
            temperature=temperature / scale,
        )

    with forward_as(head, _fused):
        loss, lp, ent = head(h, labels)  # scalar, [N], [N]
    logprobs = torch.zeros(B, L, dtype=torch.float32, device=input_ids.device)  # [B, L]
    entropy = torch.zeros(B, L, dtype=torch.float32, device=input_ids.device)  # [B, L]
    logprobs[where] = lp.float()
    entropy[where] = ent.float()
    return loss, logprobs, entropy


def compute_token_distribution(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # [B, L]
    attention_mask: torch.Tensor,  # [B, L]
    response_mask: torch.Tensor | None,  # [B, L]
    *,
    chunk_size: int,
    temperature: float = 1.0,
    top_k: int = 0,
    position_ids: torch.Tensor | None = None,  # [B, L] packed rows (see model_inputs)
) -> dict[str, torch.Tensor]:
    """Theorem 3.1 data of each stat position from ONE forward, no grad, at ``temperature``.

    Returns ``logprobs`` [B, L], ``entropy`` [B, L], ``sum_q2`` [B, L] (sum over the vocabulary of
    q^2, q = softmax(logits / T)), ``top_prob`` / ``top_ids`` [B, L, k] (the k most likely next
    tokens): p, H, sum q^2 and the alternatives all describe the same distribution, the one the
    token was sampled from when called with the sampling temperature on the pre-update policy.
    Positions as :func:`compute_token_stats` (0 / empty elsewhere); chunks of ``chunk_size`` rows
    bound memory to one [chunk, V] float32 block.
    """
    check_token_batch(input_ids, attention_mask, response_mask)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    B, L = input_ids.shape
    attention_mask = attention_mask.to(input_ids.device)
    inputs = model_inputs(attention_mask, position_ids)  # mask [B, L] / packed: positions + segments
    target = stat_targets(attention_mask, response_mask)  # [B, L]
    tgt = target[:, 1:]  # [B, L-1]
    labels = input_ids[:, 1:][tgt]  # [N]
    scale, needs_logits = head_logit_transform(model)

    def from_logits(chunk: Callable[[int, int], torch.Tensor], n: int, t: float) -> tuple[torch.Tensor, ...]:
        outs: list[tuple[torch.Tensor, ...]] = []
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logp_all = torch.log_softmax(chunk(s, e).float() / t, dim=-1)  # [c, V]
            q = logp_all.exp()
            k = min(top_k, q.shape[-1])
            top = torch.topk(q, k=k, dim=-1)
            outs.append((
                logp_all.gather(1, labels[s:e].unsqueeze(-1)).squeeze(-1),  # [c]
                -(q * logp_all).sum(-1),  # [c]
                (q * q).sum(-1),  # [c]
                top.values,  # [c, k]
                top.indices,  # [c, k]
            ))
        if not outs:
            V = model.config.vocab_size if hasattr(model, "config") else 0
            k = min(top_k, V) if V else top_k
            z = torch.zeros(0, device=input_ids.device)
            return z, z, z, torch.zeros(0, k, device=input_ids.device), torch.zeros(0, k, dtype=torch.long,
                                                                                     device=input_ids.device)
        return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))

    n = int(labels.shape[0])
    if needs_logits:
        out = type(model).forward(model, input_ids=input_ids, **inputs, use_cache=False)
        logits = out.logits[:, :-1][tgt]  # [N, V]
        lp, ent, q2, tv, ti = from_logits(lambda s, e: logits[s:e], n, temperature)
    else:
        hidden = _final_hidden(model, input_ids, inputs)  # [B, L, D]
        h = hidden[:, :-1][tgt]  # [N, D]
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (get_output_embeddings() is None)")

        def _dist(h_: torch.Tensor) -> tuple[torch.Tensor, ...]:
            bias = getattr(head, "bias", None)
            return from_logits(
                lambda s, e: torch.nn.functional.linear(h_[s:e], head.weight, bias), n, temperature / scale
            )

        with forward_as(head, _dist):
            lp, ent, q2, tv, ti = head(h)
    where = target.nonzero(as_tuple=True)
    k = tv.shape[-1]
    res = {
        "logprobs": torch.zeros(B, L, dtype=torch.float32, device=input_ids.device),
        "entropy": torch.zeros(B, L, dtype=torch.float32, device=input_ids.device),
        "sum_q2": torch.zeros(B, L, dtype=torch.float32, device=input_ids.device),
        "top_prob": torch.zeros(B, L, k, dtype=torch.float32, device=input_ids.device),
        "top_ids": torch.zeros(B, L, k, dtype=torch.long, device=input_ids.device),
    }
    res["logprobs"][where] = lp.float()
    res["entropy"][where] = ent.float()
    res["sum_q2"][where] = q2.float()
    res["top_prob"][where] = tv.float()
    res["top_ids"][where] = ti
    return res
