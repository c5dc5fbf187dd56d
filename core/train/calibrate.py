"""`stapo calibrate`: will S2T do anything on your model and prompts, and what its tokens carry.

STAPO (arXiv 2602.15620v1, Sec. 3, Algorithm 1) silences, in each optimizer mini-batch, the
candidates (A > 0, p < tau_p) whose entropy is below tau_h^(q), the q-th quantile of the candidates'
entropies. The share it silences is an outcome of the model (the paper reports "mostly < 0.01%" on
Qwen3 base models), so the first question on a new model is whether the rule fires at all at the
run's batch size; the paper's argument for it is a mechanism (Sec. 3.2): low-probability,
low-entropy tokens of correct responses carry the largest per-token gradient norms. This measures
both on the run's own parts:

1. sample with the configured rollout engine on the configured training prompts (``--limit``
   prompts, ``rollout.n`` responses each, in batches of ``rollout.prompts_per_step``: one batch =
   one training step);
2. grade with the configured grader and take advantages as the loop does
   (:func:`stapo.core.rollout.rollouts.shape_and_advantage`, and DAPO's dynamic sampling filter when on);
3. teacher-force every sampled token through the configured trainer backend
   (``Actor.distribution``: one forward in the training dtype gives p, H and sum_n pi_n^2 together)
   and split each step's rows into its ``algorithm.mini_batches`` optimizer mini-batches exactly as
   the update's first PPO epoch does (same seeded permutation): each mini-batch is one population
   of the rule;
4. apply the registered ``s2t`` weighting (the update's own function) to every mini-batch:

   - the counts (:func:`expected_counts`): silenced tokens per mini-batch, per step and per run at
     the configured batch size (``rollout.prompts_per_step`` x ``rollout.n``, ``algorithm.mini_batches``,
     ``trainer.max_steps``), and how many sampled mini-batches silenced nothing;
   - the grid: per (tau_p, q) cell, the silenced rate with the advantage condition (what the update
     silences) and before it (every token treated as A > 0);
   - the taxonomy of A > 0 tokens at the run's (tau_p, q) (``algorithm.s2t``): probability
     low/high (p < tau_p) x entropy low/high (H below the q-th quantile of that mini-batch's A > 0
     tokens' own entropies), with counts and the mean per-token gradient norm w.r.t. the logits,
     exact: ||grad||^2 = |w|^2 (1 - 2p + sum pi^2), w = A at ratio 1
     (:func:`stapo.core.algos.metrics.grad_norms`), also relative to the A > 0 tokens' mean;
   - the silenced set's gradient beside two random controls taken as exact expectations
     (:func:`expected_subset_sum`, no draw): as many tokens drawn from the same mini-batch's
     candidates, and as many drawn from all its A > 0 tokens (Theorem 3.1's contrast).

Whether silencing moves the update in a useful direction (the first-order change of the policy's
entropy and of a held-out objective) is `stapo probe`'s question; this module counts and weighs.

    sample = collect(cfg, limit=8)                        # loads the model, samples, grades, forwards
    result = analyse(sample, tau_ps=[0.002], qs=[0.75], tau_p=0.002, q=0.75)
    write_outputs(result, sample, Path("calib"))          # calibration.json + calibration.png
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stapo.core.algos import TokenContext, below_thresholds, get_token_weighting, quantile, s2t_candidates
from stapo.core.algos.metrics import grad_norms
from stapo.core.batch import collate, derive_seed, seed_everything
from stapo.core.config import Config
from stapo.core.placement import resolve_device
from stapo.core.rollout import SamplingParams, build_rollout_engine
from stapo.core.rollout.base import call_seed
from stapo.core.rollout.rollouts import mixed_groups, sample_and_grade, shape_and_advantage
from stapo.core.task.data import encode_prompt, load_prompts
from stapo.core.task.rewards import RewardFunction
from stapo.core.task.sampler import prompts_for_step
from stapo.core.train.update import Actor
from stapo.core.trainer import build_trainer_backend
from stapo.core.trainer.distributed import minibatch_rows
from stapo.core.trainer.models import load_policy

__all__ = [
    "DEFAULT_Q",
    "DEFAULT_TAU_P",
    "PAPER_Q",
    "PAPER_RATE",
    "PAPER_TAU_P",
    "CalibrationSample",
    "MiniBatchStats",
    "analyse",
    "collect",
    "expected_counts",
    "expected_subset_sum",
    "reference_sets",
    "rule_name",
    "taxonomy",
    "write_outputs",
]

PAPER_TAU_P = 0.002
"""The paper's tau_p ("across all experiments", Sec. 4.1)."""
PAPER_Q = 0.75
"""The paper's q (75% "across all experiments", Sec. 4.1)."""
DEFAULT_TAU_P = (0.0005, 0.001, 0.002, 0.005, 0.01)
"""tau_p values of the default grid: the paper's 0.002 with a factor 2.5-5 either way."""
DEFAULT_Q = (0.5, 0.75, 0.9)
"""q values of the default grid: the paper's 75% and one step either way."""
PAPER_RATE = 1e-4
"""The paper's observed silenced share ("mostly < 0.01%", Qwen3 1.7B / 8B / 14B base models)."""
CELLS = (("low", "low"), ("low", "high"), ("high", "low"), ("high", "high"))
"""The taxonomy's cells as (probability, entropy); ("low", "low") is the paper's spurious quadrant."""


