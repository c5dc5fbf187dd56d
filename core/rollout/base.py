"""The rollout contract: what every engine takes (:class:`SamplingParams`) and returns (:class:`Completion`).

The RL loop only sees this module. An engine turns tokenized prompts into ``n`` sampled responses
each, keeps its weights in step with the learner (``load_weights``) and can give its memory back
while the learner trains (``sleep`` / ``wake``). Two engines implement it: ``hf`` (transformers
``generate``, portable, shares the learner's model) and ``vllm`` (production, colocated on the GPU).

Why token ids in and token ids out: the learner recomputes log-probs on exactly the tokens that were
sampled, so a decode -> re-encode round trip (which is not the identity for most BPE tokenizers)
must never sit between the sampler and the loss. ``text`` is only for the reward.

Usage::

    sampling = SamplingParams(n=8, temperature=1.0, max_new_tokens=256, seed=1234)
    groups = engine.generate([[1, 2, 3], [4, 5]], sampling)   # groups[prompt][sample] -> Completion
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from stapo.core.batch import derive_seed

__all__ = ["Completion", "FinishReason", "RolloutEngine", "SamplingParams", "check_prompts", "fill_greedy_group",
           "request_seeds", "call_seed", "SEED_BITS"]

FinishReason = Literal["stop", "length"]
SEED_BITS = 63  # a generate call's seed and its requests' (see call_seed)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``n`` responses per prompt, temperature / nucleus, length cap, seed.

    ``temperature == 0`` means greedy decoding (``top_p`` is then ignored). ``seed`` makes a call
    reproducible: the same prompts, params and seed give the same completions on the same engine and
    hardware; ``None`` samples from the engine's running random state.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks: equal work on both sides)
    logprobs: bool = True  # sampled-token log-probs wanted (False: an engine may leave them NaN)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not (0 < self.top_p <= 1):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature 0)."""
        return self.temperature == 0


@dataclass
class Completion:
    """One sampled response.

    ``token_ids``: the generated tokens, up to and including the eos/stop token when one was
    produced, never padding. ``logprobs[i]``: log-probability of ``token_ids[i]`` under the
    distribution it was sampled from (see each engine for the exact definition with top-p).
    ``finish_reason``: ``"stop"`` when the response ended with an eos/stop token, ``"length"`` when it
    hit ``max_new_tokens``. ``text``: the response decoded without special tokens (for the grader).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from a sampler. ``generate`` returns ``[prompt][sample]``."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        """Sample ``sampling.n`` completions for every prompt (token ids, no padding)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Make the engine's policy equal to the learner's (HF parameter names)."""
        ...

    def sleep(self) -> None:
        """Free what the engine can while the learner trains (weights and/or KV cache)."""
        ...

    def wake(self) -> None:
        """Undo :meth:`sleep` before the next ``generate``."""
        ...


def check_prompts(prompt_token_ids: list[list[int]], *, vocab_size: int | None = None) -> None:
    """Reject malformed prompts with an error naming the bad entry (empty prompt, non-int id, out of vocab)."""
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise TypeError(
            f"prompt_token_ids must be a list of token-id lists, got {type(prompt_token_ids).__name__}"
        )
    for i, ids in enumerate(prompt_token_ids):
        if not isinstance(ids, (list, tuple)) or len(ids) == 0:
            raise ValueError(f"prompt_token_ids[{i}] must be a non-empty list of token ids, got {ids!r:.80}")
        for t in ids:
            if (
                not isinstance(t, int)
                or isinstance(t, bool)
                or t < 0
                or (vocab_size is not None and t >= vocab_size)
            ):
                bound = f" < vocab size {vocab_size}" if vocab_size is not None else ""
                raise ValueError(f"prompt_token_ids[{i}] holds {t!r}; token ids must be ints >= 0{bound}")


def call_seed(*parts: int) -> int:
    """The seed of one generate call, from the run's seed and the call's coordinates (step, round,
    rank, ...): 63 bits. vLLM takes int64 request seeds (0.33's ``CompletionRequest`` bounds ``seed``
    to int64; its V2 sampler hashes both 32-bit halves with the position), torch's generators 64 bits,
    so 63 bits cost nothing and make two calls' request ranges (:func:`request_seeds`: ``prompts x n``
    seeds from the call seed) overlap with probability about ``prompts x n / 2^62`` instead of ``/ 2^30``."""
    return derive_seed(*parts, bits=SEED_BITS)


def request_seeds(call_seed: int | None, n_prompts: int, n: int) -> list[int | None]:
    """The seed of each prompt's request in a call seeded ``call_seed``: ``call_seed + p * n``, wrapped
    so that ``seed + n - 1`` stays below 2^63 (an int64).

    vLLM seeds sample ``i`` of a request with ``seed + i`` (its ``n > 1`` requests fan out into n
    seeded children), and its sampling noise depends only on that seed and the position. Stepping
    the prompts ``n`` apart therefore gives every sample of a call its own stream: prompt ``p``'s G
    samples take ``call_seed + p*n + i``, none shared with another prompt of the call. The call seed
    itself is ``call_seed(seed, step, round, rank)`` (:func:`stapo.core.rollout.rollouts.rollout_and_grade`),
    so ranks and steps differ by a hash while a rerun draws the same seeds. ``None`` stays ``None``
    (an unseeded call: the engine's own random state).
    """
    if call_seed is None:
        return [None] * n_prompts
    return [(call_seed + p * n) % ((1 << SEED_BITS) - n + 1) for p in range(n_prompts)]


def fill_greedy_group(group: list[Completion], n: int, copies: int) -> list[Completion]:
    """Greedy decoding with n > 1 is generated once (``copies == 1``) and copied to n samples.

    Engines do this because every greedy sample is identical (and vLLM refuses n > 1 greedy).
    """
    if copies == 1 and n > 1:
        c = group[0]
        group = group + [
            Completion(list(c.token_ids), list(c.logprobs), c.finish_reason, c.text) for _ in range(n - 1)
        ]
    return group


def prefixed_prompts(prompt_token_ids: list[list[int]], prefix_token_ids: list[list[int]]) -> list[list[int]]:
    """``prompt + prefix`` per row, for an engine's ``generate_from_prefix``: the model sees exactly
    the token ids of the original rollout (no re-tokenization), and each completion then holds the
    *continuation* only, ``[prompt][sample]``."""
    if len(prompt_token_ids) != len(prefix_token_ids):
        raise ValueError(
            f"generate_from_prefix: {len(prompt_token_ids)} prompts but {len(prefix_token_ids)} prefixes"
        )
    return [list(p) + list(x) for p, x in zip(prompt_token_ids, prefix_token_ids, strict=True)]
