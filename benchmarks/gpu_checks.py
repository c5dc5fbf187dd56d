"""CUDA correctness checks, one process, one JSON report (run by benchmarks/gpu_suite.sh).

Each check compares a CUDA path against an independent reference and records its errors and a
verdict; a failing check does not stop the others (the report says which broke, for
docs/training-backends.md). ``--dry-run`` runs every check on the CPU with tiny shapes, so the
script itself is proven before a GPU lease is spent on it.

Checks:

1. ``tokenstats``: chunked (``token_logprobs_entropy_from_hidden``) and fused
   (``fused_token_loss_from_hidden``) log-probs, entropies and gradients w.r.t. hidden and the LM head
   against the naive full-logits computation in float64 from the same inputs, in float32 and
   bfloat16 (tolerances: fp32 1e-4 relative, bf16 3e-2 relative: bf16 has 8 mantissa bits).
2. ``backend_bf16``: the torch backend's bf16 autocast step on CUDA (fused and unfused loss) against
   the same step in float32 on the CPU: gradient cosine similarity >= 0.99 and relative norm error
   <= 5e-2, finite updated weights.
3. ``deepspeed``: ZeRO-0 and ZeRO-3 on one device (world size 1) against the torch backend on the same
   device: parameters after two updates (bf16 on CUDA: relative tolerance; fp32 on CPU: 1e-5).
4. ``generation``: the hf rollout engine on the device (prefix sharing on and off): sampled tokens'
   log-probs against a teacher-forced forward over prompt + completion.

    python benchmarks/gpu_checks.py --device cuda --out $OUT/gpu_checks.json
    python benchmarks/gpu_checks.py --dry-run                  # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from typing import Any

import torch
import torch.nn.functional as F


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ----------------------------------------------------------------------------- 1. token statistics


def check_tokenstats(dev: torch.device, tiny: bool) -> dict[str, Any]:
    from stapo.core.tokenstats import fused_token_loss_from_hidden, token_logprobs_entropy_from_hidden

    n, d, v = (64, 32, 1000) if tiny else (4096, 2048, 151_936)
    out: dict[str, Any] = {"shape": [n, d, v]}
    ok = True
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        g = torch.Generator(device="cpu").manual_seed(0)
        h0 = (torch.randn(n, d, generator=g) * 0.5).to(dev, dtype)
        w0 = (torch.randn(v, d, generator=g) * 0.02).to(dev, dtype)
        labels = torch.randint(0, v, (n,), generator=g).to(dev)
        adv = torch.randn(n, generator=g).to(dev)

        def loss_of(lp: torch.Tensor, idx: torch.Tensor, adv: torch.Tensor = adv) -> torch.Tensor:  # elementwise
            return -adv[idx] * torch.exp(lp - lp.detach()) / n

        # reference: float64 naive from the same (rounded) inputs
        h, w = h0.double().requires_grad_(), w0.double().requires_grad_()
        logp = torch.log_softmax(h @ w.T, -1)
        lp_ref = logp.gather(1, labels[:, None])[:, 0]
        ent_ref = -(logp.exp() * logp).sum(-1)
        loss_of(lp_ref, torch.arange(n, device=dev)).sum().backward()
        gh_ref, gw_ref = h.grad, w.grad
        res: dict[str, Any] = {}
        for variant in ("chunked", "fused"):
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            if variant == "chunked":
                lp, ent = token_logprobs_entropy_from_hidden(h, w, labels, chunk_size=1024)
                loss = loss_of(lp, torch.arange(n, device=dev)).sum()
            else:
                loss, lp, ent = fused_token_loss_from_hidden(h, w, labels, loss_of, chunk_size=1024)
            loss.backward()
            errs = {"logprob": rel(lp, lp_ref), "entropy": rel(ent, ent_ref),
                    "grad_hidden": rel(h.grad, gh_ref), "grad_head": rel(w.grad, gw_ref)}
            errs["ok"] = all(e <= tol for e in errs.values())
            ok &= errs["ok"]
            res[variant] = errs
        out[str(dtype).replace("torch.", "")] = res
    out["ok"] = ok
    return out


# ----------------------------------------------------------------------------- 2. backend bf16 step


def _tiny_cfg(device: str, **trainer: Any) -> Any:
    from stapo.core.config import config_from_dict

    t = {"device": device, "lr": 1e-3, "logits_chunk_size": 64, "micro_batch_size": 4, "max_grad_norm": 1e3}
    t.update(trainer)
    return config_from_dict({
        "model": {"name_or_path": "tiny-random",
                  "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128}},
        "trainer": t,
    })


def _rl_batch(vocab: int, seed: int = 0) -> Any:
    from stapo.core import loop

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for grp in range(2):
        prompt = torch.randint(3, vocab, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(4):
            r = int(torch.randint(2, 9, (1,), generator=g))
            s = loop.Sequence_(prompt, torch.randint(3, vocab, (r,), generator=g).tolist(), "stop", "", "0", grp)
            s.advantage = float(torch.randn(1, generator=g))
            seqs.append(s)
    return loop.collate(seqs, pad_id=0)


def _grads_after(cfg: Any, fused: bool) -> dict[str, torch.Tensor]:
    from types import SimpleNamespace

    from stapo.core import loop
    from stapo.core.models import load_policy
    from stapo.core.trainer.torch_backend import TorchBackend

    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"fused_loss": fused})})
    model, _ = load_policy(cfg.model, device="cpu")
    b = TorchBackend(cfg, model, total_optimizer_steps=2)
    batch = _rl_batch(model.config.vocab_size).to(b.device)
    grads: dict[str, torch.Tensor] = {}
    real = b.step

    def step() -> dict[str, float]:
        grads.update({n: p.grad.detach().float().cpu().clone() for n, p in b.model.named_parameters()
                      if p.grad is not None})
        return real()

    b.step = step
    old_lp, old_ent = loop.token_stats_batched(b, batch, 4, 1.0)
    loop.update_policy(SimpleNamespace(cfg=cfg, backend=b), batch, old_lp, old_ent, step=1)
    assert all(torch.isfinite(p).all() for p in b.model.parameters()), "non-finite weights after the step"
    return grads


def check_backend_bf16(dev: torch.device, tiny: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"autocast": dev.type == "cuda"}
    ok = True
    for fused in (True, False):
        ref = _grads_after(_tiny_cfg("cpu"), fused)
        got = _grads_after(_tiny_cfg(str(dev)), fused)
        a = torch.cat([got[k].flatten() for k in sorted(ref)])
        b = torch.cat([ref[k].flatten() for k in sorted(ref)])
        cos = float(F.cosine_similarity(a.double(), b.double(), dim=0))
        norm_err = float((a.norm() - b.norm()).abs() / b.norm())
        passed = cos >= 0.99 and norm_err <= 5e-2
        ok &= passed
        out["fused" if fused else "unfused"] = {"grad_cosine": cos, "grad_norm_rel_err": norm_err, "ok": passed}
    out["ok"] = ok
    return out


# ----------------------------------------------------------------------------- 3. DeepSpeed on one device


def check_deepspeed(dev: torch.device, tiny: bool) -> dict[str, Any]:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return {"ok": False, "skipped": "deepspeed is not installed (carry its wheel)"}
    from stapo.core.models import load_policy
    from stapo.core.trainer import build_trainer_backend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def two_updates(backend_name: str, stage: int) -> dict[str, torch.Tensor]:
        cfg = _tiny_cfg(str(dev), backend=backend_name, zero_stage=stage)
        model, _ = load_policy(cfg.model, device="cpu")
        b = build_trainer_backend(cfg, model, total_optimizer_steps=2)
        for seed in (1, 2):
            batch = _rl_batch(model.config.vocab_size, seed).to(b.device)
            lp, _ = b.token_stats(batch.input_ids, batch.attention_mask, batch.response_mask, grad=True)
            b.backward(-(lp * batch.advantages).sum() / batch.response_mask.sum())
            b.step()
        return {n: t.detach().float().cpu().clone() for n, t in b.named_parameters_for_sync()}

    ref = two_updates("torch", 0)
    out: dict[str, Any] = {}
    ok = True
    for stage in (0, 3):
        try:
            got = two_updates("deepspeed", stage)
            err = max(rel(got[k] - _start(k), ref[k] - _start(k)) for k in ref)
            abs_err = max(float((got[k] - ref[k]).abs().max()) for k in ref)
            # fp32 on CPU: the weights agree to 1e-5 (tests/e2e/test_trainer_deepspeed.py); bf16 compute on
            # CUDA (torch: autocast, DeepSpeed: its bf16 engine): the updates agree to 5% of their size.
            passed = abs_err <= 1e-5 if dev.type == "cpu" else err <= 5e-2
            out[f"zero{stage}"] = {"max_rel_update_err": err, "max_abs_weight_err": abs_err, "ok": passed}
        except Exception as err:  # report and go on: the GPU results section needs every check's outcome
            out[f"zero{stage}"] = {"ok": False, "error": f"{type(err).__name__}: {err}",
                                   "trace": traceback.format_exc()[-2000:]}
        ok &= out[f"zero{stage}"]["ok"]
    out["ok"] = ok
    return out


_START: dict[str, torch.Tensor] = {}


def _start(name: str) -> torch.Tensor:
    """Initial value of a parameter of the tiny model (updates are compared, not raw weights)."""
    if not _START:
        from stapo.core.models import load_policy

        model, _ = load_policy(_tiny_cfg("cpu").model, device="cpu")
        _START.update({n: p.detach().float().clone() for n, p in model.named_parameters()})
    return _START[name]


# ----------------------------------------------------------------------------- 4. generation


def check_generation(dev: torch.device, tiny: bool) -> dict[str, Any]:
    from stapo.core.config import TinyModel
    from stapo.core.models import build_tiny_model, build_tiny_tokenizer
    from stapo.core.rollout import SamplingParams
    from stapo.core.rollout.hf import HFRolloutEngine

    tok = build_tiny_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128), tok)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
    model = model.to(dev).eval()
    prompts = [[5, 9, 12, 7, 30], [40, 3], [8, 8, 21, 14]]
    out: dict[str, Any] = {}
    ok = True
    for share in (True, False):
        engine = HFRolloutEngine(model, tok, batch_size=12, share_prefix=share)
        groups = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3))
        err, n_tok = 0.0, 0
        for p, comps in zip(prompts, groups, strict=True):
            for c in comps:
                ids = torch.tensor([p + c.token_ids], device=dev)
                with torch.no_grad():
                    lp = torch.log_softmax(model(input_ids=ids).logits[0, len(p) - 1 : -1].float(), -1)
                want = lp.gather(1, torch.tensor(c.token_ids, device=dev)[:, None])[:, 0].cpu()
                err = max(err, float((torch.tensor(c.logprobs) - want).abs().max()))
                n_tok += len(c.token_ids)
        passed = err <= 1e-3 and n_tok > 0
        ok &= passed
        out["shared_prefix" if share else "full_rows"] = {"max_abs_logprob_err": err, "tokens": n_tok, "ok": passed}
    out["ok"] = ok
    return out


CHECKS = {
    "tokenstats": check_tokenstats,
    "backend_bf16": check_backend_bf16,
    "deepspeed": check_deepspeed,
    "generation": check_generation,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: prove the script, not the GPU")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    p.add_argument("--out", default="", help="write the JSON report here")
    args = p.parse_args()
    if args.dry_run:
        args.device = "cpu"
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_checks: --device cuda but torch sees no GPU (use --dry-run on a CPU machine)")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                              "torch": torch.__version__, "dry_run": args.dry_run}
    for name in [c.strip() for c in args.checks.split(",") if c.strip()]:
        if name not in CHECKS:
            raise SystemExit(f"--checks: unknown {name!r}; valid: {', '.join(CHECKS)}")
        t0 = time.time()
        try:
            report[name] = CHECKS[name](dev, args.dry_run)
        except Exception as err:
            report[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
        report[name]["seconds"] = round(time.time() - t0, 1)
        print(f"{name:13s} {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['seconds']} s)", flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    sys.exit(0 if all(report[k].get("ok") for k in CHECKS if k in report) else 1)


if __name__ == "__main__":
    main()
