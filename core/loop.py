"""The RL loop, read top to bottom: rollouts -> rewards -> advantages -> token weights -> update.

One step of :func:`train`::

    prompts  -> rollouts        (RolloutEngine: hf or vllm; G samples per prompt)
             -> rewards         (verifier: local worker pool or remote URL; failures never a silent 0)
             -> advantages      (grpo / dr_grpo / rloo over each group; DAPO overlong shaping)
             -> dynamic sampling(DAPO: keep groups with mixed rewards, resample to refill)
             -> dump forward    (when dumping: p, H, sum q^2, top-k of the sampled policy, one forward)
             -> old log-probs   (no-grad pass, only where stapo.core.update.needs_old_pass says: off-policy
                                 mini-batches, extras that read the sampling policy)
             -> K updates       (stapo.core.update: per mini-batch, p and H from the gradient forward ->
                                 token weights -> per-token loss -> aggregation with the GLOBAL
                                 normalizer, so micro-batching and packing never change the update; the
                                 weights' own counts are the logged diagnostics)
             -> weight sync     (trainer -> rollout engine; a no-op when hf shares the model)
             -> metrics, token dump (rank 0 writes), validation, checkpoint

Everything a recipe may add (asynchronous rollouts, the prompt sampler's step, DEEP-GRPO, the KL
reference, Lp-Reg, STARE's controller, DAPO's overlong filter) is a hook with one interface, registered
by name (``stapo.core.extras``: ``LoopHook`` phases sample / on_batch / needs_old_stats /
before_update / after_update / after_sync / state_dict); :func:`train` calls the phases and never
branches on a particular extra.

Departures from plain GRPO are all config: the token weighting (``s2t`` is STAPO, arXiv
2602.15620: silence tokens with A > 0, p < tau_p, H < tau_h and drop them from the denominator),
DAPO's clip-higher / dynamic sampling / overlong shaping (arXiv 2503.14476), 20-Entropy's
top-entropy mask (arXiv 2506.01939). No KL by default (kl_coef=0), as in DAPO and JustRL.

Data parallelism (DeepSpeed on N ranks): each rank samples its share of the prompts; every decision
about the batch is global and every rank issues the same collectives whatever its rewards
(``stapo.core.distributed``: global refill decision and trim, one global mini-batch plan, zero-weight
padding rows); logged metrics are global sums; rank 0 writes files. The token diagnostics
(``stapo/*``, ``phase/*``, the dump's weights) are the update's own weightings, counted per mini-batch.

Determinism: every RNG is re-seeded from (trainer.seed, step) at the start of each step and
prompts come from a seeded permutation indexed by step, so a run resumed from a checkpoint
replays the remaining steps exactly (CPU).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stapo.core.config import Config, save_config
from stapo.core.rewards import rule_shares
from stapo.core.sampler import dynamic_sampling_refill, prompts_per_round
from stapo.core.trainer.base import begin_rollout_step
from stapo.core.update import (
    micro_spec,
    needs_old_pass,
    old_pass_calls,
    policy_loss_params,
    stats_temperature,
    token_stats_batched,
    update_parts,
    update_policy,
    weighting_params,
)

if TYPE_CHECKING:
    from stapo.core.extras import StepState

__all__ = [
    "train", "TrainResult", "derive_seed",
    # the update lives in stapo.core.update; re-exported for the loop's callers
    "policy_loss_params", "stats_temperature", "token_stats_batched", "update_parts", "update_policy",
    "weighting_params",
]


# ----------------------------------------------------------------------------- small helpers


def derive_seed(*parts: int) -> int:
    """A stable 31-bit seed from integers (Python's hash() is salted per process)."""
    digest = hashlib.sha256(",".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prompts_for_step(n_prompts: int, step: int, per_step: int, seed: int, round_: int = 0) -> list[int]:
    """Indices of a step's prompts: consecutive slices of per-epoch seeded permutations.

    Extra dynamic-sampling rounds (``round_ > 0``) draw from their own seeded stream so that the
    main cursor, and thus every later step, is the same with or without resampling.
    """
    if round_:
        rng = np.random.default_rng(derive_seed(seed, step, round_))
        return [int(i) for i in rng.choice(n_prompts, size=per_step, replace=per_step > n_prompts)]
    out = []
    for i in range((step - 1) * per_step, step * per_step):
        epoch, pos = divmod(i, n_prompts)
        perm = np.random.default_rng(derive_seed(seed, epoch)).permutation(n_prompts)
        out.append(int(perm[pos]))
    return out


@dataclass
class Sequence_:
    """One sampled response with everything the update needs."""

    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: str
    text: str
    gold: str
    group: int
    reward: float = 0.0
    correct: bool = False
    valid: bool = True
    advantage: float = 0.0
    # asynchronous rollouts (stapo.core.async_rollout): the policy version that sampled it (None: the
    # weights this step starts from) and the log-probs its sampler recorded
    version: int | None = None
    behaviour_logprobs: list[float] | None = None


@dataclass
class Batch:
    """Padded tensors: prompts left-padded, responses right-padded, one row per sequence."""

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L]
    response_mask: torch.Tensor  # [N, L] bool
    advantages: torch.Tensor  # [N, L] (advantage broadcast over the response)

    def rows(self, idx: torch.Tensor) -> Batch:
        return Batch(self.input_ids[idx], self.attention_mask[idx], self.response_mask[idx], self.advantages[idx])

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.response_mask, self.advantages)))


