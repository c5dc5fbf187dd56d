"""`stapo calibrate`: how many tokens S2T silences on your model and prompts, before a long run.

STAPO's claim rests on silencing a tiny share of tokens (~0.01%: A > 0, low probability, low
entropy). Whether a threshold pair silences anything near that depends on the model by orders of
magnitude (docs/algorithms.md, "S2T thresholds"), so this measures it on the run's own parts:

1. sample with the configured rollout engine on the configured training prompts (``--limit``
   prompts, ``rollout.n`` responses each, in batches of ``rollout.prompts_per_step``: one batch =
   one training step's population);
2. grade with the configured grader and take advantages as the loop does
   (:func:`stapo.core.rollouts.shape_and_advantage`, and DAPO's dynamic sampling filter when on);
3. teacher-force every sampled token through the configured trainer backend (the training dtype,
   autocast and chunking; :func:`stapo.core.update.token_stats_batched`) for p and H;
4. for each (tau_p, tau_h) of a grid, count the tokens :func:`stapo.core.algos.s2t_mask` (the one
   mask the update uses) silences, per batch (a tau_h quantile is resolved on each batch's
   tokens, like ``tau_h_scope: step``), before the advantage condition (every A taken > 0) and
   with it (what the update silences).

The paper's band is 1e-5..1e-3 of response tokens (its ~0.01% with an order of magnitude either
way); the grid cell nearest ``target`` (log distance) is marked. With n tokens the smallest
non-zero rate is 1/n: a sample of 10^4 tokens cannot tell 1e-5 from 0.

    sample = collect(cfg, limit=64)                      # loads the model, samples, grades, forwards
    result = calibration_grid(sample, tau_ps=[0.01], tau_hs=[("quantile", 0.05)], target=1e-4)
    write_outputs(result, Path("calib"))                 # calibration.json + calibration.png
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

from stapo.core.config import Config

__all__ = [
    "BAND",
    "DEFAULT_TAU_H",
    "DEFAULT_TAU_P",
    "CalibrationSample",
    "calibration_grid",
    "collect",
    "write_outputs",
]

BAND = (1e-5, 1e-3)
"""The paper's band of silenced response tokens: ~1e-4 (0.01%) with an order of magnitude either way."""
DEFAULT_TAU_P = (1e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 1e-1)
DEFAULT_TAU_H: tuple[tuple[str, float], ...] = (
    ("quantile", 0.01), ("quantile", 0.05), ("quantile", 0.1), ("quantile", 0.2), ("quantile", 0.5),
    ("quantile", 0.8), ("absolute", 0.01), ("absolute", 0.1), ("absolute", 1.0),
)
"""tau_h settings of the default grid: quantiles of each batch's entropies, and absolute nats."""


@dataclass
class CalibrationSample:
    """Per batch (one training step's population), the valid response tokens' statistics, each [n_b]."""

    logprobs: list[torch.Tensor] = field(default_factory=list)  # float32 log p of the sampled token
    entropy: list[torch.Tensor] = field(default_factory=list)  # float32 H of its distribution (nats)
    advantages: list[torch.Tensor] = field(default_factory=list)  # float32 the sequence's advantage
    responses: int = 0  # responses sampled
    kept: int = 0  # responses in the update's population (after dynamic sampling)
    correct: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # model, dtype, prompts, lengths, timings

    @property
    def tokens(self) -> int:
        return int(sum(t.numel() for t in self.logprobs))


def _label(kind: str, value: float) -> str:
    return f"q{value:g}" if kind == "quantile" else f"H<{value:g}"


# ----------------------------------------------------------------------------- sampling


