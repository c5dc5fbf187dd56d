"""The memory plan against a measured CPU peak: one update of a small model, both update paths.

``stapo.core.train.plan`` sizes a GPU run from the model's config. Its byte accounting of what an update
holds (gradients, AdamW's moments, the checkpointed activations, the kept graphs) is checked here on
CPU, where the peak resident size is measurable: each row runs in its own process

1. a warm-up update of another, smaller model (the libraries' one-time allocations happen there,
   not in the measurement; they vary with the CPU and are not the plan's business),
2. the measured model loaded, its resident size taken (the fp32 weights are in it),
3. one update (AdamW's moments come to exist), then the peak-RSS counter reset, then a second
   update: the steady state every later step of a run is in,

and reports the growth of the peak over step 2 against the plan's update phase less the weights.
glibc is told to map every allocation over 64 KiB and to keep freed memory (``MALLOC_*``), so the
resident size follows the tensors; torch runs one thread. Linux only (``/proc/self/clear_refs``).

    python benchmarks/plan_memory.py                   # hidden 128 and 256, both paths (~2 min)
    python benchmarks/plan_memory.py --hidden 256 --json --first-update
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone

from peak_rss import MALLOC_ENV, peak, reset_peak

MODES = ("keep_graphs", "bounded")
S, PROMPT, ROWS = 384, 128, 12  # 12 rows of 384 tokens: 4 micro-batches of 3 rows


def config(mode: str, hidden: int, layers: int = 4):
    from stapo.core.config import config_from_dict

    return config_from_dict({
        "model": {"name_or_path": "tiny-random", "gradient_checkpointing": True,
                  "tiny": {"hidden_size": hidden, "num_layers": layers, "num_heads": 4,
                           "intermediate_size": 4 * hidden}},
        "data": {"max_prompt_tokens": PROMPT},
        "rollout": {"engine": "hf", "prompts_per_step": ROWS // 4, "n": 4, "max_new_tokens": S - PROMPT,
                    "batch_size": 4},
        "algorithm": {"token_weighting": "s2t", "s2t": {"tau_p": 0.5, "q": 0.5}},
        "trainer": {"device": "cpu", "micro_batch_size": 3, "logits_chunk_size": 256, "fused_loss": False,
                    "update_memory": mode, "share_prompt_prefix": False},
    })


def batch():
    """12 random rows in 3 groups of 4, full length, advantages +-1 (every row trains)."""
    import torch

    from stapo.core.batch import collate
    from stapo.core.rollout.rollouts import Sequence_

    g = torch.Generator().manual_seed(0)
    seqs = []
    for grp in range(ROWS // 4):
        prompt = torch.randint(3, 60, (PROMPT,), generator=g).tolist()
        for k in range(4):
            s = Sequence_(prompt, torch.randint(3, 60, (S - PROMPT,), generator=g).tolist(), "length", "", "0",
                          group=grp)
            s.advantage = (-1.0) ** k
            seqs.append(s)
    return collate(seqs, pad_id=0)


def child(mode: str, hidden: int, first_update: bool) -> dict:
    """One measurement in this process (the parent starts a fresh one per row)."""
    import torch

    from stapo.core.train import plan, update
    from stapo.core.train.hooks import Hooks
    from stapo.core.trainer.models import load_policy
    from stapo.core.trainer.torch_backend import TorchBackend

    torch.set_num_threads(1)
    rows = batch()

    def one_update(cfg, backend, step):
        update.Actor(cfg, backend, Hooks()).update(update.UpdateInputs(rows, None, None, step=step))

    if not first_update:
        warm = config(mode, 64, layers=2)
        wm, _ = load_policy(warm.model, device="cpu")
        one_update(warm, TorchBackend(warm, wm, total_optimizer_steps=1), 1)
        del wm
    cfg = config(mode, hidden)
    model, _ = load_policy(cfg.model, device="cpu")
    backend = TorchBackend(cfg, model, total_optimizer_steps=2)
    before = reset_peak()  # the loaded model's resident size
    if not first_update:
        one_update(cfg, backend, 1)
        reset_peak()
    one_update(cfg, backend, 1 if first_update else 2)
    measured = peak() - before
    shape = plan.model_shape(cfg.model)
    p = plan.plan_memory(cfg, 1, 64.0, shape, cuda=False)  # its GiB are rounded to 3 decimals
    moments = sum(t.numel() * t.element_size() for st in backend.optimizer.state.values()
                  for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    return {"mode": mode, "hidden": hidden, "path": p.update_path, "measured": measured,
            "planned": p.phases_gib["update"] * 2**30 - 4 * p.params,  # less the resident fp32 weights
            "kept_graphs": p.kept_graphs_gib * 2**30, "optimizer_bytes": moments,
            "planned_optimizer_bytes": plan.model_states(cfg, shape, 1, cuda=False)["optimizer"]}


def measure(mode: str, hidden: int, first_update: bool = False) -> dict:
    env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, __file__, "--child", mode, "--hidden", str(hidden)]
    out = subprocess.run([*args, *(["--first-update"] if first_update else [])], capture_output=True,
                         text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} hidden={hidden} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 256], help="model widths to measure")
    ap.add_argument("--first-update", action="store_true",
                    help="measure the first update instead (no warm-up; AdamW's moments not yet resident)")
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.hidden[0], a.first_update)))
        return
    rows = [measure(m, h, a.first_update) for h in a.hidden for m in MODES]
    if a.json:
        print(json.dumps(rows))
        return
    mb = 1e6
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {'first' if a.first_update else 'second'} update")
    print("| hidden | path | measured MB | planned MB | measured / planned |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['hidden']} | {r['path']} | {r['measured'] / mb:.1f} | {r['planned'] / mb:.1f} | "
              f"{r['measured'] / r['planned']:.3f} |")
    for h in a.hidden:
        k, b = (next(r for r in rows if r["hidden"] == h and r["mode"] == m) for m in MODES)
        print(f"| {h} | kept graphs (keep_graphs - bounded) | {(k['measured'] - b['measured']) / mb:.1f} | "
              f"{(k['planned'] - b['planned']) / mb:.1f} | {(k['measured'] - b['measured']) / (k['planned'] - b['planned']):.3f} |")


if __name__ == "__main__":
    main()
