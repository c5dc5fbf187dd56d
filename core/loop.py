"""The RL loop, read top to bottom: rollouts -> rewards -> advantages -> token weights -> update.

One step of :func:`train`::

    prompts  -> rollouts        (RolloutEngine: hf or vllm; G samples per prompt)
             -> rewards         (verifier: local worker pool or remote URL; failures never a silent 0)
             -> advantages      (grpo / dr_grpo / rloo over each group; DAPO overlong shaping)
             -> dynamic sampling(DAPO: keep groups with mixed rewards, resample to refill)
             -> old log-probs   (TrainerBackend.token_stats without grad)
             -> K updates       (per mini-batch: token weights -> per-token loss -> aggregation with the
                                 GLOBAL normalizer, so micro-batching never changes the update)
             -> weight sync     (trainer -> rollout engine; a no-op when hf shares the model)
             -> metrics, token dump, validation, checkpoint

Departures from plain GRPO are all config: the token weighting (``s2t`` is STAPO, arXiv
2602.15620: silence tokens with A > 0, p < tau_p, H < tau_h and drop them from the denominator),
DAPO's clip-higher / dynamic sampling / overlong shaping (arXiv 2503.14476), 20-Entropy's
top-entropy mask (arXiv 2506.01939). No KL by default (kl_coef=0), as in DAPO and JustRL.

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
from typing import Any

import numpy as np
import torch

from stapo.core.config import Config, save_config

__all__ = ["train", "TrainResult", "derive_seed"]


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


def stats_temperature(cfg: Config) -> float:
    """Log-probs and entropies are those of the sampling policy: logits / T (T=0 means greedy: 1)."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


def token_stats_batched(backend: Any, batch: Batch, micro: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad log-probs and entropies of a whole batch, micro-batch by micro-batch."""
    lps, ents = [], []
    for s in range(0, batch.input_ids.shape[0], micro):
        rows = slice(s, s + micro)
        lp, ent = backend.token_stats(
            batch.input_ids[rows], batch.attention_mask[rows], batch.response_mask[rows],
            grad=False, temperature=temperature,
        )
        lps.append(lp.detach().float())
        ents.append(ent.detach().float())
    return torch.cat(lps), torch.cat(ents)  # [N, L], [N, L]


def weighting_params(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of the configured token weighting: its config section, field for field."""
    a = cfg.algorithm
    section = getattr(a, a.token_weighting, None)
    return section.model_dump() if section is not None else {}


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
        from stapo.core.rewards import RewardFunction
        from stapo.core.rollout import build_rollout_engine
        from stapo.core.trainer import build_trainer_backend

        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        seed_everything(cfg.trainer.seed)
        device = _resolve_device(cfg.trainer.device)
        t0 = time.time()
        self.model, self.tokenizer = load_policy(cfg.model, device=device)
        log(f"policy {cfg.model.name_or_path}: {sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M params "
            f"on {device} ({time.time() - t0:.1f}s)")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        total_updates = cfg.trainer.max_steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches
        self.backend = build_trainer_backend(cfg, self.model, total_optimizer_steps=max(total_updates, 1))
        # Data parallel (deepspeed launcher): each rank samples its share of the step's prompts; the
        # token-mean normalizer and the S2T thresholds are reduced across ranks; rank 0 writes files.
        self.rank = int(getattr(self.backend, "rank", 0))
        self.world_size = int(getattr(self.backend, "world_size", 1))
        if cfg.rollout.prompts_per_step % self.world_size:
            raise ValueError(
                f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) must be divisible by the "
                f"number of data-parallel ranks ({self.world_size})"
            )
        self.engine = build_rollout_engine(cfg, model=self.backend.model, tokenizer=self.tokenizer)
        self.rewards = RewardFunction(cfg.reward)
        self.train_prompts, self.val_prompts = load_prompts(cfg.data, self.tokenizer)
        if not self.train_prompts:
            raise ValueError(f"no training prompts from data.source={cfg.data.source!r}")
        log(f"data: {len(self.train_prompts)} train / {len(self.val_prompts)} val prompts from {cfg.data.source}")
        self._encode = lambda text: encode_prompt(self.tokenizer, text, chat_template=cfg.data.chat_template)
        self._encoded: dict[str, list[int]] = {}

    def encode(self, rec: Any) -> list[int]:
        if rec.id not in self._encoded:
            self._encoded[rec.id] = self._encode(rec.prompt)
        return self._encoded[rec.id]

    def close(self) -> None:
        self.rewards.close()


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ----------------------------------------------------------------------------- phases of a step