@dataclass
class MiniBatchStats:
    """One optimizer mini-batch's valid response tokens (row-major over its rows), each [n], all four
    from the same forward (p, H and sum pi^2 of one distribution)."""

    logprobs: torch.Tensor  # float32 log p of the sampled token (sampling temperature)
    entropy: torch.Tensor  # float32 H of its distribution (nats)
    sum_q2: torch.Tensor  # float32 sum over the vocabulary of pi^2
    advantages: torch.Tensor  # float32 the sequence's advantage
    responses: int = 0  # rows (responses) of the mini-batch
    step: int = 1  # the training step (batch) it belongs to

    @property
    def tokens(self) -> int:
        return int(self.logprobs.numel())


@dataclass
class CalibrationSample:
    """Every mini-batch of the sampled steps, and what was sampled."""

    minibatches: list[MiniBatchStats] = field(default_factory=list)
    responses: int = 0  # responses sampled
    kept: int = 0  # responses in the update's population (after dynamic sampling)
    correct: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # model, dtype, prompts, batch size, lengths, timings

    @property
    def tokens(self) -> int:
        return sum(mb.tokens for mb in self.minibatches)


def rule_name(tau_p: float, q: float) -> str:
    """The rule as what it is: "the paper's rule (tau_p 0.002, q 0.75)" only at the paper's values,
    else "S2T at tau_p 0.1, q 0.75 (the paper uses tau_p 0.002)", naming each value that differs."""
    differ = [f"{k} {v:g}" for k, v, mine in (("tau_p", PAPER_TAU_P, tau_p), ("q", PAPER_Q, q)) if float(mine) != v]
    if not differ:
        return f"the paper's rule (tau_p {tau_p:g}, q {q:g})"
    return f"S2T at tau_p {tau_p:g}, q {q:g} (the paper uses {' and '.join(differ)})"


# ----------------------------------------------------------------------------- the rule, applied


