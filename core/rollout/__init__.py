"""Rollout engines: sample responses from the policy for the RL loop and for evaluation.

Engines register by name as ``"module:Class"`` strings and are imported only when built, so
``import stapo.core.rollout`` never imports vLLM (which is an optional extra, ``stapo[vllm]``).

- ``hf``   :class:`~stapo.core.rollout.hf.HFRolloutEngine` — transformers ``generate``; shares the
  learner's model object, so weight sync is free. Portable: CPU or any GPU.
- ``vllm`` :class:`~stapo.core.rollout.vllm.VLLMRolloutEngine` — vLLM's offline engine colocated with
  the learner; sleeps while the learner trains, gets the new weights pushed after every update.
- ``vllm_server`` :class:`~stapo.core.rollout.vllm_server.ServerRolloutEngine` — ``vllm serve``
  instances apart from the learners (``rollout.server.urls``); weights pushed with a version.

Usage::

    engine = build_rollout_engine(cfg, model=backend.model, tokenizer=tokenizer)
    groups = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, seed=7))

See ``docs/rollout.md`` for the exact log-prob semantics of each engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stapo.core.lazy import LazyRegistry
from stapo.core.rollout.base import Completion, FinishReason, RolloutEngine, SamplingParams
from stapo.core.trainer.models import SPECIAL_MODELS

if TYPE_CHECKING:
    from stapo.core.config import Config

__all__ = [
    "ENGINES",
    "Completion",
    "FinishReason",
    "RolloutEngine",
    "SamplingParams",
    "build_rollout_engine",
    "get_engine_class",
    "register_engine",
]

ENGINES = LazyRegistry(
    "rollout engine",
    {
        "hf": "stapo.core.rollout.hf:HFRolloutEngine",
        "vllm": "stapo.core.rollout.vllm:VLLMRolloutEngine",
        "vllm_server": "stapo.core.rollout.vllm_server:ServerRolloutEngine",
    },
    hints={"vllm": "pip install 'stapo[vllm]'"},
)
register_engine = ENGINES.add  # name, "module:Class"; a taken name is an error
get_engine_class = ENGINES.load  # imports lazily; a miss lists the valid names


def build_rollout_engine(
    cfg: Config,
    *,
    model: Any = None,
    tokenizer: Any = None,
    model_path: str | None = None,
) -> RolloutEngine:
    """Build the engine named by ``cfg.rollout.engine``.

    ``hf`` samples from the ``model`` it is given (the learner's own module, so no weight copy is
    ever needed) and needs its ``tokenizer``. ``vllm`` loads its own copy of the weights from
    ``model_path`` (default ``cfg.model.name_or_path``; it must be a local HF-format folder or a hub
    id, not a special stapo name — export the policy first) and takes the tokenizer for decoding.
    """
    name = cfg.rollout.engine
    cls = get_engine_class(name)
    if name == "hf":
        if model is None or tokenizer is None:
            raise ValueError(
                "rollout.engine='hf' needs the policy model and tokenizer: pass model= and tokenizer="
            )
        return cls(model, tokenizer, batch_size=cfg.rollout.batch_size, share_prefix=cfg.rollout.share_prefix)
    if name == "vllm":
        opts = cfg.rollout.vllm
        max_new = max(cfg.rollout.max_new_tokens, cfg.eval.val_max_new_tokens or 0)
        return cls(
            model_path or _vllm_model_path(cfg, model, tokenizer),
            tokenizer=tokenizer,
            dtype=cfg.model.dtype,
            seed=cfg.trainer.seed,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            tensor_parallel_size=opts.tensor_parallel_size,
            enable_sleep_mode=opts.enable_sleep_mode,
            enforce_eager=opts.enforce_eager,
            max_model_len=opts.max_model_len or cfg.data.max_prompt_tokens + max_new,
            trust_remote_code=cfg.model.trust_remote_code,
        )
    if name == "vllm_server":
        srv = cfg.rollout.server
        return cls(
            srv.urls, tokenizer=tokenizer, model=srv.model, timeout_s=srv.timeout_s, retries=srv.retries,
            concurrency=srv.concurrency, weight_sync=srv.weight_sync, weights_dir=srv.weights_dir,
            bucket_mb=srv.bucket_mb, nccl_master=srv.nccl_master, learner=model,
        )
    # An engine registered later through register_engine: same keyword surface as hf.
    return cls(model, tokenizer, cfg=cfg)


def _vllm_model_path(cfg: Config, model: Any, tokenizer: Any) -> str:
    """Where vLLM loads the policy from: ``cfg.model.name_or_path``, or an HF-format export of a special model.

    vLLM reads HF-format folders (or hub ids) only. The special names of :mod:`stapo.core.trainer.models`
    (``tiny-random``, ``demo:...``) exist only in code, so the learner's model is saved to a temp
    folder once and vLLM loads that; from then on weights travel through ``load_weights``.
    """
    name = cfg.model.name_or_path
    if name not in SPECIAL_MODELS:
        return name
    if model is None or tokenizer is None:
        raise ValueError(
            f"model.name_or_path={name!r} is built in code; the vllm engine needs the loaded model and "
            "tokenizer (pass model= and tokenizer=) or an HF-format folder (pass model_path=)"
        )
    import tempfile

    out = tempfile.mkdtemp(prefix="stapo-vllm-model-")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
