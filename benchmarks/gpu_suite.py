"""The GPU suite's parts, their costs, and the budget that runs them (driven by benchmarks/gpu_suite.sh).

One lent GPU (an H200 here: 139 GiB, no vLLM, whose wheel is too large to carry) gives a session 15
minutes of device time and one command at most 10; the suite must finish inside one command with
room to rerun it, so it runs against a budget (``--budget-s``, what is left of 540 s after the wheel
install). Parts run in priority order, each in its own process (an OOM or a hang in one leaves the
others their time) with a hard timeout of what is left; a part whose cost is larger than what is
left is skipped and says so. Costs on the GPU are stated, not measured (no GPU was lent when they
were written: each is a guess from the shapes, named ``stated`` in the report); costs of the CPU dry
run were measured here. Everything lands in ``--out``: the report ``results.json`` and every part's
log in ``parts.log`` (the device tool brings back at most 8 files of 16 MiB).

Parts, in priority order (the torch and DeepSpeed paths: vLLM is not on the machine):

- ``checks``: benchmarks/gpu_checks.py (numerics of the CUDA paths against same-precision references).
- ``zero3_train``: 2 steps of ``stapo train --config stapo`` on its DeepSpeed ZeRO-3 path at world
  size 1 with the hf engine, on a random Qwen3-1.7B: the policy built partitioned under
  ``zero.Init`` (``load_context``), bf16, the memory plan at start on the real card (its line is
  kept), a checkpoint at step 2.
- ``sync_stream``: the weight sync of that ZeRO-3 engine streamed into preallocated bf16 buffers
  (a stand-in for vLLM's weights) at two ``trainer.sync_bucket_mb`` sizes: the allocator's peak
  above the partitions and the buffers, against one bucket (or the largest parameter).
- ``update_memory``: peak GPU memory of an update at 8 x 8,192-token responses, gradient
  checkpointing, STAPO's S2T weighting (which keeps every micro-batch's graph until the mini-batch's
  thresholds are known), measured on the second update (after a warm-up update made AdamW's
  moments), against ``stapo train --plan --json``'s *update* phase less its CUDA-context allowance
  (the allocator does not see the context).
- ``train_resume``: 3 steps of ``stapo train`` (hf engine, torch backend, gradient checkpointing,
  STAPO's recipe) on a random Qwen3-0.6B-shaped model; then the same run killed (SIGKILL) once its
  step-2 checkpoint exists and continued with ``--resume``: its step-3 metrics must equal the
  uninterrupted run's, bit for bit (deterministic kernels requested; steps 1-2 are compared too, so
  a kernel that is not deterministic shows as such rather than as a resume bug).
- ``attention``: packed micro-batches with per-sequence attention (``sdpa_varlen``) vs row-padded
  micro-batches vs packed rows under transformers' sdpa (block-diagonal mask), on one long-tailed
  batch: time and peak memory of the statistics pass and of one update; log-probs must agree to
  1e-2 (bf16 against bf16).
- ``tokenstats``: benchmarks/tokenstats.py, fused vs naive token statistics at vocab 151,936.
- ``vs_trl`` (only when named in ``--parts``: it does not fit after the others): benchmarks/vs_trl.py,
  stapo vs TRL's GRPOTrainer on the same model and batch.

    python benchmarks/gpu_suite.py --out $OUT --budget-s 500            # on the GPU machine
    python benchmarks/gpu_suite.py --out runs/x --budget-s 500 --dry-run  # CPU, tiny shapes
    python benchmarks/gpu_suite.py --part train_resume --json r.json --model-dir D   # one part, no budget
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESERVE_S = 8  # kept back for writing the report
LOG_CAP = 2 * 2**20  # bytes of each part's log kept in parts.log (its tail)


@dataclass(frozen=True)
class Part:
    """One part: what it measures, its cost (GPU: stated; dry run: measured here), how it runs."""

    name: str
    what: str
    gpu_s: int
    dry_s: int
    model: str | None  # the random model it needs: "large" (Qwen3-1.7B) or "small" (Qwen3-0.6B); tiny in a dry run
    argv: Callable[[argparse.Namespace, Path], list[str]]  # (args, json file) -> command
    default: bool = True  # run without --parts


def _self(part: str) -> Callable[[argparse.Namespace, Path], list[str]]:
    def argv(a: argparse.Namespace, out: Path) -> list[str]:
        return [sys.executable, __file__, "--part", part, "--json", str(out), "--model-dir", a.model_dir,
                "--small-model-dir", a.small_model_dir, "--work", a.work] + (["--dry-run"] if a.dry_run else [])

    return argv


def _checks(a: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, str(HERE / "gpu_checks.py"), "--out", str(out)] + (
        ["--dry-run"] if a.dry_run else ["--device", "cuda"])


def _tokenstats(a: argparse.Namespace, out: Path) -> list[str]:
    shape = (["--tokens", "256", "--hidden", "64", "--repeats", "1", "--device", "cpu", "--dtype", "float32"]
             if a.dry_run else ["--tokens", "16384", "--hidden", "2048", "--device", "cuda", "--dtype", "bfloat16"])
    # naive vs fused (each variant is a process of its own: chunked would add one more)
    return [sys.executable, str(HERE / "tokenstats.py"), "--vocab", "151936", *shape, "--variants", "naive,fused",
            "--json"]  # JSON on stdout


def _vs_trl(a: argparse.Namespace, out: Path) -> list[str]:
    shape = (["--device", "cpu", "--dtype", "float32", "--prompts", "2", "--n", "2", "--max-new-tokens", "8",
              "--micro", "2", "--steps", "2"] if a.dry_run else
             ["--device", "cuda", "--dtype", "bfloat16", "--prompts", "16", "--n", "8", "--max-new-tokens", "512",
              "--micro", "8", "--steps", "2", "--gradient-checkpointing"])
    return [sys.executable, str(HERE / "vs_trl.py"), *shape, "--rounds", "1", "--model", a.model_dir,
            "--force-length", "--sides", "stapo,trl,stapo-none", "--json", str(out)]


PARTS = [
    Part("checks", "CUDA numerics vs same-precision references (benchmarks/gpu_checks.py)", 60, 60, None, _checks),
    Part("zero3_train", "2 stapo train steps, DeepSpeed ZeRO-3 at world size 1, zero.Init, bf16, plan, checkpoint",
         100, 70, "large", _self("zero3_train")),
    Part("sync_stream", "ZeRO-3 weight sync streamed into preallocated buffers at two bucket sizes: peak",
         45, 45, "large", _self("sync_stream")),
    Part("update_memory", "peak of an update after a warm-up one, 8 x 8,192 tokens, kept graphs; vs the plan's update",
         75, 60, "large", _self("update_memory")),
    Part("train_resume", "3 stapo train steps on Qwen3-0.6B, SIGKILL after step 2's checkpoint, --resume: step 3 equal",
         120, 200, "small", _self("train_resume")),
    Part("attention", "packed sdpa_varlen vs row-padded vs packed sdpa: time, memory, log-probs to 1e-2",
         60, 60, "large", _self("attention")),
    Part("tokenstats", "fused vs naive token statistics at vocab 151,936", 30, 40, None, _tokenstats),
    # cut from the default run: 240 s against what the parts above leave of 540; run it alone
    # (--parts vs_trl, its wheels with --extras train,bench) when a second command fits the lease
    Part("vs_trl", "stapo vs TRL GRPOTrainer, 16 prompts x 8 x 512 tokens", 240, 120, "large", _vs_trl, default=False),
]
MODEL_COST = {"gpu": {"large": 25, "small": 12}, "dry": {"large": 40, "small": 0}}  # dry: one tiny model serves both
ARCH = {"large": "qwen3-1.7b", "small": "qwen3-0.6b"}


# ----------------------------------------------------------------------------- shared helpers


def _device(dry: bool) -> str:
    return "cpu" if dry else "cuda"


def _peak_reset(dev: str) -> None:
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(dev: str) -> float | None:
    """Peak GPU memory allocated since the last reset (None on CPU: no allocator to read)."""
    import torch

    if dev != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def _sync(dev: str) -> None:
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def _long_tail_batch(vocab: int, lengths: list[int], prompt_len: int, group: int, seed: int = 0) -> Any:
    """Rows prompt + response with the given response lengths, ``group`` responses per prompt."""
    import torch

    from stapo.core.batch import collate
    from stapo.core.train import loop

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i, r in enumerate(lengths):
        if i % group == 0:
            prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        s = loop.Sequence_(prompt, torch.randint(3, vocab, (r,), generator=g).tolist(), "stop", "", "0", i // group)
        s.advantage = float(torch.randn(1, generator=g))
        seqs.append(s)
    return collate(seqs, pad_id=0)


def _update_cfg(model_dir: str, dev: str, trainer: dict[str, Any], algorithm: dict[str, Any] | None = None) -> Any:
    from stapo.core.config import config_from_dict

    return config_from_dict({
        "model": {"name_or_path": model_dir, "gradient_checkpointing": True},
        "trainer": {"device": dev, "lr": 1e-6, "logits_chunk_size": 2048, "share_prompt_prefix": False, **trainer},
        "algorithm": {"token_weighting": "s2t", "mini_batches": 1, "ppo_epochs": 1,
                      "s2t": {"tau_p": 0.002, "q": 0.75}, **(algorithm or {})},
    })


# ----------------------------------------------------------------------------- part: train_resume


def _train_overrides(a: argparse.Namespace, model_dir: str) -> list[str]:
    dry = a.dry_run
    return [
        f"model.name_or_path={model_dir}", "model.dtype=bfloat16", "model.gradient_checkpointing=true",
        "data.source=arithmetic", "data.template=short", "data.val_size=0", "eval.every=0",
        "rollout.engine=hf", f"rollout.prompts_per_step={2 if dry else 4}", "rollout.n=4",
        f"rollout.max_new_tokens={8 if dry else 128}", "rollout.batch_size=16",
        "trainer.backend=torch", f"trainer.device={_device(dry)}", "trainer.max_steps=3", "trainer.lr=1e-5",
        "trainer.warmup_steps=0", "trainer.micro_batch_size=4",
        # a random model is never right, so every group's advantages are 0: the entropy bonus gives the
        # update a gradient all the same (optimizer moments to restore), and no group is dropped
        "algorithm.entropy_coef=0.001", "trainer.entropy_grad=true", "algorithm.dynamic_sampling=false",
        "algorithm.overlong.filter=false", f"algorithm.overlong.buffer={4 if dry else 64}", "algorithm.mini_batches=2",
        "reward.urls=[]", f"reward.workers={1 if dry else 2}", "checkpoint.every=2", "checkpoint.keep_last=1",
        "checkpoint.export_hf=false", "logging.tensorboard=false", "logging.live=false",
        "logging.dump_tokens_every=0",
    ]


# torch's deterministic kernels (cuBLAS needs the workspace setting), then the CLI as `stapo` runs it
_DETERMINISTIC = ("import sys, torch; torch.use_deterministic_algorithms(True, warn_only=True); "
                  "from stapo.cli.main import main; sys.argv[0] = 'stapo'; main()")


def _stapo(args: list[str], log: Path, **kw: Any) -> subprocess.Popen:
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", _DETERMINISTIC, *args], stdout=log.open("a"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True, **kw)


def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "memory/"))} for r in rows]


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return f"{k}: {a.get(k)!r} vs {b.get(k)!r}"
    return None


def _scratch(a: argparse.Namespace, need_gib: float) -> Path:
    """A folder with room for the checkpoints (tmpfs first: fast, and the disk holds the image)."""
    for root in ("/dev/shm", a.work, "/tmp"):
        if os.path.isdir(root) and shutil.disk_usage(root).free / 2**30 >= need_gib:
            return Path(root) / "stapo-gpu-suite-train"
    raise RuntimeError(f"no folder with {need_gib:.0f} GiB free for two checkpoints (/dev/shm, {a.work}, /tmp)")


def part_train_resume(a: argparse.Namespace) -> dict[str, Any]:
    from stapo.configs import preset_path
    from stapo.core.config import load_config

    over = _train_overrides(a, a.small_model_dir)
    cfg = load_config(preset_path("stapo"), over)  # checked here, before any process starts
    n_params = _param_count(a.small_model_dir)
    # fp32 weights + two AdamW moments per checkpoint; at most two checkpoints at once (keep_last 1)
    need = 2 * 12 * n_params / 2**30 + 1
    root = _scratch(a, need)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log = Path(a.work) / "train_resume.runs.log"
    sets = [x for o in over for x in ("--set", o)]
    out: dict[str, Any] = {"config": over, "scratch": str(root), "params": n_params,
                           "algorithm": cfg.algorithm.name, "steps": 3}
    t0 = time.time()
    run_a, run_b = root / "a", root / "b"
    rc = _stapo(["train", "--config", "stapo", "--run-dir", str(run_a), *sets], log).wait()
    out["uninterrupted"] = {"rc": rc, "seconds": round(time.time() - t0, 1)}
    rows_a = _rows(run_a)
    shutil.rmtree(run_a / "checkpoints", ignore_errors=True)  # room for run b's
    if rc != 0 or len(rows_a) != 3:
        out["ok"] = False
        out["error"] = f"the uninterrupted run exited {rc} with {len(rows_a)} metrics rows (train_resume.runs.log)"
        return out
    t1 = time.time()
    proc = _stapo(["train", "--config", "stapo", "--run-dir", str(run_b), *sets], log)
    marker = run_b / "checkpoints" / "step_000002" / "meta.json"
    while proc.poll() is None and not marker.exists():
        time.sleep(0.05)
    killed = proc.poll() is None
    if killed:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    rows_killed = _rows(run_b)
    out["killed"] = {"seconds": round(time.time() - t1, 1), "killed": killed, "rows_before_resume": len(rows_killed)}
    if not killed or len(rows_killed) != 2:
        out["ok"] = False
        out["error"] = (f"the kill was to land in step 3 (after step 2's checkpoint): the run "
                        f"{'was killed' if killed else 'had ended'} with {len(rows_killed)} rows")
        return out
    t2 = time.time()
    rc = _stapo(["train", "--config", "stapo", "--run-dir", str(run_b), "--resume", *sets], log).wait()
    rows_b = _rows(run_b)
    out["resumed"] = {"rc": rc, "seconds": round(time.time() - t2, 1), "rows": len(rows_b)}
    shutil.rmtree(root, ignore_errors=True)
    if rc != 0 or len(rows_b) != 3:
        out["ok"] = False
        out["error"] = f"the resumed run exited {rc} with {len(rows_b)} metrics rows"
        return out
    diffs = {f"step{i + 1}": _first_difference(rows_a[i], rows_b[i]) for i in range(3)}
    out["differences"] = diffs
    out["step3"] = {k: rows_b[2].get(k) for k in ("actor/loss", "actor/grad_norm", "entropy/mean", "reward/mean")}
    if diffs["step1"] or diffs["step2"]:
        out["ok"] = False
        out["verdict"] = ("steps 1-2 already differ between two uninterrupted runs: this GPU's kernels were not "
                          "deterministic here, so the resume cannot be judged bit for bit")
    else:
        out["ok"] = diffs["step3"] is None
        out["verdict"] = "step 3 after the kill and --resume equals the uninterrupted run's" if out["ok"] else (
            "steps 1-2 equal, step 3 differs: the resume did not restore the state exactly")
    return out


def _param_count(model_dir: str) -> int:
    """Parameters of the model in ``model_dir`` from its config (no weights loaded)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    d, inter, layers, v = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    hd = getattr(c, "head_dim", None) or d // c.num_attention_heads
    attn = d * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    return v * d * (1 if getattr(c, "tie_word_embeddings", False) else 2) + layers * (attn + 3 * d * inter)


