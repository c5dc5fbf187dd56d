"""The portable rollout engine: transformers ``generate`` on the learner's own model (CPU or any GPU).

:class:`HFRolloutEngine` expands each prompt ``n`` times, left-pads chunks of ``batch_size``
sequences and samples them with ``model.generate``. What it guarantees, and why:

- **Exactly the requested sampler.** A checkpoint's ``generation_config.json`` often carries its own
  ``top_k``, ``repetition_penalty``, ``temperature``... which ``generate`` would silently merge in and
  which would make the rollout policy differ from the policy the loss assumes. During the call the
  model's generation config is replaced by a clean one (restored afterwards), ``top_k`` is disabled
  and the only logits processors are ours: temperature, then top-p.
- **Log-probs of the sampled tokens.** ``logprobs[i] = log_softmax(logits / T)[token_i]``: the
  temperature-scaled distribution, *before* the top-p cut (the same quantity the learner recomputes
  as ``pi_old`` with ``temperature=T``). With top-p < 1 the token was actually drawn from the
  renormalized nucleus, whose log-prob is higher by ``-log(nucleus mass)``; the learner's
  importance ratio uses the untruncated policy, as verl and OpenRLHF do. Greedy (``T == 0``) reports
  ``log_softmax(logits)`` (T = 1). They are recorded step by step by a logits processor placed
  before temperature/top-p, so memory is one ``[batch, vocab]`` row per step, not the whole
  ``[batch, steps, vocab]`` score history.
- **Seeded without side effects.** With ``sampling.seed`` set, generation runs inside
  ``torch.random.fork_rng()`` after ``torch.manual_seed(seed)``: the same seed gives the same
  completions and the caller's RNG stream is left where it was. (Same seed, same ``batch_size``, same
  device: chunking changes which sequences share a forward pass.)
- **Padding-invariant.** Prompts are left-padded by hand with an attention mask (the tokenizer's
  ``padding_side`` is never touched); transformers derives position ids from the mask, so a prompt
  batched with longer ones generates what it generates alone (up to float reduction order).
- **Mode and grads.** ``eval()`` and ``torch.no_grad()`` during generation; the previous
  ``train()``/``eval()`` mode is restored afterwards (dropout off while sampling).

Greedy requests generate each prompt once and copy it ``n`` times (greedy samples are identical).

Weight sync: the RL loop builds this engine on the learner's model object, so there is nothing to
copy; :meth:`HFRolloutEngine.load_weights` detects tensors that already *are* the engine's
parameters (same storage) and skips them, and copies anything else by name. ``sleep``/``wake`` are
no-ops: the weights are the learner's and there is no separate KV-cache pool to free (the
transformers cache lives only inside one ``generate`` call).

Usage::

    engine = HFRolloutEngine(model, tokenizer, batch_size=32)
    groups = engine.generate(prompt_ids, SamplingParams(n=4, temperature=1.0, max_new_tokens=64, seed=0))
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from stapo.core.rollout.base import (
    Completion,
    SamplingParams,
    check_prompts,
    fill_greedy_group,
    prefixed_prompts,
)
from stapo.core.trainer.prefix import cache_kwargs, prompt_groups

__all__ = ["HFRolloutEngine", "SampledLogprobRecorder"]


class SampledLogprobRecorder:
    """A logits processor that records the log-prob of each token ``generate`` samples.

    ``generate`` calls processors with ``(input_ids [B, L], scores [B, V])`` once per step, before it
    picks the next token. The token picked at step k is ``input_ids[:, -1]`` at step k+1, so the
    recorder keeps step k's log-softmax ``[B, V]`` and gathers it one call later; :meth:`finish`
    gathers the last step from the final sequences. Scores are returned unchanged.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature if temperature > 0 else 1.0
        self._pending: torch.Tensor | None = None  # [B, V] log-probs of the step not yet resolved
        self._out: list[torch.Tensor] = []  # one [B] per resolved step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._pending is not None:
            self._out.append(self._pending.gather(1, input_ids[:, -1:]).squeeze(1))  # [B]
        self._pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # [B, V]
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """Log-probs of all generated tokens, ``[B, steps]`` (``sequences`` is ``[B, prompt + steps]``)."""
        if self._pending is not None:
            self._out.append(self._pending.gather(1, sequences[:, -1:]).squeeze(1))  # [B]
            self._pending = None
        if not self._out:
            return sequences.new_zeros((sequences.shape[0], 0), dtype=torch.float32)
        return torch.stack(self._out, dim=1)  # [B, steps]


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token that ends a response: the tokenizer's eos plus the model's generation-config eos ids."""
    ids: list[int] = []
    for src in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(model.generation_config, "eos_token_id", None),
    ):
        for t in [src] if isinstance(src, int) else list(src or []):
            if t is not None and t not in ids:
                ids.append(int(t))
    if not ids:
        raise ValueError(
            "HFRolloutEngine: neither the tokenizer nor the model's generation_config has an eos token"
        )
    return ids


class HFRolloutEngine:
    """Sample with transformers ``generate`` on ``model`` (usually the learner's own module).

    ``batch_size``: sequences (prompts x n) per ``generate`` call; lower it when memory is short.
    ``share_prefix``: prefill each distinct prompt of a call once and repeat its KV cache for its n
    samples (the prompt is most of a short response's cost); same logits up to float rounding.
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 32, share_prefix: bool = True) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"HFRolloutEngine: batch_size must be an int >= 1, got {batch_size!r}")
        if not hasattr(model, "generation_config") and hasattr(model, "module"):
            model = model.module  # a DDP / DeepSpeed wrapper: sample from the wrapped module
        if not hasattr(model, "generate"):
            raise TypeError(
                f"HFRolloutEngine: model must be a transformers generative model, got {type(model).__name__}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.share_prefix = share_prefix  # prefill each distinct prompt once (see _shared_prompt_cache)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]
        self.last_sync: dict[str, int] = {}
        # Data parallel under ZeRO-3 (set by the RL loop): every rank keeps calling forward until all
        # ranks' sequences are done, since each forward gathers partitioned parameters collectively.
        self.synced_gpus = False

    # ----------------------------------------------------------------------------- generation

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, ``[prompt][sample]``; see the module docstring."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        vocab = getattr(self.model.config, "vocab_size", None)
        check_prompts(prompt_token_ids, vocab_size=vocab)
        if not prompt_token_ids:
            return []
        # Greedy samples are identical: generate each prompt once and copy.
        copies = 1 if sampling.greedy else sampling.n
        flat = [list(p) for p in prompt_token_ids for _ in range(copies)]  # prompt-major, sample-minor

        was_training = self.model.training
        saved_gen_config = self.model.generation_config
        self.model.eval()
        try:
            self.model.generation_config = self._clean_generation_config(saved_gen_config)
            with torch.no_grad(), self._autocast():
                if sampling.seed is None:
                    rows = self._generate_all(flat, sampling)
                else:
                    devices = [self.device.index or 0] if self.device.type == "cuda" else []
                    with torch.random.fork_rng(devices=devices, device_type=self.device.type):
                        torch.manual_seed(sampling.seed)
                        rows = self._generate_all(flat, sampling)
        finally:
            self.model.generation_config = saved_gen_config
            self.model.train(was_training)

        out: list[list[Completion]] = []
        for i in range(len(prompt_token_ids)):
            out.append(fill_greedy_group(rows[i * copies : (i + 1) * copies], sampling.n, copies))
        return out

    def generate_from_prefix(
        self, prompt_token_ids: list[list[int]], prefix_token_ids: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        """Continue each prompt after a given response prefix (DEEP-GRPO's branches from a pivot)."""
        return self.generate(prefixed_prompts(prompt_token_ids, prefix_token_ids), sampling)
    def _autocast(self) -> Any:
        """bf16 autocast on CUDA when the weights are fp32 masters (the torch backend's layout): the
        learner computes its log-probs under the same autocast, so sampler and learner agree, and
        generating from fp32 weights would run the GPU at a fraction of its bf16 rate."""
        import contextlib

        if self.device.type == "cuda" and next(self.model.parameters()).dtype == torch.float32:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _clean_generation_config(self, base: Any) -> Any:
        """A generation config with no sampling knobs of the checkpoint's own (see module docstring)."""
        from transformers import GenerationConfig

        return GenerationConfig(
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            bos_token_id=getattr(base, "bos_token_id", None),
            decoder_start_token_id=getattr(base, "decoder_start_token_id", None),
        )

    def _generate_all(self, flat: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        rows: list[Completion] = []
        for start in range(0, len(flat), self.batch_size):
            rows.extend(self._generate_chunk(flat[start : start + self.batch_size], sampling))
        return rows

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        from transformers import (
            GenerationConfig,
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopPLogitsWarper,
        )

        dev = self.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)  # [B, P]
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, P]
        for b, p in enumerate(prompts):  # left padding: the last prompt token sits at column P-1
            input_ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[b, width - len(p) :] = 1

        recorder = SampledLogprobRecorder(sampling.temperature)
        processors = LogitsProcessorList([recorder])
        if not sampling.greedy:
            if sampling.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_p < 1.0:
                processors.append(TopPLogitsWarper(sampling.top_p))
        # Neutral values so that nothing but our processors shapes the distribution (greedy ignores them,
        # and transformers warns when they are set without sampling).
        neutral = {} if sampling.greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        gen_config = GenerationConfig(
            do_sample=not sampling.greedy,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.max_new_tokens if sampling.ignore_eos else None,
            **neutral,
            num_beams=1,
            num_return_sequences=1,
            repetition_penalty=1.0,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
        )
        extra = {}
        if self.share_prefix and width > 1:
            cache = self._shared_prompt_cache(input_ids.to(dev), attention_mask.to(dev))
            if cache is not None:
                extra = cache_kwargs(self.model, cache)  # `cache` or `past_key_values`, as installed
        out = self.model.generate(
            input_ids=input_ids.to(dev),
            attention_mask=attention_mask.to(dev),
            generation_config=gen_config,
            logits_processor=processors,
            **extra,
            **({"synced_gpus": True} if self.synced_gpus else {}),
        )
        seqs = out.sequences  # [B, P + S]
        logprobs = recorder.finish(seqs).cpu()  # [B, S]
        new = seqs[:, width:].cpu()  # [B, S]
        return [self._completion(new[b].tolist(), logprobs[b].tolist()) for b in range(len(prompts))]

    def _shared_prompt_cache(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any | None:
        """KV cache of every row's prompt but its last token, each distinct prompt computed once.

        The n samples of a prompt are n identical rows: their prefill is one forward of the distinct
        prompts (all columns but the last), repeated along the batch; ``generate`` then runs only the
        last prompt column and the new tokens. None when every row is distinct (nothing to share).
        Position ids follow ``generate``'s (count of real tokens), so the logits are the unshared ones.
        """
        from transformers import DynamicCache

        first, group = prompt_groups(input_ids, attention_mask, input_ids.shape[1])  # [U], [B]
        if first.numel() == input_ids.shape[0]:
            return None
        ids, att = input_ids[first, :-1], attention_mask[first, :-1]  # [U, P-1]
        positions = (att.long().cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=ids, attention_mask=att, position_ids=positions, use_cache=True, logits_to_keep=1,
                   **cache_kwargs(self.model, cache))
        cache.batch_select_indices(group)  # [U, ...] -> [B, ...]
        return cache

    def _completion(self, tokens: list[int], logprobs: list[float]) -> Completion:
        """Cut a padded row after its first eos; ``stop`` if an eos was produced, else ``length``."""
        eos = set(self.eos_token_ids)
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), None)
        if end is None:
            finish = "length"
            end = len(tokens)
        else:
            finish = "stop"
        ids = tokens[:end]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(token_ids=ids, logprobs=logprobs[:end], finish_reason=finish, text=text)

    # ----------------------------------------------------------------------------- weights and memory

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy learner tensors into the engine's model by HF name (parameters and buffers).

        A tensor that already is the engine's own parameter (same storage: the colocated case where
        the engine was built on the learner's model) is skipped, so the sync is free there. Unknown
        names or shape mismatches raise after the known tensors are copied, listing the offenders.
        ``self.last_sync`` records ``{"copied", "shared"}`` counts.
        """
        own: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        own.update(dict(self.model.named_buffers(remove_duplicate=False)))
        unknown: list[str] = []
        mismatched: list[str] = []
        copied = shared = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = own.get(name)
                if target is None:
                    unknown.append(name)
                    continue
                if tuple(target.shape) != tuple(tensor.shape):
                    mismatched.append(f"{name}: engine {tuple(target.shape)} vs given {tuple(tensor.shape)}")
                    continue
                if target.device == tensor.device and target.data_ptr() == tensor.data_ptr():
                    shared += 1
                    continue
                target.data.copy_(tensor.detach())
                copied += 1
        self.last_sync = {"copied": copied, "shared": shared}
        if unknown or mismatched:
            lines = []
            if unknown:
                some = ", ".join(unknown[:8]) + (f", ... ({len(unknown)} in all)" if len(unknown) > 8 else "")
                valid = ", ".join(list(own)[:5])
                lines.append(f"unknown parameter names: {some} (engine names look like: {valid}, ...)")
            if mismatched:
                lines.append("shape mismatches: " + "; ".join(mismatched[:8]))
            raise ValueError("HFRolloutEngine.load_weights: " + " | ".join(lines))

    def sleep(self) -> None:
        """No-op: the weights are the learner's and transformers holds no KV cache between calls."""

    def wake(self) -> None:
        """No-op (see :meth:`sleep`)."""
