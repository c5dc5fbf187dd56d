"""`stapo probe`: the paper's local claim, one update's direction, measured on paired batches.

STAPO (arXiv 2602.15620v1, Sec. 3) claims that silencing the low-probability, low-entropy tokens of
correct responses (S2T) makes the update better: it removes gradient that helps nothing and drives
entropy up. A trajectory comparison cannot test that on a small machine (the seed spread of a final
accuracy dwarfs any plausible effect); one update's direction can be measured exactly, with the
same batch under every arm (paired). For each of N fresh rollout batches of a checkpoint, each
batch ONE population of the rule (one optimizer mini-batch, ``algorithm.mini_batches`` = 1):

Per-token loss l_t of the configured policy loss at ratio 1 (on-policy: the first mini-batch of a
step, where no clip is active), so grad l_t = -A_t grad log p_t. With n the batch's valid response
tokens, C the candidates (A > 0, p < tau_p), S the silenced set (the registered ``s2t`` weighting:
H < tau_h^(q) of the candidates, strict), c = |C|, k = |S|, and the per-token sums

    G_all = grad sum_{t valid} l_t,   G_S = grad sum_{t in S} l_t,   G_C = grad sum_{t in C} l_t,

each arm's loss is the token-mean over the tokens it keeps (silenced tokens leave the numerator
AND the denominator, as the update applies them), so by linearity its gradient is exactly

    A (baseline, every token)          g_A = G_all / n
    B (S2T: S silenced)                g_B = (G_all - G_S) / (n - k)
    C (k candidates silenced at random) E[g_C] = (G_all - (k/c) G_C) / (n - k)
                                       (every k-subset R of C keeps n - k tokens, and each
                                       candidate is in R with probability k/c: the exact
                                       expectation, no draw)
    D (C minus S silenced: the          g_D = (G_all - (G_C - G_S)) / (n - (c - k))
       complementary high-entropy candidates)

Measured per arm: the first-order change of (i) J_val, the mean over held-out prompts of the
log-probability of the gold answer followed by end-of-sequence (its gradient once per checkpoint),
and (ii) H, the batch's mean policy entropy over its valid response tokens (its gradient per batch),
for an update d of each arm: delta M = <grad M, d>. Two updates:

- ``sgd``: d = -lr g_arm, so delta M = -lr <grad M, g_arm>, linear in the G_X (:func:`arm_changes`).
- ``adam``: the step AdamW would take for the arm's gradient g from the optimizer's saved second
  moments v after t steps (zeros and t = 0 for the initial model: a fresh optimizer):
  d = -lr g / (sqrt(v_hat) + eps), v_hat = (beta2 v + (1 - beta2) g^2) / (1 - beta2^(t+1)), each arm
  with its own g in v (a parameter that only the kept tokens move gets Adam's normalised step, not
  1 / eps). Adam is not linear in g: C's column takes the expected gradient (not the expectation of
  the step), and the step is not a combination of the G_X. Left out, the same for every arm: the
  momentum history beta1 m (whose denominator differs slightly by arm), the weight decay and the
  constant (1 - beta1) / (1 - beta1^(t+1)) (it scales every arm alike and cancels in the shares).

Neither column includes gradient clipping (a rescaling of the whole step; the shares are
scale-free). The passes: one gradient forward over the batch's micro-batches (the repo's one
micro-batch iterator, ``stapo.core.train.micro``, through :class:`stapo.core.train.update.Actor`'s
layout and the backend's ``token_stats``) with two backwards (H and G_all), and one small forward
and backward over the rows that hold candidates (G_S and G_C: only those rows carry them).

The check: on the first ``check`` batches, real SGD steps theta -/+ lr g for arms A and B at the
reported lr (:func:`linearization_check`); J_val and H are measured exactly there (no-grad passes)
and their central difference is compared with the prediction (:data:`CHECK_REL_TOL`,
:data:`CHECK_ABS_TOL`): the first-order numbers the report gives hold at the step they describe.

The report: per checkpoint and pooled, the paired per-batch differences B - C (STAPO's own claim:
these tokens, chosen by entropy, against as many candidates chosen at random) and B - A, each
metric, each preconditioner: mean, 95% t interval, Wilcoxon signed-rank p, and the mean as a share
of the baseline step's own change (mean delta of A). The verdict (:func:`verdict`) is stated before
any batch runs and reads the pooled ``sgd`` B - C contrasts (defined at every checkpoint).

What it cannot say: the direction of one update at a checkpoint, not what many updates do (the
late-run stability the paper reports is a trajectory property), and only on the model, prompts
and lengths it ran on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stapo.core.algos import TokenContext, get_token_weighting, s2t_candidates
from stapo.core.algos.objective import per_token_objective
from stapo.core.batch import Batch, Sequence_, collate, derive_seed, seed_everything
from stapo.core.config import Config
from stapo.core.placement import resolve_device
from stapo.core.rollout import SamplingParams, build_rollout_engine
from stapo.core.rollout.rollouts import sample_and_grade, shape_and_advantage
from stapo.core.task.data import encode_prompt, load_prompts
from stapo.core.task.rewards import RewardFunction
from stapo.core.task.sampler import prompts_for_step
from stapo.core.train.checkpoint import load_checkpoint
from stapo.core.train.micro import micro_batches
from stapo.core.train.update import Actor, update_parts
from stapo.core.trainer import build_trainer_backend
from stapo.core.trainer.models import load_policy

__all__ = [
    "ARMS",
    "CHECK_REL_TOL",
        "MIN_CANDIDATES",
    "VERDICT_RULE",
    "adam_state",
    "adam_step",
    "arm_changes",
    "arm_coefficients",
    "contrast",
    "pooled",
    "probe",
    "report",
    "verdict",
]

ARMS = ("A", "B", "C", "D")
ARM_NAMES = {"A": "baseline, every token", "B": "S2T (the paper's rule)",
             "C": "as many candidates silenced at random (expectation)",
             "D": "the complementary high-entropy candidates silenced"}
METRICS = ("J_val", "H")
PRECONDS = ("sgd", "adam")
CONTRASTS = (("B-C", "B", "C"), ("B-A", "B", "A"))
MIN_CANDIDATES = 10
"""A batch should hold at least this many candidates: with fewer, S and a random k-subset of C
are nearly the same set (with 2 candidates the rule silences 1 of them)."""
CHECK_REL_TOL = 0.1
"""The check passes where |measured - predicted| <= 10% of the step's scale + CHECK_ABS_TOL; the scale
is the larger of |predicted| and the baseline arm's |predicted| at the same step size (the error of a
linearization grows with the step, which B shares with A; an arm whose first-order change nearly
cancels is judged at the baseline's scale, not at its own near-zero one)."""
CHECK_ABS_TOL = 2e-6
"""The float32 floor of a measured difference of two means of log-probabilities (nats)."""
VERDICT_RULE = ("holds if the pooled B-C change of J_val is > 0 and of H is < 0 (SGD, each 95% t interval "
                "excluding 0); refuted if either interval lies on the wrong side of 0; otherwise inconclusive")