# ----------------------------------------------------------------------------- part: zero3_train


def _zero3_overrides(a: argparse.Namespace) -> list[str]:
    """The stapo recipe's DeepSpeed ZeRO-3 path at world size 1 with the hf engine (bf16 on the GPU; the
    CPU's DeepSpeed trains fp32), 2 steps, a checkpoint at step 2; the rest as train_resume's."""
    over = [o for o in _train_overrides(a, a.model_dir)
            if not o.startswith(("trainer.backend=", "trainer.max_steps=", "model.dtype="))]
    return [*over, "trainer.backend=deepspeed", "trainer.zero_stage=3", "trainer.max_steps=2",
            f"model.dtype={'float32' if a.dry_run else 'bfloat16'}"]


def part_zero3_train(a: argparse.Namespace) -> dict[str, Any]:
    from stapo.configs import preset_path
    from stapo.core.config import load_config

    over = _zero3_overrides(a)
    cfg = load_config(preset_path("stapo"), over)
    run = Path(a.work) / "zero3_train"
    shutil.rmtree(run, ignore_errors=True)
    log = Path(a.work) / "zero3_train.run.log"
    log.unlink(missing_ok=True)
    sets = [x for o in over for x in ("--set", o)]
    t0 = time.time()
    rc = _stapo(["train", "--config", "stapo", "--run-dir", str(run), *sets], log).wait()
    text = log.read_text(errors="replace") if log.exists() else ""
    plan_line = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith(("per-GPU peak:", "memory plan:"))),
                     None)
    path = run / "metrics.jsonl"
    raw = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    ckpt = run / "checkpoints" / "step_000002"
    out = {"config": over, "backend": cfg.trainer.backend, "zero_stage": cfg.trainer.zero_stage, "rc": rc,
           "seconds": round(time.time() - t0, 1), "rows": len(raw), "plan_line": plan_line,
           "checkpoint": ckpt.is_dir(), "memory": {k: v for k, v in (raw[-1] if raw else {}).items()
                                                   if k.startswith("memory/")},
           "loss": [r.get("actor/loss") for r in raw]}
    # on the GPU the plan runs at start on the real card and prints its line; the CPU says it skipped it
    planned = plan_line is not None and (a.dry_run or plan_line.startswith("per-GPU peak:"))
    out["ok"] = rc == 0 and len(raw) == 2 and ckpt.is_dir() and planned and all(
        isinstance(v, float) and v == v for v in out["loss"])
    shutil.rmtree(run, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- part: sync_stream


def part_sync_stream(a: argparse.Namespace) -> dict[str, Any]:
    """The ZeRO-3 sync streamed into preallocated buffers (a consumer that copies, as vLLM does) at
    two bucket sizes: what the allocator holds above the partitions and the buffers at the peak."""
    import torch

    from stapo.core.config import config_from_dict
    from stapo.core.trainer import build_trainer_backend, load_context
    from stapo.core.trainer.models import load_policy

    dev = _device(a.dry_run)
    dtype = torch.float32 if a.dry_run else torch.bfloat16
    cfg = config_from_dict({"model": {"name_or_path": a.model_dir, "dtype": "float32" if a.dry_run else "bfloat16"},
                            "trainer": {"backend": "deepspeed", "zero_stage": 3, "device": dev}})
    model, _ = load_policy(cfg.model, device="cpu", compute_device=dev, init_context=load_context(cfg))
    b = build_trainer_backend(cfg, model, total_optimizer_steps=1)
    buffers: dict[str, Any] = {}
    for name, t in b.named_parameters_for_sync():  # the consumer's weights, allocated once
        buffers[name] = torch.empty(t.shape, dtype=dtype, device=t.device)
        buffers[name].copy_(t)
    largest = max(t.numel() * t.element_size() for t in buffers.values())
    out: dict[str, Any] = {"device": dev, "tensors": len(buffers), "largest_param_mib": round(largest / 2**20, 1),
                           "buckets": {}}
    ok = True
    for mb in (0, 64 if a.dry_run else 512):
        b.tcfg = b.tcfg.model_copy(update={"sync_bucket_mb": float(mb)})
        _peak_reset(dev)
        base = torch.cuda.memory_allocated() / 2**30 if dev == "cuda" else None
        t0 = time.perf_counter()
        n = 0
        for name, t in b.named_parameters_for_sync():
            buffers[name].copy_(t)
            n += 1
        _sync(dev)
        peak = _peak_gib(dev)
        bound = max(mb * 2**20, largest) / 2**30
        row: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 3), "tensors": n}
        if peak is not None and base is not None:
            above = peak - base
            # one bucket (or the largest parameter) gathered, and the allocator's rounding: 10% + 64 MiB
            row.update(above_partitions_gib=round(above, 4), bound_gib=round(bound, 4), within=above <= bound * 1.1 + 1 / 16)
            ok = ok and row["within"]
        ok = ok and n == len(buffers)
        out["buckets"][f"{mb} MiB"] = row
    out["ok"] = ok
    return out


