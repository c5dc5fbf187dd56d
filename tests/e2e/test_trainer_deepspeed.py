"""DeepSpeed backend vs the torch backend on CPU (gloo): the same update at every ZeRO stage.

In-process, world size 1 (one process group for the whole module), plus one two-rank run in
subprocesses that checks data parallelism sums gradients the way the loop expects. No DeepSpeed op
may be JIT-compiled: ``TORCH_EXTENSIONS_DIR`` points at a temporary folder that must stay empty.
Skipped when deepspeed is not installed. Run: ``pytest tests/e2e/test_trainer_deepspeed.py``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("deepspeed")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from stapo.core.config import config_from_dict  # noqa: E402
from stapo.core.trainer import build_trainer_backend  # noqa: E402

V = 64
_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCH_EXTENSIONS_DIR")


@pytest.fixture(scope="module", autouse=True)
def _ds_env(tmp_path_factory):
    """Point JIT builds at an empty folder; restore the env afterwards (the process group stays)."""
    saved = {k: os.environ.get(k) for k in _ENV_KEYS}
    ext = tmp_path_factory.mktemp("torch_extensions")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ext)
    yield ext
    assert not any(ext.iterdir()), f"a DeepSpeed op was compiled: {list(ext.iterdir())}"
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    return LlamaForCausalLM(cfg)


def backend(name: str, stage: int = 0, **trainer):
    t = {
        "backend": name,
        "device": "cpu" if name == "torch" else "auto",
        "zero_stage": stage,
        "lr": 1e-2,
        "weight_decay": 0.01,
        "max_grad_norm": 0.5,
        "warmup_steps": 2,
        "lr_schedule": "cosine",
        "logits_chunk_size": 5,
    }
    t.update(trainer)
    return build_trainer_backend(config_from_dict({"trainer": t}), tiny_model(), total_optimizer_steps=6)


def rollout_batch(seed: int):
    """[B=4, L=10]: left-padded prompts, right-padded responses, per-token loss weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (4, 10), generator=g)
    attn = torch.ones(4, 10, dtype=torch.long)
    attn[0, :3] = 0
    attn[2, :1] = 0
    attn[3, 8:] = 0
    resp = torch.zeros(4, 10, dtype=torch.bool)
    resp[:, 4:] = True
    resp &= attn.bool()
    w = torch.randn(4, 10, generator=g)
    return ids, attn, resp, w


def one_update(b, seed: int, lr_scale: float = 1.0) -> dict[str, float]:
    """Two micro-batches of 2, each loss divided by the global response-token count, then a step
    (at the LR times ``lr_scale``)."""
    ids, attn, resp, w = rollout_batch(seed)
    n = resp.sum()
    for i in (0, 2):
        lp, _ = b.token_stats(ids[i : i + 2], attn[i : i + 2], resp[i : i + 2], grad=True)
        b.backward(-(lp * w[i : i + 2]).sum() / n)
    return b.step(lr_scale=lr_scale)


def params(b) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().cpu().clone() for n, t in b.named_parameters_for_sync()}


def assert_same_params(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].shape == b[n].shape, n
        torch.testing.assert_close(a[n], b[n], atol=atol, rtol=0, msg=n)