def collate(seqs: Sequence[Sequence_], pad_id: int) -> Batch:
    p_len = max(len(s.prompt_ids) for s in seqs)
    r_len = max(max(len(s.response_ids) for s in seqs), 1)
    n = len(seqs)
    ids = torch.full((n, p_len + r_len), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p_len + r_len), dtype=torch.long)
    resp = torch.zeros((n, p_len + r_len), dtype=torch.bool)
    adv = torch.zeros((n, p_len + r_len), dtype=torch.float32)
    for i, s in enumerate(seqs):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[i, p_len - p : p_len] = torch.tensor(s.prompt_ids)
        ids[i, p_len : p_len + r] = torch.tensor(s.response_ids, dtype=torch.long)
        attn[i, p_len - p : p_len + r] = 1
        resp[i, p_len : p_len + r] = True
        adv[i, p_len : p_len + r] = s.advantage
    return Batch(ids, attn, resp, adv)


def collate_with_pad_row(seqs: Sequence[Sequence_], pad_id: int, *, pad: bool) -> Batch:
    """``collate`` plus, when ``pad``, one trailing zero-weight row (data parallel).

    The padding row is a real token sequence (the first kept one, or two pad tokens on a rank that
    kept nothing) with an all-False response mask and advantage 0: forwards through it are ordinary
    (no fully masked attention row, so no NaN), and it carries no loss and no gradient. A rank runs
    it whenever it has fewer rows than the busiest rank, so every rank joins every collective.
    """
    if not pad:
        return collate(seqs, pad_id)
    if not seqs:
        return Batch(torch.full((1, 2), pad_id, dtype=torch.long), torch.ones((1, 2), dtype=torch.long),
                     torch.zeros((1, 2), dtype=torch.bool), torch.zeros((1, 2), dtype=torch.float32))
    b = collate(seqs, pad_id)  # [N, L] each; the padding row copies row 0's tokens, nothing else
    return Batch(
        torch.cat([b.input_ids, b.input_ids[:1]]),
        torch.cat([b.attention_mask, b.attention_mask[:1]]),
        torch.cat([b.response_mask, torch.zeros_like(b.response_mask[:1])]),
        torch.cat([b.advantages, torch.zeros_like(b.advantages[:1])]),
    )


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


# ----------------------------------------------------------------------------- the parts of a run


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    val_before: float | None
    val_after: float | None
    wall_s: float


class _Run:
    """Everything a run holds: model, trainer backend, rollout engine, rewards, data, tracking."""

    def __init__(self, cfg: Config, run_dir: Path, log: Callable[[str], None]) -> None:
        from stapo.core.data import encode_prompt, load_prompts
        from stapo.core.models import load_policy
        from stapo.core.placement import rank_placement
        from stapo.core.rewards import RewardFunction
        from stapo.core.rollout import build_rollout_engine
        from stapo.core.trainer import build_trainer_backend

        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        # this rank's device, set before anything touches a GPU (stapo.core.placement); the policy
        # loads on the CPU and the trainer backend places it there
        self.placement = rank_placement(cfg.trainer.device, tp_size=vllm_tp_size(cfg))
        seed_everything(cfg.trainer.seed)
        device = self.placement.device
        t0 = time.time()
        self.model, self.tokenizer = load_policy(cfg.model, device="cpu", compute_device=device)
        log(f"policy {cfg.model.name_or_path}: {sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M params "
            f"for {device} ({time.time() - t0:.1f}s)")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        total_updates = cfg.trainer.max_steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches
        self.backend = build_trainer_backend(cfg, self.model, total_optimizer_steps=max(total_updates, 1))
        # Data parallel (deepspeed launcher): each rank samples its share of the step's prompts; the
        # token-mean normalizer and the S2T thresholds are reduced across ranks; rank 0 writes files.
        self.rank = int(self.backend.rank)
        self.world_size = int(self.backend.world_size)
        self.placement.record(run_dir / "ranks", self.backend.device)  # which host / GPU each rank took
        if cfg.rollout.prompts_per_step % self.world_size:
            raise ValueError(
                f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) must be divisible by the "
                f"number of data-parallel ranks ({self.world_size})"
            )
        self.engine = build_rollout_engine(cfg, model=self.backend.model, tokenizer=self.tokenizer)
        if self.world_size > 1 and hasattr(self.engine, "synced_gpus"):
            # ZeRO-3 gathers parameters in every generate step: a rank whose sequences finished early
            # keeps stepping (transformers' synced_gpus) until every rank is done.
            self.engine.synced_gpus = True
        self.rewards = RewardFunction(cfg.reward)
        self.train_prompts, self.val_prompts = load_prompts(cfg.data, self.tokenizer)
        if not self.train_prompts:
            raise ValueError(f"no training prompts from data.source={cfg.data.source!r}")
        log(f"data: {len(self.train_prompts)} train / {len(self.val_prompts)} val prompts from {cfg.data.source}")
        self._encode = lambda text: encode_prompt(self.tokenizer, text, chat_template=cfg.data.chat_template)
        self._encoded: dict[str, list[int]] = {}
        # which prompts (uniform | goldilocks: docs/stability.md); the loop's sampling asks it
        from stapo.core.sampler import build_sampler

        self.sampler = build_sampler(cfg, self.train_prompts, encode=self.encode, model=self.backend.model)
        # every extra (async rollouts, the sampler's step, DEEP-GRPO, KL / Lp-Reg / STARE / overlong
        # filter) is a named hook with one interface: stapo.core.extras
        from stapo.core.extras import build_hooks

        self.hooks = build_hooks(self)

    def encode(self, rec: Any) -> list[int]:
        if rec.id not in self._encoded:
            self._encoded[rec.id] = self._encode(rec.prompt)
        return self._encoded[rec.id]

    def close(self) -> None:
        try:
            self.hooks.close()
        finally:
            self.rewards.close()