# ----------------------------------------------------------------------------- the algebra


def arm_coefficients(n: int, k: int, c: int) -> dict[str, tuple[float, float, float]]:
    """Each arm's gradient as coefficients on (G_all, G_S, G_C) (module docstring): n valid tokens,
    k silenced by the rule, c candidates. An arm that keeps no token has a zero direction."""

    def over(m: int, a: float, s: float, cc: float) -> tuple[float, float, float]:
        return (a / m, s / m, cc / m) if m > 0 else (0.0, 0.0, 0.0)

    return {
        "A": over(n, 1.0, 0.0, 0.0),
        "B": over(n - k, 1.0, -1.0, 0.0),
        "C": over(n - k, 1.0, 0.0, -(k / c) if c else 0.0),
        "D": over(n - (c - k), 1.0, 1.0, -1.0),
    }


def arm_changes(dots: dict[tuple[str, str, str], float], *, n: int, k: int, c: int,
                lr: float) -> dict[str, dict[str, dict[str, float]]]:
    """{arm: {metric: {precond: first-order change}}} of an update d = -lr P g_arm, from
    ``dots[(metric, precond, X)]`` = <P grad M, G_X>, X in (all, S, C). A preconditioner missing
    from ``dots`` gives NaN."""
    coef = arm_coefficients(n, k, c)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for arm, (ca, cs, cc) in coef.items():
        out[arm] = {}
        for metric in METRICS:
            out[arm][metric] = {}
            for pre in PRECONDS:
                v = [dots.get((metric, pre, x), math.nan) for x in ("all", "S", "C")]
                out[arm][metric][pre] = -lr * (ca * v[0] + cs * v[1] + cc * v[2])
    return out


