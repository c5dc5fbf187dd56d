"""The update at the shape of real RL: long-tailed response lengths, packed vs row-padded micro-batches.

A tiny random Llama with a realistic vocabulary (32,000 tokens) and responses drawn from a
long-tailed distribution (log-normal, median ~300 tokens, clipped to 32-2,048), several optimizer
mini-batches. For each micro-batching it times one step's learner work (the no-grad old-log-prob
pass the off-policy mini-batches need + ``Actor.update``) and counts the tokens every forward
computes, so the useful-token fraction (real tokens / computed tokens) is exact, not estimated:

    python benchmarks/longtail.py                      # defaults below; prints a markdown table
    python benchmarks/longtail.py --prompts 8 --n 4 --mini-batches 4 --tokens 4096 --rows 2 4 8 --repeat 2
    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/longtail.py --threads 1 --attn sdpa_varlen sdpa

``padded (k rows)`` is ``trainer.micro_batch_size`` = k rows per forward, padded to the longest (the
mini-batch's random order, as the update draws it); ``packed`` is ``trainer.micro_batch_tokens``
(first-fit decreasing, no padding) with the attention named after it: ``sdpa_varlen`` (our default
when packing: sdpa per sequence, :mod:`stapo.core.trainer.attention`) or ``sdpa`` (transformers'
block-diagonal [T, T] mask over the whole packed row). All run the same update (same weights after
the step to rounding: tests/unit/test_update.py checks 1e-5). The last columns give the packed
``sdpa_varlen`` layout's speed-up over each layout. The header prints the model's body/head split
of the per-token matmul FLOPs next to Qwen2.5-1.5B's, and the load average before and after.

TRL's GRPOTrainer on the same batch and learner step: benchmarks/longtail_trl.py (it imports this
file's workload; run it from a venv with trl==1.16.*). benchmarks/vs_trl.py compares whole steps on
the demo workload.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import statistics
import time

import torch


def lengths(n: int, *, median: float, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(math.log(median) + sigma * torch.randn(n, generator=g))
    return [int(v) for v in x.clamp(lo, hi).round().tolist()]


def make_batch(args: argparse.Namespace, vocab: int):
    from stapo.core.batch import collate
    from stapo.core.train import loop

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
    return collate(seqs, pad_id=0), resp_lens


# Qwen2.5-1.5B (its config.json on the Hugging Face hub): hidden 1536, 28 layers, MLP 8960, 12 query
# and 2 key/value heads of 128, vocabulary 151,936: the real model the body/head split is compared with
QWEN25_15B = {"hidden": 1536, "layers": 28, "intermediate": 8960, "heads": 12, "kv_heads": 2, "vocab": 151936}


def matmul_flops_per_token(hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                           vocab: int) -> tuple[int, int]:
    """(body, LM head) multiply-adds per token of the weight matmuls (q, k, v, o, gated MLP; head).

    Attention's score/value products (~2 x context x hidden per layer) are left out: they grow with
    the context, and at a few hundred tokens they are a few percent of the body here and in Qwen."""
    head_dim = hidden // heads
    attn = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim  # q, o + k, v
    mlp = 3 * hidden * intermediate  # gate, up, down
    return layers * (attn + mlp), hidden * vocab


def setup(args: argparse.Namespace, model: torch.nn.Module, micro: dict):
    from stapo.core.config import config_from_dict
    from stapo.core.trainer.torch_backend import TorchBackend

    cfg = config_from_dict({
        "model": {"name_or_path": "tiny-random"},
        "trainer": {"device": "cpu", "lr": 1e-5, "logits_chunk_size": 1024, "share_prompt_prefix": False, **micro},
        "algorithm": {"token_weighting": args.weighting, "mini_batches": args.mini_batches,
                      "s2t": {"tau_p": 0.1, "q": 0.75}},
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
    from stapo.core.train import update
    from stapo.core.train.hooks import Hooks

    computed["tokens"] = 0
    t0, c0 = time.perf_counter(), time.process_time()
    old_lp, old_ent = update.Actor(cfg, b).old_stats(batch)
    # no hooks: the update's own work (a layer's before_update pass, e.g. a KL reference, is not timed here)
    update.Actor(cfg, b, Hooks()).update(update.UpdateInputs(batch, old_lp, old_ent, step=1))
    return time.perf_counter() - t0, time.process_time() - c0, computed["tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--median", type=float, default=300.0)
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of the response lengths")
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--rows", type=int, nargs="+", default=[4], help="padded: rows per forward (one layout each)")
    ap.add_argument("--tokens", type=int, default=4096, help="packed: token budget per forward")
    ap.add_argument("--attn", nargs="+", default=["sdpa_varlen"],
                    help="packed: attention implementations (one layout each; trainer.attn_implementation)")
    ap.add_argument("--weighting", default="none")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                         num_attention_heads=4, num_key_value_heads=args.kv_heads,
                                         intermediate_size=4 * args.hidden, max_position_embeddings=4096))
    batch, resp = make_batch(args, args.vocab)
    q = sorted(resp)
    body, head = matmul_flops_per_token(args.hidden, args.layers, 4 * args.hidden, 4, args.kv_heads, args.vocab)
    q_body, q_head = matmul_flops_per_token(**QWEN25_15B)
    print(f"# {len(resp)} responses: min {q[0]}, median {q[len(q) // 2]}, p90 {q[int(0.9 * len(q))]}, max {q[-1]}; "
          f"prompt {args.prompt_len}; vocab {args.vocab}, hidden {args.hidden}, layers {args.layers}; "
          f"{args.mini_batches} mini-batches, weighting {args.weighting}; torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"# body share of the per-token matmul FLOPs: this model {body / (body + head):.1%} "
          f"(body {body:,}, head {head:,}); Qwen2.5-1.5B {q_body / (q_body + q_head):.1%}")
    # the layouts alternate, step by step, so a change in the machine's load hits all alike; CPU
    # seconds (this process's) are reported next to wall seconds: on a shared machine they are the
    # steadier measure of the work each layout does
    names = {f"padded ({r} rows)": {"micro_batch_size": r} for r in args.rows}
    for attn in args.attn:
        names[f"packed ({args.tokens} tokens, {attn})"] = {"micro_batch_size": 1, "micro_batch_tokens": args.tokens,
                                                           "attn_implementation": attn}
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
    ref = next((n for n in names if n.endswith(f", {args.attn[0]})")), next(iter(names)))
    ref_w, ref_c = statistics.median(wall[ref]), statistics.median(cpu[ref])
    print(f"| micro-batches | computed tokens | useful-token fraction | learner step s (wall) | CPU s | "
          f"{ref.split(' (')[0]} {args.attn[0]} speed-up over it (wall) | (CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"| {name} | {computed[name]} | {real / computed[name]:.1%} | {w:.2f} | {c:.2f} | "
              f"{w / ref_w:.2f}x | {c / ref_c:.2f}x |")
    after = os.getloadavg()
    print(f"# load average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f}, "
          f"after {after[0]:.1f} {after[1]:.1f} {after[2]:.1f}; medians of {args.repeat} steps per layout")


if __name__ == "__main__":
    main()