# ----------------------------------------------------------------------------- part: update_memory


def _plan_peak(a: argparse.Namespace, over: list[str]) -> dict[str, Any]:
    """``stapo train --plan --json``'s figures for the same config, or why there are none."""
    helptext = subprocess.run([sys.executable, "-m", "stapo.cli.main", "train", "--help"], capture_output=True,
                              text=True).stdout
    if "--plan" not in helptext:
        return {"plan": None, "note": "this tree's `stapo train` has no --plan: the measured peak stands alone"}
    sets = [x for o in over for x in ("--set", o)]
    p = subprocess.run([sys.executable, "-m", "stapo.cli.main", "train", "--config", "stapo", "--plan",
                        "--world-size", "1", "--json", *sets], capture_output=True, text=True, timeout=120)
    try:
        plan = json.loads(p.stdout[p.stdout.index("{"):])
    except ValueError:
        return {"plan": None, "note": f"--plan exited {p.returncode} without a JSON object: {p.stderr[-500:]}"}
    return {"plan": plan}


def part_update_memory(a: argparse.Namespace) -> dict[str, Any]:
    from stapo.core.train import update
    from stapo.core.train.hooks import Hooks
    from stapo.core.trainer.models import load_policy
    from stapo.core.trainer.torch_backend import TorchBackend

    dev = _device(a.dry_run)
    n_resp, resp_len, prompt_len, budget = (8, 64, 16, 128) if a.dry_run else (8, 8192, 256, 16384)
    micro = {"micro_batch_size": 1, "micro_batch_tokens": budget, "attn_implementation": "sdpa_varlen"}
    cfg = _update_cfg(a.model_dir, dev, micro)
    model, _ = load_policy(cfg.model, device=dev)
    b = TorchBackend(cfg, model, total_optimizer_steps=1)
    batch = _long_tail_batch(model.config.vocab_size, [resp_len] * n_resp, prompt_len, group=4).to(b.device)
    parts = update.update_parts(cfg)
    actor = update.Actor(cfg, b, Hooks())
    t0 = time.perf_counter()
    actor.update(update.UpdateInputs(batch, None, None, step=1))  # warm-up: AdamW's moments now exist
    _sync(dev)
    warm_s = time.perf_counter() - t0
    _peak_reset(dev)
    before = _peak_gib(dev)
    t0 = time.perf_counter()
    metrics = actor.update(update.UpdateInputs(batch, None, None, step=2))
    _sync(dev)
    out = {"device": dev, "responses": n_resp, "response_tokens": resp_len, "prompt_tokens": prompt_len,
           "micro_batch_tokens": budget, "keeps_graphs": bool(parts.reads_stats), "gradient_checkpointing": True,
           "warmup_update_s": round(warm_s, 2), "allocated_before_update_gib": before, "peak_gib": _peak_gib(dev),
           "update_s": round(time.perf_counter() - t0, 2), "loss": metrics.get("actor/loss")}
    over = [f"model.name_or_path={a.model_dir}", "model.gradient_checkpointing=true", "trainer.backend=torch",
            "rollout.engine=hf", f"rollout.max_new_tokens={resp_len}", "rollout.n=4", "rollout.prompts_per_step=2",
            f"data.max_prompt_tokens={prompt_len}", f"algorithm.overlong.buffer={min(1024, resp_len // 4)}",
            f"trainer.micro_batch_tokens={budget}", "algorithm.mini_batches=1", "trainer.device=" + dev]
    out.update(_plan_peak(a, over))
    plan = out.get("plan") or {}
    phase = (plan.get("phases_gib") or {}).get("update")
    if phase is not None:  # the allocator does not see the CUDA context the plan allows for
        out["plan_update_gib"] = phase - plan.get("runtime_gib", 0.0)
        if out["peak_gib"] is not None:
            out["measured_over_plan_update"] = out["peak_gib"] / out["plan_update_gib"]
    out["ok"] = all(v == v for v in metrics.values() if isinstance(v, float))  # finite metrics (no NaN)
    return out