@pytest.fixture(scope="module")
def torch_reference():
    """Params and metrics after two updates of the torch backend."""
    b = backend("torch")
    start = params(b)
    m1 = one_update(b, 1)
    p1 = params(b)
    m2 = one_update(b, 2)
    return start, (m1, p1), (m2, params(b))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_same_updates_as_torch(stage, torch_reference):
    start, (m1, p1), (m2, p2) = torch_reference
    b = backend("deepspeed", stage)
    assert b.world_size == 1 and b.rank == 0 and b.device.type == "cpu"
    assert_same_params(params(b), start, atol=0)
    ids, attn, resp, _ = rollout_batch(1)
    lp, ent = b.token_stats(ids, attn, resp, grad=False)
    ref = backend("torch").token_stats(ids, attn, resp, grad=False)
    torch.testing.assert_close(lp, ref[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ref[1], atol=1e-6, rtol=0)
    for (m_ref, p_ref), seed in (((m1, p1), 1), ((m2, p2), 2)):
        m = one_update(b, seed)
        assert m["skipped"] == 0.0 and m["lr"] == pytest.approx(m_ref["lr"], rel=1e-12)
        assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
        assert_same_params(params(b), p_ref)
    assert m1["lr"] == pytest.approx(5e-3) and m2["lr"] == pytest.approx(1e-2)  # warmup 1/2, 2/2


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_nonfinite_update_is_skipped(stage):
    b = backend("deepspeed", stage)
    before = params(b)
    ids, attn, resp, _ = rollout_batch(1)
    lp, _ = b.token_stats(ids, attn, resp, grad=True)
    b.backward(lp.sum() * float("inf"))
    m = b.step()
    assert m["skipped"] == 1.0 and math.isnan(m["grad_norm"]) and m["lr"] == pytest.approx(5e-3)
    assert_same_params(params(b), before, atol=0)
    assert b.current_lr() == pytest.approx(5e-3), "a skipped update does not advance the schedule"
    m = one_update(b, 1)  # the next finite update goes through from clean gradients
    assert m["skipped"] == 0.0 and m["lr"] == pytest.approx(5e-3)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_lr_scale_runs_one_step_at_a_scaled_lr(stage):
    """``step(lr_scale=0.5)`` (VCPO's ESS-scaled step) from the same state moves every parameter half
    as far as the plain step (AdamW's step and its decoupled weight decay are linear in the LR) and
    reports the LR it used; the schedule's LR is the next step's again."""
    a, b = backend("deepspeed", stage), backend("deepspeed", stage)
    start = params(a)
    m_a, m_b = one_update(a, 1), one_update(b, 1, lr_scale=0.5)
    assert m_a["lr"] == pytest.approx(5e-3) and m_b["lr"] == pytest.approx(2.5e-3)
    pa, pb = params(a), params(b)
    assert max(float((pa[n] - start[n]).abs().max()) for n in start) > 1e-4  # the step moved weights
    for n in start:  # (to the float32 rounding of p + delta)
        torch.testing.assert_close(pb[n] - start[n], 0.5 * (pa[n] - start[n]), rtol=1e-4, atol=1e-6, msg=n)
    assert a.current_lr() == b.current_lr() == pytest.approx(1e-2)  # warmup 2/2 for both


@pytest.mark.parametrize("stage", [2, 3])
def test_save_load_round_trip(stage, tmp_path):
    a = backend("deepspeed", stage)
    one_update(a, 1)
    a.save(tmp_path / "trainer")
    m_a = one_update(a, 2)
    b = backend("deepspeed", stage)
    b.load(tmp_path / "trainer")
    assert b.updates_applied == 1
    m_b = one_update(b, 2)
    assert m_b["lr"] == m_a["lr"] and m_b["grad_norm"] == pytest.approx(m_a["grad_norm"], rel=1e-6)
    assert_same_params(params(b), params(a), atol=0)
    # a resume with another LR goes on with it, at the restored place on the schedule
    c = backend("deepspeed", stage, lr=0.5)
    c.load(tmp_path / "trainer")
    assert one_update(c, 2)["lr"] == pytest.approx(m_a["lr"] * 0.5 / 1e-2)


def test_zero3_export_and_sync_gather_full_tensors(tmp_path, torch_reference):
    b = backend("deepspeed", 3)
    shapes = {n: t.shape for n, t in b.named_parameters_for_sync()}
    assert shapes["lm_head.weight"] == (V, 32) and shapes["model.embed_tokens.weight"] == (V, 32)
    one_update(b, 1)
    b.export_hf(tmp_path / "final", tokenizer=None)
    again = LlamaForCausalLM.from_pretrained(tmp_path / "final")
    exported = {n: p.detach() for n, p in again.named_parameters()}
    assert_same_params(exported, torch_reference[1][1])


_DP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    sys.path.insert(0, {test_dir!r})
    from test_trainer_deepspeed import backend, rollout_batch, params
    b = backend("deepspeed", {stage})
    r = b.rank
    ids, attn, resp, w = rollout_batch(1)
    n = resp.sum()                      # GLOBAL normalizer: every rank knows the whole batch's count
    sl = slice(2 * r, 2 * r + 2)        # this rank's half of the batch
    lp, _ = b.token_stats(ids[sl], attn[sl], resp[sl], grad=True)
    b.backward(-(lp * w[sl]).sum() / n)
    m = b.step()
    gathered = b.all_gather_1d(torch.arange(3.0 - 2 * r) + 10 * r).tolist()   # lengths 3 and 1
    total = b.all_reduce_sum(torch.tensor([1.0 + r])).item()
    if r == 0:
        torch.save(params(b), {out!r})
        print(json.dumps({{"m": m, "gathered": gathered, "total": total}}))
    # Leave without the interpreter's teardown: gloo's threads can abort a normal exit
    # ("terminate called without an active exception"), which is not what this test checks.
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)
    """
)


def test_two_ranks_sum_gradients_like_one_process(tmp_path, torch_reference):
    """Two gloo ranks, half the batch each, global-normalized losses: the one-process update."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "params.pt"
    code = _DP_SCRIPT.format(test_dir=os.path.dirname(__file__), stage=2, out=str(out))
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    assert result["gathered"] == [0.0, 1.0, 2.0, 10.0]
    assert result["total"] == 3.0
    m1, p1 = torch_reference[1]
    assert result["m"]["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    assert_same_params(torch.load(out), p1)


@pytest.mark.parametrize("stage", [0, 3])
def test_lr_per_rollout_step_under_deepspeed(stage):
    """lr_schedule_unit=rollout_step through DeepSpeed's optimizer wrapper: two updates per rollout step,
    warmup 2 then linear over max_steps 4 -> multipliers [0.5, 1, 1, 0.5] per step, both updates alike."""
    from stapo.core.trainer.base import begin_rollout_step

    b = backend("deepspeed", stage, lr_schedule="linear", lr_schedule_unit="rollout_step", max_steps=4)
    lrs = []
    for step in (1, 2, 3, 4):
        begin_rollout_step(b, step)
        lrs.append([one_update(b, 10 * step + k)["lr"] for k in (0, 1)])
    assert lrs == [pytest.approx([1e-2 * m] * 2) for m in (0.5, 1.0, 1.0, 0.5)]


def test_bounded_update_matches_kept_graphs_under_zero3():
    """trainer.update_memory=bounded under ZeRO-3 (each forward gathers parameters; the no-grad
    statistics pass sits between DeepSpeed's micro-steps): the same parameters as keeping the graphs."""
    from hook_driver import run_hooks

    from stapo.core.batch import collate
    from stapo.core.train import loop, update
    from stapo.core.trainer.models import load_policy

    g = torch.Generator().manual_seed(0)
    seqs = []
    for grp in range(2):
        prompt = torch.randint(3, 60, (4,), generator=g).tolist()
        for k in range(4):
            s = loop.Sequence_(prompt, torch.randint(3, 60, (2 + k,), generator=g).tolist(), "stop", "", "0", group=grp)
            s.advantage = (-1.0) ** k * (0.5 + 0.25 * k)
            seqs.append(s)
    batch = collate(seqs, pad_id=0)
    out = {}
    for mode in ("keep_graphs", "bounded"):
        cfg = config_from_dict({
            "model": {"name_or_path": "tiny-random", "tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 4,
                                                              "intermediate_size": 64}},
            "algorithm": {"token_weighting": "s2t", "s2t": {"tau_p": 0.5, "q": 0.5}, "mini_batches": 2},
            "trainer": {"backend": "deepspeed", "device": "auto", "zero_stage": 3, "lr": 1e-2, "micro_batch_size": 2,
                        "logits_chunk_size": 5, "update_memory": mode, "zero3_param_persistence_threshold": 0},
        })
        model, _ = load_policy(cfg.model, device="cpu")
        b = build_trainer_backend(cfg, model, total_optimizer_steps=2)
        old_lp, old_ent = update.Actor(cfg, b).old_stats(batch)
        update.Actor(cfg, b, run_hooks(cfg)).update(update.UpdateInputs(batch, old_lp, old_ent, step=1))
        out[mode] = params(b)
    assert_same_params(out["bounded"], out["keep_graphs"])
