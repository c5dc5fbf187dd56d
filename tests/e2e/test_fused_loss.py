"""Fused loss path (``trainer.fused_loss``) vs the unfused one: the same update, end to end.

Three levels, each fused-vs-unfused on the tiny random model (``tiny-random``: tied embeddings,
so the LM head's precomputed gradient also reaches the input embedding):

1. the backend contract: ``token_loss`` gives the log-probs of ``token_stats``, flat indices into
   [B, L], the gradients of ``token_stats(grad=True)`` + the same loss (also through the soft-capping
   fallback);
2. ``Actor.update`` on one rollout-shaped batch (2 PPO epochs x 2 mini-batches x micro-batches,
   clipped ratios on both sides, S2T silencing, KL and dual clip): same metrics and parameters for
   every aggregation, and the fused path is really the one taken (and not for gspo / entropy_grad);
3. ``loop.train`` on ``configs/tiny.yaml``: same metrics rows (except time/perf) and parameters;
   plus DeepSpeed ZeRO-0 and ZeRO-3 (CPU, gloo) fused vs torch unfused.

Run: ``pytest tests/e2e/test_fused_loss.py`` (~30 s on 2 CPU cores).
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from hook_driver import run_hooks

from stapo.configs import preset_path
from stapo.core.batch import collate
from stapo.core.config import config_from_dict, load_config
from stapo.core.tracking import read_jsonl
from stapo.core.train import loop, update
from stapo.core.train.loop import train
from stapo.core.train.run import Run
from stapo.core.train.update import Actor, UpdateInputs
from stapo.core.trainer import build_trainer_backend
from stapo.core.trainer.models import load_policy
from stapo.core.trainer.torch_backend import TorchBackend

LR = 1e-2
TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64, "seed": 0}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_cfg(*, trainer=None, algorithm=None):
    t = {"device": "cpu", "lr": LR, "logits_chunk_size": 7, "micro_batch_size": 2, "max_grad_norm": 1e3}
    t.update(trainer or {})
    al = {
        "ppo_epochs": 2,
        "mini_batches": 2,
        "token_weighting": "s2t",
        "s2t": {"tau_p": 0.5, "q": 0.5},
    }
    al.update(algorithm or {})
    return config_from_dict(
        {"model": {"name_or_path": "tiny-random", "tiny": TINY}, "trainer": t, "algorithm": al}
    )


def make_backend(cfg):
    model, _ = load_policy(cfg.model, device="cpu")
    if cfg.trainer.backend == "torch":
        return TorchBackend(cfg, model, total_optimizer_steps=8)
    return build_trainer_backend(cfg, model, total_optimizer_steps=8)


def params(b) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().cpu().clone() for n, t in b.named_parameters_for_sync()}


def assert_same_params(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=atol, rtol=0, msg=n)


def rl_batch(vocab: int, seed: int = 0) -> loop.Batch:
    """6 sequences, 2 groups: prompts of 3-6 tokens (left-padded), responses of 2-7 (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(6):
        p = int(torch.randint(3, 7, (1,), generator=g))
        r = int(torch.randint(2, 8, (1,), generator=g))
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        seqs.append(loop.Sequence_(ids[:p], ids[p:], "stop", "", "0", group=i // 3))
    for s, a in zip(seqs, [1.2, -0.4, -0.8, 0.9, 0.0, -0.9], strict=True):
        s.advantage = a
    return collate(seqs, pad_id=0)


def old_stats(b, batch, seed=0):
    """Old log-probs = current ones shifted per token, so ratios land inside and on both sides of
    the clip range [0.8, 1.28] from the first update on."""
    lp, ent = update.Actor(b.cfg, b).old_stats(batch)
    g = torch.Generator().manual_seed(seed)
    shift = (torch.rand(lp.shape, generator=g) - 0.5) * 0.8  # ratio = exp(-shift) in [0.67, 1.49]
    return lp + shift * batch.response_mask, ent


def run_update(cfg, batch=None, backend=None):
    b = backend if backend is not None else make_backend(cfg)
    batch = batch if batch is not None else rl_batch(b.model.config.vocab_size)
    old_lp, old_ent = old_stats(b, batch)
    calls = {"token_loss": 0, "stats_grad": 0}
    grads: list[dict[str, torch.Tensor]] = []  # the accumulated gradient at each optimizer step
    real_loss, real_stats, real_step = b.token_loss, b.token_stats, b.step

    def step(**kw):
        grads.append({n: p.grad.detach().clone() for n, p in b.model.named_parameters() if p.grad is not None})
        return real_step(**kw)

    def token_loss(*a, **k):
        calls["token_loss"] += 1
        return real_loss(*a, **k)

    def token_stats(*a, grad, **k):
        calls["stats_grad"] += int(grad)
        return real_stats(*a, grad=grad, **k)

    b.token_loss, b.token_stats = token_loss, token_stats
    if cfg.trainer.backend == "torch":  # DeepSpeed keeps its gradients in its own buffers
        b.step = step
    m = Actor(cfg, b, run_hooks(cfg)).update(UpdateInputs(batch, old_lp, old_ent, step=1))
    return m, params(b), calls, grads


def assert_same_metrics(a: dict, b: dict, tol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], float) and math.isnan(a[k]):
            assert math.isnan(b[k]), k
        else:
            assert a[k] == pytest.approx(b[k], abs=tol, rel=tol), (k, a[k], b[k])


# ----------------------------------------------------------------------------- backend contract


def _linear_fn(coef_bl):
    flat = coef_bl.reshape(-1)
    return lambda lp, idx: flat[idx].to(lp.dtype) * lp


def test_backend_token_loss_matches_token_stats_and_gives_flat_indices():
    cfg = make_cfg(trainer={"logits_chunk_size": 5})
    b = make_backend(cfg)
    batch = rl_batch(b.model.config.vocab_size)
    ids, attn, resp = batch.input_ids, batch.attention_mask, batch.response_mask
    g = torch.Generator().manual_seed(1)
    coef = torch.randn(ids.shape, generator=g)
    seen = []

    def fn(lp, idx):
        seen.append(idx)
        return _linear_fn(coef)(lp, idx) - 0.3 * torch.exp(lp)  # non-linear, elementwise

    loss, lp, ent = b.token_loss(ids, attn, resp, fn)
    assert not lp.requires_grad and not ent.requires_grad and loss.ndim == 0
    b.backward(loss)
    fused = {n: p.grad.clone() for n, p in b.model.named_parameters()}
    b.zero_grad()
    lp_ref, ent_ref = b.token_stats(ids, attn, resp, grad=True)
    target = resp.clone()
    target[:, 0] = False
    assert sorted(torch.cat(seen).tolist()) == target.reshape(-1).nonzero().squeeze(1).tolist()
    obj = ((coef * lp_ref - 0.3 * torch.exp(lp_ref)) * target).sum()
    torch.testing.assert_close(loss, obj.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(lp, lp_ref.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)  # H ~ 4.6: a few float32 ulps
    b.backward(obj)
    assert b.model.lm_head.weight is b.model.model.embed_tokens.weight  # tied: both gradients land there
    for n, p in b.model.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_softcap_models_fall_back_to_the_logits_path():
    """A soft-capped head has no hidden-state path: token_loss must still give the same loss/grads."""
    cfg = make_cfg()
    b = make_backend(cfg)
    batch = rl_batch(b.model.config.vocab_size, seed=2)
    coef = torch.linspace(-1, 1, batch.input_ids.numel()).reshape(batch.input_ids.shape)
    args = (batch.input_ids, batch.attention_mask, batch.response_mask, _linear_fn(coef))
    loss, lp, _ = b.token_loss(*args, temperature=0.7)
    b.backward(loss)
    ref = [p.grad.clone() for p in b.model.parameters()]
    b.zero_grad()
    b.model.config.final_logit_softcapping = 30.0  # Llama ignores it: the logits path gives plain logits
    called = {"n": 0}
    from stapo.core import tokenstats

    real = tokenstats.token_logprobs_entropy_from_logits

    def spy(*a, **k):
        called["n"] += 1
        return real(*a, **k)

    tokenstats.token_logprobs_entropy_from_logits = spy
    try:
        loss2, lp2, _ = b.token_loss(*args, temperature=0.7)
    finally:
        tokenstats.token_logprobs_entropy_from_logits = real
    assert called["n"] == 1
    b.backward(loss2)
    torch.testing.assert_close(loss2, loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp2, lp, atol=1e-6, rtol=0)
    for r, p in zip(ref, b.model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- the update


@pytest.mark.parametrize(
    "algorithm",
    [
        {"aggregation": "token-mean"},
        {"aggregation": "seq-mean-token-mean"},
        {"aggregation": "seq-mean-token-sum", "kl_coef": 0.1, "dual_clip_c": 1.5},
        {"aggregation": "token-mean", "kl_coef": 0.2},
    ],
    ids=["token-mean", "seq-mean-token-mean", "seq-sum+kl+dual", "none+kl"],
)
def test_update_fused_equals_unfused(algorithm):
    # The fused pass needs the weights before its forward: a weighting that reads no statistics
    # (`none`); weightings that read p / H take them from an unfused gradient forward (next test).
    algorithm = {**algorithm, "token_weighting": "none"}
    m_f, p_f, calls_f, g_f = run_update(make_cfg(trainer={"fused_loss": True}, algorithm=algorithm))
    m_u, p_u, calls_u, g_u = run_update(make_cfg(trainer={"fused_loss": False}, algorithm=algorithm))
    # 2 epochs x 2 mini-batches of 3 sequences, micro-batches of 2 + 1: 8 passes with gradient
    assert calls_f == {"token_loss": 8, "stats_grad": 0} and calls_u == {"token_loss": 0, "stats_grad": 8}
    assert m_u["actor/clip_frac_low"] > 0 and m_u["actor/clip_frac_high"] > 0  # both clips were hit
    assert_same_metrics(m_f, m_u)  # the grad norms of all 4 updates among them
    assert len(g_f) == len(g_u) == 4
    for n in g_u[0]:  # the first update's gradient: same weights, so only rounding may differ
        torch.testing.assert_close(g_f[0][n], g_u[0][n], atol=1e-6, rtol=1e-4, msg=n)
    # After 4 AdamW updates: AdamW divides each gradient component by its own RMS, so rounding-level
    # differences in near-zero components move weights by a small fraction of the LR (the unfused
    # path with another chunk size differs from itself by ~7e-4 x LR here).
    assert_same_params(p_f, p_u, atol=3e-3 * LR)
    start = params(make_backend(make_cfg()))
    assert max((p_f[n] - start[n]).abs().max() for n in start) > 100 * 3e-3 * LR  # the weights moved


@pytest.mark.parametrize(
    "trainer,algorithm",
    [({"entropy_grad": True}, {"token_weighting": "none"}),
     ({}, {"token_weighting": "none", "policy_loss": "gspo", "aggregation": "seq-mean-token-mean"}),
     ({}, {})],
    ids=["entropy_grad", "gspo", "s2t-reads-stats"],
)
def test_unfused_path_kept_where_fused_does_not_apply(trainer, algorithm):
    _, _, calls, _ = run_update(make_cfg(trainer={"fused_loss": True, **trainer}, algorithm=algorithm))
    assert calls == {"token_loss": 0, "stats_grad": 8}


# ----------------------------------------------------------------------------- the whole loop


# The shape this test is calibrated on: a character vocabulary, 2 prompts x 4 responses of up to 8
# tokens (the tiny preset itself answers with one token from a digits-only vocabulary).
TINY_SHAPE = ["model.tiny.vocab=chars", "data.arithmetic.answer_range=null", "rollout.prompts_per_step=2",
              "rollout.n=4", "rollout.max_new_tokens=8", "trainer.micro_batch_size=4"]


def tiny_train_cfg(*overrides: str):
    """configs/tiny.yaml as tests/e2e/test_train_tiny.py drives it: DAPO overlong shaping over the
    whole 32-token budget makes rewards (and advantages) vary with response length."""
    base = ["logging.live=false", "logging.tensorboard=false", "algorithm.overlong.enabled=true",
            "rollout.max_new_tokens=32", "algorithm.overlong.buffer=31"]
    return load_config(preset_path("tiny"), [*TINY_SHAPE, *base, *overrides])


@pytest.fixture
def shared_first_rollout(monkeypatch):
    """Runs that start from the same weights sample the same step-1 rollouts: generate once, reuse."""
    from stapo.core.rollout.hf import HFRolloutEngine

    real = HFRolloutEngine.generate
    memo: dict = {}

    def generate(self, prompt_token_ids, sampling):
        key = (tuple(map(tuple, prompt_token_ids)), sampling)
        if key not in memo:
            memo[key] = real(self, prompt_token_ids, sampling)
        return copy.deepcopy(memo[key])

    monkeypatch.setattr(HFRolloutEngine, "generate", generate)
    return memo


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_train_tiny_fused_equals_unfused(aggregation, tmp_path, shared_first_rollout, monkeypatch):
    rows, weights = {}, {}
    fused_calls = {"n": 0}
    real_token_loss = TorchBackend.token_loss

    def counted(self, *a, **k):
        fused_calls["n"] += 1
        return real_token_loss(self, *a, **k)

    monkeypatch.setattr(TorchBackend, "token_loss", counted)

    for fused in ("true", "false"):
        cfg = tiny_train_cfg(
            "trainer.max_steps=1", "data.val_size=0", "checkpoint.export_hf=false", "logging.dump_tokens_every=0",
            "algorithm.ppo_epochs=2", "algorithm.mini_batches=2", "algorithm.token_weighting=none",
            f"algorithm.aggregation={aggregation}", f"trainer.fused_loss={fused}",
        )
        run = Run.build(cfg, tmp_path / fused, log=lambda m: None)
        train(run)
        rows[fused] = [
            {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}
            for r in read_jsonl(tmp_path / fused / "metrics.jsonl")
        ]
        weights[fused] = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    assert len(shared_first_rollout) == 1
    assert fused_calls["n"] == 2 * 2  # fused run only: 2 epochs x 2 mini-batches of 4 (= 1 micro-batch)
    assert [r["step"] for r in rows["true"]] == [1]
    assert rows["true"][0]["reward/std"] > 0 and rows["true"][0]["actor/grad_norm"] > 0
    for a, b in zip(rows["true"], rows["false"], strict=True):
        assert_same_metrics(a, b)
    assert_same_params(weights["true"], weights["false"])


# ----------------------------------------------------------------------------- DeepSpeed


@pytest.fixture(scope="module")
def ds_env(tmp_path_factory):
    pytest.importorskip("deepspeed")
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCH_EXTENSIONS_DIR")
    saved = {k: os.environ.get(k) for k in keys}
    ext = tmp_path_factory.mktemp("torch_extensions")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ext)
    yield
    assert not any(ext.iterdir()), f"a DeepSpeed op was compiled: {list(ext.iterdir())}"
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_fused_equals_torch_unfused(stage, ds_env):
    algorithm = {"aggregation": "seq-mean-token-mean", "kl_coef": 0.1, "token_weighting": "none"}
    m_ref, p_ref, _, _ = run_update(make_cfg(trainer={"fused_loss": False}, algorithm=algorithm))
    cfg = make_cfg(
        trainer={"fused_loss": True, "backend": "deepspeed", "device": "auto", "zero_stage": stage},
        algorithm=algorithm,
    )
    m, p, calls, _ = run_update(cfg)
    assert calls == {"token_loss": 8, "stats_grad": 0}
    assert_same_metrics(m, m_ref)
    assert_same_params(p, p_ref, atol=3e-3 * LR)  # 4 AdamW updates: see test_update_fused_equals_...