# ----------------------------------------------------------------------------- statistics


def contrast(diffs: Sequence[float], base: Sequence[float]) -> dict[str, Any]:
    """Paired per-batch differences: mean, 95% t interval, Wilcoxon signed-rank p and the mean as a
    share of the baseline's mean change ``base``. NaN values (no optimizer state) are left out."""
    from scipy import stats

    d = [float(x) for x in diffs if math.isfinite(x)]
    b = [float(x) for x in base if math.isfinite(x)]
    n = len(d)
    mean = sum(d) / n if n else math.nan
    if n >= 2:
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
        half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
        ci = [mean - half, mean + half]
    else:
        ci = [math.nan, math.nan]
    if n and any(x != 0 for x in d):
        p = float(stats.wilcoxon(d).pvalue)
    else:
        p = math.nan  # no difference at all (or no value): the test is undefined
    bmean = sum(b) / len(b) if b else math.nan
    share = mean / bmean if b and bmean != 0 else math.nan
    return {"mean": mean, "ci95": ci, "n": n, "wilcoxon_p": p, "share_of_baseline": share, "baseline_mean": bmean}


def verdict(bc_j: dict[str, Any], bc_h: dict[str, Any]) -> str:
    """:data:`VERDICT_RULE` on the B-C contrasts of J_val and H."""
    (jl, jh), (hl, hh) = bc_j["ci95"], bc_h["ci95"]
    if any(not math.isfinite(x) for x in (jl, jh, hl, hh)):
        return "inconclusive"
    if jh < 0 or hl > 0:
        return "refuted"
    if jl > 0 and hh < 0:
        return "holds"
    return "inconclusive"


