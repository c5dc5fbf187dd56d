"""Does STAPO's silencing move a run the paper's way? A paired-seed test that can answer either way.

The paper's claim (arXiv 2602.15620v1, Sec. 4): with everything else equal, silencing the spurious
tokens (S2T) keeps the policy's entropy from exploding and ends more accurate than the same objective
without it, and silencing as many of the same candidates at random lands in between. The part of that
claim that is STAPO's own is "these tokens, chosen by entropy": a gain of B over A alone can come from
any sparse perturbation of the update or from the renormalized denominator, so the contrast that
decides is B against C (as many candidates silenced at random). This harness trains, evaluates and
prints its verdict in one command:

1. **Pilot** (arm A, seed 0): greedy held-out accuracy at step 0 must lie in [15%, 60%] (a task the
   model can learn but has not learnt); the learning rate is raised through ``pilot_lrs`` until the
   baseline's entropy *rises* 2x (its mean over the last third of the pilot against its value at the
   reference step). Where it never rises, the entropy contrast is "not applicable" and the verdict
   rests on accuracy alone (a falling entropy on a one-number answer is convergence, not the entropy
   explosion the paper targets, and the paper's lemma predicts S2T lowers entropy further there). A
   short arm-B run must silence a non-zero share (otherwise B is the baseline and the test is void).
   The baseline's token dumps give the candidates per mini-batch (the quantile's population: at
   least 10 is the check) and the **mechanism check** (the silenced share of the logit-gradient norm
   ``|A| sqrt(1 - 2p + sum_q q^2)`` against a random same-size set of the same candidates; every
   candidate's norm lies within |A| [1, sqrt 2], so this ratio is capped near 1.41 and says little).
2. **Arms**, identical but for the token weighting (each run is ``stapo train --config BASE
   --recipe ARM``): A = ``stapo-base``, B = ``stapo``, C = ``stapo-random``, always all three; the
   same seeds in every arm (``trainer.seed``: data order and initial sampling; the held-out split
   stays fixed).
3. **Metrics** per run: held-out accuracy (greedy) at the steps validation runs; the **endpoint**,
   the mean of those accuracies over the last third of the run (less noisy than the last evaluation
   alone); the per-step mean entropy; the silenced rate (silenced (token, epoch) pairs / valid
   tokens); the candidates per mini-batch.
4. **Verdict**, decided before running (printed before the first run): see :data:`RULES`. One paired
   test decides "holds" and "refuted" alike: the 95% t interval over seeds of each per-seed difference.

Each run is a `stapo train` process with ``OMP_NUM_THREADS=1``, ``--jobs`` (2) at a time. The run
dirs, ``direction.json`` (design, pilot, per-seed table, contrasts, verdict) and a `stapo compare`
report over the arms (mean and t interval over seeds, paired differences) land in ``--out``.

    python benchmarks/direction.py                               # the CPU design (SmolLM2-135M, 4 seeds x 50 steps)
    python benchmarks/direction.py --smoke                       # 2 seeds x 2 steps on the tiny model (a test runs it)
    python benchmarks/direction.py --device cuda --scale gpu     # the same design sized for one GPU
    python benchmarks/direction.py --dry-run                     # the design and the runs' commands, nothing run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

MIN_POPULATION = 10
"""Candidates a mini-batch should hold for its q-quantile to mean something (with 2 candidates the
rule silences 1, and a random draw of 1 of 2 equals it half the time)."""

RULES = (
    "void: arm B silenced no token over the whole run (its update is arm A's).",
    "endpoint of a run: its mean held-out accuracy (greedy) over the evaluations at steps >= 2/3 of the run.",
    "one test for either answer: the 95% paired t interval over seeds of a per-seed difference; a contrast is "
    "'for' STAPO when the interval lies wholly on STAPO's side of 0, 'against' when wholly on the other side, "
    "'open' when it contains 0.",
    "deciding contrasts: accuracy B - C (the endpoint; STAPO's side > 0) and entropy ln(H_B / H_A) (per seed the "
    "mean over steps >= the reference step of the log ratio of the arms' mean entropies; STAPO's side < 0). The "
    "entropy contrast applies only where the baseline's entropy rises (2x, in the pilot; with --lr, in arm A's "
    "runs); elsewhere it is 'not applicable', never 'for'.",
    "holds: every deciding contrast is 'for'. refuted: every deciding contrast is 'against'. inconclusive: "
    "anything else (an open interval, or one contrast each way).",
    "reported beside them, deciding nothing: accuracy B - A and C - A, entropy ln(H_B / H_C).",
    f"populations: each mini-batch's candidates are the quantile's population; runs whose mini-batches hold "
    f"fewer than {MIN_POPULATION} candidates (median over steps) are named.",
)
"""The decision rules, fixed before any run and printed with the results."""


@dataclass(frozen=True)
class Scale:
    """One size of the design: the base config, the task and the schedule every arm shares."""

    base: str  # preset the arms' recipes apply their method keys to
    seeds: int
    steps: int
    eval_every: int  # held-out accuracy (greedy) at 0, eval_every, ..., steps (several in the last third)
    pilot_steps: int
    pilot_b_steps: int  # arm B's short run that checks the rule silences something
    pilot_lrs: tuple[float, ...]
    ref_step: int  # entropy is compared from this step on (the pilot's rise: against this step's entropy)
    overrides: tuple[str, ...] = ()
    enforce_pilot: bool = True


# The task: two operations (a + b - c) on one-digit numbers (the generator draws every operand with
# the same digit count; `--set data.arithmetic.digits=2` for two-digit ones, which the pilot's
# start-accuracy check may then refuse), the paper's boxed instruction, 48 new tokens; 4 prompts x 8 samples,
# clip 0.2 / 0.28 and token-mean come from the recipes (method keys), +-1 reward and the rest from here.
# One mini-batch a step [ours]: the quantile's population is a mini-batch's candidates, and at this size
# four mini-batches hold 0-3 candidates each (where B and C can differ by one token at most); one holds
# all of the step's. Held-out: 200 problems, greedy.
TASK = ("data.source=arithmetic", "data.template=boxed", "data.arithmetic.digits=1", "data.arithmetic.num_ops=2",
        "data.arithmetic.ops=[+,-]", "data.arithmetic.num_problems=2000", "data.val_size=200",
        "eval.val_temperature=0.0", "reward.scale.correct=1.0", "reward.scale.wrong=-1.0",
        "algorithm.mini_batches=1", "rollout.temperature=1.0")
QUIET = ("logging.live=false", "logging.tensorboard=false", "checkpoint.every=0", "checkpoint.export_hf=false")

SCALES: dict[str, Scale] = {
    "cpu": Scale(base="demo", seeds=4, steps=50, eval_every=5, pilot_steps=30, pilot_b_steps=5,
                 pilot_lrs=(2e-5, 6e-5, 2e-4), ref_step=5,
                 overrides=(*TASK, "rollout.prompts_per_step=4", "rollout.n=8", "rollout.max_new_tokens=48",
                            "trainer.device=cpu")),
    "gpu": Scale(base="demo", seeds=4, steps=60, eval_every=5, pilot_steps=30, pilot_b_steps=5,
                 pilot_lrs=(2e-5, 6e-5, 2e-4), ref_step=5,
                 overrides=(*TASK, "rollout.prompts_per_step=16", "rollout.n=8", "rollout.max_new_tokens=64",
                            "rollout.batch_size=128", "trainer.micro_batch_size=32")),
    # The tiny random model: the machinery end to end in about a minute. tau_p 0.1 because the tiny
    # model's p sits near 0.07 for every token (configs/tiny.yaml), so the paper's 0.002 finds no candidate.
    "smoke": Scale(base="tiny", seeds=2, steps=2, eval_every=1, pilot_steps=2, pilot_b_steps=2, pilot_lrs=(1e-3,),
                   ref_step=1, overrides=("algorithm.s2t.tau_p=0.1",), enforce_pilot=False),
}

ARMS = ("stapo-base", "stapo", "stapo-random")


# ----------------------------------------------------------------------------- running


@dataclass
class Job:
    """One `stapo train` process."""

    name: str
    run_dir: Path
    argv: list[str]
    wall_s: float = 0.0
    rc: int | None = None


def train_argv(base: str, recipe: str, run_dir: Path, sets: list[str]) -> list[str]:
    """The `stapo train` command of one run: the base config with the recipe's method keys, then ``sets``."""
    argv = [sys.executable, "-m", "stapo.cli.main", "train", "--config", base, "--recipe", recipe,
            "--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    return argv


def _log_path(job: Job) -> Path:
    return job.run_dir.parent / f"{job.run_dir.name}.log"


def run_jobs(jobs: list[Job], parallel: int, log: Any = print) -> None:
    """Run the jobs, ``parallel`` at a time, each with OMP_NUM_THREADS=1 and its output in RUN.log;
    a failed run stops the harness with the log's last lines."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            job.run_dir.parent.mkdir(parents=True, exist_ok=True)
            logf = open(_log_path(job), "w")  # noqa: SIM115 (closed when the process ends)
            running.append((job, subprocess.Popen(job.argv, stdout=logf, stderr=subprocess.STDOUT, env=env),
                            logf, time.time()))
            log(f"  start {job.name}")
        time.sleep(0.2)
        for item in list(running):
            job, proc, logf, t0 = item
            if proc.poll() is None:
                continue
            running.remove(item)
            logf.close()
            job.rc, job.wall_s = proc.returncode, time.time() - t0
            log(f"  done  {job.name} ({job.wall_s:.0f} s)")
            if job.rc != 0:
                for _, p, f, _ in running:
                    p.terminate()
                    p.wait()
                    f.close()
                tail = _log_path(job).read_text().splitlines()[-15:]
                raise SystemExit(f"direction: {job.name} failed (exit {job.rc}):\n" + "\n".join(tail))


# ----------------------------------------------------------------------------- metrics


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    from stapo.core.tracking import read_jsonl as _read

    return _read(path)


def last_third(steps: int) -> int:
    """The first step of a run's last third: ceil(2 x steps / 3) (50 steps -> 34, 60 -> 40, 2 -> 2)."""
    return math.ceil(2 * steps / 3 - 1e-9)


def endpoint(accuracy: dict[int, float], steps: int) -> float | None:
    """The run's endpoint: the mean held-out accuracy over the evaluations at steps >= :func:`last_third`
    (one evaluation's swing, e.g. 70% -> 55% between two evaluations of one run, averages out)."""
    late = [a for t, a in accuracy.items() if t >= last_third(steps)]
    return sum(late) / len(late) if late else None


def entropy_rise(entropy: dict[int, float], ref_step: int, steps: int) -> float | None:
    """ln(mean entropy over the last third / entropy at the reference step): > 0 where the policy's
    entropy rose, < 0 where it fell. None without a positive entropy at the reference or late steps."""
    ref = entropy.get(ref_step)
    late = [h for t, h in entropy.items() if t >= max(last_third(steps), ref_step)]
    if ref is None or ref <= 0 or not late or min(late) <= 0:
        return None
    return math.log(sum(late) / len(late) / ref)


def log_entropy_ratio(num: dict[int, float], den: dict[int, float], ref_step: int) -> float | None:
    """Mean over the steps t >= ref both runs logged of ln(H_num(t) / H_den(t)): < 0 where ``num``'s
    entropy ran below ``den``'s. Signed: a 2x rise and a 2x fall do not look alike."""
    ratios = [math.log(num[t] / den[t]) for t in sorted(num) if t >= ref_step and t in den and num[t] > 0 and den[t] > 0]
    return sum(ratios) / len(ratios) if ratios else None


def run_metrics(run_dir: Path, ref_step: int, steps: int, updates_per_step: int) -> dict[str, Any]:
    """One run's held-out accuracy by step, endpoint, final / best / drawdown, entropy by step and its
    rise, silenced rate, and candidates per mini-batch (``stapo/candidates`` per step over the step's
    ``updates_per_step`` mini-batches x epochs: the median step's mean)."""
    from stapo.evals.compare import load_run, silenced_rate

    val = {int(r["step"]): float(r["accuracy"]) for r in read_jsonl(run_dir / "val.jsonl") if r.get("accuracy") is not None}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    entropy = {int(r["step"]): float(r["entropy/mean"]) for r in metrics if r.get("entropy/mean") is not None}
    cands = [float(r["stapo/candidates"]) / updates_per_step for r in metrics if r.get("stapo/candidates") is not None]
    final = val[max(val)] if val else None
    best = max(val.values()) if val else None
    return {
        "accuracy": {str(k): v for k, v in sorted(val.items())},
        "endpoint": endpoint(val, steps),
        "final": final, "best": best, "drawdown": None if final is None else best - final,
        "entropy": {str(k): v for k, v in sorted(entropy.items())},
        "entropy_rise": entropy_rise(entropy, ref_step, steps),
        "silenced_rate": silenced_rate(load_run(run_dir)),
        "candidates_per_minibatch": statistics.median(cands) if cands else None,
        "steps": len(metrics),
    }


# ----------------------------------------------------------------------------- verdict


def seeds_needed(sd: float, delta: float, *, alpha: float = 0.05, power: float = 0.80) -> int:
    """Paired seeds a two-sided test at level ``alpha`` needs to detect a mean difference ``delta`` with
    probability ``power`` when the per-seed differences spread with ``sd``: the normal approximation
    n = ((z(1 - alpha/2) + z(power)) x sd / delta)^2, rounded up (the t test needs one or two more)."""
    z = statistics.NormalDist().inv_cdf
    return math.ceil(((z(1 - alpha / 2) + z(power)) * sd / delta) ** 2 - 1e-9)


@dataclass(frozen=True)
class Contrast:
    """One paired contrast over seeds: ``name`` (e.g. "B - C"), ``metric``, the per-seed differences,
    the side STAPO predicts (+1: above 0, -1: below), and whether it decides the verdict."""

    name: str
    metric: str
    diffs: dict[str, float]
    predicted: int
    deciding: bool

    @property
    def interval(self) -> dict[str, Any]:
        from stapo.evals.compare_stats import mean_interval

        return mean_interval(list(self.diffs.values()))

    @property
    def side(self) -> str:
        """'for' (the 95% interval wholly on the predicted side of 0), 'against' (wholly on the other
        side) or 'open' (it contains 0, or fewer than 2 seeds): the same test for either answer."""
        iv = self.interval
        if iv["low"] is None:
            return "open"
        if iv["low"] > 0 or iv["high"] < 0:
            return "for" if (iv["low"] > 0) == (self.predicted > 0) else "against"
        return "open"

    def record(self) -> dict[str, Any]:
        iv = self.interval
        return {"name": self.name, "metric": self.metric, "mean": iv["mean"], "ci95": [iv["low"], iv["high"]],
                "sd": iv["sd"], "n": iv["n"], "diffs": self.diffs, "predicted": "> 0" if self.predicted > 0 else "< 0",
                "side": self.side, "deciding": self.deciding}


def contrasts(per_arm: dict[str, dict[int, dict]], ref_step: int, *, entropy_applies: bool) -> list[Contrast]:
    """The paired contrasts of :data:`RULES` from the per-seed metrics of arms A, B, C (seed -> metrics,
    each with ``endpoint`` and ``entropy`` {step: H}); seeds missing a value in either arm are left out."""

    def acc(x: str, y: str) -> dict[str, float]:
        return {str(s): per_arm[x][s]["endpoint"] - per_arm[y][s]["endpoint"] for s in sorted(per_arm[x])
                if s in per_arm[y] and None not in (per_arm[x][s]["endpoint"], per_arm[y][s]["endpoint"])}

    def ent(x: str, y: str) -> dict[str, float]:
        out = {}
        for s in sorted(per_arm[x]):
            if s in per_arm[y]:
                hx = {int(t): h for t, h in per_arm[x][s]["entropy"].items()}
                hy = {int(t): h for t, h in per_arm[y][s]["entropy"].items()}
                r = log_entropy_ratio(hx, hy, ref_step)
                if r is not None:
                    out[str(s)] = r
        return out

    return [Contrast("B - C", "endpoint accuracy", acc("B", "C"), +1, True),
            Contrast("B / A", "entropy ln(H_B / H_A)", ent("B", "A"), -1, entropy_applies),
            Contrast("B - A", "endpoint accuracy", acc("B", "A"), +1, False),
            Contrast("C - A", "endpoint accuracy", acc("C", "A"), +1, False),
            Contrast("B / C", "entropy ln(H_B / H_C)", ent("B", "C"), -1, False)]


def verdict(per_arm: dict[str, dict[int, dict]], ref_step: int, *, entropy_applies: bool
            ) -> tuple[str, list[str], list[Contrast]]:
    """(verdict, reasons, contrasts) by :data:`RULES`: holds when every deciding contrast is 'for',
    refuted when every one is 'against', void when B silenced nothing, else inconclusive. Mirrored
    inputs (every difference's sign flipped) give the mirrored verdict."""
    cs = contrasts(per_arm, ref_step, entropy_applies=entropy_applies)
    b = per_arm["B"]
    if b and all((m["silenced_rate"] or 0.0) == 0.0 for m in b.values()):
        return "void", ["arm B silenced no token: its update equals arm A's"], cs
    reasons = []
    for c in cs:
        iv = c.interval
        if c.name == "B / A" and not entropy_applies:
            role = "not applicable (the baseline's entropy did not rise)"
        else:
            role = "deciding" if c.deciding else "beside"
        unit, scale = ("points", 100.0) if "accuracy" in c.metric else ("nats", 1.0)
        ci = "no interval" if iv["low"] is None else f"[{scale * iv['low']:+.3g}, {scale * iv['high']:+.3g}]"
        mean = "–" if iv["mean"] is None else f"{scale * iv['mean']:+.3g}"
        reasons.append(f"{c.name} {c.metric}: {mean} {unit} {ci} n={iv['n']}, {c.side} ({role})")
    sides = [c.side for c in cs if c.deciding]
    if not sides or any(c.interval["n"] == 0 for c in cs if c.deciding):
        return "inconclusive", ["no paired seeds", *reasons], cs
    if all(s == "for" for s in sides):
        return "holds", reasons, cs
    if all(s == "against" for s in sides):
        return "refuted", reasons, cs
    return "inconclusive", reasons, cs


def low_populations(per_arm: dict[str, dict[int, dict]]) -> list[str]:
    """The runs (``ARM seed S``) of arms B and C whose median step held fewer than :data:`MIN_POPULATION`
    candidates per mini-batch."""
    return [f"{arm} seed {s} ({m['candidates_per_minibatch']:.1f})" for arm in ("B", "C") for s, m in
            sorted(per_arm.get(arm, {}).items())
            if m["candidates_per_minibatch"] is not None and m["candidates_per_minibatch"] < MIN_POPULATION]


# ----------------------------------------------------------------------------- mechanism check


def mechanism_check(run_dir: Path, *, tau_p: float, q: float, seed: int = 0) -> dict[str, Any]:
    """From a baseline run's token dumps: the share of the summed per-token logit-gradient norm
    ``|A| sqrt(max(0, 1 - 2p + sum_q q^2))`` that the paper's rule would silence in each dumped step
    (per mini-batch, as the update: candidates A > 0 and p < tau_p, silenced below the q-th quantile
    of the mini-batch's candidate entropies), against a random same-size set of the same
    mini-batch's candidates, and each mini-batch's candidate count (mini-batches without a candidate
    are not in the dumps' sequences and do not appear). Dumps must hold every sequence
    (``logging.dump_max_sequences`` at least the batch). Every candidate has p < tau_p, so its norm
    lies within |A| [1, sqrt 2]: the ratio of the two shares is capped near 1.41 by construction. One-step
    entropy changes need a second forward pass and are not measured here (`stapo probe` measures them)."""
    rng = random.Random(seed)
    silenced_share, random_share, counted, tokens, populations = [], [], 0, 0, []
    for path in sorted((run_dir / "dumps").glob("step_*.json")):
        dump = json.loads(path.read_text())
        by_mb: dict[int, list[tuple[float, float]]] = {}  # mini-batch -> candidates' (entropy, gradient norm)
        total = 0.0
        for seq in dump.get("sequences", []):
            a = float(seq["advantage"])
            dist_p = seq.get("dist_prob", seq["prob"])  # p of the forward that gave sum_q2 (older dumps: the mask's)
            for p, h, s2, dp in zip(seq["prob"], seq["entropy"], seq["sum_q2"], dist_p, strict=True):
                g = abs(a) * math.sqrt(max(0.0, 1 - 2 * dp + s2))
                total += g
                tokens += 1
                if a > 0 and p < tau_p:
                    by_mb.setdefault(int(seq.get("minibatch", 0)), []).append((h, g))
        populations += [len(c) for c in by_mb.values()]
        if not by_mb or total <= 0:
            continue
        sil_g = rnd_g = 0.0
        for cands in by_mb.values():
            tau_h = _quantile(sorted(h for h, _ in cands), q)
            sil = [g for h, g in cands if h < tau_h]
            counted += len(sil)
            sil_g += sum(sil)
            rnd_g += sum(g for _, g in rng.sample(cands, len(sil)))
        silenced_share.append(sil_g / total)
        random_share.append(rnd_g / total)

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    return {"steps": len(silenced_share), "tokens": tokens, "silenced_tokens": counted,
            "silenced_grad_share": mean(silenced_share), "random_same_size_grad_share": mean(random_share),
            "tau_p": tau_p, "q": q, "candidates_per_minibatch": populations}


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolation quantile of sorted values (numpy's default, torch.quantile's)."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


# ----------------------------------------------------------------------------- the harness


@dataclass
class Design:
    scale: str
    arms: tuple[str, ...]
    seeds: list[int]
    steps: int
    lr: float | None = None
    sets: list[str] = field(default_factory=list)


def pilot(scale: Scale, arms: tuple[str, ...], out: Path, sets: list[str], jobs: int, log: Any) -> dict[str, Any]:
    """Start accuracy, the learning rate at which the baseline's entropy rises 2x (or none: then the
    first rate, and the entropy contrast does not apply), B's silenced share, the candidates per
    mini-batch and the mechanism check; the checks are enforced unless the scale says not to."""
    from stapo.configs import preset_path
    from stapo.core.config import load_config

    b_cfg = load_config(preset_path(arms[1]))
    tau_p = next((float(s.split("=", 1)[1]) for s in sets if s.startswith("algorithm.s2t.tau_p=")), b_cfg.algorithm.s2t.tau_p)
    q = float(getattr(b_cfg.algorithm.s2t, "q", 0.75))
    result: dict[str, Any] = {"tries": []}
    for i, lr in enumerate(scale.pilot_lrs):
        common = [*sets, f"trainer.lr={lr}", "trainer.seed=0"]
        a_dir = out / "pilot" / f"A-lr{lr:g}"
        batch = [Job(f"pilot A lr={lr:g}", a_dir, train_argv(scale.base, arms[0], a_dir, [
            *common, f"trainer.max_steps={scale.pilot_steps}", f"eval.every={scale.pilot_steps}",
            "logging.dump_tokens_every=1", "logging.dump_max_sequences=100000"]))]
        if i == 0:
            b_dir = out / "pilot" / "B"
            batch.append(Job("pilot B", b_dir, train_argv(scale.base, arms[1], b_dir, [
                *common, f"trainer.max_steps={scale.pilot_b_steps}", "eval.every=0", "data.val_size=0"])))
        run_jobs(batch, jobs, log)
        if i == 0:
            from stapo.evals.compare import load_run, silenced_rate

            result["b_silenced_rate"] = silenced_rate(load_run(out / "pilot" / "B"))
        m = run_metrics(a_dir, min(scale.ref_step, scale.pilot_steps), scale.pilot_steps, 1)
        if i == 0:
            result["start_accuracy"] = m["accuracy"].get("0")
            result["lr"], result["run"] = lr, str(a_dir)
        result["tries"].append({"lr": lr, "entropy_rise": m["entropy_rise"]})
        if (m["entropy_rise"] or 0.0) > math.log(2):
            result["lr"], result["run"] = lr, str(a_dir)
            result["entropy_rises"] = True
            break
    else:
        result["entropy_rises"] = False
    result["mechanism"] = mechanism_check(Path(result["run"]), tau_p=tau_p, q=q)
    pops = result["mechanism"]["candidates_per_minibatch"]
    acc = result["start_accuracy"]
    result["checks"] = {
        "start accuracy in [15%, 60%]": acc is not None and 0.15 <= acc <= 0.60,
        "arm B silences a non-zero share": (result["b_silenced_rate"] or 0.0) > 0,
        "baseline entropy rises > 2x": result["entropy_rises"],
        f"mini-batches hold >= {MIN_POPULATION} candidates (median)": bool(pops) and statistics.median(pops) >= MIN_POPULATION,
    }
    return result


def table(per_arm: dict[str, dict[int, dict]]) -> str:
    """The per-seed table: accuracy at each validated step, endpoint, drawdown, entropy rise, silenced
    rate, candidates per mini-batch."""
    steps = sorted({int(k) for arm in per_arm.values() for m in arm.values() for k in m["accuracy"]})
    head = ["arm", "seed", *[f"acc@{s} (%)" for s in steps], "endpoint (%)", "drawdown (pts)",
            "ln(H_late/H_ref)", "silenced (%)", "cand/mb"]
    rows = [head]

    def fmt(v: float | None, f: str) -> str:
        return "–" if v is None else format(v, f)

    for arm, seeds in per_arm.items():
        for s, m in sorted(seeds.items()):
            acc = [m["accuracy"].get(str(t)) for t in steps]
            rows.append([arm, str(s), *[fmt(None if v is None else 100 * v, ".1f") for v in acc],
                         fmt(None if m["endpoint"] is None else 100 * m["endpoint"], ".1f"),
                         fmt(None if m["drawdown"] is None else 100 * m["drawdown"], ".1f"),
                         fmt(m["entropy_rise"], "+.3f"),
                         fmt(None if m["silenced_rate"] is None else 100 * m["silenced_rate"], ".3g"),
                         fmt(m["candidates_per_minibatch"], ".1f")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def arm_configs(scale: Scale, arms: tuple[str, ...], sets: list[str]) -> dict[str, Any]:
    """Each arm's config as `stapo train --config BASE --recipe ARM --set ...` builds it (validated:
    a bad override fails here in one line, before any run)."""
    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.train.prepare import method_overrides

    base = preset_path(scale.base)
    out = {}
    for recipe in arms:
        path = preset_path(recipe)
        if path is None:
            raise SystemExit(f"direction: no recipe named {recipe!r} (`stapo recipes` lists them)")
        cap = load_config(base, [s for s in sets if s.startswith("rollout.max_new_tokens=")]).rollout.max_new_tokens
        out[recipe] = load_config(base, [*method_overrides(path, cap), *sets])
    return out


def arms_differ_in(configs: dict[str, Any]) -> list[str]:
    """The keys where arm B and C differ from arm A; refused when any is not a method key (the arms
    must differ only in the weighting)."""
    from stapo.core.fairness import config_differences

    dumps = {k: c.model_dump(mode="json", by_alias=True) for k, c in configs.items()}
    names = list(dumps)
    keys = []
    for other in names[1:]:
        for d in config_differences(dumps[names[0]], dumps[other]):
            if d.confound:
                raise SystemExit(f"direction: arms {names[0]} and {other} differ in {d.key} ({d.base!r} -> {d.other!r}), "
                                 "not only in the method")
            keys.append(f"{other}: {d.key}={d.other!r}")
    return keys


def design_lines(scale: Scale, name: str, arms: tuple[str, ...], seeds: list[int], steps: int,
                 lr: float | None) -> list[str]:
    """The design and the rules, printed before anything runs (and by --dry-run)."""
    lr_txt = f"{lr:g}" if lr is not None else f"the pilot's ({', '.join(f'{x:g}' for x in scale.pilot_lrs)})"
    late = sorted({t for t in range(0, steps, scale.eval_every) if t >= last_third(steps)} | {steps})  # and the last step
    lines = [f"direction ({name}): base config {scale.base}; arms A={arms[0]} B={arms[1]} C={arms[2]}; seeds {seeds}; "
             f"{steps} steps; held-out accuracy every {scale.eval_every} steps; endpoint = mean of the evaluations at "
             f"steps {late}; learning rate {lr_txt}; {len(seeds) * 3} arm runs",
             f"power: with n = {len(seeds)} paired seeds the 95% t interval's half-width is "
             f"{_half_width_factor(len(seeds)):.2f} x the sd of the per-seed differences; a 5-point effect at the paired "
             f"sd of final accuracy measured on this CPU (18-23 points) needs {seeds_needed(0.18, 0.05)}-"
             f"{seeds_needed(0.23, 0.05)} seeds (80% power, two-sided 5%; docs/evaluation.md)",
             "verdict rules, fixed before running:"]
    return lines + [f"  - {r}" for r in RULES]


def _half_width_factor(n: int) -> float:
    """t(0.975, n-1) / sqrt(n): the 95% t interval's half-width in units of the differences' sd."""
    from stapo.evals.compare_stats import t975

    return t975(n - 1) / math.sqrt(n) if n > 1 else math.inf


def dry_run(scale: Scale, name: str, arms: tuple[str, ...], seeds: list[int], steps: int, out: Path,
            sets: list[str], lr: float | None) -> str:
    """The design, the rules and the `stapo train` command of every run (the pilot's first try and
    arm A's first seed stand for their kind); nothing runs."""
    import shlex

    lines = design_lines(scale, name, arms, seeds, steps, lr)
    lines.append("arms differ from A in: " + "; ".join(arms_differ_in(arm_configs(scale, arms, sets))))
    if lr is None:
        pilot_dir = out / "pilot" / f"A-lr{scale.pilot_lrs[0]:g}"
        lines.append("pilot A: " + shlex.join(train_argv(scale.base, arms[0], pilot_dir, [
            *sets, f"trainer.lr={scale.pilot_lrs[0]}", "trainer.seed=0", f"trainer.max_steps={scale.pilot_steps}",
            f"eval.every={scale.pilot_steps}", "logging.dump_tokens_every=1"])))
    lines.append("arm A seed 0: " + shlex.join(train_argv(scale.base, arms[0], out / "A" / "seed0", [
        *sets, f"trainer.lr={lr if lr is not None else 'LR'}", "trainer.seed=0", f"trainer.max_steps={steps}",
        f"eval.every={scale.eval_every}"])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=sorted(SCALES), default="cpu", help="design size (default cpu)")
    ap.add_argument("--smoke", action="store_true", help="--scale smoke: 2 seeds x 2 steps on the tiny model")
    ap.add_argument("--device", default=None, help="trainer.device for every run (cuda for --scale gpu)")
    ap.add_argument("--arms", default=",".join(ARMS), help="recipes A,B,C (default stapo-base,stapo,stapo-random)")
    ap.add_argument("--seeds", type=int, default=None, help="paired seeds per arm (default: the scale's)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per arm run (default: the scale's)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (each with OMP_NUM_THREADS=1)")
    ap.add_argument("--eval-every", type=int, default=None, help="held-out accuracy every this many steps "
                    "(default: the scale's)")
    ap.add_argument("--lr", type=float, default=None, help="skip the pilot: use this rate (the entropy contrast "
                    "then applies when arm A's entropy rises 2x in its runs)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default runs/direction/SCALE)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every run (all arms alike), repeatable")
    ap.add_argument("--dry-run", action="store_true", help="print the design, the rules and the runs' commands; run nothing")
    args = ap.parse_args(argv)
    name = "smoke" if args.smoke else args.scale
    scale = SCALES[name]
    arms = tuple(args.arms.split(","))
    if len(arms) != 3:
        ap.error("--arms takes three recipes: A,B,C")
    seeds = list(range(args.seeds or scale.seeds))
    steps = args.steps or scale.steps
    if args.eval_every:
        scale = replace(scale, eval_every=args.eval_every)
    out = args.out or Path("runs/direction") / name
    sets = [*QUIET, *scale.overrides, *([f"trainer.device={args.device}"] if args.device else []), *args.sets]
    configs = arm_configs(scale, arms, sets)  # one line on a bad override, before any run
    differ = arms_differ_in(configs)
    updates = configs[arms[0]].algorithm.mini_batches * configs[arms[0]].algorithm.ppo_epochs
    if args.dry_run:
        print(dry_run(scale, name, arms, seeds, steps, out, sets, args.lr))
        return 0
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"direction: {out} is not empty: give another --out (the runs of one design stay together)")
    t_start = time.time()

    def log(msg: str) -> None:
        print(msg, flush=True)

    for line in design_lines(scale, name, arms, seeds, steps, args.lr):
        log(line)
    log("arms differ from A in: " + "; ".join(differ))
    out.mkdir(parents=True, exist_ok=True)

    if args.lr is None:
        log("pilot:")
        pil = pilot(scale, arms, out, sets, args.jobs, log)
        for check, ok in pil["checks"].items():
            log(f"  {'ok  ' if ok else 'FAIL'} {check}")
        log(f"  start accuracy {pil['start_accuracy']}, learning rate {pil['lr']:g}, B's silenced rate "
            f"{pil['b_silenced_rate']}, mechanism {pil['mechanism']}")
        if scale.enforce_pilot and not pil["checks"]["start accuracy in [15%, 60%]"]:
            raise SystemExit("direction: the task's start accuracy is outside [15%, 60%]: change the task with --set "
                             "data.arithmetic.* (or --lr to skip the pilot)")
        if scale.enforce_pilot and not pil["checks"]["arm B silences a non-zero share"]:
            raise SystemExit("direction: void: the rule silences nothing at this setup (`stapo calibrate` measures it)")
        lr, entropy_applies = pil["lr"], pil["entropy_rises"]
        if not entropy_applies:
            log("the baseline's entropy did not rise 2x in the pilot: the entropy contrast is not applicable "
                "(never 'holds'); the verdict rests on accuracy B - C")
    else:
        pil, lr, entropy_applies = None, args.lr, None

    def arm_jobs(arm: str, label: str) -> list[Job]:
        return [Job(f"{label} seed {s}", out / label / f"seed{s}", train_argv(scale.base, arm, out / label / f"seed{s}", [
            *sets, f"trainer.lr={lr}", f"trainer.seed={s}", f"trainer.max_steps={steps}",
            f"eval.every={scale.eval_every}"])) for s in seeds]

    log("arms A, B and C:")
    # seed by seed, A beside B beside C: a run cut short leaves whole triples
    run_jobs([job for triple in zip(*(arm_jobs(arm, lab) for arm, lab in zip(arms, "ABC", strict=True)), strict=True)
              for job in triple], args.jobs, log)
    per_arm = {lab: {s: run_metrics(out / lab / f"seed{s}", scale.ref_step, steps, updates) for s in seeds}
               for lab in "ABC"}
    if entropy_applies is None:  # --lr: arm A's own runs say whether the baseline's entropy rose
        rises = [m["entropy_rise"] for m in per_arm["A"].values() if m["entropy_rise"] is not None]
        entropy_applies = bool(rises) and statistics.mean(rises) > math.log(2)
        log(f"arm A's entropy {'rose' if entropy_applies else 'did not rise'} 2x (mean ln(H_late/H_ref) over seeds): "
            f"the entropy contrast is {'deciding' if entropy_applies else 'not applicable'}")
    word, reasons, cs = verdict(per_arm, scale.ref_step, entropy_applies=entropy_applies)
    small = low_populations(per_arm)
    if small:
        reasons.append(f"fewer than {MIN_POPULATION} candidates per mini-batch (median step) in: " + ", ".join(small))

    from stapo.evals.compare import compare_runs

    labels = [lab for lab in per_arm for _ in seeds]
    dirs = [out / lab / f"seed{s}" for lab in per_arm for s in seeds]
    compare_runs(dirs, out_dir=out / "compare", labels=[f"{lab}-s{s}" for lab in per_arm for s in seeds], groups=labels)
    wall = time.time() - t_start
    record = {"design": asdict(Design(name, arms, seeds, steps, lr, sets)), "rules": list(RULES), "pilot": pil,
              "per_seed": {lab: {str(s): m for s, m in v.items()} for lab, v in per_arm.items()},
              "entropy_applies": entropy_applies, "contrasts": [c.record() for c in cs],
              "low_populations": small, "verdict": word, "reasons": reasons, "wall_s": wall}
    (out / "direction.json").write_text(json.dumps(record, indent=2))
    log(f"\nper seed (A = {arms[0]}, B = {arms[1]}, C = {arms[2]}):")
    log(table(per_arm))
    log("\ncontrasts (paired over seeds, 95% t interval):")
    for r in reasons:
        log(f"  {r}")
    log(f"\nverdict: {word.upper()}")
    log(f"wall {wall:.0f} s; report {out / 'compare' / 'report.html'}; record {out / 'direction.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