def rollout_and_grade(run: _Run, step: int, round_: int) -> tuple[list[Sequence_], dict[str, float]]:
    """Sample G responses for this step's prompts and grade them."""
    from stapo.core.rollout import SamplingParams

    cfg = run.cfg
    idx = prompts_for_step(len(run.train_prompts), step, cfg.rollout.prompts_per_step, cfg.data.seed, round_)
    recs = [run.train_prompts[i] for i in idx[run.rank :: run.world_size]]  # this rank's share
    sampling = SamplingParams(
        n=cfg.rollout.n,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=derive_seed(cfg.trainer.seed, step, round_, run.rank),
        ignore_eos=cfg.rollout.ignore_eos,
    )
    # -- issue 12: with the hf engine, a step larger than one generate call (rollout.batch_size
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
            run.engine.wake()
            groups = run.engine.generate([run.encode(r) for r in wave], params)
            run.engine.sleep()
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
            failed += graded.statuses.get("timeout", 0) + graded.statuses.get("error", 0)
            retried += graded.retried
            no_answer += graded.statuses.get("no_answer", 0)
    times = {"time/rollout_s": t_roll, "time/reward_s": time.time() - t_wait, "time/reward_total_s": sum(t_grade),
             "reward/failed": failed, "reward/retried": retried, "reward/no_answer_frac": no_answer / max(len(seqs), 1)}
    return seqs, times


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
    by_group: dict[int, list[Sequence_]] = {}
    for s in seqs:
        by_group.setdefault(s.group, []).append(s)
    groups = [g for g in by_group.values() if all(s.valid for s in g)]
    if not groups:
        return []
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)  # [P, G]
    adv = get_advantage(cfg.algorithm.advantage)(rewards, eps=cfg.algorithm.adv_eps)  # [P, G]
    for g, row in zip(groups, adv.tolist(), strict=True):
        for s, a in zip(g, row, strict=True):
            s.advantage = a
    return [s for g in groups for s in g]


def mixed_groups(seqs: list[Sequence_]) -> list[Sequence_]:
    """DAPO dynamic sampling: keep only groups whose rewards are not all equal."""
    from stapo.core.algos import dynamic_sampling_filter

    by_group: dict[int, list[Sequence_]] = {}
    for s in seqs:
        by_group.setdefault(s.group, []).append(s)
    groups = list(by_group.values())
    if not groups:
        return []
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)  # [P, G]
    keep = dynamic_sampling_filter(rewards)  # [P]
    return [s for g, k in zip(groups, keep.tolist(), strict=True) if k for s in g]


