"""Asynchronous rollouts vs the synchronous loop: time per step and generated tokens per second.

Both runs use the demo's shape (configs/demo.yaml: 4 prompts x 8 samples of single-digit arithmetic,
hf engine, torch backend) on a tiny random policy so the benchmark finishes in minutes on CPU, with
``rollout.ignore_eos`` so both runs generate exactly the same number of tokens. The async run uses
``rollout.async.max_staleness`` (default 1: verl's one-step-off-policy) and VCPO's ESS-scaled LR.

Reported per run: median ``time/step_s`` over the steps after ``--skip`` (the first steps include the
producer's start-up and, with k >= 1, a step with nothing to overlap), generated tokens per second
over those steps (global response tokens / wall time of the steps), the learner's median wait for
rollouts, and the on/off ratios. Runs alternate off/on ``--rounds`` times in one process; the table
shows the median of each. So that a shared machine's share of CPU can be told apart from overlap,
each run also reports the CPU seconds its processes used per step (this process and its reaped
children: the producer and the grader workers) and the 1-minute load average before and after it.

    python benchmarks/async_rollouts.py                       # tiny policy, 8 steps, 2 rounds
    python benchmarks/async_rollouts.py --hidden 256 --layers 4 --steps 10 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def run_once(args: argparse.Namespace, async_on: bool, root: Path, tag: str) -> dict[str, float]:
    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.tracking import read_jsonl
    from stapo.core.train.loop import train
    from stapo.core.train.run import Run

    tiny = {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": 4,
            "intermediate_size": 2 * args.hidden, "seed": 0}
    over = [
        "model.name_or_path=tiny-random", f"model.tiny={tiny}", "model.dtype=float32", "trainer.device=cpu",
        f"trainer.max_steps={args.steps}", f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.ignore_eos=true",
        "data.val_size=0", "checkpoint.every=0", "checkpoint.export_hf=false", "logging.dump_tokens_every=0",
        "logging.live=false", "logging.tensorboard=false", f"reward.workers={args.reward_workers}",
    ]
    if async_on:
        over += ["rollout.async.enabled=true", f"rollout.async.max_staleness={args.max_staleness}",
                 "algorithm.off_policy.ess_lr_scaling=true"]
    cfg = load_config(preset_path("demo"), over)
    run_dir = root / tag
    load0 = os.getloadavg()[0]
    cpu0 = _cpu_s()
    t0 = time.time()
    train(Run.build(cfg, run_dir, log=lambda m: None))
    wall = time.time() - t0
    cpu = _cpu_s() - cpu0
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > args.skip]
    step_s = [r["time/step_s"] for r in rows]
    tokens = sum(r["response_length/mean"] * args.prompts * args.n for r in rows)
    return {
        "step_s": statistics.median(step_s),
        "tokens_per_s": tokens / sum(step_s),
        "wait_s": statistics.median([r.get("async/wait_s", r.get("time/rollout_s", 0.0)) for r in rows]),
        "rollout_s": statistics.median([r["time/rollout_s"] for r in rows]),
        "train_s": statistics.median([r["time/train_s"] for r in rows]),
        "wall_s": wall,
        "cpu_s_per_step": cpu / args.steps,  # whole run (start-up included) / steps
        "load_before": load0,
        "load_after": os.getloadavg()[0],
    }


def _cpu_s() -> float:
    """User + system CPU seconds of this process and of its children that have been waited for."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="steps left out of the statistics (start-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--reward-workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the learner (the producer inherits it); 0: torch's default. On a "
                         "shared, loaded machine more than one thread per process can be many times slower")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    args.prompts, args.n = 4, 8  # configs/demo.yaml
    res: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("off", "on"):
                res[mode].append(run_once(args, mode == "on", Path(tmp), f"{mode}{r}"))
                print(f"round {r} async {mode}: {res[mode][-1]}", flush=True)
    med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in res.items()}
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible; "
          f"tiny-random hidden {args.hidden} x {args.layers} layers, 4 prompts x 8 samples x "
          f"{args.max_new_tokens} tokens, steps {args.skip + 1}-{args.steps}, {args.rounds} rounds (medians), "
          f"torch threads {args.threads or 'default'}")
    print("| async | time/step (s) | generated tok/s | learner waits for rollouts (s) | rollout (s) | update (s) "
          "| CPU s/step (all processes) | load avg before -> after |")
    print("|---|---|---|---|---|---|---|---|")
    for m in ("off", "on"):
        d = med[m]
        label = "off" if m == "off" else f"on (k={args.max_staleness})"
        print(f"| {label} | {d['step_s']:.2f} | {d['tokens_per_s']:.1f} | {d['wait_s']:.2f} | {d['rollout_s']:.2f} | "
              f"{d['train_s']:.2f} | {d['cpu_s_per_step']:.1f} | {d['load_before']:.1f} -> {d['load_after']:.1f} |")
    print(f"| on/off ratio | {med['on']['step_s'] / med['off']['step_s']:.2f}x | "
          f"{med['on']['tokens_per_s'] / med['off']['tokens_per_s']:.2f}x | | | | "
          f"{med['on']['cpu_s_per_step'] / med['off']['cpu_s_per_step']:.2f}x | |")


if __name__ == "__main__":
    main()