def collect(cfg: Config, *, limit: int, progress: Callable[[str, int, int], None] | None = None,
            log: Callable[[str], None] = print) -> CalibrationSample:
    """Sample ``limit`` prompts x ``rollout.n`` responses with the configured engine, grade them,
    and teacher-force p and H in the training dtype; one batch per ``rollout.prompts_per_step``.

    ``progress(phase, done, total)`` is called after each batch. One process (no launcher).
    """
    from stapo.core.batch import Sequence_, collate, derive_seed, seed_everything
    from stapo.core.data import encode_prompt, load_prompts
    from stapo.core.models import load_policy
    from stapo.core.placement import resolve_device
    from stapo.core.rewards import RewardFunction
    from stapo.core.rollout import SamplingParams, build_rollout_engine
    from stapo.core.rollouts import mixed_groups, shape_and_advantage
    from stapo.core.sampler import prompts_for_step
    from stapo.core.trainer import build_trainer_backend
    from stapo.core.update import micro_spec, stats_temperature, token_stats_batched

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
    try:
        train, _val = load_prompts(cfg.data, tokenizer)
        if not train:
            raise ValueError(f"no training prompts from data.source={cfg.data.source!r}")
        per = cfg.rollout.prompts_per_step
        n_prompts = min(limit, len(train))
        batches = math.ceil(n_prompts / per)
        log(f"calibrate: {n_prompts} prompts x {cfg.rollout.n} responses of up to {cfg.rollout.max_new_tokens} "
            f"tokens from {cfg.data.source}, {batches} batch(es) of {per} prompts (model loaded in {time.time() - t0:.0f}s)")
        temperature = stats_temperature(cfg)
        for b in range(batches):
            step = b + 1
            idx = prompts_for_step(len(train), step, per, cfg.trainer.seed)[: n_prompts - b * per]
            recs = [train[i] for i in idx]
            prompt_ids = [encode_prompt(tokenizer, r.prompt, chat_template=cfg.data.chat_template) for r in recs]
            sampling = SamplingParams(
                n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                max_new_tokens=cfg.rollout.max_new_tokens, seed=derive_seed(cfg.trainer.seed, step, 0, 0),
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
            if kept:
                batch = collate(kept, pad_id).to(backend.device)
                lp, ent = token_stats_batched(backend, batch, micro_spec(cfg), temperature)
                m = batch.response_mask.bool()
                sample.logprobs.append(lp[m].float().cpu())
                sample.entropy.append(ent[m].float().cpu())
                sample.advantages.append(batch.advantages[m].float().cpu())
            log(f"batch {b + 1}/{batches}: {len(seqs)} responses, {sample.tokens} response tokens so far "
                f"({time.time() - t0:.0f}s)")
            if progress is not None:
                progress("batches", b + 1, batches)
    finally:
        rewards.close()
    sample.info = {
        "model": cfg.model.name_or_path, "dtype": str(next(backend.model.parameters()).dtype).removeprefix("torch."),
        "engine": cfg.rollout.engine, "data": cfg.data.source, "prompts": n_prompts, "n": cfg.rollout.n,
        "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
        "prompts_per_batch": cfg.rollout.prompts_per_step, "dynamic_sampling": cfg.algorithm.dynamic_sampling,
        "wall_s": round(time.time() - t0, 1),
    }
    return sample


# ----------------------------------------------------------------------------- the grid


def _silenced(sample: CalibrationSample, tau_p: float, kind: str, value: float) -> tuple[int, int, float]:
    """(silenced before the advantage condition, with it, mean tau_h over batches) by ``s2t_mask``."""
    from stapo.core.algos import resolve_tau_h, s2t_mask

    before = after = 0
    taus = []
    for lp, ent, adv in zip(sample.logprobs, sample.entropy, sample.advantages, strict=True):
        lp2, ent2, adv2 = lp.unsqueeze(0), ent.unsqueeze(0), adv.unsqueeze(0)  # [1, n_b]
        mask = torch.ones_like(lp2, dtype=torch.bool)
        tau = (resolve_tau_h(ent2, mask, tau_h_quantile=value) if kind == "quantile" else float(value))
        taus.append(tau)
        before += int(s2t_mask(lp2, ent2, torch.ones_like(adv2), mask, tau_p=tau_p, tau_h=tau).sum())
        after += int(s2t_mask(lp2, ent2, adv2, mask, tau_p=tau_p, tau_h=tau).sum())
    return before, after, (sum(taus) / len(taus) if taus else float("nan"))


def calibration_grid(
    sample: CalibrationSample,
    *,
    tau_ps: Sequence[float] = DEFAULT_TAU_P,
    tau_hs: Sequence[tuple[str, float]] = DEFAULT_TAU_H,
    target: float = 1e-4,
    configured: tuple[float, str, float] | None = None,
) -> dict[str, Any]:
    """Entropy quantiles and, per (tau_p, tau_h) cell, the silenced fractions; JSON-ready.

    ``configured`` = (tau_p, kind, value) of the run's own setting: its cell is added to the grid
    when missing and marked. ``rate`` (advantage condition applied) is what the update silences;
    ``in_band`` and ``nearest_target`` are judged on it, or on ``rate_before_adv`` when no sampled
    token has A > 0 (every group all right or all wrong: the update would silence nothing whatever
    the thresholds), which ``judged_on`` says.
    """
    if not target > 0:
        raise ValueError(f"--target must be > 0, got {target}")
    n = sample.tokens
    ent = torch.cat(sample.entropy) if sample.entropy else torch.zeros(0)
    lp = torch.cat(sample.logprobs) if sample.logprobs else torch.zeros(0)
    adv = torch.cat(sample.advantages) if sample.advantages else torch.zeros(0)
    from stapo.core.algos import quantile

    qs = (0.01, 0.05, 0.1, 0.2, 0.5, 0.8, 0.95)
    stats = {
        "tokens": n,
        "entropy_quantiles": {f"{q:g}": quantile(ent, q) for q in qs},
        "share_entropy_below_0.01": float((ent.double() < 0.01).double().mean()) if n else float("nan"),
        "share_p_below_0.01": float((lp.double().exp() < 0.01).double().mean()) if n else float("nan"),
        "share_positive_advantage": float((adv > 0).double().mean()) if n else float("nan"),
    }
    settings = [(float(p), str(k), float(v)) for p in tau_ps for k, v in tau_hs]
    if configured is not None and configured not in settings:
        settings.append(configured)
    judge = "rate" if n and bool((adv > 0).any()) else "rate_before_adv"
    rows = []
    for tau_p, kind, value in settings:
        before, after, tau = _silenced(sample, tau_p, kind, value)
        rate_b, rate_a = (before / n, after / n) if n else (float("nan"), float("nan"))
        rows.append({
            "tau_p": tau_p, "tau_h_kind": kind, "tau_h_setting": value, "label": _label(kind, value),
            "tau_h_mean": tau, "silenced_before_adv": before, "silenced": after,
            "rate_before_adv": rate_b, "rate": rate_a,
            "in_band": bool(n and BAND[0] <= (rate_a if judge == "rate" else rate_b) <= BAND[1]),
            "configured": configured == (tau_p, kind, value), "nearest_target": False,
        })
    dist = [abs(math.log10(r[judge]) - math.log10(target)) if r[judge] and r[judge] > 0 else math.inf for r in rows]
    if rows and min(dist) < math.inf:
        rows[dist.index(min(dist))]["nearest_target"] = True
    return {"sample": {**sample.info, "responses": sample.responses, "kept": sample.kept, "correct": sample.correct},
            "stats": stats, "band": list(BAND), "target": target, "resolution": 1.0 / n if n else None,
            "judged_on": judge, "grid": rows}


# ----------------------------------------------------------------------------- outputs


def write_outputs(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """``calibration.json`` and the heat map ``calibration.png`` (log10 silenced rate per cell)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "calibration.json", "png": out_dir / "calibration.png"}
    paths["json"].write_text(json.dumps(result, indent=2, allow_nan=True))
    rows = result["grid"]
    key = result.get("judged_on", "rate")  # the rate the marks are on (before A > 0 when no A > 0)
    tps = sorted({r["tau_p"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    grid = np.full((len(tps), len(labels)), np.nan)
    cell = {}
    for r in rows:
        i, j = tps.index(r["tau_p"]), labels.index(r["label"])
        cell[i, j] = r
        grid[i, j] = math.log10(r[key]) if r[key] and r[key] > 0 else np.nan
    fig, ax = plt.subplots(figsize=(1.1 * len(labels) + 2.5, 0.55 * len(tps) + 2.2), dpi=110)
    floor = math.log10(result["resolution"]) - 0.5 if result["resolution"] else -7.0
    im = ax.imshow(np.where(np.isnan(grid), floor, grid), cmap="viridis", aspect="auto", vmin=floor, vmax=0)
    for (i, j), r in cell.items():
        txt = f"{r[key]:.1e}" if r[key] and r[key] > 0 else "0"
        mark = ("*" if r["nearest_target"] else "") + (" (cfg)" if r["configured"] else "")
        ax.text(j, i, txt + mark, ha="center", va="center", fontsize=7,
                color="black" if grid[i, j] > floor + 0.6 * (0 - floor) else "white")
        if r["in_band"]:
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.6))
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(tps)), [f"{t:g}" for t in tps], fontsize=8)
    ax.set_xlabel("tau_h (qX: quantile of each batch's entropies; H<X: absolute nats)")
    ax.set_ylabel("tau_p")
    s = result["sample"]
    what = "A > 0 applied" if key == "rate" else "before A > 0: no sampled token had A > 0"
    ax.set_title(f"S2T silenced rate ({what}): {s['model']}, {result['stats']['tokens']} tokens\n"
                 f"red box: paper's band {BAND[0]:g}..{BAND[1]:g}; *: nearest {result['target']:g}", fontsize=9)
    fig.colorbar(im, ax=ax, label="log10 silenced fraction (0 drawn at the floor)")
    fig.tight_layout()
    fig.savefig(paths["png"])
    plt.close(fig)
    return paths
