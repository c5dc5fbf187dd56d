"""`stapo calibrate`: what the paper's S2T rule silences on your model and prompts, and why it matters.

STAPO (arXiv 2602.15620v1, Sec. 3, Algorithm 1) silences, in each optimizer mini-batch, the
candidates (A > 0, p < tau_p) whose entropy is below tau_h^(q), the q-th quantile of the candidates'
entropies. The share it silences is an outcome of the model (the paper reports "mostly < 0.01%" on
Qwen3 base models), and its argument is a mechanism: low-probability, low-entropy tokens of correct
responses carry the largest per-token gradient norms (Sec. 3.2). This measures both on the run's
own parts:

1. sample with the configured rollout engine on the configured training prompts (``--limit``
   prompts, ``rollout.n`` responses each, in batches of ``rollout.prompts_per_step``: one batch =
   one training step);
2. grade with the configured grader and take advantages as the loop does
   (:func:`stapo.core.rollout.rollouts.shape_and_advantage`, and DAPO's dynamic sampling filter when on);
3. teacher-force every sampled token through the configured trainer backend
   (``token_distribution``: the training dtype and chunking; p, H and sum_n pi_n^2 of one forward)
   and split each step's rows into its ``algorithm.mini_batches`` optimizer mini-batches exactly as
   the update's first PPO epoch does (same seeded permutation): each mini-batch is one population
   of the rule;
4. apply the registered ``s2t`` weighting (the update's own function) to every mini-batch:

   - the grid: per (tau_p, q) cell, the silenced rate with the advantage condition (what the update
     silences) and before it (every token treated as A > 0);
   - the taxonomy of A > 0 tokens at the run's (tau_p, q) (``algorithm.s2t``): probability
     low/high (p < tau_p) x entropy low/high (H < that mini-batch's tau_h^(q)), with counts and the
     mean per-token gradient norm w.r.t. the logits, exact: ||grad||^2 = |w|^2 (1 - 2p + sum pi^2),
     w = A at ratio 1 (:func:`stapo.evals.inspect.grad_norms`);
   - the silenced set's share of the batches' gradient norm beside a random same-size set of the
     same candidates (the weighting's ``random`` ablation, seeded as the update seeds it);
   - optionally (``entropy_step``), the entropy change one SGD step on the baseline objective
     restricted to each set would cause, to first order (:func:`entropy_rates`).

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

from stapo.core.algos import TokenContext, below_thresholds, get_token_weighting, s2t_candidates, s2t_tau_h
from stapo.core.batch import Sequence_, collate, derive_seed, seed_everything
from stapo.core.config import Config
from stapo.core.placement import resolve_device
from stapo.core.rollout import SamplingParams, build_rollout_engine
from stapo.core.rollout.base import call_seed
from stapo.core.rollout.rollouts import mixed_groups, shape_and_advantage
from stapo.core.task.data import encode_prompt, load_prompts
from stapo.core.task.rewards import RewardFunction
from stapo.core.task.sampler import prompts_for_step
from stapo.core.train.micro import MicroSpec, micro_batches
from stapo.core.train.update import Actor, stats_temperature
from stapo.core.trainer import build_trainer_backend
from stapo.core.trainer.base import compute_token_stats
from stapo.core.trainer.distributed import minibatch_rows
from stapo.core.trainer.models import load_policy
from stapo.evals.inspect import grad_norms

__all__ = [
    "DEFAULT_Q",
    "DEFAULT_TAU_P",
    "PAPER_RATE",
    "CalibrationSample",
    "MiniBatchStats",
    "analyse",
    "collect",
    "entropy_rates",
    "reference_sets",
    "taxonomy",
    "write_outputs",
]

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
    """One optimizer mini-batch's valid response tokens (row-major over its rows), each [n]."""

    logprobs: torch.Tensor  # float32 log p of the sampled token (sampling temperature)
    entropy: torch.Tensor  # float32 H of its distribution (nats)
    sum_q2: torch.Tensor  # float32 sum over the vocabulary of pi^2
    advantages: torch.Tensor  # float32 the sequence's advantage
    seed: int  # the seed the update gives this mini-batch's weighting (the random ablation's draw)
    step: int = 1  # the training step (batch) it belongs to
    entropy_step: dict[str, float] | None = None  # entropy_rates() of this mini-batch, when measured

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
    info: dict[str, Any] = field(default_factory=dict)  # model, dtype, prompts, lengths, timings

    @property
    def tokens(self) -> int:
        return sum(mb.tokens for mb in self.minibatches)


