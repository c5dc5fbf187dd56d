"""CUDA correctness checks, one process, one JSON report (run by benchmarks/gpu_suite.sh).

Each check compares a CUDA path against a reference of the same precision: bf16 against bf16 with a
bf16-sized tolerance, or fp32 against fp32; each result carries its tolerance and the reason for it
(``tolerance``, ``why``), and the script prints both. A failing check does not stop the others.
``--dry-run`` runs every check on the CPU with tiny shapes (fp32 there: the torch backend and the hf
engine autocast to bf16 on CUDA only), so the script is proven before a GPU lease is spent on it.

Checks:

1. ``tokenstats``: chunked (``token_logprobs_entropy_from_hidden``) and fused
   (``fused_token_loss_from_hidden``) log-probs, entropies and gradients w.r.t. hidden and the LM head
   against the naive full-logits computation in the same dtype from the same inputs (fp32: 1e-4
   relative; bf16: 3e-2 relative).
2. ``backend``: the torch backend on the device: its fused and unfused losses under its own autocast
   (bf16 on CUDA) give the same gradients (cosine >= 0.999, norm within 1e-2), and with autocast
   off its fp32 step matches the same fp32 step on the CPU (1e-4 relative).
3. ``deepspeed``: ZeRO-0 and ZeRO-3 on one device (world size 1) against the torch backend on the same
   device. CUDA (bf16 compute on both): the first step's fp32-accumulated gradients agree in
   direction and size, and the fp32 master weights' updates after two steps agree in direction.
   CPU (fp32 on both): gradients within 1e-5, updates after two steps in the same direction.
4. ``generation``: the hf rollout engine on the device (prefix sharing on and off): each sampled
   token's log-prob against a teacher-forced forward over prompt + completion under the same
   autocast (bf16 on CUDA: 5e-2 absolute; fp32: 1e-4).

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
    rules = {torch.float32: (1e-4, "fp32 vs fp32: the same sums in another order (chunks) over V logits"),
             torch.bfloat16: (3e-2, "bf16 vs bf16: both round the logits to 8 bits (2^-8 relative); the "
                                    "chunked matmuls and softmax sums round in another order: a few ulps")}
    for dtype, (tol, why) in rules.items():
        g = torch.Generator(device="cpu").manual_seed(0)
        h0 = (torch.randn(n, d, generator=g) * 0.5).to(dev, dtype)
        w0 = (torch.randn(v, d, generator=g) * 0.02).to(dev, dtype)
        labels = torch.randint(0, v, (n,), generator=g).to(dev)
        adv = torch.randn(n, generator=g).to(dev)

        def loss_of(lp: torch.Tensor, idx: torch.Tensor, adv: torch.Tensor = adv) -> torch.Tensor:  # elementwise
            return -adv[idx] * torch.exp(lp - lp.detach()) / n

        # reference: the naive computation in the same dtype (logits [N, V] in `dtype`, softmax in fp32,
        # as a plain HF forward + loss computes them)
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        logp = torch.log_softmax((h @ w.T).float(), -1)
        lp_ref = logp.gather(1, labels[:, None])[:, 0]
        ent_ref = -(logp.exp() * logp).sum(-1)
        loss_of(lp_ref, torch.arange(n, device=dev)).sum().backward()
        gh_ref, gw_ref = h.grad, w.grad
        res: dict[str, Any] = {"tolerance": tol, "why": why}
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
    from stapo.core.batch import collate
    from stapo.core.train import loop

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for grp in range(2):
        prompt = torch.randint(3, vocab, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(4):
            r = int(torch.randint(2, 9, (1,), generator=g))
            s = loop.Sequence_(prompt, torch.randint(3, vocab, (r,), generator=g).tolist(), "stop", "", "0", grp)
            s.advantage = float(torch.randn(1, generator=g))
            seqs.append(s)
    return collate(seqs, pad_id=0)


def _grads_after(cfg: Any, fused: bool, autocast: bool = True) -> dict[str, torch.Tensor]:
    """Gradients of the first optimizer step of one update on the tiny model (``autocast=False``: the
    backend's bf16 autocast switched off, so CUDA computes in fp32 like the CPU)."""
    import contextlib

    from stapo.core.train import update
    from stapo.core.train.hooks import Hooks
    from stapo.core.trainer.models import load_policy
    from stapo.core.trainer.torch_backend import TorchBackend

    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"fused_loss": fused})})
    model, _ = load_policy(cfg.model, device="cpu")
    b = TorchBackend(cfg, model, total_optimizer_steps=2)
    if not autocast:
        b._autocast = contextlib.nullcontext
    batch = _rl_batch(model.config.vocab_size).to(b.device)
    grads: dict[str, torch.Tensor] = {}
    real = b.step

    def step(**kw: float) -> dict[str, float]:
        if not grads:
            grads.update({n: p.grad.detach().float().cpu().clone() for n, p in b.model.named_parameters()
                          if p.grad is not None})
        return real(**kw)

    b.step = step
    old_lp, old_ent = update.Actor(cfg, b).old_stats(batch)
    update.Actor(cfg, b, Hooks()).update(update.UpdateInputs(batch, old_lp, old_ent, step=1))
    assert all(torch.isfinite(p).all() for p in b.model.parameters()), "non-finite weights after the step"
    return grads


