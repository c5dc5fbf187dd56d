"""Does STAPO's silencing move a run the paper's way? The smallest honest version of its comparison.

The paper's claim (arXiv 2602.15620v1, Sec. 4): with everything else equal, silencing the spurious
tokens (S2T) keeps the policy's entropy stable and ends more accurate than the same objective
without it, and silencing as many of the same candidates at random lands in between. This harness
tests that claim in small form, as one command that trains, evaluates and prints its verdict:

1. **Pilot** (arm A, seed 0): greedy held-out accuracy at step 0 must lie in [15%, 60%] (a task the
   model can learn but has not learnt); the baseline must move its mean entropy by more than 2x
   either way within ``pilot_steps`` (the learning rate is raised through ``pilot_lrs`` until it
   does, then frozen for every arm; if it never does, the run can only test "no harm"); a short
   arm-B run must silence a non-zero share (otherwise B is the baseline and the test is void). The
   baseline's token dumps give the **mechanism check**: the share of the logit-gradient norm
   (``|A| sqrt(1 - 2p + sum_q q^2)`` per token, exact at ratio 1) that the paper's rule would
   silence, against a random same-size set of the same candidates.
2. **Arms**, identical but for the token weighting (each run is ``stapo train --config BASE
   --recipe ARM``: the recipe's method keys on one base config, `stapo recipes matched`): A =
   ``stapo-base``, B = ``stapo``, and C = ``stapo-random`` only if B beats A; the same seeds in
   every arm (``trainer.seed``: data order and initial sampling; the held-out split stays fixed).
3. **Metrics** per run: held-out accuracy (greedy) at the steps validation runs; drawdown (best
   minus final accuracy); entropy drift ``max_t |ln(H_t / H_ref)|`` over steps t >= the reference
   step (5, or 1 in short runs); the silenced rate (silenced (token, epoch) pairs / valid tokens).
4. **Verdict**, decided before running (printed before the first run): see :data:`RULES`.

Each run is a `stapo train` process with ``OMP_NUM_THREADS=1``, ``--jobs`` (2) at a time. The run
dirs, ``direction.json`` (design, pilot, per-seed table, verdict) and a `stapo compare` report over
the arms (mean and t interval over seeds, paired differences) land in ``--out``.

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

RULES = (
    "void: arm B silenced no token over the whole run (its update is arm A's).",
    "holds: B's final held-out accuracy is above A's in every paired seed, and B's entropy drift is lower "
    "in at least 3/4 of them.",
    "refuted: B's final accuracy is below A's in at least 3/4 of the paired seeds, each time by more than "
    "A's seed-to-seed standard deviation of final accuracy.",
    "inconclusive: anything else.",
    "no-harm scope: when the baseline never moved its entropy 2x in the pilot, the harness can only test "
    "that S2T does no harm: 'holds' then reads 'no harm', and 'refuted' stays 'refuted'.",
    "arm C (random silencing of as many candidates) runs only when B beats A: B above A in at least 3/4 "
    "of the seeds; the table says whether C lands between A and B.",
)
"""The decision rules, fixed before any run and printed with the results."""


@dataclass(frozen=True)
class Scale:
    """One size of the design: the base config, the task and the schedule every arm shares."""

    base: str  # preset the arms' recipes apply their method keys to
    seeds: int
    steps: int
    eval_every: int  # held-out accuracy (greedy) at 0, eval_every, ..., steps
    pilot_steps: int
    pilot_b_steps: int  # arm B's short run that checks the rule silences something
    pilot_lrs: tuple[float, ...]
    ref_step: int  # entropy drift is measured against this step's entropy
    overrides: tuple[str, ...] = ()
    enforce_pilot: bool = True


# The task: two operations (a + b - c) on one-digit numbers (the generator draws every operand with
# the same digit count; `--set data.arithmetic.digits=2` for two-digit ones, which the pilot's
# start-accuracy check may then refuse), the paper's boxed instruction, 48 new tokens; 4 prompts x 8 samples, 4 mini-batches, clip 0.2 / 0.28 and token-mean come from the
# recipes (method keys), +-1 reward and the rest from here. Held-out: 200 problems, greedy.
TASK = ("data.source=arithmetic", "data.template=boxed", "data.arithmetic.digits=1", "data.arithmetic.num_ops=2",
        "data.arithmetic.ops=[+,-]", "data.arithmetic.num_problems=2000", "data.val_size=200",
        "eval.val_temperature=0.0", "reward.scale.correct=1.0", "reward.scale.wrong=-1.0",
        "algorithm.mini_batches=4", "rollout.temperature=1.0")
QUIET = ("logging.live=false", "logging.tensorboard=false", "checkpoint.every=0", "checkpoint.export_hf=false")

SCALES: dict[str, Scale] = {
    "cpu": Scale(base="demo", seeds=4, steps=50, eval_every=25, pilot_steps=30, pilot_b_steps=5,
                 pilot_lrs=(2e-5, 6e-5, 2e-4), ref_step=5,
                 overrides=(*TASK, "rollout.prompts_per_step=4", "rollout.n=8", "rollout.max_new_tokens=48",
                            "trainer.device=cpu")),
    "gpu": Scale(base="demo", seeds=4, steps=60, eval_every=30, pilot_steps=30, pilot_b_steps=5,
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


def entropy_drift(entropy: dict[int, float], ref_step: int) -> float | None:
    """max over steps t >= ref of |ln(H_t / H_ref)|; None without a positive entropy at the reference."""
    ref = entropy.get(ref_step)
    if ref is None or ref <= 0:
        return None
    later = [h for t, h in entropy.items() if t >= ref_step and h > 0]
    return max(abs(math.log(h / ref)) for h in later)


def run_metrics(run_dir: Path, ref_step: int) -> dict[str, Any]:
    """Held-out accuracy by step, final / best / drawdown, entropy drift and silenced rate of one run."""
    from stapo.evals.compare import load_run, silenced_rate

    val = {int(r["step"]): float(r["accuracy"]) for r in read_jsonl(run_dir / "val.jsonl") if r.get("accuracy") is not None}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    entropy = {int(r["step"]): float(r["entropy/mean"]) for r in metrics if r.get("entropy/mean") is not None}
    final = val[max(val)] if val else None
    best = max(val.values()) if val else None
    return {
        "accuracy": {str(k): v for k, v in sorted(val.items())},
        "final": final, "best": best, "drawdown": None if final is None else best - final,
        "entropy_drift": entropy_drift(entropy, ref_step),
        "silenced_rate": silenced_rate(load_run(run_dir)),
        "steps": len(metrics),
    }


# ----------------------------------------------------------------------------- verdict


def _at_least(share: float, n: int) -> int:
    return math.ceil(share * n - 1e-9)


def b_beats_a(a: dict[int, dict], b: dict[int, dict]) -> bool:
    """B's final accuracy above A's in at least 3/4 of the paired seeds (the bar for running arm C)."""
    seeds = [s for s in a if s in b]
    wins = sum(1 for s in seeds if b[s]["final"] > a[s]["final"])
    return bool(seeds) and wins >= _at_least(0.75, len(seeds))


def verdict(a: dict[int, dict], b: dict[int, dict], *, no_harm_only: bool = False) -> tuple[str, list[str]]:
    """(verdict, reasons) by :data:`RULES` from the per-seed metrics of arms A and B (seed -> metrics)."""
    seeds = sorted(s for s in a if s in b)
    n = len(seeds)
    if not seeds:
        return "inconclusive", ["no paired seeds"]
    if all((b[s]["silenced_rate"] or 0.0) == 0.0 for s in seeds):
        return "void", ["arm B silenced no token: its update equals arm A's"]
    wins = sum(1 for s in seeds if b[s]["final"] > a[s]["final"])
    calmer = sum(1 for s in seeds if None not in (a[s]["entropy_drift"], b[s]["entropy_drift"])
                 and b[s]["entropy_drift"] < a[s]["entropy_drift"])
    finals_a = [a[s]["final"] for s in seeds]
    sd_a = statistics.stdev(finals_a) if n > 1 else 0.0
    worse = sum(1 for s in seeds if a[s]["final"] - b[s]["final"] > sd_a)
    reasons = [f"B above A in {wins}/{n} seeds (final held-out accuracy)",
               f"B's entropy drift lower in {calmer}/{n}",
               f"B below A by more than A's seed-to-seed sd ({100 * sd_a:.1f} points) in {worse}/{n}"]
    if worse >= _at_least(0.75, n):
        return "refuted", reasons
    if wins == n and calmer >= _at_least(0.75, n):
        return ("no harm" if no_harm_only else "holds"), reasons
    return "inconclusive", reasons


# ----------------------------------------------------------------------------- mechanism check


def mechanism_check(run_dir: Path, *, tau_p: float, q: float, seed: int = 0) -> dict[str, Any]:
    """From a baseline run's token dumps: the share of the summed per-token logit-gradient norm
    ``|A| sqrt(max(0, 1 - 2p + sum_q q^2))`` that the paper's rule would silence in each dumped step
    (per mini-batch, as the update: candidates A > 0 and p < tau_p, silenced below the q-th quantile
    of the mini-batch's candidate entropies), against a random same-size set of the same
    mini-batch's candidates. Dumps must hold every sequence (``logging.dump_max_sequences`` at least
    the batch). One-step entropy changes need a second forward pass and are not measured here."""
    rng = random.Random(seed)
    silenced_share, random_share, counted, tokens = [], [], 0, 0
    for path in sorted((run_dir / "dumps").glob("step_*.json")):
        dump = json.loads(path.read_text())
        by_mb: dict[int, list[tuple[float, float]]] = {}  # mini-batch -> candidates' (entropy, gradient norm)
        total = 0.0
        for seq in dump.get("sequences", []):
            a = float(seq["advantage"])
            for p, h, s2 in zip(seq["prob"], seq["entropy"], seq["sum_q2"], strict=True):
                g = abs(a) * math.sqrt(max(0.0, 1 - 2 * p + s2))
                total += g
                tokens += 1
                if a > 0 and p < tau_p:
                    by_mb.setdefault(int(seq.get("minibatch", 0)), []).append((h, g))
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
            "tau_p": tau_p, "q": q}


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
    """Start accuracy, the learning rate at which the baseline destabilises (or none), B's silenced
    share and the mechanism check; the checks are enforced unless the scale says not to."""
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
        m = run_metrics(a_dir, 1)
        result["start_accuracy"] = m["accuracy"].get("0")
        result["tries"].append({"lr": lr, "entropy_drift": m["entropy_drift"]})
        result["lr"], result["run"] = lr, str(a_dir)
        if (m["entropy_drift"] or 0.0) > math.log(2):
            result["destabilises"] = True
            break
    else:
        result["destabilises"] = False
    result["mechanism"] = mechanism_check(Path(result["run"]), tau_p=tau_p, q=q)
    acc = result["start_accuracy"]
    result["checks"] = {
        "start accuracy in [15%, 60%]": acc is not None and 0.15 <= acc <= 0.60,
        "arm B silences a non-zero share": (result["b_silenced_rate"] or 0.0) > 0,
        "baseline entropy moves > 2x": result["destabilises"],
    }
    return result


def table(per_arm: dict[str, dict[int, dict]]) -> str:
    """The per-seed table: accuracy at each validated step, drawdown, entropy drift, silenced rate."""
    steps = sorted({int(k) for arm in per_arm.values() for m in arm.values() for k in m["accuracy"]})
    head = ["arm", "seed", *[f"acc@{s} (%)" for s in steps], "drawdown (pts)", "entropy drift", "silenced (%)"]
    rows = [head]
    for arm, seeds in per_arm.items():
        for s, m in sorted(seeds.items()):
            acc = [m["accuracy"].get(str(t)) for t in steps]
            rows.append([arm, str(s), *[("–" if v is None else f"{100 * v:.1f}") for v in acc],
                         "–" if m["drawdown"] is None else f"{100 * m['drawdown']:.1f}",
                         "–" if m["entropy_drift"] is None else f"{m['entropy_drift']:.3f}",
                         "–" if m["silenced_rate"] is None else f"{100 * m['silenced_rate']:.3g}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def arm_configs(scale: Scale, arms: tuple[str, ...], sets: list[str]) -> dict[str, Any]:
    """Each arm's config as `stapo train --config BASE --recipe ARM --set ...` builds it (validated:
    a bad override fails here in one line, before any run)."""
    from stapo.cli.train import method_overrides
    from stapo.configs import preset_path
    from stapo.core.config import load_config

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


def dry_run(scale: Scale, name: str, arms: tuple[str, ...], seeds: list[int], steps: int, out: Path,
            sets: list[str], lr: float | None) -> str:
    """The design, the rules and the `stapo train` command of every run (the pilot's first try and
    arm A's first seed stand for their kind); nothing runs."""
    import shlex

    lr_txt = f"{lr:g}" if lr is not None else f"the pilot's ({', '.join(f'{x:g}' for x in scale.pilot_lrs)})"
    lines = [f"direction ({name}): base config {scale.base}; arms A={arms[0]} B={arms[1]} C={arms[2]} (C only if B "
             f"beats A); seeds {seeds}; {steps} steps; held-out accuracy every {scale.eval_every} steps; "
             f"learning rate {lr_txt}; {len(seeds) * 2} arm runs (+{len(seeds)} for C)", "rules:"]
    lines += [f"  - {r}" for r in RULES]
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
    ap.add_argument("--lr", type=float, default=None, help="skip the learning-rate search: use this rate")
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
    differ = arms_differ_in(arm_configs(scale, arms, sets))  # one line on a bad override, before any run
    if args.dry_run:
        print(dry_run(scale, name, arms, seeds, steps, out, sets, args.lr))
        return 0
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"direction: {out} is not empty: give another --out (the runs of one design stay together)")
    t_start = time.time()

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(f"direction ({name}): arms A={arms[0]} B={arms[1]} C={arms[2]}, seeds {seeds}, {steps} steps, base "
        f"config {scale.base}\nverdict rules, fixed before running:")
    for rule in RULES:
        log(f"  - {rule}")
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
        lr, no_harm_only = pil["lr"], not pil["destabilises"]
    else:
        pil, lr, no_harm_only = None, args.lr, False
    if no_harm_only:
        log("the baseline never moved its entropy 2x: this run can only test 'no harm'")

    def arm_jobs(arm: str, label: str) -> list[Job]:
        return [Job(f"{label} seed {s}", out / label / f"seed{s}", train_argv(scale.base, arm, out / label / f"seed{s}", [
            *sets, f"trainer.lr={lr}", f"trainer.seed={s}", f"trainer.max_steps={steps}",
            f"eval.every={scale.eval_every}"])) for s in seeds]

    log("arms A and B:")
    # seed by seed, A beside B: a run cut short leaves whole pairs
    run_jobs([job for pair in zip(arm_jobs(arms[0], "A"), arm_jobs(arms[1], "B"), strict=True) for job in pair],
             args.jobs, log)
    per_arm = {lab: {s: run_metrics(out / lab / f"seed{s}", scale.ref_step) for s in seeds} for lab in ("A", "B")}
    if b_beats_a(per_arm["A"], per_arm["B"]):
        log("B beats A: arm C (random silencing):")
        run_jobs(arm_jobs(arms[2], "C"), args.jobs, log)
        per_arm["C"] = {s: run_metrics(out / "C" / f"seed{s}", scale.ref_step) for s in seeds}
    word, reasons = verdict(per_arm["A"], per_arm["B"], no_harm_only=no_harm_only)
    between = None
    if "C" in per_arm:
        mean = {k: statistics.mean(m["final"] for m in v.values()) for k, v in per_arm.items()}
        between = mean["A"] < mean["C"] < mean["B"]
        reasons.append(f"C (random) lands {'between A and B' if between else 'outside A..B'} in mean final accuracy")

    from stapo.evals.compare import compare_runs

    labels = [lab for lab in per_arm for _ in seeds]
    dirs = [out / lab / f"seed{s}" for lab in per_arm for s in seeds]
    compare_runs(dirs, out_dir=out / "compare", labels=[f"{lab}-s{s}" for lab in per_arm for s in seeds], groups=labels)
    wall = time.time() - t_start
    record = {"design": asdict(Design(name, arms, seeds, steps, lr, sets)), "rules": list(RULES), "pilot": pil,
              "per_seed": {lab: {str(s): m for s, m in v.items()} for lab, v in per_arm.items()},
              "verdict": word, "reasons": reasons, "c_between": between, "no_harm_only": no_harm_only, "wall_s": wall}
    (out / "direction.json").write_text(json.dumps(record, indent=2))
    log("\nper seed (A = " + arms[0] + ", B = " + arms[1] + (", C = " + arms[2] if "C" in per_arm else "") + "):")
    log(table(per_arm))
    log(f"\nverdict: {word.upper()}  (" + "; ".join(reasons) + ")")
    log(f"wall {wall:.0f} s; report {out / 'compare' / 'report.html'}; record {out / 'direction.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
