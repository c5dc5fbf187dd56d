"""Per-rank host memory of loading the policy at ZeRO-3: built whole vs built partitioned.

A Llama-shaped model (8 layers, hidden 512, ~34M parameters, 134 MB in fp32) is saved with
``save_pretrained``; then 2 CPU ranks (gloo, torchrun) load it and build the DeepSpeed ZeRO-3 engine,
once as the loop does (``load_policy(..., init_context=load_context(cfg))``: ``zero.Init``, rank 0
reads the checkpoint) and once whole (no context: every rank builds the whole model, the engine
partitions it). Each rank reports the growth of its peak resident size from just before the load to
the model loaded (and what stays resident), then from there to the engine built. On CPU the partitions themselves live in host
memory (half the model per rank here); on a GPU they go to the GPU, so there the host keeps only
rank 0's read of the checkpoint. glibc maps every allocation over 64 KiB and keeps freed memory
(``MALLOC_*``), so the resident size follows the tensors. Linux only (``/proc/self/clear_refs``).

    python benchmarks/zero3_load_memory.py          # ~1-2 min on 2 busy cores
    python benchmarks/zero3_load_memory.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from peak_rss import MALLOC_ENV, peak, reset_peak, status_bytes

MB = 1e6


def rank_child(mode: str, ckpt: str, out: str) -> None:
    """One rank of one launch: load the checkpoint (``mode``: whole | partitioned), build the engine."""
    import deepspeed
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (imports are not the load's memory)

    from stapo.core.config import config_from_dict
    from stapo.core.trainer import build_trainer_backend, load_context
    from stapo.core.trainer.deepspeed_backend import init_distributed
    from stapo.core.trainer.models import load_policy

    torch.set_num_threads(1)
    cfg = config_from_dict({
        "model": {"name_or_path": ckpt},
        "trainer": {"backend": "deepspeed", "device": "auto", "zero_stage": 3,
                    "zero3_param_persistence_threshold": 0, "micro_batch_size": 1},
    })
    init_distributed(deepspeed, cpu=True)  # both modes join the group before the measurement

    start = reset_peak()
    anon0, file0 = status_bytes("RssAnon:"), status_bytes("RssFile:")
    context = load_context(cfg) if mode == "partitioned" else None
    model, _ = load_policy(cfg.model, init_context=context)
    load_peak, loaded = peak() - start, status_bytes("VmRSS:") - start
    anon, file = status_bytes("RssAnon:") - anon0, status_bytes("RssFile:") - file0  # private vs mapped-file pages
    before_engine = reset_peak()
    backend = build_trainer_backend(cfg, model, total_optimizer_steps=1)
    row = {"mode": mode, "rank": backend.rank, "load_peak": load_peak, "loaded": loaded, "loaded_anon": anon, "loaded_file": file,
           "engine_peak": peak() - before_engine + loaded, "resident_after": status_bytes("VmRSS:") - start}
    with open(f"{out}.rank{backend.rank}.json", "w") as f:
        json.dump(row, f)
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter teardown: gloo's threads can abort a normal exit


def launch(mode: str, ckpt: Path, tmp: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(tmp / "ext")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = tmp / mode
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), __file__, "--rank-child", mode, str(ckpt), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} launch failed:\n{done.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    ap.add_argument("--rank-child", nargs=3, metavar=("MODE", "CKPT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_child:
        rank_child(*args.rank_child)
        return

    from stapo.core.config import TinyModel
    from stapo.core.trainer.models import build_tiny_model, build_tiny_tokenizer

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tok = build_tiny_tokenizer()
        model = build_tiny_model(TinyModel(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=2048), tok)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(tmp / "ckpt")
        tok.save_pretrained(tmp / "ckpt")
        del model
        rows = [r for mode in ("whole", "partitioned") for r in launch(mode, tmp / "ckpt", tmp)]
    for r in rows:
        r["model_mb"] = round(model_bytes / MB, 1)
    if args.json:
        print(json.dumps(rows))
        return
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{when}, {platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} CPUs; "
          f"model {model_bytes / MB:.1f} MB fp32, 2 ranks, ZeRO-3")
    print("| load | rank | load peak MB | after load MB (private + file) | peak with engine MB | with engine MB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['rank']} | {r['load_peak'] / MB:.1f} | {r['loaded'] / MB:.1f} "
              f"({r['loaded_anon'] / MB:.1f} + {r['loaded_file'] / MB:.1f}) | "
              f"{r['engine_peak'] / MB:.1f} | {r['resident_after'] / MB:.1f} |")


if __name__ == "__main__":
    main()