def update_policy(run: _Run, batch: Batch, old_lp: torch.Tensor, old_ent: torch.Tensor, step: int) -> dict[str, float]:
    """K mini-batch updates with the configured token weighting, loss and aggregation.

    Fused path (``trainer.fused_loss``, the default): for a per-token policy loss (``ppo_clip``;
    ``gspo`` couples the tokens of a sequence and keeps the unfused path) without entropy gradient,
    each micro-batch is one ``backend.token_loss`` call: the loss is sum_i coef_i * l_i(logp_i)
    (+ kl_coef * k3_i), where coef_i = d(aggregate)/d(l_i) is taken once per micro-batch by autograd
    on a ones tensor (every aggregation is linear in the per-token losses), so the LM head's gradient
    is computed inside the chunked forward and no logits are recomputed in backward. Same update as
    the unfused ``token_stats(grad=True) -> loss_fn -> aggregate`` sequence, up to float rounding.
    """
    from stapo.core.algos import (
        TokenContext,
        get_aggregation,
        get_policy_loss,
        get_token_weighting,
        kl_k3,
    )

    cfg, backend = run.cfg, run.backend
    a = cfg.algorithm
    weigh = get_token_weighting(a.token_weighting)
    loss_fn = get_policy_loss(a.policy_loss)
    agg = get_aggregation(a.aggregation)
    params = weighting_params(cfg)
    micro = cfg.trainer.micro_batch_size
    temp = stats_temperature(cfg)
    n = batch.input_ids.shape[0]
    ref_lp = old_lp if a.kl_coef > 0 else None  # k3 to the policy that sampled (no separate reference model)
    sums: dict[str, float] = {"loss": 0.0, "clip_low": 0.0, "clip_high": 0.0, "tokens": 0.0, "ratio_sum": 0.0}
    loss_kw = {"eps_low": a.eps_low, "eps_high": a.eps_high, "dual_clip_c": a.dual_clip_c}
    fused = (
        cfg.trainer.fused_loss
        and a.policy_loss in ("ppo_clip",)  # elementwise in each token's log-prob
        and not cfg.trainer.entropy_grad
        and hasattr(backend, "token_loss")
    )

    def agg_coefficients(tw_rows: Any, like: torch.Tensor, norm: Any) -> torch.Tensor:
        """d(aggregate)/d(per_token_loss) [b, L]: exact, since every aggregation is linear in it."""
        x = torch.ones_like(like, dtype=torch.float32, requires_grad=True)  # [b, L]
        with torch.enable_grad():
            (coef,) = torch.autograd.grad(agg.aggregate(x, tw_rows, normalizer=norm), x, allow_unused=True)
        return torch.zeros_like(x) if coef is None else coef.detach()

    def make_token_loss(old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, coef: torch.Tensor,
                        ref: torch.Tensor | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """coef * (policy loss + kl_coef * k3) at flat positions ``idx`` into the micro-batch's [b, L]."""
        old_f, adv_f, mask_f, coef_f = old.reshape(-1), adv.reshape(-1), mask.reshape(-1), coef.reshape(-1)
        ref_f = None if ref is None else ref.reshape(-1)

        def token_loss_fn(lp: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            lp2 = lp.unsqueeze(0)  # [1, n]: the registered loss works on [B, T] tensors
            per_tok, _ = loss_fn(lp2, old_f[idx].unsqueeze(0).to(lp.dtype), adv_f[idx].unsqueeze(0),
                                 mask_f[idx].unsqueeze(0), **loss_kw)
            if ref_f is not None:
                per_tok = per_tok + a.kl_coef * kl_k3(lp2, ref_f[idx].unsqueeze(0).to(lp.dtype))
            c = coef_f[idx].to(per_tok.dtype)  # [n]
            return torch.where(c != 0, c * per_tok[0], torch.zeros_like(c))  # as aggregate: 0 where w == 0

        return token_loss_fn

    step_out: list[dict[str, float]] = []
    fresh = True  # params unchanged since old_lp was computed: its stats are the current policy's
    for epoch in range(a.ppo_epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(cfg.trainer.seed, step, epoch)))
        for mb_idx in perm.to(batch.input_ids.device).chunk(a.mini_batches):
            mb = batch.rows(mb_idx)
            if fresh:
                cur_lp, cur_ent = old_lp[mb_idx], old_ent[mb_idx]
            else:
                cur_lp, cur_ent = token_stats_batched(backend, mb, micro, temp)
            ctx = TokenContext(
                logprobs=cur_lp,
                entropy=cur_ent,
                advantages=mb.advantages,
                mask=mb.response_mask,
                gather=getattr(backend, "all_gather_1d", None),
                all_reduce_sum=getattr(backend, "all_reduce_sum", None),
            )
            tw = weigh(ctx, **params)
            norm = agg.normalizer(tw, mb.response_mask)
            reduce = getattr(backend, "all_reduce_sum", None)
            norm = reduce(norm) if reduce is not None else norm
            for s in range(0, mb.input_ids.shape[0], micro):
                rows = slice(s, s + micro)
                old_rows, adv_rows, mask_rows = old_lp[mb_idx][rows], mb.advantages[rows], mb.response_mask[rows]
                ref_rows = None if ref_lp is None else ref_lp[mb_idx][rows]
                if fused:
                    coef = agg_coefficients(tw.select(rows), old_rows, norm)  # [b, L]
                    loss, lp, _ = backend.token_loss(
                        mb.input_ids[rows], mb.attention_mask[rows], mask_rows,
                        make_token_loss(old_rows, adv_rows, mask_rows, coef, ref_rows), temperature=temp,
                    )
                    with torch.no_grad():  # the clip metrics, from the pass's own (detached) log-probs
                        _, m = loss_fn(lp, old_rows, adv_rows, mask_rows, **loss_kw)
                else:
                    lp, _ = backend.token_stats(
                        mb.input_ids[rows], mb.attention_mask[rows], mask_rows, grad=True, temperature=temp
                    )
                    per_tok, m = loss_fn(lp, old_rows, adv_rows, mask_rows, **loss_kw)
                    if ref_rows is not None:
                        per_tok = per_tok + a.kl_coef * kl_k3(lp, ref_rows)
                    loss = agg.aggregate(per_tok, tw.select(rows), normalizer=norm)
                backend.backward(loss)
                sums["loss"] += float(loss.detach())
                sums["clip_low"] += float(m["clip_low_count"])
                sums["clip_high"] += float(m["clip_high_count"])
                sums["tokens"] += float(m["token_count"])
                sums["ratio_sum"] += float(m["ratio_sum"])
            step_out.append(backend.step())
            fresh = False
    updates = len(step_out)
    tokens = max(sums["tokens"], 1.0)
    grad_norms = [o.get("grad_norm", float("nan")) for o in step_out]
    return {
        "actor/loss": sums["loss"] / updates,
        "actor/grad_norm": _mean(grad_norms),
        "actor/lr": step_out[-1].get("lr", float("nan")),
        "actor/skipped_updates": float(sum(o.get("skipped", 0.0) for o in step_out)),
        "actor/clip_frac_low": sums["clip_low"] / tokens,
        "actor/clip_frac_high": sums["clip_high"] / tokens,
        "actor/ratio_mean": sums["ratio_sum"] / tokens,
    }


def batch_token_metrics(run: _Run, batch: Batch, lp: torch.Tensor, ent: torch.Tensor) -> tuple[dict[str, float], Any]:
    """Silenced fraction, the 8 phase cells, entropy: on the whole step batch at the sampling policy."""
    from stapo.core.algos import TokenContext, get_token_weighting, resolve_tau_h, token_metrics

    cfg = run.cfg
    ctx = TokenContext(logprobs=lp, entropy=ent, advantages=batch.advantages, mask=batch.response_mask)
    tw = get_token_weighting(cfg.algorithm.token_weighting)(ctx, **weighting_params(cfg))
    s2t = cfg.algorithm.s2t
    tau_h = resolve_tau_h(ent, batch.response_mask, tau_h=s2t.tau_h, tau_h_quantile=s2t.tau_h_quantile)
    metrics = token_metrics(ctx, tw, tau_p=s2t.tau_p, tau_h=tau_h)
    metrics["stapo/tau_h"] = float(tau_h)
    return metrics, (tw, tau_h)


def validate(run: _Run) -> dict[str, float]:
    """Accuracy on held-out prompts (greedy by default)."""
    from stapo.core.rollout import SamplingParams

    cfg = run.cfg
    recs = run.val_prompts
    if not recs:
        return {}
    sampling = SamplingParams(
        n=1,
        temperature=cfg.eval.val_temperature,
        top_p=1.0,
        max_new_tokens=cfg.eval.val_max_new_tokens or cfg.rollout.max_new_tokens,
        seed=derive_seed(cfg.trainer.seed, 999_983),
    )
    run.engine.wake()
    outs = run.engine.generate([run.encode(r) for r in recs], sampling)
    run.engine.sleep()
    texts = [o[0].text for o in outs]
    graded = run.rewards(texts, [r.answer for r in recs])
    return {
        "accuracy": _mean([float(c) for c in graded.correct]),
        "mean_length": _mean([len(o[0].token_ids) for o in outs]),
        "n": len(recs),
    }


def dump_tokens(run: _Run, step: int, seqs: list[Sequence_], batch: Batch, lp: torch.Tensor, ent: torch.Tensor,
                weights: torch.Tensor, tau_h: float) -> None:
    """Bounded token-level dump for `stapo inspect` (format in docs/architecture.md)."""
    cfg = run.cfg
    k = cfg.logging.dump_top_k
    # Prefer sequences that hold silenced tokens, then ones with a learning signal (A != 0), then the
    # rest, up to the bound: a group whose answers all agree has zero advantage and no gradient.
    silenced_rows = ((weights == 0) & batch.response_mask).any(dim=1).tolist()
    order = sorted(range(len(seqs)), key=lambda i: (not silenced_rows[i], seqs[i].advantage == 0, i))
    order = order[: cfg.logging.dump_max_sequences]
    out = []
    model = run.backend.model
    with torch.no_grad():
        for i in order:
            s = seqs[i]
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=run.backend.device)
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float()  # [R, V]
            probs = torch.softmax(logits, dim=-1)
            top = torch.topk(probs, k=min(k, probs.shape[-1])) if k else None
            resp = batch.response_mask[i]
            out.append({
                "prompt": run.tokenizer.decode(s.prompt_ids, skip_special_tokens=True)[-500:],
                "gold": s.gold,
                "reward": s.reward,
                "advantage": s.advantage,
                "tokens": [run.tokenizer.decode([t]) for t in s.response_ids],
                "token_ids": s.response_ids,
                "prob": lp[i][resp].exp().tolist(),
                "entropy": ent[i][resp].tolist(),
                "sum_q2": (probs**2).sum(-1).tolist(),
                "weight": weights[i][resp].tolist(),
                "top": [
                    [[run.tokenizer.decode([int(t)]), float(p)] for t, p in zip(ti, pi, strict=True)]
                    for ti, pi in zip(top.indices.tolist(), top.values.tolist(), strict=True)
                ] if top is not None else [],
            })
    d = run.run_dir / "dumps"
    d.mkdir(exist_ok=True)
    payload = {"step": step, "tau_p": cfg.algorithm.s2t.tau_p, "tau_h": tau_h,
               "token_weighting": cfg.algorithm.token_weighting, "sequences": out}
    tmp = d / f".step_{step:06d}.json.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.rename(d / f"step_{step:06d}.json")


