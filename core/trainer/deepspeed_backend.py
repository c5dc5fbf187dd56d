"""DeepSpeed trainer backend: ZeRO stage 0-3 on one or many GPUs and nodes (and on CPU for tests).

Every DeepSpeed-specific call of stapo lives in this file (design habit 7); ``deepspeed`` is imported
only when the backend is built, so stapo installs and imports without it.

How the update is made identical to the ``torch`` backend's:

* **Accumulation boundary owned by the loop.** The loop calls ``backward()`` once per micro-batch and
  ``step()`` once per mini-batch, with a micro-batch count DeepSpeed cannot know at config time
  (dynamic sampling changes it). The engine runs with ``gradient_accumulation_steps = 1`` and
  ``managed_gradient_accumulation = false`` (DeepSpeed >= 0.19.8): ``backward()`` only accumulates
  locally and ``step()`` is the boundary that reduces gradients, clips and updates.
  ``engine.backward(loss, scale_wrt_gas=False)`` so DeepSpeed never divides the loss (the loop has
  already divided every micro-batch loss by the GLOBAL normalizer).
* **Data parallelism sums.** DeepSpeed averages gradients over the data-parallel ranks; the loop's
  losses are per-rank shares of one global objective whose gradient is the SUM over ranks, so
  ``backward`` multiplies the loss by ``world_size`` (identity on one rank).
* **Same optimizer and schedule.** A ``torch.optim.AdamW`` object with the same parameter groups
  (passed as the client optimizer: DeepSpeed's fused Adam would need a ~1.5 minute JIT compile) and
  the same ``LambdaLR`` schedule (:func:`stapo.core.trainer.base.make_lr_scheduler`), stepped by the
  engine only on applied updates. With ``trainer.offload_optimizer`` the optimizer is DeepSpeed's
  CPU Adam instead (built from the config, compiled once), which is what offloading is for.
* **Clipping and non-finite skips.** ZeRO 1-3 and the bf16 optimizer clip to
  ``gradient_clipping`` and skip updates whose global norm is inf/nan (grads zeroed, LR schedule
  not advanced), whatever ``trainer.skip_nonfinite`` says. At ZeRO-0 in fp32 (CPU) DeepSpeed uses
  the client optimizer bare, so :class:`_ClippedAdamW` does clipping and the skip itself, after the
  gradients were averaged, and exposes them through the attributes the engine reads.

Precision: bf16 (with fp32 master weights in the optimizer) on GPU, fp32 on CPU.

Loading at ZeRO-3: :meth:`DeepSpeedBackend.load_context` is the context the loop loads the policy
under. It holds a ``transformers.integrations.HfDeepSpeedConfig`` of the engine's own config (the
non-Trainer use transformers documents), so ``from_pretrained`` builds the model inside
``deepspeed.zero.Init``: each parameter is partitioned as it is made, rank 0 reads the checkpoint
and every other rank reads only its keys and shapes, and the weights are copied in one module at a
time. No rank holds the whole model on its GPU, and only rank 0 reads it into host memory. The
engine then takes the partitioned module as it is (DeepSpeed recognizes parameters that carry a
``ds_id``). The partitions' dtype is the engine's (bf16 on GPU, fp32 on CPU).

LM head under ZeRO-3: the head weight is partitioned; :func:`stapo.core.trainer.base.compute_token_stats`
runs the chunked log-softmax as the head module's forward, so ZeRO-3's module hooks gather the
weight before the forward and again before the backward (gradients reach it and are
reduce-scattered as usual). :meth:`named_parameters_for_sync` and :meth:`export_hf` gather full
tensors one parameter (or one ``trainer.sync_bucket_mb`` bucket) at a time.

Checkpoints: ``engine.save_checkpoint`` / ``load_checkpoint`` (tag ``state``) at every stage: each
rank writes its own ZeRO shards, the LR scheduler state rides along, and resuming on the same world
size is exact. Use ``export_hf`` (or DeepSpeed's ``zero_to_fp32.py``) for a portable copy.

Launch (one node, 8 GPUs; many nodes: add ``--hostfile``, see ``docs/training-backends.md``)::

    deepspeed --num_gpus 8 -m stapo.cli.main train --config configs/stapo.yaml --set trainer.backend=deepspeed

Single process (tests, CPU): RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT get defaults when
unset and the gloo backend is used, so no launcher or MPI is needed.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stapo.core.lazy import no_progress_bars
from stapo.core.trainer.attention import use_attention
from stapo.core.trainer.base import (
    adamw_param_groups,
    apply_optimizer_settings,
    compute_token_distribution,
    compute_token_loss,
    compute_token_stats,
    enable_activation_checkpointing,
    forward_as,
    make_lr_scheduler,
    make_readable,
    scaled_lr,
)

__all__ = ["DeepSpeedBackend", "build_ds_config", "cpu_adam_build_missing", "engine_options", "init_distributed",
           "sync_buckets"]

log = logging.getLogger(__name__)

_TAG = "state"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(deepspeed: Any, *, cpu: bool, timeout_s: float = 3600.0) -> None:
    """Join (or create) the process group. Under the launcher the env is set; alone, default to 1 rank.

    Without these variables DeepSpeed falls back to MPI discovery, which fails on a missing mpi4py.
    On CPU the backend is gloo (DeepSpeed's CPU accelerator would otherwise ask for oneCCL).
    ``timeout_s``: every collective's timeout (``trainer.dist_timeout_s``: ranks generate apart for
    minutes between collectives, longer than DeepSpeed's 10-minute default).
    """
    if dist.is_available() and dist.is_initialized():
        # A group made earlier in this process (another engine, a test) whose launcher variables are
        # gone: DeepSpeed's engine still reads LOCAL_RANK, so restore what the group says.
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if cpu:
        # DeepSpeed's CPU comm JIT-compiles a shared-memory all-reduce kernel (~2 minutes) at init;
        # gloo is enough for CPU runs, so mark the op unavailable and nothing gets compiled.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo" if cpu else None, auto_mpi_discovery=False,
                               timeout=timedelta(seconds=timeout_s))


def sync_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive parameter indices grouped so that each group's bytes stay within ``bucket_bytes``
    (a parameter larger than that is a group of its own; ``bucket_bytes <= 0``: one per group)."""
    buckets: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if buckets and bucket_bytes > 0 and used + size <= bucket_bytes:
            buckets[-1].append(i)
            used += size
        else:
            buckets.append([i])
            used = size
    return buckets


def build_ds_config(trainer_cfg: Any, *, bf16: bool, offload: bool, own_clip: bool) -> dict[str, Any]:
    """The DeepSpeed JSON config for ``trainer_cfg`` (see the module docstring for each choice)."""
    stage = int(trainer_cfg.zero_stage)
    zero: dict[str, Any] = {"stage": stage}
    if stage <= 1:
        zero["overlap_comm"] = False  # required by unmanaged accumulation below stage 2
    threshold = getattr(trainer_cfg, "zero3_param_persistence_threshold", None)
    if stage == 3 and threshold is not None:
        zero["stage3_param_persistence_threshold"] = int(threshold)
    if offload:
        if stage == 0:
            raise ValueError("trainer.offload_optimizer needs trainer.zero_stage >= 1 (ZeRO-Offload)")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(trainer_cfg.micro_batch_size),
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.0 if own_clip else float(trainer_cfg.max_grad_norm),
        "zero_optimization": zero,
        "bf16": {"enabled": bool(bf16)},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if offload:
        config["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": float(trainer_cfg.lr),
                "betas": list(trainer_cfg.betas),
                "eps": float(trainer_cfg.adam_eps),
                "weight_decay": float(trainer_cfg.weight_decay),
            },
        }
    return config


