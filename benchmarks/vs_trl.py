"""Step time of stapo's RL loop against TRL's GRPOTrainer, side by side on the same work.

Both sides get the same policy (loaded by stapo's ``load_policy``), the same prompts in the same
order (stapo's seeded prompt stream, handed to TRL as a non-shuffled conversational dataset, so both
render them through the same chat template), the same sampler (T = 1, top-p 1, top-k off, no
repetition penalty), the same number of new tokens, the same optimizer (AdamW, constant LR, same
betas / weight decay / clipping), the same micro-batching (``--micro`` rows per forward, gradient
accumulation to one optimizer step per batch), no KL, the same DAPO clip-higher PPO loss with
token-level aggregation, and the same grader (stapo's ``RewardFunction`` over the local math-verify
pool; TRL calls it as its reward function). TRL runs with ``gradient_checkpointing=False`` and
``bf16=False`` on CPU (its defaults are True/True; stapo's CPU demo uses neither).

Each (side, round) runs in a fresh subprocess, sides alternating (and the order flipped every
round), so machine load drifts over both sides alike; ratios are reported per round. Per step:

- ``gen``   : sampling (stapo: ``time/rollout_s``; TRL: time inside ``model.generate``);
- ``grade`` : the grader (both: time inside the same ``RewardFunction`` call);
- ``stats`` : everything between sampling and the update's forward: tokenization, old log-probs /
              entropies, advantages, token weights (stapo: ``time/stats_s``; TRL: the rest of
              ``_generate_and_score_completions``);
- ``update``: the gradient forwards, backwards and the optimizer step (the rest of the step);
- ``tokens``: generated tokens in the step (early EOS differs between runs, so time per generated
              token is reported too).

The first step of each run is a warm-up and is not counted. Peak memory is the child's peak
resident set (``ru_maxrss``, includes the model and Python) on CPU, ``torch.cuda.max_memory_allocated``
on CUDA.

    python benchmarks/vs_trl.py                               # demo workload, 2 rounds x 4 steps each
    python benchmarks/vs_trl.py --rounds 3 --steps 5 --sides stapo,trl,stapo-baseline
    python benchmarks/vs_trl.py --device cuda --model Qwen/Qwen3-1.7B ...   # see benchmarks/gpu_suite.sh

``stapo-baseline`` is stapo with its speed-ups switched off (the separate old-log-prob pass, no
prompt-prefix sharing in generation or training): what those speed-ups buy, measured in the same run. ``stapo-none`` is stapo
with the ``none`` token weighting (DAPO): against ``stapo`` it gives the S2T mask's overhead. TRL is an optional benchmark
dependency (``pip install "trl==1.16.*"`` or ``pip install -e ".[bench]"``), never a runtime one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SIDES = ("stapo", "trl", "stapo-baseline", "stapo-none")

# stapo settings that turn the step-time speed-ups off (what "stapo-baseline" runs).
BASELINE_OVERRIDES = ["trainer.share_prompt_prefix=false",
                      "rollout.share_prefix=false"]


def _peak_mem_mib(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _stapo_cfg(args: argparse.Namespace, extra: list[str]) -> Any:
    from stapo.core.config import load_config

    overrides = [
        f"model.name_or_path={args.model}",
        f"model.dtype={args.dtype}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.batch_size={args.prompts * args.n}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        f"trainer.micro_batch_size={args.micro}",
        f"trainer.max_steps={args.steps}",
        f"trainer.lr={args.lr}",
        f"trainer.device={args.device}",
        "trainer.lr_schedule=constant",
        "trainer.warmup_steps=0",
        "trainer.weight_decay=0.0",
        "trainer.max_grad_norm=1.0",
        f"algorithm.token_weighting={args.weighting}",
        "algorithm.kl_coef=0.0",
        "algorithm.ppo_epochs=1",
        "algorithm.mini_batches=1",
        "data.val_size=0",
        "eval.every=0",
        "checkpoint.every=0",
        "logging.dump_tokens_every=0",
        "logging.live=false",
    ]
    if args.force_length:
        overrides.append("rollout.ignore_eos=true")
    if args.gradient_checkpointing:
        overrides.append("model.gradient_checkpointing=true")
    return load_config(HERE.parent / "configs" / "demo.yaml", overrides + extra)


def _step_prompts(cfg: Any, tokenizer: Any, steps: int) -> list[Any]:
    """The prompt records stapo's loop uses for steps 1..steps, in order."""
    from stapo.core.task.data import load_prompts
    from stapo.core.task.sampler import prompts_for_step

    train, _ = load_prompts(cfg.data, tokenizer)
    out = []
    for step in range(1, steps + 1):
        out += [train[i] for i in prompts_for_step(len(train), step, cfg.rollout.prompts_per_step, cfg.data.seed)]
    return out