def report(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``verdict`` and ``contrasts`` (per checkpoint and pooled, each contrast x metric x preconditioner)
    from the per-batch records (:func:`probe`)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for b in batches:
        groups.setdefault(b["checkpoint"], []).append(b)
    groups["pooled"] = list(batches)
    rows = []
    for where, bs in groups.items():
        for name, x, y in CONTRASTS:
            for metric in METRICS:
                for pre in PRECONDS:
                    diffs = [b["changes"][x][metric][pre] - b["changes"][y][metric][pre] for b in bs]
                    base = [b["changes"]["A"][metric][pre] for b in bs]
                    rows.append({"name": name, "metric": metric, "precond": pre, "checkpoint": where,
                                 **contrast(diffs, base)})
    pick = {(r["name"], r["metric"]): r for r in rows if r["checkpoint"] == "pooled" and r["precond"] == "sgd"}
    return {"verdict": verdict(pick["B-C", "J_val"], pick["B-C", "H"]), "rule": VERDICT_RULE, "contrasts": rows}


def pooled(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from several :func:`probe` results (probes run side by side: other checkpoints, or
    the same checkpoint with another ``trainer.seed``, whose batches are other draws): their batches
    and checks together, reported again (:func:`report`)."""
    seen: set[tuple[str, int]] = set()
    for r in results:
        keys = {(b["checkpoint"], b.get("seed", 0)) for b in r["batches"]}
        if keys & seen:
            label, seed = sorted(keys & seen)[0]
            raise ValueError(f"checkpoint {label} with seed {seed} appears in two results (the same batches)")
        seen |= keys
    batches = [b for r in results for b in r["batches"]]
    checks = [c for r in results for c in r.get("checks", [])]
    out = report(batches)
    out["checks"] = checks
    out["checks_agree"] = all(c[m]["agrees"] for c in checks for m in METRICS) if checks else None
    out["batches"] = batches
    out["info"] = {"pooled_from": [r.get("info", {}) for r in results]}
    return out


# ----------------------------------------------------------------------------- gradients


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], w: Sequence[torch.Tensor] | None = None) -> float:
    """<a, b> (or <a, diag(w) b>) over parameter lists, accumulated in float64."""
    if w is None:
        return float(sum((x.detach().double() * y.detach().double()).sum() for x, y in zip(a, b, strict=True)))
    return float(sum((x.double() * y.double() * z.double()).sum() for x, y, z in zip(a, b, w, strict=True)))


@dataclass(frozen=True)
class AdamState:
    """What the Adam column reads from the optimizer: the second moments per parameter (zeros for an
    optimizer that has taken no step), the step count t, beta2 and eps."""

    v: list[torch.Tensor]
    t: int
    beta2: float
    eps: float


def adam_state(optimizer: Any, params: Sequence[torch.Tensor]) -> AdamState:
    """The saved ``exp_avg_sq`` of AdamW (a fresh optimizer: zeros, t = 0)."""
    group = optimizer.param_groups[0]
    v, t = [], 0
    for p in params:
        st = optimizer.state.get(p, {})
        v.append(st["exp_avg_sq"].float() if "exp_avg_sq" in st else torch.zeros_like(p))
        t = max(t, int(float(st.get("step", 0))))
    return AdamState(v, t, float(group["betas"][1]), float(group["eps"]))


def adam_step(state: AdamState, g_arm: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Adam's step direction for one arm's gradient (module docstring): g / (sqrt(v_hat) + eps) with
    v_hat = (beta2 v + (1 - beta2) g^2) / (1 - beta2^(t+1)); the step is -lr times this."""
    corr = 1.0 - state.beta2 ** (state.t + 1)
    return [g.float() / (((state.beta2 * v + (1.0 - state.beta2) * g.float() ** 2) / corr).sqrt() + state.eps)
            for v, g in zip(state.v, g_arm, strict=True)]


def _grads(actor: Actor, batch: Batch, rows: torch.Tensor | None,
           objectives: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
           params: Sequence[torch.Tensor]) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor, torch.Tensor]:
    """Gradients of named scalar objectives summed over ``rows``' micro-batches (all rows: None), and
    the detached log-probs and entropies [N, L] of those rows. ``objectives(rows, lp, ent, resp)``
    gets one micro-batch's batch rows [b] and its [b, L] tensors with graph; every objective is
    backpropagated from the same forward (graph kept until the last)."""
    rows = torch.arange(batch.input_ids.shape[0]) if rows is None else rows
    (micros,) = micro_batches(batch, [rows], actor.spec)
    lp_all = torch.zeros(batch.input_ids.shape, dtype=torch.float32)  # [N, L]
    ent_all = torch.zeros_like(lp_all)
    acc: dict[str, list[torch.Tensor]] = {}
    for m in micros:
        lp, ent = actor.backend.token_stats(m.input_ids, m.attention_mask, m.response_mask, grad=True,
                                            temperature=actor.temperature, position_ids=m.position_ids)
        dev = m.response_mask.device
        lp, ent = m.to_rows(lp.float().to(dev)), m.to_rows(ent.float().to(dev))  # [b, L] each
        lp_all[m.rows.cpu()], ent_all[m.rows.cpu()] = lp.detach().cpu(), ent.detach().cpu()
        terms = objectives(m.rows, lp, ent, batch.response_mask[m.rows].bool())
        names = list(terms)
        for i, name in enumerate(names):
            gs = torch.autograd.grad(terms[name], params, retain_graph=i < len(names) - 1, allow_unused=True)
            if name not in acc:
                acc[name] = [torch.zeros_like(p) for p in params]
            for a, g in zip(acc[name], gs, strict=True):
                if g is not None:
                    a += g.detach()
    return acc, lp_all, ent_all


def val_batch(records: Sequence[Any], tokenizer: Any, cfg: Config) -> Batch:
    """Held-out prompts with their gold answer and end-of-sequence as the response (J_val's tokens)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seqs = []
    for g, r in enumerate(records):
        ids = encode_prompt(tokenizer, r.prompt, chat_template=cfg.data.chat_template)
        ans = list(tokenizer.encode(str(r.answer), add_special_tokens=False)) + ([eos] if eos is not None else [])
        seqs.append(Sequence_(ids, ans, "stop", str(r.answer), str(r.answer), group=g))
    return collate(seqs, pad)


def j_val(actor: Actor, vb: Batch) -> float:
    """J_val measured exactly: mean over prompts of the summed log-probability of gold answer + EOS."""
    lp, _ = actor.old_stats(vb)  # [N, L]
    return float((lp.double() * vb.response_mask.double()).sum()) / vb.input_ids.shape[0]


def grad_j_val(actor: Actor, vb: Batch, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """grad J_val (:func:`j_val`) per parameter: one forward and backward over the held-out batch."""

    def objective(rows, lp, ent, resp):
        return {"J": (lp * resp).sum() / vb.input_ids.shape[0]}

    return _grads(actor, vb, None, objective, params)[0]["J"]


def mean_entropy(actor: Actor, batch: Batch) -> float:
    """H measured exactly: the mean entropy over the batch's valid response tokens."""
    _, ent = actor.old_stats(batch)  # [N, L]
    resp = batch.response_mask.double()
    return float((ent.double() * resp).sum() / resp.sum())


# ----------------------------------------------------------------------------- one batch


@dataclass
class Probe:
    """A loaded checkpoint's parts: what every batch of it needs."""

    cfg: Config
    actor: Actor
    params: list[torch.Tensor]
    grad_j: list[torch.Tensor]  # grad J_val
    adam: AdamState  # the optimizer's second moments (the adam column's preconditioner)
    val: Batch
    lr: float
    extra: dict[str, Any] = field(default_factory=dict)


def measure_batch(pr: Probe, batch: Batch, *, seed: int, check: bool) -> dict[str, Any]:
    """One batch's counts, dot products, per-arm first-order changes and, with ``check``, the
    linearization check (module docstring)."""
    cfg, actor, params = pr.cfg, pr.actor, pr.params
    parts = update_parts(cfg)
    resp = batch.response_mask.bool()  # [N, L]
    n = int(resp.sum())

    def per_token(rows: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        adv = batch.advantages[rows].float()  # [b, L]
        per, _ = per_token_objective(lp, lp.detach(), adv, resp[rows], policy_loss=parts.loss_fn,
                                     loss_kwargs=parts.loss_kw)
        return per * resp[rows]  # [b, L]

    def full(rows, lp, ent, r):
        return {"H": (ent * r).sum() / n, "all": per_token(rows, lp).sum()}

    g, lp, ent = _grads(actor, batch, None, full, params)
    adv = batch.advantages.float().cpu()  # [N, L]
    ctx = TokenContext(lp.unsqueeze(0).flatten(1, 2), ent.unsqueeze(0).flatten(1, 2), adv.flatten().unsqueeze(0),
                       resp.cpu().flatten().unsqueeze(0), seed=seed)  # [1, N*L] each: one population
    s2t = cfg.algorithm.s2t
    tw = get_token_weighting("s2t")(ctx, tau_p=s2t.tau_p, q=s2t.q)
    silenced = (~tw.denom_mask[0] & ctx.mask[0]).reshape(resp.shape)  # [N, L]
    cand = s2t_candidates(lp, adv, resp.cpu(), tau_p=s2t.tau_p)  # [N, L]
    k, c = int(silenced.sum()), int(cand.sum())
    if c:
        crow = cand.any(1).nonzero()[:, 0]  # [r] rows holding a candidate
        sets = {"S": silenced.to(resp.device), "C": cand.to(resp.device)}

        def sparse(rows, lp2, ent2, r):
            pt = per_token(rows, lp2)  # [b, L]
            return {name: (pt * chosen[rows]).sum() for name, chosen in sets.items()}

        gs, _, _ = _grads(actor, batch, crow, sparse, params)
    else:
        gs = {x: [torch.zeros_like(p) for p in params] for x in ("S", "C")}
    g.update(gs)
    grads = {"J_val": pr.grad_j, "H": g["H"]}
    dots = {(metric, "sgd", x): _dot(v, g[x]) for metric, v in grads.items() for x in ("all", "S", "C")}
    changes = arm_changes(dots, n=n, k=k, c=c, lr=pr.lr)
    for arm, (ca, cs, cc) in arm_coefficients(n, k, c).items():  # Adam: per arm, not linear in g
        step = adam_step(pr.adam, [ca * a + cs * b + cc * d for a, b, d in zip(g["all"], g["S"], g["C"], strict=True)])
        for metric, v in grads.items():
            changes[arm][metric]["adam"] = -pr.lr * _dot(v, step)
    out = {"tokens": n, "candidates": c, "silenced": k, "responses": int(batch.input_ids.shape[0]),
           "tau_h": float(tw.info["tau_h"]), "H": float((ent.double() * resp.cpu()).sum() / max(n, 1)),
           "changes": changes}
    if check:
        out["check"] = linearization_check(pr, batch, g, dots, n=n, k=k, c=c)
    return out


def linearization_check(pr: Probe, batch: Batch, g: dict[str, list[torch.Tensor]],
                        dots: dict[tuple[str, str, str], float], *, n: int, k: int, c: int) -> list[dict[str, Any]]:
    """Arms A and B: real SGD steps theta -/+ lr g_arm at the learning rate the report uses
    (``trainer.lr``), J_val and H measured exactly (no-grad passes) at both, against the first-order
    prediction at that lr. The measured change is the central difference
    (M(theta - lr g) - M(theta + lr g)) / 2, whose error is third order in the step (the one-sided
    difference's second-order term would be read as a disagreement of the first-order term)."""
    coef = arm_coefficients(n, k, c)
    per_lr = arm_changes(dots, n=n, k=k, c=c, lr=1.0)
    lr = pr.lr
    saved = [p.detach().clone() for p in pr.params]
    out = []
    try:
        for arm in ("A", "B"):
            ca, cs, cc = coef[arm]
            d = [ca * ga + cs * gs_ + cc * gc for ga, gs_, gc in zip(g["all"], g["S"], g["C"], strict=True)]
            vals = {}
            for sign in (-1.0, 1.0):
                with torch.no_grad():
                    for p, s, dp in zip(pr.params, saved, d, strict=True):
                        p.copy_(s).add_(dp, alpha=sign * lr)
                vals[sign] = (j_val(pr.actor, pr.val), mean_entropy(pr.actor, batch))
            row: dict[str, Any] = {"arm": arm, "lr": lr}
            for i, metric in enumerate(METRICS):
                pred = per_lr[arm][metric]["sgd"] * lr
                scale = max(abs(pred), abs(per_lr["A"][metric]["sgd"] * lr))
                meas = (vals[-1.0][i] - vals[1.0][i]) / 2
                row[metric] = {"predicted": pred, "measured": meas, "scale": scale,
                               "agrees": abs(meas - pred) <= CHECK_REL_TOL * scale + CHECK_ABS_TOL}
            out.append(row)
    finally:
        with torch.no_grad():
            for p, s in zip(pr.params, saved, strict=True):
                p.copy_(s)
    return out


# ----------------------------------------------------------------------------- the run


def probe_config(cfg: Config) -> Config:
    """The probe's reading of a run's config: each batch one population of the rule (one optimizer
    mini-batch) and the entropy's gradient on (H is one of the measured objectives)."""
    return cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"mini_batches": 1}),
                                  "trainer": cfg.trainer.model_copy(update={"entropy_grad": True})})


