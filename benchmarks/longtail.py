"""The update at the shape of real RL: long-tailed response lengths, packed vs row-padded micro-batches.

A tiny random Llama with a realistic vocabulary (32,000 tokens) and responses drawn from a
long-tailed distribution (log-normal, median ~300 tokens, clipped to 32-2,048), several optimizer
mini-batches. For each micro-batching it times one step's learner work (the no-grad old-log-prob
pass the off-policy mini-batches need + ``update_policy``) and counts the tokens every forward
computes, so the useful-token fraction (real tokens / computed tokens) is exact, not estimated:

    python benchmarks/longtail.py                      # defaults below; prints a markdown table
    python benchmarks/longtail.py --prompts 8 --n 4 --mini-batches 4 --tokens 4096 --rows 4 --repeat 2
    python benchmarks/longtail.py --threads 1     # CPU seconds comparable on a shared machine

``padded`` is ``trainer.micro_batch_size`` rows per forward, padded to the longest (the mini-batch's
random order, as the update draws it); ``packed`` is ``trainer.micro_batch_tokens`` (first-fit
decreasing, no padding, attention within each sequence through position ids). Both run the same
update (same weights after the step to rounding: tests/unit/test_update.py checks 1e-5).

TRL's GRPOTrainer is not run here: its install (trl==1.16.*, a separate venv) and its own
generation-driven step do not fit this harness's learner-only timing; benchmarks/vs_trl.py compares
whole steps on the demo workload.
"""

from __future__ import annotations

import argparse
import copy
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


def make_batch(args: argparse.Namespace, vocab: int):
    from stapo.core import loop

    g = torch.Generator().manual_seed(args.seed)
    resp_lens = lengths(args.prompts * args.n, median=args.median, sigma=args.sigma, lo=32, hi=2048, seed=args.seed)
    seqs = []
    for p in range(args.prompts):
        prompt = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
        for j in range(args.n):
            r = resp_lens[p * args.n + j]
            s = loop.Sequence_(prompt, torch.randint(3, vocab, (r,), generator=g).tolist(), "stop", "", "0", group=p)
            s.advantage = float(torch.randn(1, generator=g))
            seqs.append(s)
    return loop.collate(seqs, pad_id=0), resp_lens


def setup(args: argparse.Namespace, model: torch.nn.Module, micro: dict):
    from stapo.core.config import config_from_dict
    from stapo.core.trainer.torch_backend import TorchBackend

    cfg = config_from_dict({
        "model": {"name_or_path": "tiny-random"},
        "trainer": {"device": "cpu", "lr": 1e-5, "logits_chunk_size": 1024, "share_prompt_prefix": False, **micro},
        "algorithm": {"token_weighting": args.weighting, "mini_batches": args.mini_batches,
                      "s2t": {"tau_p": 0.1, "tau_h_quantile": 0.05}},
    })
    b = TorchBackend(cfg, copy.deepcopy(model), total_optimizer_steps=args.mini_batches)
    computed = {"tokens": 0}
    real_stats, real_loss = b.token_stats, b.token_loss

    def stats(ids, *a, **k):
        computed["tokens"] += ids.numel()
        return real_stats(ids, *a, **k)

    def loss(ids, *a, **k):
        computed["tokens"] += ids.numel()
        return real_loss(ids, *a, **k)

    b.token_stats, b.token_loss = stats, loss
    return cfg, b, computed


def one_step(cfg, b, computed: dict, batch) -> tuple[float, float, int]:
    """(wall s, this process's CPU s, computed tokens) of one step's learner work."""
    from stapo.core import update

    computed["tokens"] = 0
    t0, c0 = time.perf_counter(), time.process_time()
    old_lp, old_ent = update.token_stats_batched(b, batch, update.micro_spec(cfg), 1.0)
    update.update_policy(SimpleNamespace(cfg=cfg, backend=b), batch, old_lp, old_ent, step=1)
    return time.perf_counter() - t0, time.process_time() - c0, computed["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--median", type=float, default=300.0)
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the response lengths")
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4, help="padded: rows per forward")
    ap.add_argument("--tokens", type=int, default=4096, help="packed: token budget per forward")
    ap.add_argument("--weighting", default="none")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                         num_attention_heads=4, num_key_value_heads=4,
                                         intermediate_size=4 * args.hidden, max_position_embeddings=4096))
    batch, resp = make_batch(args, args.vocab)
    q = sorted(resp)
    print(f"# {len(resp)} responses: min {q[0]}, median {q[len(q) // 2]}, p90 {q[int(0.9 * len(q))]}, max {q[-1]}; "
          f"prompt {args.prompt_len}; vocab {args.vocab}, hidden {args.hidden}, layers {args.layers}; "
          f"{args.mini_batches} mini-batches, weighting {args.weighting}; torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    # the two layouts alternate, step by step, so a change in the machine's load hits both alike; CPU
    # seconds (this process's) are reported next to wall seconds: on a shared machine they are the
    # steadier measure of the work each layout does
    names = {f"padded ({args.rows} rows)": {"micro_batch_size": args.rows},
             f"packed ({args.tokens} tokens)": {"micro_batch_size": args.rows, "micro_batch_tokens": args.tokens}}
    setups = {name: setup(args, model, micro) for name, micro in names.items()}
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    computed: dict[str, int] = {}
    for _ in range(args.repeat):
        for name, (cfg, b, counter) in setups.items():
            w, c, tokens = one_step(cfg, b, counter, batch)
            wall[name].append(w)
            cpu[name].append(c)
            computed[name] = tokens
    real = int(batch.attention_mask.sum()) * 2  # the old pass + one epoch of gradient forwards
    base_w, base_c = (statistics.median(x[next(iter(names))]) for x in (wall, cpu))
    print("| micro-batches | computed tokens | useful-token fraction | learner step s (wall) | CPU s | "
          "speed-up (wall) | speed-up (CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"| {name} | {computed[name]} | {real / computed[name]:.1%} | {w:.2f} | {c:.2f} | "
              f"{base_w / w:.2f}x | {base_c / c:.2f}x |")

if __name__ == "__main__":
    main()