# ----------------------------------------------------------------------------- the rule, applied


def _silenced(mb: MiniBatchStats, *, tau_p: float, q: float, silence: str = "lowest_entropy",
              positive_only: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """([n] bool silenced, the weighting's info) from the registered ``s2t`` weighting on this
    mini-batch; ``positive_only=False`` treats every token as A > 0 (the rule before the advantage
    condition)."""
    adv = mb.advantages if positive_only else torch.ones_like(mb.advantages)
    ctx = TokenContext(mb.logprobs.unsqueeze(0), mb.entropy.unsqueeze(0), adv.unsqueeze(0),
                       torch.ones(1, mb.tokens, dtype=torch.bool), seed=mb.seed)  # [1, n] each
    tw = get_token_weighting("s2t")(ctx, tau_p=tau_p, q=q, silence=silence)
    return ~tw.denom_mask[0], tw.info  # [n]


def reference_sets(mb: MiniBatchStats, *, tau_p: float, q: float) -> dict[str, torch.Tensor]:
    """{"silenced", "random", "candidates"}: [n] bool each. ``silenced`` is what the paper's rule
    silences; ``random`` as many candidates drawn at random by the weighting's ``random`` ablation
    (seeded with the mini-batch's seed, as in training)."""
    silenced, _ = _silenced(mb, tau_p=tau_p, q=q)
    rand, _ = _silenced(mb, tau_p=tau_p, q=q, silence="random")
    cand = s2t_candidates(mb.logprobs.unsqueeze(0), mb.advantages.unsqueeze(0),
                          torch.ones(1, mb.tokens, dtype=torch.bool), tau_p=tau_p)[0]  # [n]
    return {"silenced": silenced, "random": rand, "candidates": cand}


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


def token_grad_norms(mb: MiniBatchStats) -> torch.Tensor:
    """[n] float64: each token's gradient norm w.r.t. its logits for the baseline objective at ratio 1
    (w = A), exact: |A| sqrt(1 - 2p + sum pi^2) (:func:`stapo.evals.inspect.grad_norms`)."""
    prob = mb.logprobs.double().exp().numpy()
    measured, _ = grad_norms(prob, mb.entropy.double().numpy(), mb.advantages.double().numpy(),
                             mb.sum_q2.double().numpy())
    return torch.from_numpy(measured)


def taxonomy(sample: CalibrationSample, *, tau_p: float, q: float) -> dict[str, Any]:
    """The paper's taxonomy of A > 0 tokens (Sec. 3.2) and the silenced set's gradient share.

    Cells: probability low (p < tau_p) / high x entropy low (H < the mini-batch's tau_h^(q),
    :func:`stapo.core.algos.s2t_tau_h`; a mini-batch without a candidate has no tau_h and its tokens
    count as high entropy) / high, each with its count and mean / summed per-token gradient norm
    (:func:`token_grad_norms`). ``sets``: for the silenced tokens and a random same-size set of the
    same candidates, their count and their share of the sum of every valid token's gradient norm
    (``share``) and of its squares (``share_sq``: the share of the squared norm of the batches' whole
    gradient w.r.t. the logits, since different positions' logits are different variables).
    """
    cells = {c: {"count": 0, "grad_norm_sum": 0.0} for c in CELLS}
    sets = {k: {"count": 0, "grad_norm_sum": 0.0, "grad_norm_sq_sum": 0.0} for k in ("silenced", "random")}
    total = total_sq = 0.0
    per_mb = []  # candidates per mini-batch
    for mb in sample.minibatches:
        g = token_grad_norms(mb)  # [n]
        total += float(g.sum())
        total_sq += float((g * g).sum())
        ones = torch.ones(1, mb.tokens, dtype=torch.bool)
        tau = s2t_tau_h(mb.logprobs.unsqueeze(0), mb.entropy.unsqueeze(0), mb.advantages.unsqueeze(0), ones,
                        tau_p=tau_p, q=q)
        lowp, lowh = below_thresholds(mb.logprobs, mb.entropy, tau_p=tau_p, tau_h=tau)  # [n] each
        pos = mb.advantages > 0
        for pc, ec in CELLS:
            sel = pos & (lowp if pc == "low" else ~lowp) & (lowh if ec == "low" else ~lowh)
            cells[pc, ec]["count"] += int(sel.sum())
            cells[pc, ec]["grad_norm_sum"] += float(g[sel].sum())
        ref = reference_sets(mb, tau_p=tau_p, q=q)
        per_mb.append(int(ref["candidates"].sum()))
        for k, acc in sets.items():
            acc["count"] += int(ref[k].sum())
            acc["grad_norm_sum"] += float(g[ref[k]].sum())
            acc["grad_norm_sq_sum"] += float((g[ref[k]] ** 2).sum())
    n_pos = sum(c["count"] for c in cells.values())
    out_cells = []
    for (pc, ec), c in cells.items():
        out_cells.append({"probability": pc, "entropy": ec, "count": c["count"],
                          "share_of_positive": c["count"] / n_pos if n_pos else math.nan,
                          "mean_grad_norm": c["grad_norm_sum"] / c["count"] if c["count"] else math.nan,
                          "grad_norm_sum": c["grad_norm_sum"]})
    for acc in sets.values():
        acc["share"] = acc["grad_norm_sum"] / total if total > 0 else math.nan
        acc["share_sq"] = acc["grad_norm_sq_sum"] / total_sq if total_sq > 0 else math.nan
        acc["mean_grad_norm"] = acc["grad_norm_sum"] / acc["count"] if acc["count"] else math.nan
    r, s = sets["random"]["share"], sets["silenced"]["share"]
    return {"tau_p": float(tau_p), "q": float(q), "positive_tokens": n_pos, "cells": out_cells, "sets": sets,
            "candidates_per_minibatch": per_mb,
            "grad_norm_total": total, "grad_norm_sq_total": total_sq,
            "silenced_vs_random": s / r if r and r > 0 else math.nan}


# ----------------------------------------------------------------------------- the entropy step


def entropy_rates(model: torch.nn.Module, batch: Any, rows: torch.Tensor, sets: dict[str, torch.Tensor], *,
                  temperature: float, chunk_size: int, spec: MicroSpec) -> dict[str, float]:
    """Per set S, dH/d(eta) of one SGD step theta <- theta - eta grad L_S, to first order.

    L_S = -(1/n) sum_{t in S} A_t log p_t is the baseline objective (token-mean over the mini-batch's
    n valid tokens, ratio 1, where no clip is active) restricted to the tokens of S, and H the mean
    entropy of the mini-batch's valid tokens at ``temperature``: H(theta - eta g_S) - H(theta) =
    -eta <grad H, g_S> + O(eta^2), so the rate is -<grad H, g_S>, exact in the limit of a small step
    and independent of a step size (multiply by a learning rate for a change in nats). Since g_S is
    linear in S, the rates of disjoint sets add up. ``sets``: name -> [b, L] bool over ``rows``
    (batch layout); ``"all"`` (every valid token: the whole baseline step) is added. One forward and
    one backward per objective per micro-batch (``spec``: the update's layout), parameter-sized
    vectors held.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    resp_all = batch.response_mask[rows].bool()  # [b, L]
    n = int(resp_all.sum())
    objectives = {**sets, "all": resp_all}
    grads: dict[str, list[torch.Tensor]] = {k: [torch.zeros_like(p) for p in params] for k in ("entropy", *objectives)}
    was_training = model.training
    model.train(False)
    try:
        where = {int(r): i for i, r in enumerate(rows.tolist())}
        for m in micro_batches(batch, [rows], spec)[0]:
            sl = torch.tensor([where[int(r)] for r in m.rows.tolist()])  # the forward's rows within ``rows``
            r = m.rows
            resp = resp_all[sl]
            if not bool(resp.any()):
                continue
            with torch.enable_grad():
                lp, ent = compute_token_stats(model, m.input_ids, m.attention_mask, m.response_mask,
                                              chunk_size=chunk_size, entropy_grad=True, temperature=temperature,
                                              position_ids=m.position_ids)
                lp, ent = m.to_rows(lp), m.to_rows(ent)  # [b', L] each
                adv = batch.advantages[r].float()  # [b', L]
                terms = {"entropy": (ent * resp).sum() / n}
                for k, chosen in objectives.items():
                    terms[k] = -(adv * lp * chosen[sl].float()).sum() / n
                names = list(terms)
                for i, k in enumerate(names):
                    gs = torch.autograd.grad(terms[k], params, retain_graph=i < len(names) - 1, allow_unused=True)
                    for acc, gk in zip(grads[k], gs, strict=True):
                        if gk is not None:
                            acc += gk.detach()
    finally:
        model.train(was_training)
    g_h = grads.pop("entropy")
    return {k: -float(sum((a.double() * b.double()).sum() for a, b in zip(g_h, g, strict=True)))
            for k, g in grads.items()}


# ----------------------------------------------------------------------------- sampling


def collect(cfg: Config, *, limit: int, entropy_step: bool = False,
            progress: Callable[[str, int, int], None] | None = None,
            log: Callable[[str], None] = print) -> CalibrationSample:
    """Sample ``limit`` prompts x ``rollout.n`` responses with the configured engine, grade them, and
    teacher-force p, H and sum pi^2 in the training dtype; one batch per ``rollout.prompts_per_step``,
    split into the update's ``algorithm.mini_batches``.

    ``entropy_step``: also :func:`entropy_rates` of each mini-batch for the run's rule
    (``algorithm.s2t``'s tau_p and q): the silenced set and a random same-size set of candidates.
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
    spec = actor.spec
    k_mb = cfg.algorithm.mini_batches
    s2t = cfg.algorithm.s2t
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
        temperature = stats_temperature(cfg)
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
            engine.wake()
            groups = engine.generate(prompt_ids, sampling)
            engine.sleep()
            seqs = [Sequence_(ids, list(c.token_ids), c.finish_reason, c.text, rec.answer, group=g)
                    for g, (rec, ids, comps) in enumerate(zip(recs, prompt_ids, groups, strict=True)) for c in comps]
            graded = rewards([s.text for s in seqs], [s.gold for s in seqs])
            for s, r, v, c in zip(seqs, graded.rewards, graded.valid, graded.correct, strict=True):
                s.reward, s.valid, s.correct = r, v, c
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
                for mb_index, rows in enumerate(minibatch_rows([len(kept)], 0, k_mb, gen)):
                    rows = rows.to(batch.input_ids.device)
                    m = batch.response_mask[rows].bool()  # [b, L]
                    mb = MiniBatchStats(
                        dist["logprobs"][rows][m].float().cpu(), dist["entropy"][rows][m].float().cpu(),
                        dist["sum_q2"][rows][m].float().cpu(), batch.advantages[rows][m].float().cpu(),
                        seed=derive_seed(cfg.trainer.seed, step, 0, mb_index, 0x52), step=step)
                    if entropy_step:
                        ref = reference_sets(mb, tau_p=s2t.tau_p, q=s2t.q)
                        sets = {}
                        for k in ("silenced", "random"):
                            full = torch.zeros_like(m)
                            full[m] = ref[k].to(m.device)
                            sets[k] = full
                        mb.entropy_step = entropy_rates(
                            backend.model, batch, rows, sets, temperature=temperature,
                            chunk_size=cfg.trainer.logits_chunk_size, spec=spec)
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
        "dynamic_sampling": cfg.algorithm.dynamic_sampling, "entropy_step": entropy_step,
        "lr": cfg.trainer.lr, "wall_s": round(time.time() - t0, 1),
    }
    return sample


# ----------------------------------------------------------------------------- the result


def _entropy_summary(sample: CalibrationSample) -> dict[str, Any] | None:
    per = [mb.entropy_step for mb in sample.minibatches if mb.entropy_step is not None]
    if not per:
        return None
    tot = {k: sum(p[k] for p in per) for k in per[0]}
    lr = float(sample.info.get("lr") or 0.0)
    return {
        "method": "first order: dH/d(eta) = -<grad H, grad L_S> for one SGD step on the baseline objective "
                  "restricted to S (entropy_rates)",
        "minibatches": len(per), "per_minibatch": per,
        "rate_sum": tot, "lr": lr, "delta_at_lr": {k: lr * v for k, v in tot.items()},
        "silenced_vs_random": tot["silenced"] / tot["random"] if tot.get("random") else math.nan,
    }


def analyse(sample: CalibrationSample, *, tau_ps: Sequence[float] = DEFAULT_TAU_P, qs: Sequence[float] = DEFAULT_Q,
            tau_p: float = 0.002, q: float = 0.75) -> dict[str, Any]:
    """Everything ``calibration.json`` holds: the sample, the grid, the taxonomy at the run's
    (``tau_p``, ``q``) (added to the grid when missing), the entropy step when measured, and the reading."""
    tau_ps = sorted({float(t) for t in (*tau_ps, tau_p)})
    qs = sorted({float(x) for x in (*qs, q)})
    n = sample.tokens
    rows = grid(sample, tau_ps, qs)
    for r in rows:
        r["configured"] = (r["tau_p"], r["q"]) == (float(tau_p), float(q))
    tax = taxonomy(sample, tau_p=tau_p, q=q)
    ent_step = _entropy_summary(sample)
    result = {
        "sample": {**sample.info, "responses": sample.responses, "kept": sample.kept, "correct": sample.correct,
                   "tokens": n, "minibatches": len(sample.minibatches)},
        "rule": {"tau_p": float(tau_p), "q": float(q), "source": "algorithm.s2t of the config"},
        "paper_rate": PAPER_RATE, "resolution": 1.0 / n if n else None,
        "grid": rows, "taxonomy": tax, "entropy_step": ent_step,
    }
    result["reading"] = reading(result)
    return result


def reading(result: dict[str, Any]) -> str:
    """The one-paragraph reading of a result: what the rule silences, the gradient share, the entropy step."""
    s, tax = result["sample"], result["taxonomy"]
    row = next(r for r in result["grid"] if r["configured"])
    n = s["tokens"]
    head = (f"On {s['model']} ({n} response tokens of {s['responses']} responses, {tax['positive_tokens']} with A > 0, "
            f"{s['minibatches']} mini-batch(es)), the paper's rule (tau_p {row['tau_p']:g}, q {row['q']:g}) ")
    if not n:
        return head + "had no token to judge: no step kept a response."
    sil = tax["sets"]["silenced"]
    base = (f"silences {row['silenced']} of {row['candidates']} candidates: {row['rate']:.2e} of the response tokens "
            f"({row['rate_before_adv']:.2e} before the A > 0 condition; the paper reports mostly < {PAPER_RATE:g} on "
            f"Qwen3 base models).")
    if not sil["count"]:
        why = ("no token has A > 0 (every group all right or all wrong)" if not tax["positive_tokens"]
               else "no A > 0 token has p < tau_p" if not row["candidates"]
               else "no mini-batch has more than one candidate, and a lone candidate is its own q-quantile, never "
                    "strictly below it" if max(tax["candidates_per_minibatch"]) <= 1
               else "no candidate lies below tau_h^(q)")
        return head + base + f" Nothing is silenced here: {why}."
    rnd = tax["sets"]["random"]
    text = (head + base + f" The silenced tokens carry {100 * sil['share']:.2f}% of the batches' per-token gradient norm "
            f"(w.r.t. the logits; {100 * sil['share_sq']:.2f}% of its square), "
            f"{tax['silenced_vs_random']:.2f} times a random same-size set of the candidates ({100 * rnd['share']:.2f}%).")
    es = result.get("entropy_step")
    if es:
        r = es["rate_sum"]
        text += (f" One SGD step on the baseline objective restricted to the silenced tokens changes the mean entropy at "
                 f"{r['silenced']:+.3g} nats per unit learning rate (to first order; the random set {r['random']:+.3g}, "
                 f"every token {r['all']:+.3g})")
        text += (f": {es['silenced_vs_random']:.2f} times the random set's." if math.isfinite(es["silenced_vs_random"])
                 else ".")
    return text


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
