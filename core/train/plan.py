"""The memory plan: what one GPU holds at each phase of a step, from the model's config alone.

``stapo train --plan`` (and ``stapo train`` itself at start on a GPU) sizes a run before anything
loads: no weights, no network. Parameters are counted by building the model from its ``config.json``
on PyTorch's ``meta`` device (shapes only). The recipes' models ship their configs
(``stapo/configs/models``: Qwen3 1.7B / 8B / 14B base); any local model folder works too.

Per GPU, in bytes (P parameters, L the largest module's own parameters, N ranks, T the tokens of the
longest forward, h hidden size, n layers)::

    model states   DeepSpeed's accounting of mixed-precision Adam: 16-bit weights (2 B/param),
                   16-bit + fp32 gradients (2 + 4), fp32 master weights and two moments (4 + 8);
                   ZeRO-1 partitions the fp32 states over N, ZeRO-2 also the gradients, ZeRO-3 also
                   the weights (plus one gathered layer, 4 L; the policy is built partitioned
                   under ``zero.Init``, so loading it never puts the whole model on a GPU, which
                   is the estimator's ``zero_init=True``). Stages 2 and 3 are DeepSpeed's own
                   estimators (``estimate_zero2/3_model_states_mem_needs``); stages 0 and 1 follow
                   the same accounting (DeepSpeed has no estimator for them). ``offload_optimizer``
                   moves the fp32 states and gradients to the CPU. The torch backend keeps fp32
                   weights, gradients and moments (16 B/param) plus, on CUDA, autocast's bf16
                   weight copies (2 B/param).
    activations    the longest micro-batch (T tokens): with gradient checkpointing each layer's
                   input (n T h) plus one layer recomputed for its backward and the gradients
                   flowing through it (1.5 layers); without it every layer's activations. Plus the
                   chunked LM head (logits_chunk_size x vocab, fp32). On CPU a small model's
                   update measures within 3% of this (benchmarks/plan_memory.py).
    kept graphs    a weighting that reads p / H (s2t, top_entropy, stare; Lp-Reg's term) needs the
                   whole mini-batch's statistics before any backward: stapo.core.train.update keeps every
                   micro-batch's graph (its checkpointed inputs) until then. When those graphs do
                   not fit the card, the update takes its bounded path instead: a no-grad
                   statistics pass over the mini-batch, then forward + backward per micro-batch.
    ZeRO buffers   what DeepSpeed holds beyond the partitions while it trains, from the engine's
                   own settings (``build_ds_config`` read through DeepSpeed's ``DeepSpeedZeroConfig``,
                   so its defaults where stapo sets nothing): ZeRO-3's prefetch bucket, its live
                   gathered parameters (``stage3_max_live_parameters``, at most the model) and its
                   gradient reduce bucket, 2 B each (bf16); ZeRO-1/2's reduce and all-gather buckets.
                   DeepSpeed's estimators leave these out.
    vLLM           ``gpu_memory_utilization`` x card while it generates: its bf16 weights (/ TP)
                   and the KV cache in the rest (its CUDA-graph pool is inside that share). Asleep
                   (level 2) during the update, which frees the weights and the KV cache but, in
                   vLLM 0.33, neither the CUDA-graph pool nor the NCCL communicators unless
                   ``sleep_mode_offload_cudagraph`` / ``enable_nccl_comm_suspend`` are set (both
                   default off in 0.33's ``config/model.py``). The engine sets each that the
                   installed vLLM has (:func:`stapo.core.rollout.vllm.sleep_release_flags`); the
                   plan charges the update with what stays: ``CUDA_GRAPHS_GIB`` for the graph pool
                   (without ``enforce_eager``) and ``VLLM_NCCL_GIB`` for a tensor-parallel group.
    weight sync    vLLM's weights awake and the model states, plus the gathered sync bucket
                   (``trainer.sync_bucket_mb``, at least the largest parameter) and one layer of
                   vLLM's in-place reload (it reloads layer by layer), bf16.
    fleet          ``rollout.engine: vllm_server``: the servers generate, so a learner holds no KV
                   cache and no vLLM; rank 0's push beyond the model states is the "weight push"
                   phase. ``checkpoint``: one shard bucket, ``rollout.server.bucket_mb`` (at least the
                   largest parameter). ``nccl``: vLLM's packed broadcast (packed_tensor.py in 0.32 and
                   0.33) keeps ``NCCL_PACKED_BUFFERS`` (2) packed chunks on the GPU at once (one in
                   flight, one being packed), each the buffer size the push passes
                   (``bucket_mb``; vLLM's default is 1 GiB) plus at most one parameter (a chunk closes
                   once it exceeds the buffer); under ZeRO-3 also the gathered parameters a chunk
                   collects before copying them (one more chunk) and the rest of the gather they came
                   from (``trainer.sync_bucket_mb``). Without ZeRO-3 the stream yields the resident
                   parameters themselves (no gather, no copy). Wire dtype: the learner's weights (bf16
                   under DeepSpeed, fp32 with the torch backend). An upper bound: two chunks in
                   flight both closed by the largest parameter (on Qwen3-8B the embedding and
                   lm_head close chunks that are not adjacent, so the true peak is lower).
    runtime        the CUDA context, 1 GiB, and, with several ranks, the learners' NCCL
                   communicators, ``NCCL_GIB`` (our allowances; not measured here).
    margin         ``FRAGMENTATION`` of the card: the caching allocator's rounding and split
                   segments (our allowance). A plan fits only when its peak plus the margin fits.

The peak is the largest phase: generate (model states + vLLM, or hf's KV cache), update (model
states + activations + kept graphs + ZeRO buffers, vLLM asleep), weight sync (or the fleet's
weight push). Activation and kept-graph terms are our accounting of what the update's forwards
save, held against measured CPU peaks (benchmarks/plan_memory.py; tests/unit/test_plan.py checks
the kept graphs and the optimizer's bytes); the model states are DeepSpeed's.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stapo.core.algos import token_weighting_spec
from stapo.core.config import apply_overrides, config_from_dict
from stapo.core.rollout.vllm import sleep_release_flags
from stapo.core.rollout.vllm_server import NCCL_PACKED_BUFFERS
from stapo.core.trainer.deepspeed_backend import build_ds_config, engine_options
from stapo.core.trainer.models import build_tiny_model, demo_cache_path

if TYPE_CHECKING:
    from stapo.core.config import Config, ModelConfig

__all__ = ["GIB", "ModelShape", "Plan", "PlanError", "card_gib", "model_shape", "plan_at_start", "plan_memory", "plan_run",
           "resolve_update_memory"]

GIB = 2**30
# Planning without a GPU and without --card-gib / trainer.gpu_memory_gib: an 80 GB card (H100/A100),
# its nominal size; what torch reports as usable is about 1 GiB less, which RUNTIME_GIB covers.
DEFAULT_CARD_GIB = 80.0
RUNTIME_GIB = 1.0  # the CUDA context and kernel workspaces [ours: allowance]
NCCL_GIB = 1.0  # a learner's NCCL communicators with several ranks [ours: allowance]
VLLM_NCCL_GIB = 0.5  # a vLLM tensor-parallel group's communicators, kept asleep without suspend [ours]
CUDA_GRAPHS_GIB = 1.0  # vLLM's CUDA-graph pool, kept asleep without offload [ours: vLLM logs its size at start]
FRAGMENTATION = 0.05  # share of the card left for the caching allocator's fragmentation [ours]
LM_HEAD_BUFFERS = 3  # fp32 [chunk, V] blocks alive at once in the chunked log-softmax: logits, log-probs, probs/grad


class PlanError(ValueError):
    """A model whose shape the plan cannot know (no config.json), or a config that cannot fit."""


# ----------------------------------------------------------------------------- the model's shape


@dataclass(frozen=True)
class ModelShape:
    """What the plan reads of a model: its counts and the sizes of its activations."""

    source: str  # where the config came from
    params: int  # unique parameters (tied embeddings once)
    largest_layer_params: int  # the largest module's own parameters (DeepSpeed's ``model_to_params``)
    largest_param: int  # the largest single tensor (what one streamed weight-sync item holds)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def _shipped_config(name: str) -> Path | None:
    """The shipped config.json of a recipe model: ``Qwen/Qwen3-8B-Base`` (or ``Qwen/Qwen3-8B``)."""
    from importlib import resources

    base = name.rsplit("/", 1)[-1]
    folder = resources.files("stapo.configs") / "models"
    for stem in (base, f"{base}-Base"):
        p = folder / f"{stem}.json"
        if name.startswith("Qwen/") and p.is_file():
            return Path(str(p))
    return None


def model_config(model_cfg: ModelConfig) -> tuple[Any, str]:
    """(transformers config, where it came from) of ``model.name_or_path``, without weights or network."""
    from transformers import AutoConfig

    name = model_cfg.name_or_path
    if name == "tiny-random":
        import torch

        with torch.device("meta"):
            return build_tiny_model(model_cfg.tiny).config, "tiny-random (model.tiny)"
    if name.startswith("demo:"):
        path = demo_cache_path(model_cfg) / "config.json"
    else:
        path = Path(name).expanduser() / "config.json"
        if not path.is_file():
            path = _shipped_config(name) or path
    if not path.is_file():
        try:  # a hub model already in the local Hugging Face cache (never the network)
            return AutoConfig.from_pretrained(name, local_files_only=True), f"{name} (Hugging Face cache)"
        except (OSError, ValueError):
            pass
        raise PlanError(
            f"model.name_or_path={name}: the plan needs the model's config.json; shipped: Qwen/Qwen3-1.7B-Base, "
            "Qwen/Qwen3-8B-Base, Qwen/Qwen3-14B-Base, or models in the local Hugging Face cache; otherwise point "
            "it at a local model folder"
        )
    data = json.loads(path.read_text())
    return AutoConfig.for_model(data.pop("model_type"), **data), str(path)


def model_shape(model_cfg: ModelConfig) -> ModelShape:
    """Count parameters by building the model on the ``meta`` device (shapes only, no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    config, source = model_config(model_cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    return ModelShape(
        source=source,
        params=int(params),
        largest_layer_params=int(largest_layer),
        largest_param=int(max(p.numel() for p in model.parameters())),
        hidden=hidden,
        intermediate=int(config.intermediate_size),
        layers=int(config.num_hidden_layers),
        heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        vocab=int(config.vocab_size),
    )


# ----------------------------------------------------------------------------- model states


def model_states(cfg: Config, shape: ModelShape, world_size: int, *, cuda: bool) -> dict[str, int]:
    """Bytes per GPU of weights, gradients and optimizer state (module docstring), and their sum."""
    P, L, N, t = shape.params, shape.largest_layer_params, world_size, cfg.trainer
    if t.backend == "torch":
        w = 4 * P + (2 * P if cuda else 0)  # fp32 master weights (+ autocast's bf16 copies on CUDA)
        return {"weights": w, "gradients": 4 * P, "optimizer": 8 * P, "total": w + 12 * P}
    stage, off = t.zero_stage, t.offload_optimizer
    weights = 2 * P // N + 4 * L if stage == 3 else 2 * P
    if off:  # fp32 gradients, master weights and moments live on the CPU
        grads, optim = 0, 0
    else:
        # 16-bit + fp32 gradients (2 + 4 B); ZeRO-3: DeepSpeed counts 18 B/param in all, 2 of them the
        # weights' partition, so 4 for the gradients
        grads = {0: 6 * P, 1: 2 * P + 4 * P // N, 2: 6 * P // N}.get(stage, 4 * P // N)
        optim = 12 * P // N if stage else 12 * P
    total = weights + grads + optim
    if stage in (2, 3):  # DeepSpeed's own estimators are the reference for these stages
        total = deepspeed_model_states(P, L, N, stage=stage, offload=off)
    return {"weights": weights, "gradients": grads, "optimizer": optim, "total": total}


def deepspeed_model_states(params: int, largest_layer: int, world_size: int, *, stage: int, offload: bool) -> int:
    """GPU bytes per rank from DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs``."""
    _quiet_deepspeed()
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return int(estimate_zero2_model_states_mem_needs(params, world_size, 1, cpu_offload=offload)[1])
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    return int(estimate_zero3_model_states_mem_needs(params, largest_layer, world_size, 1, cpu_offload=offload,
                                                     cpu_offload_params=False, zero_init=True)[1])


def zero_buffers(cfg: Config, shape: ModelShape) -> int:
    """Bytes DeepSpeed holds beyond the partitions while it trains, from the engine's own settings:
    ZeRO-3's prefetch bucket, live gathered parameters (at most the model) and reduce bucket; ZeRO-1/2's
    reduce and all-gather buckets; bf16 (2 B) each. 0 for the torch backend and ZeRO-0."""
    t = cfg.trainer
    if t.backend != "deepspeed" or t.zero_stage == 0:
        return 0
    zero = zero_settings(cfg)
    if t.zero_stage == 3:
        return 2 * (zero.prefetch_bucket_size + min(zero.max_live_parameters, shape.params) + zero.reduce_bucket_size)
    return 2 * (zero.reduce_bucket_size + zero.allgather_bucket_size)


def zero_settings(cfg: Config) -> Any:
    """DeepSpeed's ``DeepSpeedZeroConfig`` of the engine ``build_ds_config`` makes for ``cfg`` on a GPU
    (DeepSpeed's defaults where stapo sets nothing)."""
    _quiet_deepspeed()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds = build_ds_config(cfg.trainer, **engine_options(cfg.trainer, cpu=False))
    return DeepSpeedZeroConfig(**ds["zero_optimization"])


def _quiet_deepspeed() -> None:
    import logging

    # the import probes the accelerator and logs the result on stdout, which `--plan --json` keeps for JSON
    logger = logging.getLogger("DeepSpeed")
    if _quiet_probe not in logger.filters:
        logger.addFilter(_quiet_probe)


def _quiet_probe(record: Any) -> bool:
    return not record.getMessage().startswith(("Setting accelerator", "Setting ds_accelerator"))


# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class MicroBatchEstimate:
    """The update's micro-batches on one rank for one mini-batch, at their worst (every row full
    length): an estimate from the config, not the forwards themselves (those are
    :class:`stapo.core.train.micro.Micro`)."""

    tokens: int  # tokens of the longest forward (padding included)
    count: int  # forwards per mini-batch on this rank


def estimate_micro_batches(cfg: Config, world_size: int) -> MicroBatchEstimate:
    """Worst case of :func:`stapo.core.train.micro.micro_batches`: every row prompt + response long."""
    r, t = cfg.rollout, cfg.trainer
    seq = cfg.data.max_prompt_tokens + r.max_new_tokens
    rows = max(1, math.ceil(r.prompts_per_step * r.n / cfg.algorithm.mini_batches / world_size))
    if t.micro_batch_tokens is None:
        per = min(t.micro_batch_size, rows)
        return MicroBatchEstimate(per * seq, math.ceil(rows / per))
    per = max(1, t.micro_batch_tokens // seq)  # rows per packed forward (a longer row alone)
    return MicroBatchEstimate(max(min(per, rows) * seq, min(t.micro_batch_tokens, seq)), math.ceil(rows / per))


def layer_activations(shape: ModelShape, tokens: int, nbytes: int) -> int:
    """One decoder layer's saved forward tensors for ``tokens`` tokens: two norms and the residual
    (3 h), q / k / v and the attention output (2 H d + 2 KV d), o_proj (h), the MLP's gate, up,
    activation and product (4 I)."""
    s = shape
    width = 4 * s.hidden + 2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim + 4 * s.intermediate
    return tokens * width * nbytes


def update_memory(cfg: Config, shape: ModelShape, micro: MicroBatchEstimate, nbytes: int) -> dict[str, int]:
    """Bytes of one training forward + backward (``activations``) and of one micro-batch's kept
    graph (``graph``: what stays alive from its forward until its backward)."""
    T, ckpt = micro.tokens, cfg.model.gradient_checkpointing
    head = LM_HEAD_BUFFERS * min(cfg.trainer.logits_chunk_size, T) * shape.vocab * 4
    final_hidden = T * shape.hidden * nbytes  # the last norm's output, read chunk by chunk by the head
    per_token_out = 2 * T * 4  # log-probs and entropies, fp32
    saved = shape.layers * T * shape.hidden * nbytes if ckpt else shape.layers * layer_activations(shape, T, nbytes)
    graph = saved + final_hidden + per_token_out
    # backward: one layer's activations (recomputed under checkpointing) and the gradients flowing
    # through it, half a layer again: what a CPU update measures in steady state (AdamW's moments
    # resident, libraries warm; benchmarks/plan_memory.py)
    layer = layer_activations(shape, T, nbytes)
    work = layer + layer // 2 + head
    return {"graph": graph, "activations": graph + work, "work": work}


# ----------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    """One GPU's memory at each phase of a step; ``peak_gib`` is the largest phase."""

    model: str
    params: int
    largest_layer_params: int
    world_size: int
    backend: str
    zero_stage: int | None
    offload_optimizer: bool
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    model_states_gib: float
    reference_gib: float
    micro_batch_tokens: int
    micro_batches_per_mini_batch: int
    activations_gib: float
    kept_graphs_gib: float
    update_path: str  # keep_graphs | bounded | per_micro_batch (a weighting that reads no statistics)
    engine: str
    vllm_gib: float
    vllm_weights_gib: float
    kv_cache_gib: float
    kv_cache_tokens: int
    weight_sync_gib: float
    zero_buffers_gib: float
    cuda_graphs_gib: float  # vLLM's graph pool kept through the update (0: offloaded asleep, or eager)
    nccl_gib: float  # the learners' communicators, plus vLLM's kept asleep
    vllm_sleep_flags: list[str]  # the vLLM flags that free more asleep, set by the engine (installed vLLM)
    runtime_gib: float
    fragmentation_gib: float  # the margin a fitting plan leaves free
    phases_gib: dict[str, float]
    peak_phase: str
    peak_gib: float
    card_gib: float
    fits: bool
    fix: list[str] = field(default_factory=list)  # `--set` overrides that fit it ([] when it fits or none does)
    fix_peak_gib: float | None = None
    notes: list[str] = field(default_factory=list)
    weight_push: str = ""  # rollout fleet: what rank 0's push holds

    def line(self) -> str:
        if self.fits:
            verdict = "fits"
        elif self.fix:
            sets = " ".join(f"--set {k}" for k in self.fix)
            verdict = f"does NOT fit; fits with {sets} (peak {self.fix_peak_gib:.1f} GiB)"
        else:
            verdict = ("does NOT fit; no single setting fits it: more GPUs (--world-size), a larger card, or "
                       "shorter sequences (rollout.max_new_tokens, data.max_prompt_tokens)")
        return (f"per-GPU peak: {self.peak_gib:.1f} GiB of {self.card_gib:.1f} GiB ({self.peak_phase}) + "
                f"{self.fragmentation_gib:.1f} GiB margin; update path: {self.update_path}; {verdict}")

    def report(self) -> list[str]:
        zero = f"ZeRO-{self.zero_stage}" if self.backend == "deepspeed" else "torch backend"
        off = ", optimizer offloaded" if self.offload_optimizer else ""
        lines = [
            f"memory plan: {self.model}, {self.params / 1e9:.3f}B params (largest layer "
            f"{self.largest_layer_params / 1e6:.1f}M), {self.world_size} GPU(s), {zero}{off}",
            f"  weights {self.weights_gib:.2f} + gradients {self.gradients_gib:.2f} + optimizer "
            f"{self.optimizer_gib:.2f} GiB -> model states {self.model_states_gib:.2f} GiB",
        ]
        if self.reference_gib:
            lines.append(f"  reference model {self.reference_gib:.2f} GiB")
        lines += [
            f"  update: {self.micro_batches_per_mini_batch} micro-batch(es) of <= {self.micro_batch_tokens} tokens "
            f"per mini-batch; activations {self.activations_gib:.2f} GiB; kept graphs "
            f"{self.kept_graphs_gib:.2f} GiB; path: {self.update_path}",
        ]
        if self.zero_buffers_gib:
            lines.append(f"  ZeRO buffers (prefetch, live parameters, reduce bucket): {self.zero_buffers_gib:.2f} GiB")
        if self.engine == "vllm":
            freed = ", ".join(self.vllm_sleep_flags) or "none (the installed vLLM has neither flag)"
            lines.append(f"  vLLM: {self.vllm_gib:.2f} GiB (weights {self.vllm_weights_gib:.2f}, KV cache "
                         f"{self.kv_cache_gib:.2f} GiB = {self.kv_cache_tokens} tokens); weight sync peak "
                         f"{self.weight_sync_gib:.2f} GiB; kept asleep: CUDA graphs {self.cuda_graphs_gib:.2f} GiB; "
                         f"sleep flags set: {freed}")
        elif self.engine == "vllm_server":
            lines.append(f"  rollout fleet: no KV cache on the learners; rank 0's weight push peak "
                         f"{self.weight_sync_gib:.2f} GiB ({self.weight_push})")
        else:
            lines.append(f"  hf generation: KV cache {self.kv_cache_gib:.2f} GiB")
        lines.append("  phases: " + ", ".join(f"{k} {v:.1f}" for k, v in self.phases_gib.items()) +
                     f" GiB (each with {self.runtime_gib:.1f} GiB of CUDA context and {self.nccl_gib:.1f} GiB "
                     f"of NCCL); margin {self.fragmentation_gib:.1f} GiB")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(self.line())
        return lines

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _gib(x: float) -> float:
    return round(x / GIB, 3)


def plan_memory(cfg: Config, world_size: int, card_gib: float, shape: ModelShape, *, cuda: bool = True,
                sleep_flags: list[str] | None = None) -> Plan:
    """The plan of ``cfg`` on ``world_size`` ranks with ``card_gib`` per GPU (``cuda``: GPU dtypes).

    ``sleep_flags``: the vLLM flags the engine sets (default: those the installed vLLM has; none
    where vLLM is not installed, e.g. planning on a laptop, which charges what they would free)."""
    t, r, a = cfg.trainer, cfg.rollout, cfg.algorithm
    nbytes = 2 if cuda else 4  # bf16 compute on GPU (autocast / DeepSpeed bf16), fp32 on CPU
    states = model_states(cfg, shape, world_size, cuda=cuda)
    ref = 0
    if a.kl_coef > 0 and not a.kl.offload:
        ref_b = 4 if a.kl.dtype == "float32" or (a.kl.dtype == "same" and not cuda) else 2
        ref = shape.params * ref_b // (world_size if t.backend == "deepspeed" and t.zero_stage == 3 else 1)
    micro = estimate_micro_batches(cfg, world_size)
    mem = update_memory(cfg, shape, micro, nbytes)
    reads = token_weighting_spec(a.token_weighting).reads_stats or a.lp_reg.enabled
    kept = micro.count * mem["graph"]  # every micro-batch's graph alive until the mini-batch's weights are known
    runtime = int(RUNTIME_GIB * GIB) if cuda else 0
    nccl = int(NCCL_GIB * GIB) if cuda and world_size > 1 else 0
    zero_buf = zero_buffers(cfg, shape) if cuda else 0
    card = card_gib * GIB
    margin = int(FRAGMENTATION * card)
    tp = r.vllm.tensor_parallel_size
    # what a sleeping vLLM keeps through the update: its CUDA-graph pool and a TP group's communicators
    flags = (sleep_flags if sleep_flags is not None else _installed_sleep_flags()) if r.engine == "vllm" else []
    graphs = 0
    if r.engine == "vllm" and cuda:
        if not r.vllm.enforce_eager and "sleep_mode_offload_cudagraph" not in flags:
            graphs = int(CUDA_GRAPHS_GIB * GIB)
        if tp > 1 and "enable_nccl_comm_suspend" not in flags:
            nccl += int(VLLM_NCCL_GIB * GIB)
    base = states["total"] + ref + runtime + nccl
    asleep = graphs if r.engine == "vllm" and r.vllm.enable_sleep_mode else 0
    if not reads:
        path, train = "per_micro_batch", mem["activations"]
    elif t.update_memory == "bounded" or (
            t.update_memory == "auto" and base + kept + mem["work"] + zero_buf + asleep + margin > card):
        path, train = "bounded", mem["activations"]  # kept graphs would eat the margin: bound them
    else:
        path, train = "keep_graphs", kept + mem["work"]  # then one backward's working set on top
    notes: list[str] = []
    push_words = ""
    if r.engine == "vllm":
        vllm_total = int(r.vllm.gpu_memory_utilization * card)
        vllm_w = shape.params * 2 // tp
        kv = max(0, vllm_total - vllm_w)
        kv_tokens = kv // max(1, shape.kv_bytes_per_token // tp)
        seq = cfg.data.max_prompt_tokens + r.max_new_tokens
        if kv_tokens < seq:
            notes.append(f"vLLM's KV cache holds {kv_tokens} tokens, less than one sequence ({seq}): raise "
                         "rollout.vllm.gpu_memory_utilization")
        if not r.vllm.enable_sleep_mode:
            asleep = vllm_total
        # the sync: vLLM's weights awake, the learner's gathered bucket, one layer of vLLM's reload
        gathered = max(int(t.sync_bucket_mb * 2**20), shape.largest_param * 2)
        sync = base + vllm_w + gathered + shape.largest_layer_params * 2 // tp + graphs
        phases = {"generate": base + vllm_total, "update": base + train + zero_buf + asleep, "weight sync": sync}
    elif r.engine == "vllm_server":
        vllm_total = vllm_w = kv = kv_tokens = 0
        # the servers generate; rank 0 holds the push's buffers (see the module docstring)
        push, push_words = fleet_push(cfg, shape, cuda=cuda)
        sync = base + push
        phases = {"update": base + train + zero_buf, "weight push": sync}
    else:
        vllm_total = vllm_w = 0
        kv = r.batch_size * (cfg.data.max_prompt_tokens + r.max_new_tokens) * shape.kv_bytes_per_token
        kv_tokens = kv // shape.kv_bytes_per_token
        sync = 0
        phases = {"generate": base + kv + r.batch_size * shape.vocab * 4 + zero_buf, "update": base + train + zero_buf}
    peak_phase = max(phases, key=lambda k: phases[k])
    peak = phases[peak_phase]
    return Plan(
        model=shape.source if cfg.model.name_or_path == "tiny-random" else cfg.model.name_or_path,
        params=shape.params,
        largest_layer_params=shape.largest_layer_params,
        world_size=world_size,
        backend=t.backend,
        zero_stage=t.zero_stage if t.backend == "deepspeed" else None,
        offload_optimizer=bool(t.offload_optimizer and t.backend == "deepspeed"),
        weights_gib=_gib(states["weights"]),
        gradients_gib=_gib(states["gradients"]),
        optimizer_gib=_gib(states["optimizer"]),
        model_states_gib=_gib(states["total"]),
        reference_gib=_gib(ref),
        micro_batch_tokens=micro.tokens,
        micro_batches_per_mini_batch=micro.count,
        activations_gib=_gib(mem["activations"]),
        kept_graphs_gib=_gib(kept if reads else 0),
        update_path=path,
        engine=r.engine,
        vllm_gib=_gib(vllm_total),
        vllm_weights_gib=_gib(vllm_w),
        kv_cache_gib=_gib(kv),
        kv_cache_tokens=int(kv_tokens),
        weight_sync_gib=_gib(sync),
        zero_buffers_gib=_gib(zero_buf),
        cuda_graphs_gib=_gib(graphs),
        nccl_gib=_gib(nccl),
        vllm_sleep_flags=list(flags),
        runtime_gib=_gib(runtime),
        fragmentation_gib=_gib(margin),
        phases_gib={k: _gib(v) for k, v in phases.items()},
        peak_phase=peak_phase,
        peak_gib=_gib(peak),
        card_gib=round(card_gib, 3),
        fits=peak + margin <= card and not notes,
        notes=notes,
        weight_push=push_words,
    )


def fleet_push(cfg: Config, shape: ModelShape, *, cuda: bool = True) -> tuple[int, str]:
    """What learner rank 0 holds beyond the model states while it pushes weights to the fleet, and
    what it is (bytes, words)."""
    r, t = cfg.rollout.server, cfg.trainer
    if r.weight_sync == "checkpoint":
        return max(r.bucket_mb * 2**20, shape.largest_param * 2), f"checkpoint: one {r.bucket_mb} MiB shard bucket"
    wire = 2 if t.backend == "deepspeed" or not cuda else 4  # bf16 under DeepSpeed; the torch backend's fp32
    chunk = r.bucket_mb * 2**20 + shape.largest_param * wire  # a chunk closes past the buffer: + one parameter
    held = NCCL_PACKED_BUFFERS * chunk
    words = f"nccl: {NCCL_PACKED_BUFFERS} packed buffers of {r.bucket_mb} MiB + one parameter each"
    if t.backend == "deepspeed" and t.zero_stage == 3:  # the chunk's gathered sources, the rest of their gather
        held += chunk + int(t.sync_bucket_mb * 2**20)
        words += f", its gathered sources and a {t.sync_bucket_mb:g} MiB sync bucket (ZeRO-3)"
    return held, words


def _installed_sleep_flags() -> list[str]:
    return sleep_release_flags()


# ----------------------------------------------------------------------------- what fits it


def _knobs(cfg: Config, plan: Plan, card_gib: float) -> list[str]:
    """``--set`` overrides to try, each on top of the ones before, cheapest in step time first (our
    order): ZeRO-3 (partitioned states, more communication), a smaller fleet push bucket (more, smaller
    broadcasts or shards), a smaller vLLM share (a smaller KV cache:
    fewer sequences in flight), smaller micro-batches (more forwards), optimizer offload (CPU Adam)."""
    t, r = cfg.trainer, cfg.rollout
    out: list[str] = []
    if t.backend == "deepspeed" and t.zero_stage < 3:
        out.append("trainer.zero_stage=3")
    if r.engine == "vllm_server" and plan.peak_phase == "weight push" and r.server.bucket_mb > 64:
        out.append(f"rollout.server.bucket_mb={max(64, r.server.bucket_mb // 4)}")
    if r.engine == "vllm":
        spare = (card_gib - plan.model_states_gib - plan.reference_gib - plan.runtime_gib - plan.nccl_gib
                 - plan.fragmentation_gib)
        share = math.floor(20 * spare / card_gib) / 20  # in steps of 0.05
        if plan.vllm_weights_gib < share * card_gib < r.vllm.gpu_memory_utilization * card_gib:
            out.append(f"rollout.vllm.gpu_memory_utilization={share:.2f}")
    if t.micro_batch_tokens is not None:
        out += [f"trainer.micro_batch_tokens={t.micro_batch_tokens // 2**k}" for k in (1, 2, 3)
                if t.micro_batch_tokens // 2**k >= 1]
    else:
        out += [f"trainer.micro_batch_size={t.micro_batch_size // 2**k}" for k in (1, 2)
                if t.micro_batch_size // 2**k >= 1]
    if t.backend == "deepspeed" and not t.offload_optimizer:
        out.append("trainer.offload_optimizer=true")
    return out


def _with(cfg: Config, overrides: list[str]) -> Config:
    return config_from_dict(apply_overrides(cfg.model_dump(mode="json", by_alias=True), overrides))


def plan_run(cfg: Config, world_size: int, card_gib: float, shape: ModelShape | None = None, *,
             cuda: bool = True, sleep_flags: list[str] | None = None) -> Plan:
    """:func:`plan_memory`, and when it does not fit, the knobs (``--set`` overrides) that fit it."""
    shape = shape or model_shape(cfg.model)
    if sleep_flags is None:
        sleep_flags = _installed_sleep_flags() if cfg.rollout.engine == "vllm" else []
    plan = plan_memory(cfg, world_size, card_gib, shape, cuda=cuda, sleep_flags=sleep_flags)
    if plan.fits:
        return plan
    tried: list[str] = []
    knobs = _knobs(cfg, plan, card_gib)
    for knob in knobs:
        if knob.split("=")[0] in {k.split("=")[0] for k in tried}:  # a smaller value of the same knob
            tried = [k for k in tried if k.split("=")[0] != knob.split("=")[0]]
        tried.append(knob)
        trial = plan_memory(_with(cfg, tried), world_size, card_gib, shape, cuda=cuda, sleep_flags=sleep_flags)
        if trial.fits:
            for k in tried[:-1]:  # drop the earlier settings the last one makes unnecessary
                fewer = [x for x in tried if x != k]
                smaller = plan_memory(_with(cfg, fewer), world_size, card_gib, shape, cuda=cuda,
                                      sleep_flags=sleep_flags)
                if smaller.fits:
                    tried, trial = fewer, smaller
            plan.fix, plan.fix_peak_gib = list(tried), trial.peak_gib
            return plan
    return plan


# ----------------------------------------------------------------------------- at launch


def card_gib(cfg: Config, given: float | None = None) -> float:
    """The card the plan measures against: ``given`` (--card-gib), else ``trainer.gpu_memory_gib``,
    else the GPU's own memory (device 0: the cards of a node are alike), else an 80 GB card."""
    if given is not None:
        return float(given)
    if cfg.trainer.gpu_memory_gib is not None:
        return float(cfg.trainer.gpu_memory_gib)
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return DEFAULT_CARD_GIB


def on_gpu(cfg: Config) -> bool:
    """Whether this run trains on a GPU (``trainer.device``: auto with CUDA present, or cuda...)."""
    import torch

    dev = cfg.trainer.device
    return dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available())


def plan_at_start(cfg: Config, world_size: int, card: float | None = None) -> tuple[Config, Plan | None]:
    """``stapo train`` at start: on a GPU, the plan of this launch; a config that cannot fit raises
    :class:`PlanError` with the setting that fits it; ``trainer.update_memory: auto`` becomes the
    path the plan chose (every rank plans alike, so all take the same path). On CPU: (cfg, None)."""
    if not on_gpu(cfg):
        return cfg, None
    plan = plan_run(cfg, world_size, card_gib(cfg, card))
    if not plan.fits:
        raise PlanError(f"{plan.line()} (`stapo train --plan` shows each part)")
    return resolve_update_memory(cfg, plan), plan


def resolve_update_memory(cfg: Config, plan: Plan | None) -> Config:
    """``trainer.update_memory: auto`` as ``plan`` decides: ``bounded`` when the kept graphs do not fit
    the card; any other value, or no plan (a CPU run), leaves ``cfg`` as it is. ``stapo train`` and
    ``stapo.core.train.run.Run.build`` both resolve it here."""
    if plan is not None and cfg.trainer.update_memory == "auto" and plan.update_path == "bounded":
        return _with(cfg, ["trainer.update_memory=bounded"])
    return cfg
