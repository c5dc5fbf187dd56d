"""Fair comparisons: which config keys are the method, which are confounds, and what a layer owns.

A claim "method X beats method Y" holds only if the two runs differ in the method and nothing else.
Every dotted config key (``rollout.n``, ``algorithm.eps_high``...) falls in one group here:

- ``method``: the objective and its layers (``algorithm.*``, the Goldilocks prompt sampler,
  ``trainer.entropy_grad`` that an entropy bonus needs). Differences here are the comparison.
- ``execution``: how the same math is run (backend, micro-batch size, chunking, logging, checkpoints,
  where the verifier lives). They do not change the objective, so they are not confounds.
- every other group (``batch``, ``length``, ``grader``, ``reward scale``, ``sampler``, ``schedule``,
  ``seed``, ``model``, ``data``, ``eval``) is a **confound**: two runs that differ there measure more
  than the method. A key no rule names is a confound too (``other``), so a new config field is
  flagged until someone classifies it.

``stapo compare`` warns on confounds between runs (``config_differences``); ``stapo recipes
matched`` removes them (``matched_overrides``); the recipe test checks that each ``stapo-*`` layer
recipe differs from ``stapo`` only in the keys its layers own (``LAYER_KEYS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "LAYER_KEYS", "LAYER_RECIPES", "KEY_GROUPS", "NOT_CONFOUNDS", "Difference", "flatten", "owned_by",
    "classify", "config_differences", "confounds", "matched_overrides", "FRAME_KEYS", "SHARED_FRAME",
    "frame_of", "frame_differences",
]

#: The frame of a comparison: what a step trains on (batch, optimizer steps, lengths) and the model.
FRAME_KEYS: tuple[str, ...] = (
    "model.name_or_path", "rollout.prompts_per_step", "rollout.n", "algorithm.mini_batches",
    "algorithm.ppo_epochs", "rollout.max_new_tokens", "data.max_prompt_tokens",
)
#: The recipes meant to be compared as shipped: ``stapo`` is the paper's setup, ``stapo-base`` the same
#: without S2T, the ablations change which candidates are silenced, and each layer recipe is ``stapo``
#: + its layer, so all of them share ``stapo``'s frame (tested). The other baselines keep their own
#: sources' frames; ``stapo recipes matched stapo NAME`` aligns one.
SHARED_FRAME: tuple[str, ...] = ("stapo", "stapo-base", "stapo-random", "stapo-high-entropy", "justrl-fullmask",
                                 "stapo-goldilocks", "stapo-maspo", "stapo-deep", "stapo-stack", "stapo-async")

#: The config keys each stability layer owns (a trailing "." = the whole section). A layer recipe
#: ``stapo-X`` is ``stapo`` plus its layers: it may differ from ``stapo`` in these keys (and its label,
#: ``algorithm.name``) only, so a comparison with ``stapo`` measures the layer and nothing else.
LAYER_KEYS: dict[str, tuple[str, ...]] = {
    "goldilocks": ("data.sampler", "data.goldilocks."),
    "maspo": ("algorithm.policy_loss", "algorithm.maspo.", "algorithm.dual_clip_c"),  # its gate replaces every clip
    "deep": ("algorithm.deep_grpo.",),
    "async": ("rollout.async.", "algorithm.off_policy."),  # VCPO's layer: stale rollouts and their controls
    "no-s2t": ("algorithm.token_weighting",),  # the matched control: every token counts
    "s2t-ablation": ("algorithm.s2t.silence",),  # the paper's masking-strategy ablations
}
#: Which layers each shipped layer recipe stacks on ``stapo``.
LAYER_RECIPES: dict[str, tuple[str, ...]] = {
    "stapo-goldilocks": ("goldilocks",),
    "stapo-maspo": ("maspo",),
    "stapo-deep": ("deep",),
    "stapo-stack": ("goldilocks", "deep", "maspo"),
    "stapo-async": ("async",),
    "stapo-base": ("no-s2t",),
    "stapo-random": ("s2t-ablation",),
    "stapo-high-entropy": ("s2t-ablation",),
    "justrl-fullmask": ("s2t-ablation",),
}

#: (group, key prefixes), first match wins: the specific rules come before the broad ones.
KEY_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("seed", ("trainer.seed", "data.seed", "data.goldilocks.seed", "model.tiny.seed")),
    ("batch", ("rollout.prompts_per_step", "rollout.n", "algorithm.mini_batches", "algorithm.ppo_epochs")),
    ("length", ("rollout.max_new_tokens", "data.max_prompt_tokens", "rollout.vllm.max_model_len")),
    ("reward scale", ("reward.scale.",)),
    ("grader", ("reward.mode", "reward.think", "reward.deadline_s")),
    ("sampler", ("rollout.temperature", "rollout.top_p", "rollout.ignore_eos")),
    ("schedule", ("trainer.max_steps", "trainer.lr", "trainer.warmup_steps", "trainer.lr_schedule_unit",
                  "trainer.lr_schedule", "trainer.weight_decay", "trainer.betas", "trainer.adam_eps", "trainer.max_grad_norm")),
    ("execution", (
        "logging.", "checkpoint.", "eval.every", "reward.urls", "reward.token", "reward.workers", "reward.retries",
        "reward.max_failure_frac", "trainer.micro_batch_size", "trainer.logits_chunk_size", "trainer.fused_loss",
        "trainer.micro_batch_tokens", "trainer.attn_implementation", "trainer.share_prompt_prefix", "trainer.device", "trainer.backend",
        "trainer.zero_stage", "trainer.offload_optimizer", "trainer.zero3_param_persistence_threshold",
        "trainer.skip_nonfinite", "trainer.update_memory", "trainer.gpu_memory_gib", "trainer.sync_bucket_mb",
        "trainer.dist_timeout_s", "model.gradient_checkpointing", "model.cache_dir", "rollout.engine",
        "rollout.batch_size", "rollout.share_prefix", "rollout.vllm.", "rollout.server.", "algorithm.kl.offload",
    )),
    ("method", ("algorithm.", "rollout.async.", "data.sampler", "data.goldilocks.", "trainer.entropy_grad")),
    ("model", ("model.",)),
    ("data", ("data.",)),
    ("eval", ("eval.",)),
)
#: Groups whose differences are not confounds.
NOT_CONFOUNDS = ("method", "execution")


@dataclass(frozen=True)
class Difference:
    """One config key whose value differs between a baseline run and another run."""

    key: str
    group: str
    base: Any
    other: Any

    @property
    def confound(self) -> bool:
        return self.group not in NOT_CONFOUNDS


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": value} (lists stay values)."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flatten(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
    return out


def owned_by(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether a dotted key is one of ``prefixes`` (exactly, or inside a section ending in ".")."""
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def classify(key: str) -> str:
    """The group of a dotted config key (``other`` when no rule names it: treated as a confound)."""
    for group, prefixes in KEY_GROUPS:
        if owned_by(key, prefixes):
            return group
    return "other"