def vllm_tp_size(cfg: Config) -> int:
    """vLLM's tensor-parallel size (1 unless the colocated vllm engine is used)."""
    return cfg.rollout.vllm.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1


# ----------------------------------------------------------------------------- phases of a step


def rollout_and_grade(run: _Run, step: int, round_: int) -> tuple[list[Sequence_], dict[str, float]]:
    """Sample G responses for this step's prompts and grade them."""
    from stapo.core.rollout import SamplingParams

    cfg = run.cfg
    idx = run.sampler.select(step, round_, prompts_per_round(cfg))  # uniform: prompts_for_step
    recs = [run.train_prompts[i] for i in idx[run.rank :: run.world_size]]  # this rank's share
    sampling = SamplingParams(
        n=cfg.rollout.n,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=derive_seed(cfg.trainer.seed, step, round_, run.rank),
        ignore_eos=cfg.rollout.ignore_eos,
        logprobs=cfg.rollout.async_.enabled,  # only the async producer reads behaviour log-probs
    )
    # With the hf engine, a step larger than one generate call (rollout.batch_size
    #    sequences) is sampled in waves, and each wave is graded (in a thread; the grader's work runs
    #    in its own processes or service) while the next one generates. Wave 0 keeps the step's seed,
    #    so a single-wave step samples exactly what it did before.
    per_wave = max(1, cfg.rollout.batch_size // cfg.rollout.n) if cfg.rollout.engine == "hf" else len(recs)
    waves = [recs[i : i + per_wave] for i in range(0, len(recs), per_wave)] or [recs]
    seqs: list[Sequence_] = []
    futures = []
    t_grade: list[float] = []

    def grade(wave_seqs: list[Sequence_]) -> Any:
        t = time.time()
        out = run.rewards([s.text for s in wave_seqs], [s.gold for s in wave_seqs])
        t_grade.append(time.time() - t)
        return out

    from concurrent.futures import ThreadPoolExecutor

    t_roll = 0.0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="grade") as pool:
        for w, wave in enumerate(waves):
            params = sampling if w == 0 else replace(sampling, seed=derive_seed(sampling.seed or 0, w))
            t1 = time.time()
            groups = run.engine.generate([run.encode(r) for r in wave], params)
            t_roll += time.time() - t1
            base = len(seqs) // cfg.rollout.n
            wave_seqs = [
                Sequence_(run.encode(rec), list(c.token_ids), c.finish_reason, c.text, rec.answer, group=base + g)
                for g, (rec, comps) in enumerate(zip(wave, groups, strict=True))
                for c in comps
            ]
            seqs += wave_seqs
            futures.append((wave_seqs, pool.submit(grade, wave_seqs)))
        t_wait = time.time()
        failed = retried = no_answer = 0
        for wave_seqs, fut in futures:
            graded = fut.result()
            for s, r, v, c in zip(wave_seqs, graded.rewards, graded.valid, graded.correct, strict=True):
                s.reward, s.valid, s.correct = r, v, c
            failed += graded.valid.count(False)  # no reward computed: timeout, error, undecided
            retried += graded.retried
            no_answer += graded.statuses.get("no_answer", 0)
    record_groups(run, idx[run.rank :: run.world_size], seqs)  # the sampler learns from observed accuracies
    times = {"time/rollout_s": t_roll, "time/reward_s": time.time() - t_wait, "time/reward_total_s": sum(t_grade),
             "reward/failed": failed, "reward/retried": retried, "reward/no_answer_frac": no_answer / max(len(seqs), 1),
             **rule_shares([fut.result() for _, fut in futures])}
    return seqs, times


def group_sequences(seqs: Sequence[Sequence_]) -> dict[int, list[Sequence_]]:
    """Sequences by group id, groups and members in order of first appearance."""
    by_group: dict[int, list[Sequence_]] = {}
    for s in seqs:
        by_group.setdefault(s.group, []).append(s)
    return by_group


def record_groups(run: _Run, idx: Sequence[int], seqs: list[Sequence_]) -> None:
    """Tell the prompt sampler each valid group's accuracy and whether its rewards were all equal."""
    groups = group_sequences(seqs)
    ok = [(i, g) for i, g in zip(idx, (groups.get(k, []) for k in range(len(idx))), strict=True)
          if g and all(s.valid for s in g)]
    run.sampler.record([i for i, _ in ok], [_mean([float(s.correct) for s in g]) for _, g in ok],
                       [len({s.reward for s in g}) == 1 for _, g in ok])