def _silenced(mb: MiniBatchStats, *, tau_p: float, q: float,
              positive_only: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """([n] bool silenced, the weighting's info) from the registered ``s2t`` weighting on this
    mini-batch; ``positive_only=False`` treats every token as A > 0 (the rule before the advantage
    condition)."""
    adv = mb.advantages if positive_only else torch.ones_like(mb.advantages)
    ctx = TokenContext(mb.logprobs.unsqueeze(0), mb.entropy.unsqueeze(0), adv.unsqueeze(0),
                       torch.ones(1, mb.tokens, dtype=torch.bool))  # [1, n] each
    tw = get_token_weighting("s2t")(ctx, tau_p=tau_p, q=q)
    return ~tw.denom_mask[0], tw.info  # [n]


def reference_sets(mb: MiniBatchStats, *, tau_p: float, q: float) -> dict[str, torch.Tensor]:
    """{"silenced", "candidates", "positive"}: [n] bool each. ``silenced`` is what the rule silences,
    ``candidates`` the tokens it may silence (A > 0, p < tau_p), ``positive`` every A > 0 token: the
    populations of the two random controls."""
    silenced, _ = _silenced(mb, tau_p=tau_p, q=q)
    cand = s2t_candidates(mb.logprobs.unsqueeze(0), mb.advantages.unsqueeze(0),
                          torch.ones(1, mb.tokens, dtype=torch.bool), tau_p=tau_p)[0]  # [n]
    return {"silenced": silenced, "candidates": cand, "positive": mb.advantages > 0}


def grid(sample: CalibrationSample, tau_ps: Sequence[float], qs: Sequence[float]) -> list[dict[str, Any]]:
    """Per (tau_p, q) cell: candidates and silenced counts, with the advantage condition and before it,
    the rule applied per mini-batch; rates are over every sampled response token."""
    n = sample.tokens
    rows = []
    for tau_p in tau_ps:
        for q in qs:
            cnt = {"candidates": 0, "silenced": 0, "candidates_before_adv": 0, "silenced_before_adv": 0}
            taus = []
            for mb in sample.minibatches:
                s, info = _silenced(mb, tau_p=tau_p, q=q)
                sb, info_b = _silenced(mb, tau_p=tau_p, q=q, positive_only=False)
                cnt["silenced"] += int(s.sum())
                cnt["candidates"] += int(info["candidates"])
                cnt["silenced_before_adv"] += int(sb.sum())
                cnt["candidates_before_adv"] += int(info_b["candidates"])
                if math.isfinite(info["tau_h"]):
                    taus.append(info["tau_h"])
            rows.append({
                "tau_p": float(tau_p), "q": float(q), **cnt,
                "rate": cnt["silenced"] / n if n else math.nan,
                "rate_before_adv": cnt["silenced_before_adv"] / n if n else math.nan,
                "tau_h_mean": sum(taus) / len(taus) if taus else math.nan,
            })
    return rows


# ----------------------------------------------------------------------------- how many, at the run's size


def expected_counts(*, silenced: int, tokens: int, responses: int, silenced_per_minibatch: Sequence[int],
                    prompts_per_step: int, n: int, mini_batches: int, steps: int) -> dict[str, Any]:
    """The answer to "will S2T do anything here?": the sample's silenced rate carried to the configured
    batch size.

    A step trains on ``prompts_per_step`` x ``n`` responses of the sample's mean length
    (``tokens / responses``) in ``mini_batches`` optimizer mini-batches, so at the sampled rate
    ``silenced / tokens`` it silences ``rate x tokens_per_step`` tokens (one pass over the step; each
    further PPO epoch judges the same tokens again under the moved policy), ``/ mini_batches`` per
    mini-batch, and ``x steps`` over a run. With nothing silenced, ``rate_upper_95`` is the rule of
    three's bound 3 / tokens (the largest rate that still leaves 0 of ``tokens`` likely at 95%, for
    independent tokens). ``idle_minibatches``: sampled mini-batches that silenced nothing (their
    updates equal the baseline's: S2T changes the loss only through the silenced tokens).
    """
    rate = silenced / tokens if tokens else math.nan
    tokens_per_step = tokens / responses * prompts_per_step * n if responses else math.nan
    per_step = rate * tokens_per_step
    return {
        "silenced": silenced, "tokens": tokens, "rate": rate,
        "rate_upper_95": 3.0 / tokens if tokens and not silenced else None,
        "tokens_per_response": tokens / responses if responses else math.nan,
        "prompts_per_step": prompts_per_step, "n": n, "mini_batches": mini_batches, "steps": steps,
        "tokens_per_step": tokens_per_step,
        "per_minibatch": per_step / mini_batches, "per_step": per_step,
        "per_run": per_step * steps, "tokens_per_run": tokens_per_step * steps,
        "sampled_minibatches": len(silenced_per_minibatch),
        "idle_minibatches": sum(1 for k in silenced_per_minibatch if k == 0),
        "silenced_per_sampled_minibatch": list(silenced_per_minibatch),
    }


# ----------------------------------------------------------------------------- gradient norms


def token_grad_norms(mb: MiniBatchStats) -> torch.Tensor:
    """[n] float64: each token's gradient norm w.r.t. its logits for the baseline objective at ratio 1
    (w = A), exact: |A| sqrt(1 - 2p + sum pi^2) (:func:`stapo.core.algos.metrics.grad_norms`), p and
    sum pi^2 of the same forward."""
    prob = mb.logprobs.double().exp().numpy()
    measured, _ = grad_norms(prob, mb.entropy.double().numpy(), mb.advantages.double().numpy(),
                             mb.sum_q2.double().numpy())
    return torch.from_numpy(measured)


def expected_subset_sum(values: torch.Tensor, k: int) -> float:
    """E[sum of ``values`` over a uniformly random k-subset], exact: k / |values| x their sum.

    Each of the N values is in a random k-subset with probability k / N, so by linearity the expected
    sum is (k / N) sum(values), whatever the values. Applied to per-token norms it is the expected sum
    of norms; to squared norms the expected squared norm of the subset's gradient w.r.t. the logits
    (different positions' logits are different variables, so squares add). The expectation of a
    share (this over a fixed total) is this share; a ratio against it is a ratio to an expectation,
    not the expectation of a ratio. k = 0 gives 0; k > N is an error."""
    n = int(values.numel())
    if not 0 <= k <= n:
        raise ValueError(f"a random {k}-subset of {n} values does not exist")
    return 0.0 if k == 0 else k / n * float(values.double().sum())


def taxonomy(sample: CalibrationSample, *, tau_p: float, q: float) -> dict[str, Any]:
    """The paper's taxonomy of A > 0 tokens (Sec. 3.2) and the silenced set against exact controls.

    Cells: probability low (p < tau_p) / high x entropy low / high, where low entropy is below the
    q-th quantile of the mini-batch's own A > 0 tokens' entropies (:func:`stapo.core.algos.quantile`,
    strict, as the rule compares): the split belongs to the population being split, not to the
    candidates' tau_h^(q). Each cell has its count, mean per-token gradient norm
    (:func:`token_grad_norms`) and that mean over the A > 0 tokens' mean.

    ``sets``, each with its token count k, summed norm, summed squared norm, ``share`` (of the sum of
    every valid token's norm), ``share_sq`` (of the squared norm of the batches' whole gradient w.r.t.
    the logits) and ``mean_grad_norm`` (summed norm / k), also ``vs_positive_mean``:

    - ``silenced``: what the rule silences;
    - ``random_candidates``: per mini-batch, a random k-subset of its candidates, k its silenced count,
      as the exact expectation (:func:`expected_subset_sum`): the weighting's ``random`` ablation on
      average. Every candidate has p < tau_p, so its norm is |A| times sqrt(1 - 2p + sum pi^2), a factor
      within [1 - tau_p, sqrt 2]: at equal |A| the silenced set's mean norm is within that factor of
      this control's, whichever candidates it picks;
    - ``random_positive``: the same k drawn from all the mini-batch's A > 0 tokens (Theorem 3.1's
      contrast: low-p, low-H tokens against the other tokens of correct responses);
    - ``candidates`` and ``positive``: the whole populations.

    ``candidate_factor``: the range of norm / |A| over the candidates (the cap above, measured).
    """
    cells = {c: {"count": 0, "grad_norm_sum": 0.0} for c in CELLS}
    names = ("silenced", "random_candidates", "random_positive", "candidates", "positive")
    sets = {k: {"count": 0, "grad_norm_sum": 0.0, "grad_norm_sq_sum": 0.0} for k in names}
    total = total_sq = 0.0
    per_mb, sil_mb, tau_pos = [], [], []  # candidates, silenced, A > 0 entropy split per mini-batch
    fac_lo, fac_hi = math.inf, -math.inf
    for mb in sample.minibatches:
        g = token_grad_norms(mb)  # [n]
        g2 = g * g  # [n]
        total += float(g.sum())
        total_sq += float(g2.sum())
        ref = reference_sets(mb, tau_p=tau_p, q=q)
        pos, cand, sil = ref["positive"], ref["candidates"], ref["silenced"]
        k = int(sil.sum())
        tau = quantile(mb.entropy[pos], q)  # NaN without an A > 0 token
        if math.isfinite(tau):
            tau_pos.append(tau)
        lowp, lowh = below_thresholds(mb.logprobs, mb.entropy, tau_p=tau_p, tau_h=tau)  # [n] each
        for pc, ec in CELLS:
            sel = pos & (lowp if pc == "low" else ~lowp) & (lowh if ec == "low" else ~lowh)
            cells[pc, ec]["count"] += int(sel.sum())
            cells[pc, ec]["grad_norm_sum"] += float(g[sel].sum())
        per_mb.append(int(cand.sum()))
        sil_mb.append(k)
        for name, sel in (("silenced", sil), ("candidates", cand), ("positive", pos)):
            acc = sets[name]
            acc["count"] += int(sel.sum())
            acc["grad_norm_sum"] += float(g[sel].sum())
            acc["grad_norm_sq_sum"] += float(g2[sel].sum())
        for name, popl in (("random_candidates", cand), ("random_positive", pos)):
            acc = sets[name]
            acc["count"] += k
            acc["grad_norm_sum"] += expected_subset_sum(g[popl], k)
            acc["grad_norm_sq_sum"] += expected_subset_sum(g2[popl], k)
        if bool(cand.any()):
            fac = g[cand] / mb.advantages[cand].double().abs()  # [c] sqrt(1 - 2p + sum pi^2)
            fac_lo, fac_hi = min(fac_lo, float(fac.min())), max(fac_hi, float(fac.max()))
    pos_mean = (sets["positive"]["grad_norm_sum"] / sets["positive"]["count"] if sets["positive"]["count"]
                else math.nan)
    n_pos = sets["positive"]["count"]
    out_cells = []
    for (pc, ec), c in cells.items():
        mean = c["grad_norm_sum"] / c["count"] if c["count"] else math.nan
        out_cells.append({"probability": pc, "entropy": ec, "count": c["count"],
                          "share_of_positive": c["count"] / n_pos if n_pos else math.nan,
                          "mean_grad_norm": mean, "vs_positive_mean": mean / pos_mean if pos_mean > 0 else math.nan,
                          "grad_norm_sum": c["grad_norm_sum"]})
    for acc in sets.values():
        acc["share"] = acc["grad_norm_sum"] / total if total > 0 else math.nan
        acc["share_sq"] = acc["grad_norm_sq_sum"] / total_sq if total_sq > 0 else math.nan
        acc["mean_grad_norm"] = acc["grad_norm_sum"] / acc["count"] if acc["count"] else math.nan
        acc["vs_positive_mean"] = acc["mean_grad_norm"] / pos_mean if pos_mean > 0 else math.nan
    s = sets["silenced"]["share_sq"]
    return {"tau_p": float(tau_p), "q": float(q), "positive_tokens": n_pos, "cells": out_cells, "sets": sets,
            "entropy_split": "the q-th quantile of each mini-batch's A > 0 tokens' entropies",
            "entropy_split_mean": sum(tau_pos) / len(tau_pos) if tau_pos else math.nan,
            "candidates_per_minibatch": per_mb, "silenced_per_minibatch": sil_mb,
            "candidate_factor": [fac_lo, fac_hi] if fac_lo <= fac_hi else None,
            "grad_norm_total": total, "grad_norm_sq_total": total_sq,
            "silenced_vs_random_candidates": _ratio(s, sets["random_candidates"]["share_sq"]),
            "silenced_vs_random_positive": _ratio(s, sets["random_positive"]["share_sq"])}


def _ratio(a: float, b: float) -> float:
    return a / b if b and b > 0 and math.isfinite(a) else math.nan


# ----------------------------------------------------------------------------- sampling


def collect(cfg: Config, *, limit: int,
            progress: Callable[[str, int, int], None] | None = None,
            log: Callable[[str], None] = print) -> CalibrationSample:
    """Sample ``limit`` prompts x ``rollout.n`` responses with the configured engine, grade them, and
    teacher-force p, H and sum pi^2 in the training dtype; one batch per ``rollout.prompts_per_step``,
    split into the update's ``algorithm.mini_batches``. p, H and sum pi^2 come from one forward of the
    sampling policy (``Actor.distribution``), so every per-token norm pairs a token's own p and sum pi^2.
    ``progress(phase, done, total)`` is called after each batch. One process (no launcher).
    """
    if limit < 1:
        raise ValueError(f"--limit must be >= 1 prompt, got {limit}")
    t0 = time.time()
    seed_everything(cfg.trainer.seed)
    model, tokenizer = load_policy(cfg.model, device=resolve_device(cfg.trainer.device))
    backend = build_trainer_backend(cfg, model, total_optimizer_steps=1)
    engine = build_rollout_engine(cfg, model=backend.model, tokenizer=tokenizer)
    rewards = RewardFunction(cfg.reward)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sample = CalibrationSample()
    actor = Actor(cfg, backend)  # the update's passes over the policy (its micro-batch layout)
    k_mb = cfg.algorithm.mini_batches
    try:
        train, _val = load_prompts(cfg.data, tokenizer)
        if not train:
            raise ValueError(f"no training prompts from data.source={cfg.data.source!r}")
        per = cfg.rollout.prompts_per_step
        n_prompts = min(limit, len(train))
        batches = math.ceil(n_prompts / per)
        log(f"calibrate: {n_prompts} prompts x {cfg.rollout.n} responses of up to {cfg.rollout.max_new_tokens} "
            f"tokens from {cfg.data.source}, {batches} batch(es) of {per} prompts, {k_mb} mini-batch(es) each "
            f"(model loaded in {time.time() - t0:.0f}s)")
        for b in range(batches):
            step = b + 1
            idx = prompts_for_step(len(train), step, per, cfg.trainer.seed)[: n_prompts - b * per]
            recs = [train[i] for i in idx]
            prompt_ids = [encode_prompt(tokenizer, r.prompt, chat_template=cfg.data.chat_template) for r in recs]
            sampling = SamplingParams(
                n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                max_new_tokens=cfg.rollout.max_new_tokens, seed=call_seed(cfg.trainer.seed, step, 0, 0),
                ignore_eos=cfg.rollout.ignore_eos,
            )
            seqs = sample_and_grade(engine, prompt_ids, recs, sampling, rewards)
            kept = shape_and_advantage(cfg, seqs)
            if cfg.algorithm.dynamic_sampling:
                kept = mixed_groups(kept, cfg.algorithm.dynamic_sampling_metric)
            sample.responses += len(seqs)
            sample.correct += sum(s.correct for s in seqs)
            sample.kept += len(kept)
            if len(kept) >= k_mb:
                batch = collate(kept, pad_id).to(backend.device)
                dist = actor.distribution(batch, range(len(kept)))  # [N, L] each, the sampled policy
                gen = torch.Generator().manual_seed(derive_seed(cfg.trainer.seed, step, 0))  # the update's epoch 0
                for rows in minibatch_rows([len(kept)], 0, k_mb, gen):
                    rows = rows.to(batch.input_ids.device)
                    m = batch.response_mask[rows].bool()  # [b, L]
                    mb = MiniBatchStats(
                        dist["logprobs"][rows][m].float().cpu(), dist["entropy"][rows][m].float().cpu(),
                        dist["sum_q2"][rows][m].float().cpu(), batch.advantages[rows][m].float().cpu(),
                        responses=len(rows), step=step)
                    sample.minibatches.append(mb)
            elif kept:
                log(f"batch {step}: {len(kept)} responses kept, fewer than algorithm.mini_batches={k_mb}: skipped "
                    "(the loop refuses such a step)")
            log(f"batch {step}/{batches}: {len(seqs)} responses, {sample.tokens} response tokens so far "
                f"({time.time() - t0:.0f}s)")
            if progress is not None:
                progress("batches", step, batches)
    finally:
        rewards.close()
    sample.info = {
        "model": cfg.model.name_or_path, "dtype": str(next(backend.model.parameters()).dtype).removeprefix("torch."),
        "engine": cfg.rollout.engine, "data": cfg.data.source, "prompts": n_prompts, "n": cfg.rollout.n,
        "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
        "prompts_per_batch": cfg.rollout.prompts_per_step, "mini_batches_per_batch": k_mb,
        "population": "optimizer mini-batch (the update's epoch-0 split of each step)",
        "dynamic_sampling": cfg.algorithm.dynamic_sampling, "ppo_epochs": cfg.algorithm.ppo_epochs,
        "max_steps": cfg.trainer.max_steps, "wall_s": round(time.time() - t0, 1),
    }
    return sample


# ----------------------------------------------------------------------------- the result


def analyse(sample: CalibrationSample, *, tau_ps: Sequence[float] = DEFAULT_TAU_P, qs: Sequence[float] = DEFAULT_Q,
            tau_p: float = PAPER_TAU_P, q: float = PAPER_Q) -> dict[str, Any]:
    """Everything ``calibration.json`` holds: the sample, the counts at the configured batch size
    (``sample.info``'s ``prompts_per_batch``, ``n``, ``mini_batches_per_batch``, ``max_steps``), the
    grid, the taxonomy at the run's (``tau_p``, ``q``) (added to the grid when missing) and the reading."""
    tau_ps = sorted({float(t) for t in (*tau_ps, tau_p)})
    qs = sorted({float(x) for x in (*qs, q)})
    n = sample.tokens
    rows = grid(sample, tau_ps, qs)
    for r in rows:
        r["configured"] = (r["tau_p"], r["q"]) == (float(tau_p), float(q))
    row = next(r for r in rows if r["configured"])
    tax = taxonomy(sample, tau_p=tau_p, q=q)
    info = sample.info
    counts = expected_counts(
        silenced=row["silenced"], tokens=n, responses=sum(mb.responses for mb in sample.minibatches),
        silenced_per_minibatch=tax["silenced_per_minibatch"], prompts_per_step=int(info["prompts_per_batch"]),
        n=int(info["n"]), mini_batches=int(info["mini_batches_per_batch"]), steps=int(info["max_steps"]))
    result = {
        "sample": {**info, "responses": sample.responses, "kept": sample.kept, "correct": sample.correct,
                   "tokens": n, "minibatches": len(sample.minibatches)},
        "rule": {"tau_p": float(tau_p), "q": float(q), "name": rule_name(tau_p, q),
                 "source": "algorithm.s2t of the config"},
        "paper_rate": PAPER_RATE, "resolution": 1.0 / n if n else None,
        "counts": counts, "grid": rows, "taxonomy": tax,
    }
    lead, rest = reading(result)
    result["answer"], result["reading"] = lead, f"{lead} {rest}".strip()
    return result


def _why_none(tax: dict[str, Any], row: dict[str, Any]) -> str:
    if not tax["positive_tokens"]:
        return "no token has A > 0 (every group all right or all wrong)"
    if not row["candidates"]:
        return "no A > 0 token has p < tau_p"
    if max(tax["candidates_per_minibatch"]) <= 1:
        return "no mini-batch has more than one candidate, and a lone candidate is its own q-quantile, never strictly below it"
    return "no candidate lies below its mini-batch's tau_h^(q)"


def reading(result: dict[str, Any]) -> tuple[str, str]:
    """(the answer, the rest of the reading). The answer says whether the rule fires at the configured
    batch size and what that means for a run of ``trainer.max_steps`` steps (or why nothing is
    silenced); the rest, what the silenced tokens weigh against the exact random controls, and where
    the directional question is measured (`stapo probe`)."""
    s, tax, c = result["sample"], result["taxonomy"], result["counts"]
    row = next(r for r in result["grid"] if r["configured"])
    name, n = result["rule"]["name"], s["tokens"]
    if not n:
        return f"On {s['model']}, {name} had no token to judge: no step kept a response.", ""
    batch = (f"the configured batch ({c['prompts_per_step']} prompts x {c['n']} responses of ~{c['tokens_per_response']:.0f} "
             f"tokens, {c['mini_batches']} mini-batch(es) a step)")
    if not row["silenced"]:
        ub = c["rate_upper_95"]
        lead = (f"On {s['model']}, {name} silences nothing in {n} response tokens ({_why_none(tax, row)}). At this "
                f"rate a {c['steps']}-step run at {batch} trains like its baseline: an update that silences nothing "
                f"equals the baseline's. This sample bounds the rate below ~{ub:.1e} (3/{n}, the rule of three): "
                f"~{ub * c['tokens_per_step']:.2g} tokens a step at most.")
    else:
        lead = (f"On {s['model']}, {name} silences {row['silenced']} of {n} response tokens ({c['rate']:.1e}). At {batch} "
                f"that is ~{c['per_minibatch']:.2g} silenced tokens per mini-batch and ~{c['per_step']:.2g} per step: "
                f"a {c['steps']}-step run silences ~{c['per_run']:.3g} of the ~{c['tokens_per_run']:.3g} tokens it "
                f"trains on, and differs from its baseline only through them (their terms and the token mean's "
                f"denominator).")
        if c["idle_minibatches"]:
            lead += (f" {c['idle_minibatches']} of {c['sampled_minibatches']} sampled mini-batches silenced nothing "
                     "(their updates equal the baseline's).")
    rest = (f"The paper reports mostly < {PAPER_RATE:g} on Qwen3 base models; before the A > 0 condition this rule "
            f"would silence {row['rate_before_adv']:.1e}.")
    sets = tax["sets"]
    sil, rc, rp = sets["silenced"], sets["random_candidates"], sets["random_positive"]
    if sil["count"]:
        fac = tax["candidate_factor"]
        rest += (f" The silenced tokens' mean gradient norm w.r.t. the logits is {sil['vs_positive_mean']:.2f} times the "
                 f"A > 0 tokens' mean; they carry {100 * sil['share_sq']:.2f}% of the squared norm, against an "
                 f"expected {100 * rc['share_sq']:.2f}% for as many random candidates "
                 f"({tax['silenced_vs_random_candidates']:.2f}x, a capped contrast: each candidate's norm is |A| "
                 f"times a factor within [1 - tau_p, sqrt 2], here {fac[0]:.2f} to {fac[1]:.2f}) and "
                 f"{100 * rp['share_sq']:.2f}% for as many random A > 0 tokens "
                 f"({tax['silenced_vs_random_positive']:.2f}x, Theorem 3.1's contrast).")
    rest += (" Whether silencing the rule's tokens moves an update toward the answer or lowers the entropy is a "
             "directional question that norms cannot settle: `stapo probe` measures it (first-order steps on paired "
             "batches).")
    return lead, rest


# ----------------------------------------------------------------------------- outputs


def write_outputs(result: dict[str, Any], sample: CalibrationSample, out_dir: Path) -> dict[str, Path]:
    """``calibration.json`` and ``calibration.png``: log p vs H of the A > 0 tokens with the tau_p line
    and each mini-batch's tau_h^(q) (their mean drawn; one line when there is one mini-batch), silenced
    tokens marked, like the paper's quadrant figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "calibration.json", "png": out_dir / "calibration.png"}
    paths["json"].write_text(json.dumps(result, indent=2, allow_nan=True))
    tau_p, q = result["rule"]["tau_p"], result["rule"]["q"]
    xs, ys, sx, sy = [], [], [], []
    for mb in sample.minibatches:
        pos = mb.advantages > 0
        sil = reference_sets(mb, tau_p=tau_p, q=q)["silenced"]
        xs += mb.entropy[pos & ~sil].tolist()
        ys += (mb.logprobs[pos & ~sil].double() / math.log(10)).tolist()
        sx += mb.entropy[sil].tolist()
        sy += (mb.logprobs[sil].double() / math.log(10)).tolist()
    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=110)
    ax.scatter(xs, ys, s=6, alpha=0.35, color="tab:blue", label=f"A > 0 tokens ({len(xs)})")
    ax.scatter(sx, sy, s=14, marker="x", color="tab:red", label=f"silenced ({len(sx)})")
    ax.axhline(math.log10(tau_p), color="black", linestyle="--", linewidth=1, label=f"tau_p = {tau_p:g}")
    row = next(r for r in result["grid"] if r["configured"])
    if math.isfinite(row["tau_h_mean"]):
        ax.axvline(row["tau_h_mean"], color="tab:red", linestyle=":", linewidth=1,
                   label=f"tau_h^({q:g}) = {row['tau_h_mean']:.3g} nats (mean over mini-batches)")
    ax.ticklabel_format(useOffset=False)
    ax.set_xlabel("entropy H of the next-token distribution (nats)")
    ax.set_ylabel("log10 p of the sampled token")
    s = result["sample"]
    ax.set_title(f"S2T quadrants of A > 0 tokens: {s['model']}\nlower left (p < tau_p, H < tau_h): the silenced, "
                 "spurious quadrant", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(paths["png"])
    plt.close(fig)
    return paths