@dataclass(frozen=True)
class Target:
    """One checkpoint to probe: ``path`` a checkpoint folder, or None for the config's initial model."""

    label: str
    path: Path | None
    step: int


def probe(cfg: Config, targets: Sequence[Target], *, batches: int, check: int, val_prompts: int,
          log: Callable[[str], None] = print,
          progress: Callable[[Iterable[int], int, str], Iterable[int]] | None = None,
          partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every target's ``batches`` fresh rollout batches (``rollout.prompts_per_step`` prompts x
    ``rollout.n``), measured (:func:`measure_batch`); returns the per-batch records, the checks and
    :func:`report`'s verdict and contrasts. ``partial`` gets the result so far after every batch (a
    long run stopped early keeps what it measured). One process, the torch backend."""

    t0 = time.time()
    cfg = probe_config(cfg)
    seed = cfg.trainer.seed
    seed_everything(seed)
    model, tokenizer = load_policy(cfg.model, device=resolve_device(cfg.trainer.device))
    backend = build_trainer_backend(cfg, model, total_optimizer_steps=1)
    engine = build_rollout_engine(cfg, model=backend.model, tokenizer=tokenizer)
    rewards = RewardFunction(cfg.reward)
    actor = Actor(cfg, backend)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    params = [p for p in backend.model.parameters() if p.requires_grad]
    train, val = load_prompts(cfg.data, tokenizer)
    if not train or not val:
        raise ValueError(f"the probe needs training and held-out prompts; data.source={cfg.data.source!r} gave "
                         f"{len(train)} and {len(val)} (data.val_size)")
    vb = val_batch(val[:val_prompts], tokenizer, cfg).to(backend.device)
    log(f"probe: model loaded in {time.time() - t0:.0f}s; {len(train)} training prompts, J_val over {vb.input_ids.shape[0]} "
        f"held-out prompts; per batch {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.n} responses, one population")
    records: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    per = cfg.rollout.prompts_per_step
    try:
        for target in targets:
            if target.path is not None:
                load_checkpoint(target.path, backend=backend)
            adam = adam_state(backend.optimizer, params)
            backend.optimizer.state.clear()  # the probe never steps: the first moments' memory goes (adam keeps v)
            gj = grad_j_val(actor, vb, params)
            pr = Probe(cfg, actor, params, gj, adam, vb, lr=cfg.trainer.lr)
            j0 = j_val(actor, vb)
            log(f"{target.label}: J_val {j0:.4f} nats, |grad J_val| {math.sqrt(_dot(gj, gj)):.3g}, "
                f"Adam second moments {f'after {adam.t} steps' if adam.t else 'none yet (a fresh optimizer)'}")
            it: Iterable[int] = range(batches)
            if progress is not None:
                it = progress(it, batches, target.label)
            for b in it:
                bseed = derive_seed(seed, 0x9B0BE, target.step, b)
                idx = prompts_for_step(len(train), 1, per, bseed, round_=1)
                recs = [train[i] for i in idx]
                prompt_ids = [encode_prompt(tokenizer, r.prompt, chat_template=cfg.data.chat_template) for r in recs]
                sampling = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                          max_new_tokens=cfg.rollout.max_new_tokens, seed=bseed,
                                          ignore_eos=cfg.rollout.ignore_eos)
                tb = time.time()
                seqs = sample_and_grade(engine, prompt_ids, recs, sampling, rewards)
                kept = shape_and_advantage(cfg, seqs)
                ts = time.time()
                batch = collate(kept, pad_id).to(backend.device)
                rec = measure_batch(pr, batch, seed=bseed, check=b < check)
                rec.update({"checkpoint": target.label, "step": target.step, "seed": seed, "batch": b,
                            "correct": sum(s.correct for s in seqs), "sample_s": round(ts - tb, 1),
                            "measure_s": round(time.time() - ts, 1)})
                if "check" in rec:
                    checks += [{"checkpoint": target.label, "seed": seed, "batch": b, **row} for row in rec.pop("check")]
                records.append(rec)
                if partial is not None:
                    partial(_result(records, checks, cfg, targets, vb, backend, t0, done=False))
                if rec["candidates"] < MIN_CANDIDATES:
                    log(f"{target.label} batch {b}: {rec['candidates']} candidates (< {MIN_CANDIDATES}): S and a random "
                        "subset nearly coincide")
    finally:
        rewards.close()
    return _result(records, checks, cfg, targets, vb, backend, t0, done=True)


def _result(records: list[dict[str, Any]], checks: list[dict[str, Any]], cfg: Config, targets: Sequence[Target],
            vb: Batch, backend: Any, t0: float, *, done: bool) -> dict[str, Any]:
    out = report(records)
    out["complete"] = done
    out["checks"] = checks
    out["checks_agree"] = all(row[m]["agrees"] for row in checks for m in METRICS) if checks else None
    out["batches"] = records
    out["info"] = {"model": cfg.model.name_or_path, "data": cfg.data.source, "prompts_per_batch":
                   cfg.rollout.prompts_per_step, "n": cfg.rollout.n, "max_new_tokens": cfg.rollout.max_new_tokens,
                   "lr": cfg.trainer.lr, "tau_p": cfg.algorithm.s2t.tau_p, "q": cfg.algorithm.s2t.q,
                   "val_prompts": int(vb.input_ids.shape[0]), "device": str(backend.device),
                   "targets": [{"label": t.label, "step": t.step, "path": str(t.path) if t.path else None}
                               for t in targets],
                   "check_rel_tol": CHECK_REL_TOL, "check_abs_tol": CHECK_ABS_TOL,
                   "wall_s": round(time.time() - t0, 1)}
    return out