def _flat(g: dict[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    return torch.cat([g[k].flatten().double() for k in keys])


def check_backend(dev: torch.device, tiny: bool) -> dict[str, Any]:
    bf16 = dev.type == "cuda"
    fused, unfused = _grads_after(_tiny_cfg(str(dev)), True), _grads_after(_tiny_cfg(str(dev)), False)
    keys = sorted(unfused)
    a, b = _flat(fused, keys), _flat(unfused, keys)
    cos = float(F.cosine_similarity(a, b, dim=0))
    norm_err = float((a.norm() - b.norm()).abs() / b.norm())
    same = {"grad_cosine": cos, "grad_norm_rel_err": norm_err, "ok": cos >= 0.999 and norm_err <= 1e-2,
            "tolerance": "cosine >= 0.999, norm within 1e-2",
            "why": ("bf16 vs bf16 (the backend's autocast on both): the fused loss computes the same gradient "
                    "with other roundings (2^-8 relative each)" if bf16 else "fp32 vs fp32 (no autocast on CPU)")}
    gpu32, cpu32 = _grads_after(_tiny_cfg(str(dev)), False, autocast=False), _grads_after(_tiny_cfg("cpu"), False)
    err = max(rel(gpu32[k], cpu32[k]) for k in keys)
    fp32 = {"max_rel_grad_err": err, "ok": err <= 1e-4, "tolerance": "relative 1e-4 per tensor",
            "why": "fp32 vs fp32: the device's kernels sum in another order than the CPU's (fp32 eps 1.2e-7)"}
    return {"fused_vs_unfused": same, "fp32_device_vs_cpu": fp32, "autocast": bf16, "ok": same["ok"] and fp32["ok"]}


# ----------------------------------------------------------------------------- 3. DeepSpeed on one device


def check_deepspeed(dev: torch.device, tiny: bool) -> dict[str, Any]:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return {"ok": False, "skipped": "deepspeed is not installed (carry its wheel)"}
    from stapo.core.trainer import build_trainer_backend
    from stapo.core.trainer.models import load_policy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def two_updates(backend_name: str, stage: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(fp32 gradients of the first step, fp32 master weights after two steps)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

        cfg = _tiny_cfg(str(dev), backend=backend_name, zero_stage=stage)
        model, _ = load_policy(cfg.model, device="cpu")
        b = build_trainer_backend(cfg, model, total_optimizer_steps=2)
        ds = backend_name == "deepspeed"
        grads: dict[str, torch.Tensor] = {}
        for seed in (1, 2):
            batch = _rl_batch(model.config.vocab_size, seed).to(b.device)
            lp, _ = b.token_stats(batch.input_ids, batch.attention_mask, batch.response_mask, grad=True)
            b.backward(-(lp * batch.advantages).sum() / batch.response_mask.sum())
            if not grads:
                for n, p in b.model.named_parameters():
                    g = safe_get_full_grad(p) if ds else p.grad
                    grads[n] = g.detach().float().cpu().clone()
            b.step()
        weights = {}
        for n, p in b.model.named_parameters():
            full = safe_get_full_fp32_param(p) if ds else None  # None: the module's weights are the masters
            weights[n] = (p if full is None else full).detach().float().cpu().clone()
        return grads, weights

    ref_g, ref_w = two_updates("torch", 0)
    keys = sorted(ref_w)
    out: dict[str, Any] = {}
    ok = True
    for stage in (0, 3):
        try:
            got_g, got_w = two_updates("deepspeed", stage)
            ua = _flat({k: got_w[k] - _start(k) for k in keys}, keys)
            ub = _flat({k: ref_w[k] - _start(k) for k in keys}, keys)
            u_cos = float(F.cosine_similarity(ua, ub, dim=0))
            adam = ("AdamW divides by sqrt(v) + eps, so a weight whose gradient is near 0 moves by what rounding "
                    "decides: the updates are compared by direction")
            if dev.type == "cpu":
                g_err = max(rel(got_g[k], ref_g[k]) for k in keys)
                res = {"max_rel_grad_err": g_err, "update_cosine": u_cos, "ok": g_err <= 1e-5 and u_cos >= 0.999,
                       "tolerance": "gradients within 1e-5 relative per tensor; update cosine >= 0.999",
                       "why": "fp32 vs fp32 on the CPU (the same sums, DeepSpeed's reductions aside); " + adam}
            else:
                ga, gb = _flat(got_g, keys), _flat(ref_g, keys)
                g_cos = float(F.cosine_similarity(ga, gb, dim=0))
                g_norm = float((ga.norm() - gb.norm()).abs() / gb.norm())
                res = {"grad_cosine": g_cos, "grad_norm_rel_err": g_norm, "update_cosine": u_cos,
                       "ok": g_cos >= 0.99 and g_norm <= 5e-2 and u_cos >= 0.9,
                       "tolerance": "gradient cosine >= 0.99 and norm within 5e-2; master-weight update cosine >= 0.9",
                       "why": ("bf16 vs bf16 compute, fp32 vs fp32 accumulation and masters: DeepSpeed runs a bf16 "
                               "module, autocast keeps norms and softmax in fp32, so gradients agree in direction "
                               "and size, not elementwise; " + adam)}
            out[f"zero{stage}"] = res
        except Exception as err:  # report and go on: the next stage may still run
            out[f"zero{stage}"] = {"ok": False, "error": f"{type(err).__name__}: {err}",
                                   "trace": traceback.format_exc()[-2000:]}
        ok &= out[f"zero{stage}"]["ok"]
    out["ok"] = ok
    return out


_START: dict[str, torch.Tensor] = {}


def _start(name: str) -> torch.Tensor:
    """Initial value of a parameter of the tiny model (updates are compared, not raw weights)."""
    if not _START:
        from stapo.core.trainer.models import load_policy

        model, _ = load_policy(_tiny_cfg("cpu").model, device="cpu")
        _START.update({n: p.detach().float().clone() for n, p in model.named_parameters()})
    return _START[name]


# ----------------------------------------------------------------------------- 4. generation


def check_generation(dev: torch.device, tiny: bool) -> dict[str, Any]:
    from stapo.core.config import TinyModel
    from stapo.core.rollout import SamplingParams
    from stapo.core.rollout.hf import HFRolloutEngine
    from stapo.core.trainer.models import build_tiny_model, build_tiny_tokenizer

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
    if dev.type == "cuda":  # fp32 master weights, bf16 autocast: the hf engine's layout with the torch backend
        tol, why = 5e-2, ("bf16 vs bf16 (the same autocast on both): cached decoding and the full forward round "
                          "logits of magnitude up to ~10 to 8 bits in another order: a few ulps of 2^-8 relative")
    else:
        tol, why = 1e-4, "fp32 vs fp32: cached decoding and the full forward sum in another order"
    for share in (True, False):
        engine = HFRolloutEngine(model, tok, batch_size=12, share_prefix=share)
        groups = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=3))
        err, n_tok = 0.0, 0
        for p, comps in zip(prompts, groups, strict=True):
            for c in comps:
                ids = torch.tensor([p + c.token_ids], device=dev)
                with torch.no_grad(), engine._autocast():  # the engine's own precision (bf16 on CUDA)
                    lp = torch.log_softmax(model(input_ids=ids).logits[0, len(p) - 1 : -1].float(), -1)
                want = lp.gather(1, torch.tensor(c.token_ids, device=dev)[:, None])[:, 0].cpu()
                err = max(err, float((torch.tensor(c.logprobs) - want).abs().max()))
                n_tok += len(c.token_ids)
        passed = err <= tol and n_tok > 0
        ok &= passed
        out["shared_prefix" if share else "full_rows"] = {"max_abs_logprob_err": err, "tokens": n_tok, "ok": passed,
                                                          "tolerance": tol, "why": why}
    out["ok"] = ok
    return out


CHECKS = {
    "tokenstats": check_tokenstats,
    "backend": check_backend,
    "deepspeed": check_deepspeed,
    "generation": check_generation,
}


def _rules(res: dict[str, Any], path: str) -> list[str]:
    """One line per sub-check: its verdict, tolerance and why (the report's nested dicts)."""
    lines = []
    if "tolerance" in res:
        lines.append(f"{path}: {'ok' if res.get('ok') else 'FAILED'}; tolerance {res['tolerance']}: {res.get('why', '')}")
    for k, v in res.items():
        if isinstance(v, dict):
            lines += _rules(v, f"{path}.{k}")
    return lines


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
        for line in _rules(report[name], name):
            print("  " + line, flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    sys.exit(0 if all(report[k].get("ok") for k in CHECKS if k in report) else 1)


if __name__ == "__main__":
    main()