def run_stapo(args: argparse.Namespace, baseline: bool) -> list[dict[str, float]]:
    from stapo.core.train.loop import train
    from stapo.core.train.run import Run

    cfg = _stapo_cfg(args, BASELINE_OVERRIDES if baseline else [])
    with tempfile.TemporaryDirectory(prefix="vs_trl_stapo_") as tmp:
        train(Run.build(cfg, Path(tmp), log=lambda m: None))
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = []
    for r in rows:
        stats = r.get("time/stats_s", 0.0)
        out.append({
            "step": r["step"],
            "total": r["time/step_s"],
            "gen": r["time/rollout_s"],
            "grade": r["time/reward_s"],
            "stats": stats,
            "update": r["time/train_s"] - stats,
            "tokens": r["response_length/mean"] * args.prompts * args.n,
        })
    return out


class _Clock:
    """Accumulates time spent inside wrapped callables."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}

    def wrap(self, key: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        t, self.t = self.t, {}
        return t


def run_trl(args: argparse.Namespace) -> list[dict[str, float]]:
    try:
        import trl  # noqa: F401
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        raise SystemExit(
            'vs_trl: TRL is not installed. It is a benchmark-only dependency: pip install "trl==1.16.*" '
            '(or pip install -e ".[bench]"), then run again; or pass --sides stapo,stapo-baseline.'
        ) from None
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from stapo.core.task.rewards import RewardFunction
    from stapo.core.trainer.models import load_policy

    cfg = _stapo_cfg(args, [])
    torch.manual_seed(cfg.trainer.seed)
    model, tok = load_policy(cfg.model, device=args.device)
    model.float() if args.dtype == "float32" else None
    recs = _step_prompts(cfg, tok, args.steps)
    ds = Dataset.from_list([
        {"prompt": [{"role": "user", "content": r.prompt}], "gold": r.answer} for r in recs
    ])
    grader = RewardFunction(cfg.reward)
    clock = _Clock()
    tokens: list[int] = []

    def reward(completions: list[Any], gold: list[str], completion_ids: list[list[int]], **_: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        tokens.append(sum(len(c) for c in completion_ids))
        t0 = time.perf_counter()
        graded = grader(texts, gold)
        clock.t["grade"] = clock.t.get("grade", 0.0) + time.perf_counter() - t0
        return [float(x) for x in graded.rewards]

    out_dir = tempfile.mkdtemp(prefix="vs_trl_trl_")
    # HF generate has no ignore_eos: min_new_tokens = max suppresses EOS until the last token
    gen_kwargs = {"min_new_tokens": args.max_new_tokens} if args.force_length else None
    conf = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.prompts * args.n // args.micro,
        num_generations=args.n,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dapo",
        epsilon=cfg.algorithm.eps_low,
        epsilon_high=cfg.algorithm.eps_high,
        scale_rewards="group",
        num_iterations=1,
        bf16=args.dtype == "bfloat16",
        gradient_checkpointing=args.gradient_checkpointing,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        shuffle_dataset=False,
        use_cpu=args.device == "cpu",
        seed=cfg.trainer.seed,
        generation_kwargs=gen_kwargs,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=conf, train_dataset=ds, processing_class=tok)
    model.generate = clock.wrap("gen", model.generate)  # what TRL's unwrapped model calls
    trainer._generate_and_score_completions = clock.wrap("score", trainer._generate_and_score_completions)
    rows: list[dict[str, float]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            clock.take()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            total = time.perf_counter() - self.t0
            t = clock.take()
            rows.append({
                "step": len(rows) + 1,
                "total": total,
                "gen": t.get("gen", 0.0),
                "grade": t.get("grade", 0.0),
                "stats": t.get("score", 0.0) - t.get("gen", 0.0) - t.get("grade", 0.0),
                "update": total - t.get("score", 0.0),
                "tokens": float(tokens[-1]) if tokens else float("nan"),
            })

    trainer.add_callback(Timer())
    trainer.train()
    grader.close()
    return rows


def child(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    side = args.child
    if side == "stapo-none":  # S2T off (DAPO's weighting): the mask's overhead is the difference
        args.weighting = "none"
    rows = run_trl(args) if side == "trl" else run_stapo(args, baseline=side == "stapo-baseline")
    print("VS_TRL_RESULT " + json.dumps({"side": side, "rows": rows, "peak_mib": _peak_mem_mib(args.device)}))


# ----------------------------------------------------------------------------- parent: alternate and report


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg()[:1])


def _run_child(args: argparse.Namespace, side: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", side] + [a for a in sys.argv[1:] if a != "--"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads) if args.threads else os.environ.get("OMP_NUM_THREADS", ""))
    env = {k: v for k, v in env.items() if v != ""}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    load_before = _load()
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VS_TRL_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"vs_trl: the {side} run failed (exit {proc.returncode}); its output is above")
    res = json.loads(line[len("VS_TRL_RESULT "):])
    res.update(load=f"{load_before} / {_load()}", wall=time.time() - t0)
    return res


def _summary(res: dict[str, Any]) -> dict[str, float]:
    rows = res["rows"][1:] or res["rows"]  # step 1 is the warm-up
    med = {k: statistics.median(r[k] for r in rows) for k in ("total", "gen", "grade", "stats", "update", "tokens")}
    med["ms_per_token"] = 1000 * statistics.median(r["total"] / max(r["tokens"], 1) for r in rows)
    med["peak_mib"] = res["peak_mib"]
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", default="stapo,trl", help=f"comma-separated, from {', '.join(SIDES)}")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (each side once per round)")
    p.add_argument("--steps", type=int, default=4, help="RL steps per run (the first is a warm-up)")
    p.add_argument("--model", default="demo:smollm2-135m-instruct", help="stapo model name (model.name_or_path)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--micro", type=int, default=16, help="rows per forward/backward (gradient accumulation)")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--weighting", default="s2t", help="stapo token weighting (s2t: STAPO; none: DAPO)")
    p.add_argument("--force-length", action="store_true", help="generate exactly --max-new-tokens (ignore EOS)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="both sides recompute activations")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each run (0: torch's default)")
    p.add_argument("--json", default="", help="also write every row here")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    bad = [s for s in sides if s not in SIDES]
    if bad:
        raise SystemExit(f"--sides: unknown {bad}; valid: {', '.join(SIDES)}")
    if (args.prompts * args.n) % args.micro:
        raise SystemExit(f"--micro ({args.micro}) must divide prompts x n ({args.prompts * args.n})")
    if "trl" in sides:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit(
                'vs_trl: TRL is not installed (benchmark-only dependency): pip install "trl==1.16.*", '
                "or run --sides stapo,stapo-baseline"
            ) from None
    print(f"machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, {platform.platform()}, "
          f"python {platform.python_version()}; device {args.device}, {args.dtype}")
    print(f"work: {args.prompts} prompts x {args.n} samples, {args.max_new_tokens} new tokens"
          f"{' (forced)' if args.force_length else ''}, micro-batch {args.micro}, {args.steps} steps per run "
          f"(first = warm-up), {args.rounds} rounds, model {args.model}")
    results: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = sides if rnd % 2 == 0 else list(reversed(sides))
        for side in order:
            res = _run_child(args, side)
            res["round"] = rnd + 1
            res["summary"] = _summary(res)
            results.append(res)
            s = res["summary"]
            print(f"  round {rnd + 1} {side:15s} step {s['total']:.2f}s = gen {s['gen']:.2f} + grade {s['grade']:.3f} "
                  f"+ stats {s['stats']:.2f} + update {s['update']:.2f}; {s['tokens']:.0f} tokens, "
                  f"{s['ms_per_token']:.1f} ms/token, peak {s['peak_mib']:.0f} MiB (load {res['load']})", flush=True)
            if args.json:  # after every run: a long comparison interrupted keeps what it measured
                Path(args.json).write_text(json.dumps(results, indent=1))
    hdr = ("| round | side | step s | gen s | grade s | stats s | update s | gen tokens | ms / gen token "
           "| peak MiB | step vs TRL | per token vs TRL | load |")
    print()
    print(hdr)
    print("|---|---|" + "---:|" * 10 + "---|")
    for rnd in range(1, args.rounds + 1):
        in_round = {r["side"]: r["summary"] for r in results if r["round"] == rnd}
        ref = in_round.get("trl")
        for r in (r for r in results if r["round"] == rnd):
            s = r["summary"]
            ratio = f"**{ref['total'] / s['total']:.2f}x**" if ref and r["side"] != "trl" else ""
            ratio_tok = f"{ref['ms_per_token'] / s['ms_per_token']:.2f}x" if ref and r["side"] != "trl" else ""
            print(f"| {rnd} | {r['side']} | {s['total']:.2f} | {s['gen']:.2f} | {s['grade']:.3f} | {s['stats']:.2f} "
                  f"| {s['update']:.2f} | {s['tokens']:.0f} | {s['ms_per_token']:.1f} | {s['peak_mib']:.0f} "
                  f"| {ratio} | {ratio_tok} | {r['load']} |")
    print("\n(step vs TRL = TRL's median step time / this side's, same round; > 1 means faster than TRL)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