def config_differences(base: dict[str, Any], other: dict[str, Any]) -> list[Difference]:
    """Every key whose value differs between two (nested or flat) configs, sorted by key.

    Configs are compared as saved (``config.yaml``), without validation, so a run written by an older
    stapo (a field missing) still compares: the missing value shows as None."""
    fa, fb = flatten(base), flatten(other)
    return [Difference(k, classify(k), fa.get(k), fb.get(k))
            for k in sorted(set(fa) | set(fb)) if _norm(fa.get(k)) != _norm(fb.get(k))]


def confounds(diffs: list[Difference]) -> list[Difference]:
    return [d for d in diffs if d.confound]


def matched_overrides(reference: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """``--set`` overrides that give ``other`` the reference's value for every confound key.

    After them the two configs differ in method (and execution) keys only: the same prompts x
    samples x response length x steps budget, grader, reward scale, sampling, schedule, seed, model
    and data. Values are written as YAML flow scalars, as ``--set`` parses them."""
    import yaml

    out = []
    for d in config_differences(other, reference):
        if d.confound:
            val = yaml.safe_dump(d.other, default_flow_style=True, width=10_000).strip()
            out.append(f"{d.key}={val.removesuffix('...').strip()}")
    return out


def _norm(v: Any) -> Any:
    """YAML gives tuples back as lists: compare them alike."""
    return list(v) if isinstance(v, tuple) else v


def frame_of(config: dict[str, Any]) -> dict[str, Any]:
    """The :data:`FRAME_KEYS` values of a config dump (``model_dump(mode="json", by_alias=True)``)."""
    flat = flatten(config)
    return {k: flat.get(k) for k in FRAME_KEYS}


def frame_differences(ref: dict[str, Any], other: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(frame key, reference value, other value) where two config dumps' frames differ."""
    a, b = frame_of(ref), frame_of(other)
    return [(k, a[k], b[k]) for k in FRAME_KEYS if a[k] != b[k]]