def shape_and_advantage(cfg: Config, seqs: list[Sequence_]) -> list[Sequence_]:
    """Overlong shaping, drop groups with a failed reward, group advantages; returns kept sequences."""
    from stapo.core.algos import get_advantage, overlong_penalty

    if cfg.algorithm.overlong.enabled:
        lengths = torch.tensor([len(s.response_ids) for s in seqs], dtype=torch.float32)
        pen = overlong_penalty(
            lengths,
            max_len=cfg.rollout.max_new_tokens,
            buffer=cfg.algorithm.overlong.buffer,
            penalty=cfg.algorithm.overlong.penalty,
        )
        for s, p in zip(seqs, pen.tolist(), strict=True):
            s.reward += p
    groups = [g for g in group_sequences(seqs).values() if all(s.valid for s in g)]
    if not groups:
        return []
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)  # [P, G]
    adv = get_advantage(cfg.algorithm.advantage)(rewards, eps=cfg.algorithm.adv_eps)  # [P, G]
    for g, row in zip(groups, adv.tolist(), strict=True):
        for s, a in zip(g, row, strict=True):
            s.advantage = a
    return [s for g in groups for s in g]


def mixed_groups(seqs: list[Sequence_], metric: str = "acc") -> list[Sequence_]:
    """DAPO dynamic sampling: keep only groups whose accuracies (``metric="acc"``, DAPO) or shaped
    rewards (``"reward"``) are not all equal."""
    from stapo.core.algos import dynamic_sampling_filter, dynamic_sampling_values

    groups = list(group_sequences(seqs).values())
    if not groups:
        return []
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)  # [P, G]
    correct = torch.tensor([[float(s.correct) for s in g] for g in groups], dtype=torch.float32)  # [P, G]
    keep = dynamic_sampling_filter(dynamic_sampling_values(rewards, correct, metric=metric))  # [P]
    return [s for g, k in zip(groups, keep.tolist(), strict=True) if k for s in g]


def trim_kept(kept: list[Sequence_], want: int, n: int, dp: Any) -> list[Sequence_]:
    """Cut the GLOBAL kept batch to ``want`` sequences (whole groups of ``n``).

    One process: the first ``want``, as DAPO fills its batch. Data parallel: the ranks' kept group
    counts are all-gathered and :func:`stapo.core.distributed.balanced_quota` says how many groups
    each keeps, so the global batch has ``min(want, total)`` sequences spread as evenly as possible.
    """
    from stapo.core.distributed import balanced_quota

    if not dp.multi:
        return kept[:want]
    quota = balanced_quota(dp.counts(len(kept) // n), want // n)
    return kept[: quota[dp.rank] * n]


def rollout_metrics(dp: Any, all_seqs: Sequence[Sequence_], metrics: dict[str, float]) -> dict[str, float]:
    """Reward, accuracy and length metrics over EVERY rank's sampled sequences (one all_gather).

    Also sums the per-rank reward failure / retry counts; ``_tokens`` (global response tokens) is
    for the throughput metric.
    """
    lengths = [len(s.response_ids) for s in all_seqs]
    rewards = [s.reward for s in all_seqs]
    local = [
        float(len(all_seqs)), math.fsum(rewards), math.fsum(r * r for r in rewards),
        float(sum(s.correct for s in all_seqs)), float(sum(lengths)),
        float(sum(s.finish_reason == "length" for s in all_seqs)),
        float(metrics.get("reward/failed", 0.0)), float(metrics.get("reward/retried", 0.0)),
        float(metrics.get("reward/no_answer_frac", 0.0)), float(max(lengths, default=0)),
    ]
    rows = dp.gather_rows(local)
    tot = [math.fsum(col) for col in zip(*rows, strict=True)]
    n = tot[0]
    mean = tot[1] / n if n else float("nan")
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(tot[2] / n - mean * mean, 0.0)) if n else float("nan"),
        "reward/accuracy": tot[3] / n if n else float("nan"),
        "response_length/mean": tot[4] / n if n else float("nan"),
        "response_length/max": max(r[9] for r in rows),
        "response_length/clip_ratio": tot[5] / n if n else float("nan"),
        "reward/failed": tot[6],
        "reward/retried": tot[7],
        "reward/no_answer_frac": tot[8] / len(rows),  # equal shares of the step's prompts per rank
        "_tokens": tot[4],
    }


