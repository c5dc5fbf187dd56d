"""Time per RL step with and without each stability layer (Goldilocks, DEEP-GRPO, MASPO, all three).

Every variant is STAPO (S2T token weighting, clip-higher) on the same preset, seeds and step count;
one layer switched on at a time, then all. Variants run round-robin (``--repeats`` rounds) so that
load from other jobs on a shared machine spreads over all of them; the reported ratio is the median
step time of a variant over the baseline's, in the same run. Step 1 is dropped (first-call warm-up).

DEEP-GRPO's budget mirrors the recipe's (configs/stapo-deep.yaml: 64 pivots x 8 branches over
256 prompts x 8 rollouts = 25% extra rollouts): here ``max_pivots`` x ``k_branches`` = 25% of
``prompts_per_step`` x ``n``. Extra *tokens* are fewer, since branches only generate continuations.

    python benchmarks/stability_layers.py                     # tiny random model (seconds per run)
    python benchmarks/stability_layers.py --preset demo --steps 4 --repeats 2   # SmolLM2-135M demo model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

QUIET = ["logging.live=false", "logging.tensorboard=false", "logging.dump_tokens_every=0",
         "checkpoint.every=0", "checkpoint.export_hf=false", "eval.every=0", "data.val_size=0"]
TINY = ["rollout.prompts_per_step=4", "rollout.n=8", "rollout.max_new_tokens=32",
        "algorithm.overlong.enabled=true", "algorithm.overlong.buffer=31", "trainer.micro_batch_size=32",
        "reward.workers=1"]


def variants(prompts: int, n: int) -> dict[str, list[str]]:
    k = 8
    pivots = max(1, round(0.25 * prompts * n / k))
    deep = ["algorithm.deep_grpo.enabled=true", f"algorithm.deep_grpo.k_branches={k}",
            f"algorithm.deep_grpo.max_pivots={pivots}"]
    gold = ["data.sampler=goldilocks", "data.goldilocks.pool_factor=4"]
    maspo = ["algorithm.policy_loss=maspo"]
    return {"stapo": [], "+goldilocks": gold, "+deep_grpo": deep, "+maspo": maspo, "+stack": gold + deep + maspo}


def run_once(preset: str, overrides: list[str], steps: int) -> list[dict]:
    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.tracking import read_jsonl
    from stapo.core.train.loop import train
    from stapo.core.train.run import Run

    cfg = load_config(preset_path(preset), [*QUIET, f"trainer.max_steps={steps}", *overrides])
    with tempfile.TemporaryDirectory() as d:
        train(Run.build(cfg, Path(d), log=lambda m: None))
        return read_jsonl(Path(d) / "metrics.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="config preset: tiny (random model) or demo (SmolLM2-135M)")
    ap.add_argument("--steps", type=int, default=6, help="RL steps per run (step 1 is not timed)")
    ap.add_argument("--repeats", type=int, default=3, help="round-robin rounds over the variants")
    ap.add_argument("--json", type=Path, help="also write the raw per-step rows here")
    args = ap.parse_args()
    base = TINY if args.preset == "tiny" else []
    from stapo.configs import preset_path
    from stapo.core.config import load_config

    c = load_config(preset_path(args.preset), base)
    vs = variants(c.rollout.prompts_per_step, c.rollout.n)
    rows: dict[str, list[dict]] = {v: [] for v in vs}
    load_before = os.getloadavg()[0]
    t0 = time.time()
    for _ in range(args.repeats):
        for name, over in vs.items():
            rows[name] += [r for r in run_once(args.preset, [*base, *over], args.steps) if r["step"] > 1]
    load_after = os.getloadavg()[0]

    def med(name: str, key: str) -> float:
        xs = [r[key] for r in rows[name] if r.get(key) is not None]
        return statistics.median(xs) if xs else float("nan")

    base_t = med("stapo", "time/step_s")
    print(f"preset={args.preset} steps={args.steps} (timed {args.steps - 1}) repeats={args.repeats} "
          f"prompts x n = {c.rollout.prompts_per_step} x {c.rollout.n}; {platform.machine()}, "
          f"{os.cpu_count()} cores, Python {sys.version.split()[0]}; load {load_before:.1f} -> {load_after:.1f}; "
          f"{time.time() - t0:.0f} s")
    print("| variant | step s (median) | ratio | rollout s | train s | teacher s | branch rollout s "
          "| extra rollouts | extra tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in vs:
        branches = med(name, "deep/branches")
        extra_rollouts = branches / (c.rollout.prompts_per_step * c.rollout.n) if branches == branches else 0.0
        print(f"| {name} | {med(name, 'time/step_s'):.3f} | **{med(name, 'time/step_s') / base_t:.2f}x** | "
              f"{med(name, 'time/rollout_s'):.3f} | {med(name, 'time/train_s'):.3f} | "
              f"{med(name, 'time/sampler_s'):.4f} | {med(name, 'time/deep_rollout_s'):.3f} | "
              f"{extra_rollouts:.0%} | {med(name, 'deep/extra_token_frac'):.0%} |".replace("nan%", "-").replace("nan", "-"))
    if args.json:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