def engine_options(trainer_cfg: Any, *, cpu: bool) -> dict[str, bool]:
    """:func:`build_ds_config`'s switches for ``trainer_cfg`` on this accelerator: bf16 on GPU (fp32 on
    CPU, where DeepSpeed's bf16 path needs an accelerator), offload as configured, and our own clipping
    where DeepSpeed has none (ZeRO-0 in fp32). One place, so the engine and the ZeRO-3 load agree."""
    return {
        "bf16": not cpu,
        "offload": bool(trainer_cfg.offload_optimizer),
        "own_clip": int(trainer_cfg.zero_stage) == 0 and cpu,
    }


def cpu_adam_build_missing(environ: Mapping[str, str]) -> list[str]:
    """The tools ``trainer.offload_optimizer`` needs and ``environ``'s PATH lacks ([]: none missing).

    DeepSpeed's CPU Adam is a C++ op that its PyPI release does not ship compiled (built with
    ``DS_BUILD_OPS=0``): at its first use DeepSpeed (0.19's ``OpBuilder.jit_load``) compiles it through
    ``torch.utils.cpp_extension``, which runs ``ninja`` and the C++ compiler ``$CXX`` (default
    ``c++``) found on PATH. A DeepSpeed installed with the op prebuilt (``DS_BUILD_CPU_ADAM=1``)
    needs neither; that is read from DeepSpeed only when a tool is missing (importing it is slow).
    """
    path = environ.get("PATH", "")
    missing = [tool for tool in (environ.get("CXX", "c++"), "ninja") if shutil.which(tool, path=path) is None]
    if missing:
        from deepspeed.git_version_info import installed_ops

        if installed_ops.get("cpu_adam"):
            return []
    return missing


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as err:  # pragma: no cover - exercised only without deepspeed
        raise ImportError(
            "trainer.backend=deepspeed needs the deepspeed package: pip install 'stapo[train]'"
        ) from err
    return deepspeed


