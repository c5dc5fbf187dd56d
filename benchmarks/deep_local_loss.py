"""DEEP-GRPO's local (branch) loss at a long-tailed shape: row-padded vs packed micro-batches.

A tiny random Llama; branch rows with log-normal response lengths (median ~300 tokens, clipped to
32-2,048) after a 64-token prompt, each branching at a random third of its response. One step's
local term over several optimizer mini-batches (``DeepGRPO.local_loss_hook``'s ``before_step`` per
update, as ``Actor.update`` calls it), S2T weighting (it reads p and H). Counted exactly: gradient
and no-grad forwards, tokens every forward computes, and so the useful-token fraction; timed: wall
and this process's CPU seconds (on a shared machine the CPU seconds are the work done):

    python benchmarks/deep_local_loss.py                            # prints a markdown table
    python benchmarks/deep_local_loss.py --rows 32 --mini-batches 4 --tokens 2048 --repeat 3
    python benchmarks/deep_local_loss.py --before 58aafe3          # also the local loss of that commit

``--before COMMIT`` loads ``core/train/deep_grpo.py`` of that commit (``git show``) and runs its local loss
on the same rows with row micro-batches (the branch rows' statistics from a row-micro-batched no-grad
pass, as that code built them).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from stapo.core import batch as batch_mod


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


def load_before(commit: str):
    src = subprocess.run(["git", "show", f"{commit}:core/train/deep_grpo.py"], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(tempfile.mkdtemp()) / "deep_grpo_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("deep_grpo_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["deep_grpo_before"] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def one(args: argparse.Namespace, micro: dict, before=None) -> dict[str, float]:
    from stapo.core.train import deep_grpo, loop

    cfg, run, kept = setup(args, micro)
    if before is None:
        br, mod = deep_grpo.collate_branches(run, kept, [len(kept)]), deep_grpo
    else:  # that commit's local loss on its own BranchRollouts (row-micro-batched statistics)
        batch = batch_mod.collate(kept, 0)
        lp, ent = loop.token_stats_batched(run.backend, batch, cfg.trainer.micro_batch_size, 1.0)
        suffix = before.suffix_mask(batch.response_mask, torch.tensor([s.prefix_len for s in kept]))
        br, mod = before.BranchRollouts(kept, batch, suffix, lp, ent, [len(kept)], None), before
    hook = mod.DeepGRPO(cfg, run).local_loss_hook(run, br, 1)
    n = counting(run.backend)
    t, c = time.perf_counter(), time.process_time()
    for update in range(args.mini_batches):
        hook(update, update == 0)
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
    ap.add_argument("--before", default=None, help="also run core/train/deep_grpo.py of this commit (row-padded)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = {f"rows of {args.micro_rows}": ({"micro_batch_size": args.micro_rows}, None),
                f"packed {args.tokens} tokens": ({"micro_batch_tokens": args.tokens}, None)}
    if args.before:
        variants = {f"{args.before}: rows of {args.micro_rows}": ({"micro_batch_size": args.micro_rows},
                                                                  load_before(args.before)), **variants}
    results: dict[str, list[dict]] = {k: [] for k in variants}
    for _ in range(args.repeat):
        for name, (micro, before) in variants.items():
            results[name].append(one(args, micro, before))
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