def step_entropies(old_ent: torch.Tensor, mask: torch.Tensor,
                   gather: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """Every valid response token's entropy in the step's GLOBAL batch [n_valid] (one all_gather)."""
    with torch.no_grad():
        local = old_ent.detach()[mask.bool()]  # [n_valid]
        return gather(local) if gather is not None else local


def entropy_thresholds(cfg: Config, allv: torch.Tensor) -> tuple[float, float | None]:
    """(5th entropy percentile of ``allv``, the step's tau_h or None): see :func:`step_entropy_thresholds`."""
    from stapo.core.algos import quantile

    s2t = cfg.algorithm.s2t
    p05 = quantile(allv, 0.05)
    if s2t.tau_h is not None:
        return p05, float(s2t.tau_h)
    if s2t.tau_h_quantile is not None and s2t.tau_h_scope == "step":
        return p05, quantile(allv, float(s2t.tau_h_quantile))
    return p05, None


def step_entropy_thresholds(cfg: Config, old_ent: torch.Tensor, mask: torch.Tensor,
                            gather: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[float, float | None]:
    """(global 5th entropy percentile of the step batch, the step's tau_h or None).

    The step's tau_h is ``algorithm.s2t.tau_h`` when absolute, else, with ``tau_h_scope=step``, the
    ``tau_h_quantile`` of every valid response token's entropy in the step's GLOBAL batch under the
    pre-update policy; None with ``tau_h_scope=minibatch`` (each mini-batch resolves its own).
    One all_gather, on every rank.
    """
    return entropy_thresholds(cfg, step_entropies(old_ent, mask, gather))


def update_diagnostics(cfg: Config, ctx: Any, tw: Any, tau_step: float | None, diag: dict[str, float]) -> float:
    """Add one mini-batch's global token counts (from the weighting's own output) to ``diag``;
    returns the tau_h it used: the weighting's (S2T), else the step's, else this mini-batch's quantile."""
    from stapo.core.algos import resolve_tau_h, token_counts

    s2t = cfg.algorithm.s2t
    tau = tw.info.get("tau_h", tau_step)
    if tau is None:  # (a weighting other than s2t with a rate target: its cells at the 5th percentile)
        tau = resolve_tau_h(ctx.entropy, ctx.mask, tau_h_quantile=s2t.tau_h_quantile or 0.05, gather=ctx.gather)
    for k, v in token_counts(ctx, tw, tau_p=s2t.tau_p, tau_h=float(tau)).items():
        diag[k] = diag.get(k, 0.0) + v
    return float(tau)


@dataclass
class UpdateRecord:
    """What the update's own token weightings produced, per local row, for the token dump.

    ``weights[e, i]`` is the weight row i got in PPO epoch e (the weighting's output on the
    mini-batch that held row i, under the policy of that moment); ``tau_h[e, i]`` that mini-batch's
    entropy threshold.
    """

    weights: torch.Tensor  # [E, N, L]
    tau_h: torch.Tensor  # [E, N]
    cells: torch.Tensor  # [E, N, L] int8 phase cell (index into PHASE_KEYS) the update's counts used
    logprobs: torch.Tensor  # [E, N, L] float32 log p the weighting compared (its p is exp in float64)
    entropy: torch.Tensor  # [E, N, L] float32 H the weighting compared

    @staticmethod
    def empty(epochs: int, batch: Batch) -> UpdateRecord:
        n, L = batch.input_ids.shape
        return UpdateRecord(torch.ones(epochs, n, L), torch.full((epochs, n), float("nan")),
                            torch.full((epochs, n, L), -1, dtype=torch.int8), torch.zeros(epochs, n, L),
                            torch.zeros(epochs, n, L))

    def put(self, epoch: int, rows: torch.Tensor, ctx: Any, tw: Any, tau_h: float, tau_p: float) -> None:
        """Store what one mini-batch's weighting gave its first ``len(rows)`` rows (the real ones;
        padding rows come after them): applied weights, tau_h, and each token's phase cell."""
        from stapo.core.algos import phase_cells

        k = len(rows)
        rows = rows.cpu()
        self.weights[epoch, rows] = tw.weights[:k].detach().float().cpu()
        self.tau_h[epoch, rows] = tau_h
        self.cells[epoch, rows] = phase_cells(ctx, tau_p=tau_p, tau_h=tau_h)[:k].cpu()  # [k, L]
        self.logprobs[epoch, rows] = ctx.logprobs[:k].detach().float().cpu()
        self.entropy[epoch, rows] = ctx.entropy[:k].detach().float().cpu()


def loss_sums() -> dict[str, float]:
    """Empty running sums of one update's loss terms (``add_loss_sums`` fills, ``update_metrics`` reads)."""
    return {"loss": 0.0, "clip_low": 0.0, "clip_high": 0.0, "tokens": 0.0, "ratio_sum": 0.0}


def add_loss_sums(sums: dict[str, float], loss: torch.Tensor, m: dict[str, Any]) -> None:
    """Add one micro-batch's loss and its policy loss's counts to ``sums`` (both update paths)."""
    sums["loss"] += float(loss.detach())
    sums["clip_low"] += float(m["clip_low_count"])
    sums["clip_high"] += float(m["clip_high_count"])
    sums["tokens"] += float(m["token_count"])
    sums["ratio_sum"] += float(m["ratio_sum"])


def update_metrics(diag: dict[str, float], taus: Sequence[float], p05: float, sums: dict[str, float],
                   step_out: Sequence[dict[str, float]], epochs: int) -> dict[str, float]:
    """The update's logged metrics: token diagnostics counted from its own weightings (``diag``,
    summed over mini-batches and epochs), the thresholds it used, and the loss / clip sums and
    optimizer outputs (``step_out``: one per optimizer step), as ``stapo.core.update.update_policy``
    logs them."""
    from stapo.core.algos import fractions_from_counts

    tokens = max(sums["tokens"], 1.0)
    token_diag = fractions_from_counts(diag)
    token_diag["tokens/valid"] = diag["tokens"] / epochs  # every epoch sees each row once
    return {
        **token_diag,
        "stapo/silenced_count": diag["silenced"],
        "stapo/tau_h": _mean(taus),
        "entropy/p05": p05,
        "actor/loss": sums["loss"] / len(step_out),
        "actor/grad_norm": _mean([o.get("grad_norm", float("nan")) for o in step_out]),
        "actor/lr": step_out[-1].get("lr", float("nan")),
        "actor/skipped_updates": float(sum(o.get("skipped", 0.0) for o in step_out)),
        "actor/clip_frac_low": sums["clip_low"] / tokens,
        "actor/clip_frac_high": sums["clip_high"] / tokens,
        "actor/ratio_mean": sums["ratio_sum"] / tokens,
    }


def validate(run: _Run) -> dict[str, float]:
    """Accuracy on held-out prompts (greedy by default), global over data-parallel ranks.

    Each rank generates a strided share of the prompts, padded to the same count (every rank makes
    the same generate calls; the HF engine runs them with ``synced_gpus`` under data parallelism),
    and the correct counts and lengths are summed over ranks.
    """
    from stapo.core.distributed import DataParallel, even_shard
    from stapo.core.rollout import SamplingParams

    cfg = run.cfg
    if not run.val_prompts:
        return {}
    dp = DataParallel(run.backend)
    recs, real = even_shard(run.val_prompts, dp.rank, dp.world_size)
    sampling = SamplingParams(
        n=1,
        temperature=cfg.eval.val_temperature,
        top_p=1.0,
        max_new_tokens=cfg.eval.val_max_new_tokens or cfg.rollout.max_new_tokens,
        seed=derive_seed(cfg.trainer.seed, 999_983),
    )
    outs = run.engine.generate([run.encode(r) for r in recs], sampling)[:real]
    texts = [o[0].text for o in outs]
    graded = run.rewards(texts, [r.answer for r in recs[:real]]) if outs else None
    correct = float(sum(graded.correct)) if graded is not None else 0.0
    length = float(sum(len(o[0].token_ids) for o in outs))
    n_correct, n_len, n = dp.sum([correct, length, float(len(outs))])
    return {
        "accuracy": n_correct / n if n else float("nan"),
        "mean_length": n_len / n if n else float("nan"),
        "n": int(n),
    }


def dump_candidates(cfg: Config, seqs: Sequence[Sequence_]) -> list[int]:
    """Local rows worth dumping, best first, at most ``logging.dump_max_sequences``: positive
    advantage (only those can be silenced), then negative, then zero (no gradient at all)."""
    order = sorted(range(len(seqs)), key=lambda i: (seqs[i].advantage <= 0, seqs[i].advantage == 0, i))
    return order[: cfg.logging.dump_max_sequences]


def dump_forward(run: _Run, batch: Batch, rows: list[int], dp: Any) -> dict[str, torch.Tensor]:
    """Theorem 3.1 data of the dump rows from one forward of the PRE-update (sampled) policy at the
    sampling temperature: p, H, sum q^2 and top-k describe the same distribution. Micro-batches as
    the update's (packed with ``trainer.micro_batch_tokens``); every rank makes the same number of
    forwards (ZeRO-3), short ranks run their padding row."""
    from stapo.core.update import build_micro, lockstep, micro_spec, split_rows, with_padding

    cfg = run.cfg
    spec = micro_spec(cfg)
    sets = split_rows(torch.tensor(rows, dtype=torch.long), batch.attention_mask.sum(1).cpu(), spec)
    calls = max(1, lockstep(dp, [len(sets)])[0])
    sets = with_padding(sets, calls, batch.input_ids.shape[0] - 1 if dp.multi else None, "dump_forward")
    where = {r: i for i, r in enumerate(rows)}
    out: dict[str, torch.Tensor] = {}
    for r in sets:
        m = build_micro(batch, r, spec.packed)
        dist = run.backend.token_distribution(
            m.input_ids, m.attention_mask, m.response_mask,
            temperature=stats_temperature(cfg), top_k=cfg.logging.dump_top_k, position_ids=m.position_ids,
        )
        for k, v in dist.items():
            v = m.to_rows(v.detach()).cpu()  # [b, L, ...]
            if k not in out:
                out[k] = torch.zeros((len(rows), *v.shape[1:]), dtype=v.dtype)
            for j, row in enumerate(m.rows.tolist()):
                if row in where:  # (padding-row forwards carry nothing)
                    out[k][where[row]] = v[j]
    return out


def dump_tokens(run: _Run, step: int, seqs: list[Sequence_], batch: Batch, rows: list[int],
                dist: dict[str, torch.Tensor], record: UpdateRecord, dp: Any) -> None:
    """Bounded token-level dump for `stapo inspect` (format in docs/architecture.md); rank 0 writes.

    ``weight`` is what the update applied (PPO epoch 0; ``weights_per_epoch`` when there are more),
    ``cell`` the phase cell the update counted each token in (index into ``PHASE_KEYS``), ``prob``
    and ``entropy`` the p and H its weighting compared with the thresholds (the same float64
    comparison, so a shown p >= tau_p is never a silenced token) and ``tau_h`` the threshold of the
    row's mini-batch; ``sum_q2`` and ``top`` come from :func:`dump_forward` (the sampled policy;
    later mini-batches see the updated policy). Records from every rank are gathered; sequences holding
    silenced tokens come first, then ones with a learning signal (A != 0), up to the bound.
    """
    cfg = run.cfg
    resp_all = batch.response_mask.cpu()
    local = []
    for j, i in enumerate(rows):
        s, resp = seqs[i], resp_all[i]
        w = record.weights[:, i][:, resp]  # [E, R]
        top_p, top_i = dist["top_prob"][j][resp], dist["top_ids"][j][resp]  # [R, k]
        rec = {
            "prompt": run.tokenizer.decode(s.prompt_ids, skip_special_tokens=True)[-500:],
            "gold": s.gold,
            "reward": s.reward,
            "advantage": s.advantage,
            "tokens": [run.tokenizer.decode([t]) for t in s.response_ids],
            "token_ids": s.response_ids,
            # p and H as the update's weighting compared them (p = exp in float64, as below_thresholds)
            "prob": record.logprobs[0, i][resp].double().exp().tolist(),
            "entropy": record.entropy[0, i][resp].double().tolist(),
            "sum_q2": dist["sum_q2"][j][resp].tolist(),
            "weight": w[0].tolist(),
            "cell": record.cells[0, i][resp].tolist(),
            "tau_h": float(record.tau_h[0, i]),
            "top": [
                [[run.tokenizer.decode([int(t)]), float(p)] for t, p in zip(ti, pi, strict=True)]
                for ti, pi in zip(top_i.tolist(), top_p.tolist(), strict=True)
            ],
        }
        if w.shape[0] > 1:
            rec["weights_per_epoch"] = w.tolist()
        silenced = bool(((w[0] == 0)).any())
        local.append(((not silenced, s.advantage == 0, dp.rank, i), rec))
    gathered = [x for part in dp.gather_objects(local) for x in part]
    if dp.rank != 0:
        return
    out = [rec for _, rec in sorted(gathered, key=lambda kv: kv[0])][: cfg.logging.dump_max_sequences]
    taus = [t for t in record.tau_h[0].tolist() if math.isfinite(t)]
    d = run.run_dir / "dumps"
    d.mkdir(exist_ok=True)
    payload = {"step": step, "tau_p": cfg.algorithm.s2t.tau_p, "tau_h": _mean(taus),
               "tau_h_scope": cfg.algorithm.s2t.tau_h_scope,
               "token_weighting": cfg.algorithm.token_weighting, "sequences": out}
    tmp = d / f".step_{step:06d}.json.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.rename(d / f"step_{step:06d}.json")


# ----------------------------------------------------------------------------- the loop


def train(cfg: Config, run_dir: Path, *, resume: bool = False, log: Callable[[str], None] = print) -> TrainResult:
    """Run (or resume) RL training; returns where it went and validation before/after.

    Each step, top to bottom: sample -> grade -> advantages (+ dynamic sampling) -> old pass (where
    needed) -> update -> weight sync -> metrics / validation / checkpoint. The extras are hooks
    (``stapo.core.extras``: ``run.hooks``), called at their named phases with the step's
    :class:`~stapo.core.extras.StepState`; nothing below branches on a particular extra.
    """
    from stapo.core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from stapo.core.distributed import DataParallel
    from stapo.core.extras import StepState, legacy_hook_state
    from stapo.core.tracking import LiveView, Tracker, truncate_jsonl

    t_start = time.time()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    run = _Run(cfg, run_dir, log)
    hooks = run.hooks
    dp = DataParallel(run.backend)
    main = run.rank == 0
    if not main:
        log = _quiet
    tracker = Tracker(run_dir, cfg) if main else _NullTracker()
    start = 0
    val_before: float | None = None
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt, backend=run.backend)
        start = state.step
        val_before = state.extra.get("val_before")
        hooks.load_state_dict(legacy_hook_state(state.extra))  # STARE's schedule, sampler, DEEP-GRPO's model
        log(f"resumed from {ckpt} (step {start})")
    for name in ("metrics.jsonl", "val.jsonl") if main else ():
        truncate_jsonl(run_dir / name, max_step=start if ckpt is not None else -1)
    sync_weights(run)
    if start == 0 and run.val_prompts:
        v = validate(run)
        val_before = v["accuracy"]
        tracker.log_val(0, v)
        log(f"validation before training: accuracy {v['accuracy']:.3f} on {v['n']} prompts")

    def checkpoint(step: int) -> None:
        save_checkpoint(run_dir, step=step, backend=run.backend, cfg=cfg,
                        extra={"val_before": val_before, "hooks": hooks.state_dict()},
                        keep_last=cfg.checkpoint.keep_last)

    view = LiveView(cfg.trainer.max_steps, start, enabled=main and cfg.logging.live and sys.stderr.isatty(), log=log)
    last_val: float | None = val_before
    try:
        for step in range(start + 1, cfg.trainer.max_steps + 1):
            t_step = time.time()
            seed_everything(derive_seed(cfg.trainer.seed, step))
            begin_rollout_step(run.backend, step)  # LR of this step when the schedule counts rollout steps (verl)

            # --- sample + grade (a hook may supply round 0: async rollouts), advantages, DAPO's
            #     dynamic sampling (resample until the GLOBAL batch is full: stapo.core.sampler)
            seqs, metrics = hooks.sample(step) or rollout_and_grade(run, step, 0)
            all_seqs = list(seqs)
            kept = shape_and_advantage(cfg, seqs)
            if cfg.algorithm.dynamic_sampling:
                kept = dynamic_sampling_refill(run, step, kept, all_seqs, metrics, dp)
            st = StepState(step, all_seqs, kept, metrics, temperature=stats_temperature(cfg))
            hooks.on_batch(st)  # Goldilocks' teacher, DEEP-GRPO's branches, DAPO's overlong filter
            st.counts = dp.counts(len(st.kept))
            metrics.update(rollout_metrics(dp, all_seqs, metrics))
            metrics["batch/sequences"] = float(sum(st.counts))

            # --- old log-probs (only where needed), update (every rank, in lockstep), token dump
            t0 = time.time()
            run.engine.sleep()  # once a step: the rollout engine's memory goes to the update (docs/gpu.md)
            if sum(st.counts):
                update_step(run, st, dp)
            else:
                metrics["actor/skipped_updates"] = 1.0
                log(f"step {step}: no group with a usable advantage signal; update skipped")
            metrics["time/train_s"] = time.time() - t0

            # --- weight sync (the hf engine shares the trained model: nothing to copy)
            sync_weights(run)
            hooks.after_sync(st)

            # --- validation, metrics, checkpoint
            if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.trainer.max_steps:
                v = validate(run)
                if v:
                    tracker.log_val(step, v)
                    metrics["val/accuracy"] = last_val = v["accuracy"]
            metrics["time/step_s"] = time.time() - t_step
            metrics["perf/tokens_per_s"] = metrics.pop("_tokens") / max(metrics["time/step_s"], 1e-9)
            tracker.log(step, metrics)
            view.update(metrics)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != cfg.trainer.max_steps:
                checkpoint(step)

        view.close()
        end = cfg.trainer.max_steps
        if run.val_prompts and end > start:
            v = validate(run)
            tracker.log_val(end, v)
            last_val = v["accuracy"]
            log(f"validation after training: accuracy {v['accuracy']:.3f} (before: {val_before})")
        if end > start:
            checkpoint(end)
        if cfg.checkpoint.export_hf:
            run.backend.export_hf(run_dir / "final", run.tokenizer)
    finally:
        view.close()
        tracker.close()
        run.close()
    result = TrainResult(run_dir, cfg.trainer.max_steps, val_before, last_val, time.time() - t_start)
    if main:
        _write_summary(run_dir, result)
    return result


def sync_weights(run: _Run) -> None:
    """Trainer -> rollout engine (a no-op when the hf engine shares the trained model)."""
    if run.cfg.rollout.engine != "hf" or getattr(run.engine, "model", None) is not run.backend.model:
        run.engine.load_weights(run.backend.named_parameters_for_sync())


def update_step(run: _Run, st: StepState, dp: Any) -> None:
    """One step's update on ``st.kept`` (every rank, also one with no row): collate, the token dump's
    forward of the sampled policy, the old pass where the config or a hook needs it, the hooks'
    ``before_update``, ``update_policy``, the hooks' ``after_update``, the dump. Metrics go to
    ``st.metrics``."""
    cfg, hooks, metrics, step = run.cfg, run.hooks, st.metrics, st.step
    t0 = time.time()
    st.batch = batch = collate_with_pad_row(st.kept, run.pad_id, pad=dp.multi).to(run.backend.device)
    st.pad_row = len(st.kept) if dp.multi else None
    dumping = bool(cfg.logging.dump_tokens_every and step % cfg.logging.dump_tokens_every == 0)
    record = UpdateRecord.empty(cfg.algorithm.ppo_epochs, batch) if dumping else None
    if dumping:
        dump_rows = dump_candidates(cfg, st.kept)
        dump_dist = dump_forward(run, batch, dump_rows, dp)  # the pre-update (sampled) policy
    if needs_old_pass(cfg, hooks.needs_old_stats(st)):
        st.spec = micro_spec(cfg)
        st.calls = old_pass_calls(dp, batch, st.spec, len(st.kept))
        st.old_lp, st.old_ent = token_stats_batched(run.backend, batch, st.spec, st.temperature,
                                                    calls=st.calls, pad_row=st.pad_row)
    hooks.before_update(st)  # async's off-policy weights, KL / Lp-Reg / STARE constants, DEEP-GRPO's local loss
    metrics["time/stats_s"] = time.time() - t0

    def before_step(update: int, fresh: bool) -> None:
        for fn in st.before_step:
            fn(update, fresh)

    metrics.update(update_policy(run, batch, st.old_lp, st.old_ent, step, counts=st.counts, record=record,
                                 off_policy=st.off_policy, before_step=before_step if st.before_step else None))
    hooks.after_update(st)
    if dumping:
        dump_tokens(run, step, st.kept, batch, dump_rows, dump_dist, record, dp)


def _quiet(msg: str) -> None:
    """Log sink of ranks other than 0."""


class _NullTracker:
    """Ranks other than 0 write no metrics."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_val(self, step: int, result: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _write_summary(run_dir: Path, result: TrainResult) -> None:
    val_before, last_val = result.val_before, result.val_after
    (run_dir / "summary.json").write_text(json.dumps({
        "steps": result.steps,
        "val_accuracy_before": val_before,
        "val_accuracy_after": last_val,
        "wall_s": result.wall_s,
        "finite": all(math.isfinite(x) for x in (val_before or 0.0, last_val or 0.0)),
    }, indent=2))