def _on_cpu(trainer_cfg: Any) -> bool:
    """Whether DeepSpeed's accelerator is the CPU; a ``trainer.device`` that disagrees is refused."""
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if trainer_cfg.device != "auto" and (trainer_cfg.device == "cpu") != (name == "cpu"):
        raise ValueError(
            f"trainer.device={trainer_cfg.device!r} but DeepSpeed's accelerator is {name!r}; "
            "with deepspeed use `auto` (or set DS_ACCELERATOR)"
        )
    return name == "cpu"


class _ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips to ``max_norm`` and skips non-finite updates itself (ZeRO-0 fp32 only).

    At ZeRO-0 without bf16 DeepSpeed calls the client optimizer directly, after averaging the
    gradients over ranks; there is no wrapper that measures the norm or skips overflows. The engine
    reads ``overflow`` (True: the LR scheduler is not stepped) and ``_global_grad_norm`` from its
    optimizer, so this class provides both, matching what ZeRO 1-3 do.
    """

    def __init__(self, params: Any, *, max_norm: float, skip_nonfinite: bool, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.max_norm = max_norm
        self.skip_nonfinite = skip_nonfinite
        self.overflow = False
        self._global_grad_norm = 0.0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_norm)) if params else 0.0
        self._global_grad_norm = norm
        self.overflow = not math.isfinite(norm) and self.skip_nonfinite
        if self.overflow:
            return None
        return super().step(closure)


class DeepSpeedBackend:
    """ZeRO 0-3 through a DeepSpeed engine; same contract and same update as ``TorchBackend``."""

    @classmethod
    @contextmanager
    def load_context(cls, cfg: Any) -> Iterator[None]:
        """The context the policy is loaded under: at ZeRO-3, ``from_pretrained`` builds it partitioned.

        Inside it a ``transformers.integrations.HfDeepSpeedConfig`` of the engine's config (the same
        :func:`build_ds_config` the engine gets) is alive, which is what makes transformers build the
        model under ``deepspeed.zero.Init`` and load the checkpoint one gathered module at a time
        (rank 0 reads the values). transformers keeps only a weak reference to that object, so this
        frame holds it; it is dropped on exit, so models built later in the process (a KL reference,
        a teacher) are not partitioned by accident. Joins the process group first: ``zero.Init``
        partitions over it. Stages 0-2: nothing to do (the engine places the whole model).
        """
        if int(cfg.trainer.zero_stage) != 3:
            yield
            return
        deepspeed = _import_deepspeed()
        from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

        cpu = _on_cpu(cfg.trainer)
        init_distributed(deepspeed, cpu=cpu, timeout_s=cfg.trainer.dist_timeout_s)
        hf_ds_config = HfDeepSpeedConfig(build_ds_config(cfg.trainer, **engine_options(cfg.trainer, cpu=cpu)))
        try:
            yield
        finally:
            del hf_ds_config
            unset_hf_deepspeed_config()

    def __init__(self, cfg: Any, model: torch.nn.Module, total_optimizer_steps: int) -> None:
        deepspeed = _import_deepspeed()
        from deepspeed.runtime.engine import DeepSpeedEngine

        if not hasattr(DeepSpeedEngine, "managed_gradient_accumulation"):
            raise ImportError(
                f"deepspeed {deepspeed.__version__} lacks `managed_gradient_accumulation`, which lets the "
                "RL loop own the optimizer-step boundary; install deepspeed>=0.19.8"
            )
        if total_optimizer_steps < 1:
            raise ValueError(f"total_optimizer_steps must be >= 1, got {total_optimizer_steps}")
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self.cfg = cfg
        self.tcfg = tcfg = cfg.trainer
        self.total_optimizer_steps = total_optimizer_steps
        self._deepspeed = deepspeed
        cpu = _on_cpu(tcfg)
        init_distributed(deepspeed, cpu=cpu, timeout_s=tcfg.dist_timeout_s)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.zero_stage = int(tcfg.zero_stage)
        options = engine_options(tcfg, cpu=cpu)
        if cpu and any(p.dtype != torch.float32 for p in model.parameters()):
            if any(hasattr(p, "ds_id") for p in model.parameters()):
                raise ValueError("the policy was partitioned in a 16-bit dtype but DeepSpeed runs fp32 on CPU; "
                                 "load it under DeepSpeedBackend.load_context (its config sets fp32)")
            model = model.float()  # CPU runs fp32 (DeepSpeed's bf16 path needs an accelerator)
        # the attention set on the model (None: its own), see stapo.core.trainer.attention
        self.attn_implementation = use_attention(model, self.tcfg.attn_implementation, packed=self.tcfg.micro_batch_tokens is not None)
        if cfg.model.gradient_checkpointing:
            enable_activation_checkpointing(model)
        if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
            model.config.use_cache = False

        offload, own_clip = options["offload"], options["own_clip"]
        ds_config = build_ds_config(tcfg, **options)
        groups = adamw_param_groups(model, tcfg.weight_decay)
        adam_kw = {"lr": tcfg.lr, "betas": tuple(tcfg.betas), "eps": tcfg.adam_eps}
        if offload:
            optimizer = None  # DeepSpeed builds its CPU Adam from the config over `groups`
        elif own_clip:
            optimizer = _ClippedAdamW(
                groups, max_norm=tcfg.max_grad_norm, skip_nonfinite=tcfg.skip_nonfinite, **adam_kw
            )
        else:
            optimizer = torch.optim.AdamW(groups, **adam_kw)

        def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
            return make_lr_scheduler(opt, tcfg, total_optimizer_steps)

        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=groups if optimizer is None else None,
            lr_scheduler=scheduler,
            config=ds_config,
            dist_init_required=False,
        )
        self.model = self.engine.module
        self.device = torch.device(self.engine.device)
        self.updates_applied = 0
        self.updates_skipped = 0

    # ------------------------------------------------------------------ forward

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
        """(logprobs [B, L], entropy [B, L]) fp32; see ``compute_token_stats``."""
        self.engine.train(grad)

        def stats(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor | None, pos: torch.Tensor | None) -> Any:
            return compute_token_stats(
                self.model,
                ids,
                attn,
                resp,
                chunk_size=self.tcfg.logits_chunk_size,
                entropy_grad=self.tcfg.entropy_grad,
                temperature=temperature,
                position_ids=pos,
            )

        return self._engine_forward(stats, input_ids, attention_mask, response_mask, position_ids, grad=grad)

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
        """No-grad p, H, sum q^2 and top-k as the engine's forward (ZeRO-3 gathers: every rank calls)."""
        self.engine.train(False)

        def dist_fn(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor | None, pos: torch.Tensor | None) -> Any:
            return compute_token_distribution(
                self.model, ids, attn, resp,
                chunk_size=self.tcfg.logits_chunk_size, temperature=temperature, top_k=top_k, position_ids=pos,
            )

        return self._engine_forward(dist_fn, input_ids, attention_mask, response_mask, position_ids, grad=False)

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

        Runs as the engine's forward, like :meth:`token_stats` (ZeRO-3 gathers and micro-step
        bookkeeping); the LM head's gradient is computed inside that forward while ZeRO-3 holds the
        gathered weight, and handed to autograd by :meth:`backward`.
        """
        self.engine.train(True)

        def fused(ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor | None, pos: torch.Tensor | None) -> Any:
            return compute_token_loss(
                self.model,
                ids,
                attn,
                resp,
                token_loss_fn,
                chunk_size=self.tcfg.logits_chunk_size,
                temperature=temperature,
                position_ids=pos,
            )

        return self._engine_forward(fused, input_ids, attention_mask, response_mask, position_ids, grad=True)

    def _engine_forward(
        self, fn: Callable[..., Any], input_ids: torch.Tensor, attention_mask: torch.Tensor,
        response_mask: torch.Tensor | None, position_ids: torch.Tensor | None, *, grad: bool,
    ) -> Any:
        """Run ``fn(ids, attn, resp, pos)`` as the engine's forward.

        DeepSpeed's per-forward bookkeeping (ZeRO micro-step counters that decide copy vs accumulate,
        backward hooks on the outputs, ZeRO-3 parameter tracing) must see the computation, or ZeRO-3
        overwrites instead of accumulating gradients.
        """
        ctx = torch.enable_grad() if grad else torch.no_grad()
        resp = None if response_mask is None else response_mask.to(self.device)
        pos = None if position_ids is None else position_ids.to(self.device)
        with ctx, forward_as(self.model, fn):
            return self.engine(input_ids.to(self.device), attention_mask.to(self.device), resp, pos)

    # ------------------------------------------------------------------ frozen reference (KL)

    def frozen_copy(self, dtype: torch.dtype | None = None, *, offload: bool = False) -> Any:
        """A no-grad copy of the policy's current weights, partitioned like the policy (ZeRO-3 only).

        Why: under ZeRO-3 no rank holds the whole model, so the KL reference cannot be a
        ``copy.deepcopy`` of it; like the reference workers of OpenRLHF and verl, it gets its own
        DeepSpeed ZeRO-3 engine built without an optimizer (DeepSpeed's ZeRO inference: parameters
        partitioned over the ranks, gathered module by module in each forward and released after).
        Built without ever holding the full model on a rank: the module is constructed inside
        ``deepspeed.zero.Init`` (partitioned as it is made) and filled one parameter at a time,
        gathering the policy's tensor and writing it into the reference's (rank 0's copy is
        broadcast back into the partitions). Every rank must call this, and every forward of the
        returned engine's module, the same number of times. ``dtype``: the copy's dtype (None: the
        policy's). ``offload``: partitions kept on the CPU (DeepSpeed's ``offload_param``), fetched to
        the device for each forward. Returns the engine; its ``module`` is the frozen model.
        """
        if self.zero_stage != 3:
            raise ValueError(f"frozen_copy partitions like ZeRO-3; this engine runs ZeRO-{self.zero_stage}")
        ds = self._deepspeed
        cfg = getattr(self.model, "config", None)
        if cfg is None:
            raise TypeError(f"frozen_copy rebuilds the model from its config; {type(self.model).__name__} has none")
        dtype = dtype or next(self.model.parameters()).dtype
        zero: dict[str, Any] = {"stage": 3}
        threshold = getattr(self.tcfg, "zero3_param_persistence_threshold", None)
        if threshold is not None:
            zero["stage3_param_persistence_threshold"] = int(threshold)
        if offload:
            zero["offload_param"] = {"device": "cpu", "pin_memory": self.device.type != "cpu"}
        config = {
            "train_micro_batch_size_per_gpu": int(self.tcfg.micro_batch_size),
            "zero_optimization": zero,
            "bf16": {"enabled": dtype == torch.bfloat16},  # zero.Init takes the dtype from here
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"frozen_copy supports bfloat16 and float32, got {dtype}")
        from transformers.initialization import no_init_weights
        from transformers.integrations.deepspeed import prevent_arange_dtype_change

        # As transformers builds a model under ZeRO-3: no weight init (the partitions are empty, and
        # every weight is copied below) and RoPE buffers kept in their own dtype.
        with no_init_weights(), prevent_arange_dtype_change(), ds.zero.Init(config_dict_or_path=config):
            ref = type(self.model)(copy.deepcopy(cfg))  # fp32 unless bf16 is enabled above
        if hasattr(ref, "tie_weights"):
            ref.tie_weights()  # tied heads share the embedding, as in the policy (weight init skipped it)
        ref.requires_grad_(False)
        policy = dict(self.model.named_parameters())
        names = [n for n, _ in ref.named_parameters()]
        if sorted(names) != sorted(policy):
            raise RuntimeError(f"frozen_copy: the rebuilt model's parameters differ from the policy's: "
                               f"{sorted(set(names) ^ set(policy))[:5]}")
        for name, p in ref.named_parameters():
            src = policy[name]
            with self._gathered([src]), ds.zero.GatheredParameters([p], modifier_rank=0):
                if self.rank == 0:
                    p.data.copy_(src.data.to(p.dtype))
        buffers = dict(self.model.named_buffers())
        for name, b in ref.named_buffers():
            if name in buffers:
                b.copy_(buffers[name].to(b.dtype))
        engine, *_ = ds.initialize(model=ref, config=config, dist_init_required=False)
        engine.eval()
        return engine

    # ------------------------------------------------------------------ update

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate; ``loss * world_size`` turns DeepSpeed's rank average into the global sum."""
        if loss.ndim != 0:
            raise ValueError(f"loss must be a scalar tensor, got shape {tuple(loss.shape)}")
        self.engine.backward(loss * self.world_size if self.world_size > 1 else loss, scale_wrt_gas=False)

    def zero_grad(self) -> None:
        """Drop accumulated gradients (module grads and ZeRO's partitioned buffers)."""
        self.engine.zero_grad()
        if hasattr(self.optimizer, "zero_grad"):  # ZeRO / bf16 wrappers keep their own grad buffers
            self.optimizer.zero_grad()

    def current_lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def step(self, *, lr_scale: float = 1.0) -> dict[str, float]:
        """Reduce, clip, update, schedule (all inside ``engine.step``) -> {"grad_norm", "lr", "skipped"};
        ``lr_scale``: this step's LR multiplier (``TrainerBackend.step``), on the engine's optimizer."""
        with scaled_lr(self.optimizer, lr_scale):
            return self._step()

    def _step(self) -> dict[str, float]:
        lr = self.current_lr()
        self.engine.step()
        applied = bool(self.engine.was_step_applied())
        norm = self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        if not applied:
            self.zero_grad()
            self.updates_skipped += 1
            log.warning("deepspeed backend: non-finite grad norm; update skipped")
            return {"grad_norm": float("nan"), "lr": lr, "skipped": 1.0}
        self.updates_applied += 1
        return {"grad_norm": norm, "lr": lr, "skipped": 0.0}

    # ------------------------------------------------------------------ weights out

    def _gathered(self, params: list[torch.nn.Parameter]) -> Any:
        return self._deepspeed.zero.GatheredParameters(params, enabled=self.zero_stage == 3)

    def named_parameters_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors, streamed: never the whole model gathered at once.

        Under ZeRO-3 the parameters are gathered one bucket at a time (``trainer.sync_bucket_mb``;
        0: one parameter at a time, as TRL's colocated sync does), each yielded without a copy and
        released when the next bucket is drawn: a yielded tensor is valid until the consumer asks
        for the next one beyond its bucket, so a consumer copies what it keeps (vLLM copies into its
        own weights). Every rank must draw the whole stream (each gather is a collective). At the
        peak one bucket (or the largest parameter) is alive beyond the partitions.
        """
        named = list(self.model.named_parameters())
        if self.zero_stage != 3:
            for name, p in named:
                yield name, p.detach()
            return
        sizes = [int(getattr(p, "ds_numel", p.numel())) * p.element_size() for _, p in named]
        for bucket in sync_buckets(sizes, int(self.tcfg.sync_bucket_mb * 2**20)):
            with self._gathered([named[i][1] for i in bucket]):
                for i in bucket:
                    yield named[i][0], named[i][1].detach()

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's state dict on CPU (gathered under ZeRO-3), on every rank.

        ``rank0_only``: the other ranks still draw the gathers (collectives) but keep nothing and
        get ``{}``, so only the rank that writes holds a host copy of the model.
        """
        keep = not rank0_only or self.rank == 0
        sd = {}
        for name, t in self.named_parameters_for_sync():
            if keep:
                sd[name] = t.detach().to("cpu", copy=True)
        if keep:
            for name, b in self.model.named_buffers():
                sd[name] = b.detach().to("cpu", copy=True)
        return sd

    def export_hf(self, path: Path, tokenizer: Any) -> None:
        """``save_pretrained`` of the current policy, written by rank 0 (all ranks must call it)."""
        path = Path(path)
        sd = self.full_state_dict(rank0_only=True) if self.zero_stage == 3 else None
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            with no_progress_bars():
                self.model.save_pretrained(path, state_dict=sd, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
            make_readable(path)
        if self.world_size > 1:
            dist.barrier()

    # ------------------------------------------------------------------ data parallel

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over data-parallel ranks (a new tensor on ``t``'s device)."""
        if self.world_size == 1:
            return t
        out = t.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(t.device)

    def all_gather_1d(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenation of a 1-D tensor from every rank, in rank order; lengths may differ per rank."""
        if t.ndim != 1:
            raise ValueError(f"all_gather_1d expects a 1-D tensor, got shape {tuple(t.shape)}")
        if self.world_size == 1:
            return t
        local = t.detach().to(self.device)
        n = torch.tensor([local.numel()], device=self.device, dtype=torch.long)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n)
        lengths = [int(s) for s in sizes]
        padded = torch.zeros(max(lengths), dtype=local.dtype, device=self.device)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:k] for p, k in zip(parts, lengths, strict=True)]).to(t.device)

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: Path) -> None:
        """DeepSpeed checkpoint (model, optimizer/ZeRO shards, LR scheduler) under ``path``; all ranks call."""
        path = Path(path)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        if self.world_size > 1:
            dist.barrier()
        client = {"updates_applied": self.updates_applied, "updates_skipped": self.updates_skipped}
        self.engine.save_checkpoint(str(path), tag=_TAG, client_state=client)

    def load(self, path: Path) -> None:
        """Restore what :meth:`save` wrote (same world size and ZeRO stage)."""
        path = Path(path)
        if not (path / _TAG).is_dir():
            raise FileNotFoundError(f"no deepspeed trainer state at {path / _TAG}")
        load_path, client = self.engine.load_checkpoint(
            str(path), tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise RuntimeError(f"deepspeed could not load the checkpoint at {path}")
        apply_optimizer_settings(self.scheduler, self.tcfg, self.total_optimizer_steps)
        self.updates_applied = int((client or {}).get("updates_applied", 0))
        self.updates_skipped = int((client or {}).get("updates_skipped", 0))
        self.zero_grad()