# ----------------------------------------------------------------------------- the loop


def train(cfg: Config, run_dir: Path, *, resume: bool = False, log: Callable[[str], None] = print) -> TrainResult:
    """Run (or resume) RL training; returns where it went and validation before/after."""
    from stapo.core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from stapo.core.tracking import LiveView, Tracker, truncate_jsonl

    t_start = time.time()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    run = _Run(cfg, run_dir, log)
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
        log(f"resumed from {ckpt} (step {start})")
    for name in ("metrics.jsonl", "val.jsonl") if main else ():
        truncate_jsonl(run_dir / name, max_step=start if ckpt is not None else -1)
    if cfg.rollout.engine != "hf" or getattr(run.engine, "model", None) is not run.backend.model:
        run.engine.load_weights(run.backend.named_parameters_for_sync())

    if start == 0 and run.val_prompts:
        v = validate(run)
        val_before = v["accuracy"]
        tracker.log_val(0, v)
        log(f"validation before training: accuracy {v['accuracy']:.3f} on {v['n']} prompts")

    view = LiveView(cfg.trainer.max_steps, start, enabled=main and cfg.logging.live and sys.stderr.isatty(), log=log)
    last_val: float | None = val_before
    try:
        for step in range(start + 1, cfg.trainer.max_steps + 1):
            t_step = time.time()
            seed_everything(derive_seed(cfg.trainer.seed, step))

            # --- rollouts + rewards (+ DAPO dynamic sampling: resample until the batch is full)
            seqs, metrics = rollout_and_grade(run, step, 0)
            all_seqs = list(seqs)
            kept = shape_and_advantage(cfg, seqs)
            if cfg.algorithm.dynamic_sampling:
                kept = mixed_groups(kept)
                want = cfg.rollout.prompts_per_step * cfg.rollout.n
                for round_ in range(1, cfg.algorithm.max_sampling_rounds):
                    if len(kept) >= want:
                        break
                    more, m2 = rollout_and_grade(run, step, round_)
                    for key in ("time/rollout_s", "time/reward_s", "reward/failed", "reward/retried"):
                        metrics[key] += m2[key]
                    for s in more:
                        s.group += 10_000 * round_
                    all_seqs += more
                    kept += mixed_groups(shape_and_advantage(cfg, more))
                kept = kept[:want]
                metrics["dapo/kept_groups"] = len(kept) / cfg.rollout.n

            lengths = [len(s.response_ids) for s in all_seqs]
            metrics.update({
                "reward/mean": _mean([s.reward for s in all_seqs]),
                "reward/std": float(np.std([s.reward for s in all_seqs])),
                "reward/accuracy": _mean([float(s.correct) for s in all_seqs]),
                "response_length/mean": _mean(lengths),
                "response_length/max": float(max(lengths)),
                "response_length/clip_ratio": _mean([float(s.finish_reason == "length") for s in all_seqs]),
            })

            # --- old log-probs, token metrics, updates
            t0 = time.time()
            if kept:
                batch = collate(kept, run.pad_id).to(run.backend.device)
                # -- issue 12: an exactly on-policy update takes p and H from its gradient forward
                #    (no separate old-log-prob pass); see stapo.core.onpolicy
                from stapo.core.onpolicy import onpolicy_applies, onpolicy_update

                if onpolicy_applies(cfg, run.backend, batch.input_ids.shape[0]):
                    upd, old_lp, old_ent = onpolicy_update(run, batch, step)
                    t_stats = time.time()
                    tm, (tw, tau_h) = batch_token_metrics(run, batch, old_lp, old_ent)
                    metrics.update(tm)
                    metrics["time/stats_s"] = upd.pop("time/weights_s") + time.time() - t_stats
                    metrics.update(upd)
                else:
                    old_lp, old_ent = token_stats_batched(
                        run.backend, batch, cfg.trainer.micro_batch_size, stats_temperature(cfg)
                    )
                    tm, (tw, tau_h) = batch_token_metrics(run, batch, old_lp, old_ent)
                    metrics.update(tm)
                    metrics["time/stats_s"] = time.time() - t0
                    metrics.update(update_policy(run, batch, old_lp, old_ent, step))
                if main and cfg.logging.dump_tokens_every and step % cfg.logging.dump_tokens_every == 0:
                    dump_tokens(run, step, kept, batch, old_lp, old_ent, tw.weights, tau_h)
            else:
                metrics["actor/skipped_updates"] = 1.0
                log(f"step {step}: no group with a usable advantage signal; update skipped")
            metrics["time/train_s"] = time.time() - t0

            # --- weight sync (the hf engine shares the trained model: nothing to copy)
            if cfg.rollout.engine != "hf" or getattr(run.engine, "model", None) is not run.backend.model:
                run.engine.load_weights(run.backend.named_parameters_for_sync())

            # --- validation, metrics, checkpoint
            if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.trainer.max_steps:
                v = validate(run)
                if v:
                    tracker.log_val(step, v)
                    metrics["val/accuracy"] = last_val = v["accuracy"]
            metrics["time/step_s"] = time.time() - t_step
            metrics["perf/tokens_per_s"] = sum(lengths) / max(metrics["time/step_s"], 1e-9)
            tracker.log(step, metrics)
            view.update(metrics)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != cfg.trainer.max_steps:
                save_checkpoint(run_dir, step=step, backend=run.backend, cfg=cfg,
                                extra={"val_before": val_before}, keep_last=cfg.checkpoint.keep_last)

        view.close()
        end = cfg.trainer.max_steps
        if run.val_prompts and end > start:
            v = validate(run)
            tracker.log_val(end, v)
            last_val = v["accuracy"]
            log(f"validation after training: accuracy {v['accuracy']:.3f} (before: {val_before})")
        if end > start:
            save_checkpoint(run_dir, step=end, backend=run.backend, cfg=cfg,
                            extra={"val_before": val_before}, keep_last=cfg.checkpoint.keep_last)
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
