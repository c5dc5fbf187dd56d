"""DEEP-GRPO's local (branch) loss at a long-tailed shape: row-padded vs packed micro-batches.

A tiny random Llama; branch rows with log-normal response lengths (median ~300 tokens, clipped to
32-2,048) after a 64-token prompt, each branching at a random third of its response. One step's
local term over several optimizer mini-batches (``DeepGRPO.local_loss``'s rows through
``Actor.contribute`` per optimizer step, as ``Actor.update`` runs them), S2T weighting (it reads p and H). Counted exactly: gradient
and no-grad forwards, tokens every forward computes, and so the useful-token fraction; timed: wall
and this process's CPU seconds (on a shared machine the CPU seconds are the work done):

    python benchmarks/deep_local_loss.py                            # prints a markdown table
    python benchmarks/deep_local_loss.py --rows 32 --mini-batches 4 --tokens 2048 --repeat 3
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from types import SimpleNamespace

import torch


def lengths(n: int, *, median: float, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(math.log(median) + sigma * torch.randn(n, generator=g))
    return [int(v) for v in x.clamp(lo, hi).round().tolist()]


def setup(args: argparse.Namespace, micro: dict) -> tuple:
    from stapo.core.config import config_from_dict
    from stapo.core.train import loop
    from stapo.core.trainer.models import load_policy
    from stapo.core.trainer.torch_backend import TorchBackend

    cfg = config_from_dict({
        "model": {"name_or_path": "tiny-random", "dtype": "float32",
                  "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128, "seed": 0}},
        "rollout": {"temperature": 1.0},
        "trainer": {"device": "cpu", "logits_chunk_size": 1024, **micro},
        "algorithm": {"token_weighting": "s2t", "mini_batches": args.mini_batches,
                      "deep_grpo": {"enabled": True, "lambda": 1.0}},
    })
    model, _ = load_policy(cfg.model, device="cpu")
    backend = TorchBackend(cfg, model, total_optimizer_steps=args.mini_batches)
    g = torch.Generator().manual_seed(args.seed)
    kept = []
    for i, r in enumerate(lengths(args.rows, median=300, sigma=0.9, lo=32, hi=2048, seed=args.seed)):
        ids = torch.randint(3, model.config.vocab_size, (args.prompt + r,), generator=g).tolist()
        s = loop.Sequence_(ids[: args.prompt], ids[args.prompt :], "stop", "", "0", group=i // 4)
        s.prefix_len = max(1, r // 3)
        s.advantage = float(torch.randn(1, generator=g))
        kept.append(s)
    return cfg, SimpleNamespace(cfg=cfg, backend=backend, pad_id=0), kept


def counting(backend) -> dict[str, int]:
    n = {"grad": 0, "nograd": 0, "tokens": 0}
    real = backend.token_stats

    def spy(ids, attn, resp=None, *, grad, **kw):
        n["grad" if grad else "nograd"] += 1
        n["tokens"] += int(ids.numel())
        return real(ids, attn, resp, grad=grad, **kw)

    backend.token_stats = spy
    return n


def one(args: argparse.Namespace, micro: dict) -> dict[str, float]:
    from stapo.core.train import deep_grpo
    from stapo.core.train.update import Actor

    cfg, run, kept = setup(args, micro)
    br = deep_grpo.collate_branches(run, kept, [len(kept)])
    local = deep_grpo.DeepGRPO(cfg, run).local_loss(run.backend, br, 1)
    actor = Actor(cfg, run.backend)
    n = counting(run.backend)
    t, c = time.perf_counter(), time.process_time()
    for update in range(args.mini_batches):
        actor.contribute(local, update)
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    real = sum(len(s.prompt_ids) + len(s.response_ids) for s in kept)  # each row once over the mini-batches
    return {"s": dt, "cpu": cpu, **n, "real": real}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32, help="branch rows")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--micro-rows", type=int, default=4, help="trainer.micro_batch_size (row-padded)")
    ap.add_argument("--tokens", type=int, default=2048, help="trainer.micro_batch_tokens (packed)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (round-robin over the variants); median time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = {f"rows of {args.micro_rows}": {"micro_batch_size": args.micro_rows},
                f"packed {args.tokens} tokens": {"micro_batch_tokens": args.tokens}}
    results: dict[str, list[dict]] = {k: [] for k in variants}
    for _ in range(args.repeat):
        for name, micro in variants.items():
            results[name].append(one(args, micro))
    first = next(iter(results.values()))
    base_cpu = statistics.median(r["cpu"] for r in first)
    print(f"{args.rows} branch rows, {args.mini_batches} mini-batches, S2T; {platform.machine()}, torch"
          f" {torch.__version__}, {args.threads} thread(s), median of {args.repeat}\n")
    print("| variant | wall s | CPU s | vs first (CPU) | grad forwards | no-grad forwards | computed tokens | useful |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, rs in results.items():
        r, s, cpu = rs[0], statistics.median(x["s"] for x in rs), statistics.median(x["cpu"] for x in rs)
        print(f"| {name} | {s:.2f} | {cpu:.2f} | {base_cpu / cpu:.2f}x | {r['grad']} | {r['nograd']} | {r['tokens']} |"
              f" {r['real'] / r['tokens']:.0%} |")


if __name__ == "__main__":
    main()