# ----------------------------------------------------------------------------- part: attention


def part_attention(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from stapo.core.train import update
    from stapo.core.train.hooks import Hooks
    from stapo.core.trainer.models import load_policy
    from stapo.core.trainer.torch_backend import TorchBackend

    sys.path.insert(0, str(HERE))
    from longtail import lengths

    dev = _device(a.dry_run)
    n, median, hi, prompt_len, budget, rows = ((8, 24, 64, 8, 128, 4) if a.dry_run else
                                               (16, 1500, 8192, 256, 16384, 4))
    lens = lengths(n, median=median, sigma=0.8, lo=16, hi=hi, seed=0)
    lens[0] = hi  # the long tail's end is always there
    layouts = {
        "packed sdpa_varlen": {"micro_batch_size": 1, "micro_batch_tokens": budget, "attn_implementation": "sdpa_varlen"},
        f"padded ({rows} rows)": {"micro_batch_size": rows},
        "packed sdpa (block mask)": {"micro_batch_size": 1, "micro_batch_tokens": budget, "attn_implementation": "sdpa"},
    }
    base_cfg = _update_cfg(a.model_dir, dev, {})
    model, _ = load_policy(base_cfg.model, device="cpu")
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batch = None
    out: dict[str, Any] = {"device": dev, "response_lengths": sorted(lens), "prompt_tokens": prompt_len, "layouts": {}}
    ref_lp = None
    # bf16 autocast on CUDA on every side: two bf16 computations of the same log-prob differ by a few
    # bf16 ulps of the logits (2^-8 relative each); 1e-2 absolute in log-prob is ~2-3 ulps at |logit| ~ 1-4
    tol = 1e-2
    for name, micro in layouts.items():
        model.load_state_dict(start)
        cfg = _update_cfg(a.model_dir, dev, micro)
        b = TorchBackend(cfg, model, total_optimizer_steps=1)
        if batch is None:
            batch = _long_tail_batch(model.config.vocab_size, lens, prompt_len, group=4).to(b.device)
        _peak_reset(dev)
        t0 = time.perf_counter()
        lp, _ = update.Actor(cfg, b).old_stats(batch)
        _sync(dev)
        stats_s, stats_peak = time.perf_counter() - t0, _peak_gib(dev)
        _peak_reset(dev)
        t0 = time.perf_counter()
        update.Actor(cfg, b, Hooks()).update(update.UpdateInputs(batch, None, None, step=1))
        _sync(dev)
        row = {"stats_s": round(stats_s, 3), "stats_peak_gib": stats_peak,
               "update_s": round(time.perf_counter() - t0, 3), "update_peak_gib": _peak_gib(dev)}
        mask = batch.response_mask.bool()
        lp = lp.float().cpu()[mask.cpu()]
        if ref_lp is None:
            ref_lp = lp
        else:
            row["max_abs_logprob_diff_vs_packed_varlen"] = float((lp - ref_lp).abs().max())
        out["layouts"][name] = row
        del b  # its AdamW moments: 2 x fp32 weights
        model.zero_grad(set_to_none=True)
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    out["logprob_tolerance"] = tol
    out["ok"] = all(r.get("max_abs_logprob_diff_vs_packed_varlen", 0.0) <= tol for r in out["layouts"].values())
    return out


IN_PROCESS = {"zero3_train": part_zero3_train, "sync_stream": part_sync_stream, "train_resume": part_train_resume,
              "update_memory": part_update_memory, "attention": part_attention}


# ----------------------------------------------------------------------------- the driver


def _run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    t0 = time.time()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    return rc, time.time() - t0


def _result(js: Path, log: Path) -> dict[str, Any]:
    """The part's JSON: its file, else the JSON object it printed last (tokenstats.py prints one)."""
    if js.exists():
        res = json.loads(js.read_text())
    else:
        text = log.read_text(errors="replace")
        try:
            res = json.loads(text[text.rindex("\n{") + 1:])
        except ValueError:
            return {}
    return res if isinstance(res, dict) else {"rows": res}


def _tail(path: Path, cap: int) -> str:
    data = path.read_bytes() if path.exists() else b""
    return (b"[... cut ...]\n" + data[-cap:] if len(data) > cap else data).decode(errors="replace")


def drive(a: argparse.Namespace) -> int:
    deadline = time.time() + a.budget_s - RESERVE_S
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    key = "dry" if a.dry_run else "gpu"
    names = a.parts.replace(",", " ").split() if a.parts else [p.name for p in PARTS if p.default]
    unknown = [n for n in names if n not in {p.name for p in PARTS}]
    if unknown:
        raise SystemExit(f"--parts: unknown {', '.join(unknown)}; the parts are {', '.join(p.name for p in PARTS)}")
    chosen = [p for p in PARTS if p.name in names]
    report: dict[str, Any] = {"dry_run": a.dry_run, "budget_s": a.budget_s, "machine": _machine(),
                              "cost_basis": "measured on this CPU machine" if a.dry_run else
                              "stated (no GPU timing existed when the costs were written)", "parts": {}}
    logs: list[Path] = []

    def left() -> float:
        return deadline - time.time()

    dirs = {"large": a.model_dir, "small": a.small_model_dir}

    def make_model(which: str) -> None:  # before the first part that needs it
        if (Path(dirs[which]) / "config.json").exists():
            return
        arch = "tiny-qwen3" if a.dry_run else ARCH[which]
        log = work / f"model-{which}.log"
        logs.append(log)
        if left() < MODEL_COST[key][which]:
            report.setdefault("models", {})[which] = {"skipped": "no time left"}
            return
        rc, s = _run([sys.executable, str(HERE / "make_random_model.py"), "--arch", arch, "--out", dirs[which]],
                     log, left())
        report.setdefault("models", {})[which] = {"arch": arch, "rc": rc, "seconds": round(s, 1)}

    for p in chosen:
        if p.model is not None and left() >= (p.dry_s if a.dry_run else p.gpu_s):
            make_model(p.model)
        cost = p.dry_s if a.dry_run else p.gpu_s
        res: dict[str, Any]
        if left() < cost:
            res = {"ok": None, "skipped": f"needs ~{cost} s ({'measured' if a.dry_run else 'stated'}), "
                                         f"{max(left(), 0):.0f} s left"}
        elif p.model is not None and not (Path(dirs[p.model]) / "config.json").exists():
            res = {"ok": False, "error": "no model: the random-model step failed (parts.log)"}
        else:
            js, log = work / f"{p.name}.json", work / f"{p.name}.log"
            js.unlink(missing_ok=True)
            logs.append(log)
            rc, s = _run(p.argv(a, js), log, left())
            res = _result(js, log)
            res.setdefault("ok", rc == 0)
            res.update(rc=rc, seconds=round(s, 1), cost_s=cost)
            if rc == 124:  # its cost was underestimated: cut like a skipped part, and said
                res.update(ok=None, cut=f"stopped at the budget's end after {s:.0f} s (cost {cost} s)")
            elif rc != 0 and "error" not in res:
                res["ok"] = False
                res["error"] = f"exit {rc}: " + _tail(log, 600).strip().splitlines()[-1] if _tail(log, 600).strip() else ""
        report["parts"][p.name] = res
        state = "skipped" if "skipped" in res else "cut" if "cut" in res else ("ok" if res.get("ok") else "FAILED")
        print(f"{p.name:14s} {state:8s} {res.get('seconds', 0):7.1f} s  "
              f"{res.get('skipped') or res.get('cut') or res.get('verdict') or res.get('error') or ''}", flush=True)
    train_log = work / "train_resume.runs.log"
    if train_log.exists():
        logs.append(train_log)
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    with (out / "parts.log").open("w") as f:
        for log in logs:
            f.write(f"\n===== {log.name}\n{_tail(log, LOG_CAP)}")
    failed = [n for n, r in report["parts"].items() if r.get("ok") is False]
    print(f"gpu_suite: {len(report['parts'])} parts, failed: {', '.join(failed) or 'none'}; report {out}/results.json")
    return 1 if failed else 0


def _machine() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch
        import transformers

        info.update(torch=torch.__version__, transformers=transformers.__version__,
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception as err:  # noqa: BLE001 - the report says what could not be read
        info["error"] = f"{type(err).__name__}: {err}"
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, dry-run costs")
    p.add_argument("--budget-s", type=float, default=540.0, help="seconds left for every part together")
    p.add_argument("--parts", default="", help=f"a subset, in any order ({', '.join(x.name for x in PARTS)})")
    p.add_argument("--out", default="runs/gpu_suite")
    p.add_argument("--work", default="/tmp/stapo-gpu-suite", help="scratch: part logs, JSON, checkpoints")
    p.add_argument("--model-dir", default="", help="the random Qwen3-1.7B (default: WORK/model-<arch>)")
    p.add_argument("--small-model-dir", default="", help="the random Qwen3-0.6B of train_resume (default: WORK/model-<arch>)")
    p.add_argument("--part", default="", help=argparse.SUPPRESS)
    p.add_argument("--json", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.model_dir = a.model_dir or str(Path(a.work) / ("model-tiny-qwen3" if a.dry_run else "model-qwen3-1.7b"))
    # a dry run's one tiny model serves both
    a.small_model_dir = a.small_model_dir or (a.model_dir if a.dry_run else str(Path(a.work) / "model-qwen3-0.6b"))
    if a.part:  # one part, in this process: its result to --json
        if not a.dry_run:
            import torch

            if not torch.cuda.is_available():
                raise SystemExit("gpu_suite: no GPU visible to torch (use --dry-run on a CPU machine)")
        res = IN_PROCESS[a.part](a)
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
        print(json.dumps(res, indent=1, default=str))
        sys.exit(0 if res.get("ok") else 1)
    sys.exit(drive(a))


if __name__ == "__main__":
    main()
