"""`stapo probe`'s algebra and passes against independent computations.

* The arms' directions from (G_all, G_S, G_C) equal each arm's own loss gradient computed directly
  on a hand-built softmax model: the token-mean over the kept tokens, and for the random arm the
  average over every k-subset of the candidates (enumerated, not sampled).
* On the tiny model: S2T's first-order entropy change from :func:`measure_batch` equals the one of
  the update's own S2T loss (the registered weighting and the policy objective, backpropagated
  directly); the linearization check agrees with real SGD steps within its stated tolerance.
* The statistics: t interval, Wilcoxon p and the verdict rule on hand-computed numbers.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from stapo.core.algos import TokenContext, compute_policy_objective, get_token_weighting
from stapo.core.batch import Sequence_, collate
from stapo.core.config import config_from_dict
from stapo.core.train import probe
from stapo.core.train.update import Actor
from stapo.core.trainer.models import load_policy
from stapo.core.trainer.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LR = 0.01  # the tiny model's update size here: the check's SGD steps are taken at the reported lr


def test_arm_coefficients_by_hand():
    co = probe.arm_coefficients(10, 2, 5)
    assert co["A"] == pytest.approx((0.1, 0.0, 0.0))
    assert co["B"] == pytest.approx((1 / 8, -1 / 8, 0.0))
    assert co["C"] == pytest.approx((1 / 8, 0.0, -0.4 / 8))
    assert co["D"] == pytest.approx((1 / 7, 1 / 7, -1 / 7))
    assert probe.arm_coefficients(4, 0, 0)["C"] == pytest.approx((0.25, 0.0, 0.0))  # no candidate: C is A


def test_arm_directions_equal_each_arms_own_loss_gradient():
    """A softmax policy over 6 tokens, 9 positions; every arm's loss written out and differentiated."""
    g = torch.Generator().manual_seed(0)
    n, d, vocab = 9, 4, 6
    x = torch.randn(n, d, generator=g, dtype=torch.float64)  # [n, d] position features
    y = torch.randint(0, vocab, (n,), generator=g)  # [n] sampled tokens
    adv = torch.randn(n, generator=g, dtype=torch.float64)  # [n]
    theta = torch.randn(d, vocab, generator=g, dtype=torch.float64, requires_grad=True)  # [d, V]
    cand = [1, 3, 4, 6, 8]
    sil = [3, 6]
    n_k = n

    def token_losses(th):
        return -adv * torch.log_softmax(x @ th, -1)[torch.arange(n), y]  # [n]

    def grad_of(keep):
        (gr,) = torch.autograd.grad(token_losses(theta)[keep].mean(), theta)
        return gr

    def grad_sum(idx):
        (gr,) = torch.autograd.grad(token_losses(theta)[idx].sum(), theta)
        return gr

    everything = list(range(n))
    g_all, g_s, g_c = grad_sum(everything), grad_sum(sil), grad_sum(cand)
    direct = {
        "A": grad_of(everything),
        "B": grad_of([t for t in everything if t not in sil]),
        "C": torch.stack([grad_of([t for t in everything if t not in r])
                          for r in itertools.combinations(cand, len(sil))]).mean(0),
        "D": grad_of([t for t in everything if t not in cand or t in sil]),
    }
    coef = probe.arm_coefficients(n_k, len(sil), len(cand))
    for arm, (ca, cs, cc) in coef.items():
        assert torch.allclose(ca * g_all + cs * g_s + cc * g_c, direct[arm], atol=1e-12), arm
    # arm_changes: -lr <grad M, g_arm> for a metric's gradient v (the sgd column)
    v = torch.randn(d, vocab, generator=g, dtype=torch.float64)
    dots = {("H", "sgd", k): float((v * gx).sum()) for k, gx in (("all", g_all), ("S", g_s), ("C", g_c))}
    ch = probe.arm_changes(dots, n=n_k, k=len(sil), c=len(cand), lr=0.5)
    for arm in probe.ARMS:
        assert ch[arm]["H"]["sgd"] == pytest.approx(-0.5 * float((v * direct[arm]).sum()), abs=1e-12)
        assert math.isnan(ch[arm]["H"]["adam"]) and math.isnan(ch[arm]["J_val"]["sgd"])


def test_contrast_by_hand():
    from scipy import stats

    c = probe.contrast([1.0, 2.0, 3.0], [4.0, 4.0, 4.0])
    half = stats.t.ppf(0.975, 2) / math.sqrt(3)  # sd 1
    assert c["mean"] == 2.0 and c["n"] == 3
    assert c["ci95"] == pytest.approx([2 - half, 2 + half])
    assert c["share_of_baseline"] == pytest.approx(0.5)
    assert c["wilcoxon_p"] == pytest.approx(0.25)  # exact: all 3 positive, 2 / 2^3
    z = probe.contrast([0.0, 0.0], [1.0, 1.0])
    assert z["mean"] == 0 and math.isnan(z["wilcoxon_p"])
    assert probe.contrast([float("nan")] * 3, [float("nan")] * 3)["n"] == 0


@pytest.mark.parametrize(("j", "h", "want"), [
    ((0.1, 0.3), (-0.3, -0.1), "holds"),
    ((-0.3, -0.1), (-0.3, -0.1), "refuted"),
    ((0.1, 0.3), (0.1, 0.3), "refuted"),
    ((-0.1, 0.3), (-0.3, -0.1), "inconclusive"),
    ((0.1, 0.3), (-0.3, 0.1), "inconclusive"),
    ((math.nan, math.nan), (-0.3, -0.1), "inconclusive"),
])
def test_verdict_rule(j, h, want):
    assert probe.verdict({"ci95": list(j)}, {"ci95": list(h)}) == want


# ----------------------------------------------------------------------------- on the tiny model


def _tiny():
    cfg = probe.probe_config(config_from_dict({
        "model": {"name_or_path": "tiny-random", "tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 4,
                                                          "intermediate_size": 64, "seed": 0}},
        "trainer": {"device": "cpu", "lr": 1e-2, "micro_batch_size": 3},
        "algorithm": {"token_weighting": "s2t", "s2t": {"tau_p": 0.5, "q": 0.5}},
    }))
    model, tok = load_policy(cfg.model, device=torch.device("cpu"))
    backend = TorchBackend(cfg, model, total_optimizer_steps=1)
    return cfg, Actor(cfg, backend), [p for p in backend.model.parameters() if p.requires_grad], tok


def _batch(vocab, seed, advs):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i, a in enumerate(advs):
        prompt = torch.randint(3, vocab, (4,), generator=g).tolist()
        resp = torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        s = Sequence_(prompt, resp, "stop", "", "0", group=i // 2)
        s.advantage = a
        seqs.append(s)
    return collate(seqs, pad_id=0)


def test_s2t_entropy_change_equals_the_updates_own_loss_and_the_step_agrees():
    cfg, actor, params, tok = _tiny()
    vocab = actor.backend.model.config.vocab_size
    batch = _batch(vocab, 1, [1.0, -1.0, 0.8, -0.8, 1.2, -1.2])
    vb = _batch(vocab, 2, [0.0] * 4)
    pr = probe.Probe(cfg, actor, params, probe.grad_j_val(actor, vb, params),
                     probe.adam_state(actor.backend.optimizer, params), vb, lr=LR)
    rec = probe.measure_batch(pr, batch, seed=0, check=True)
    assert rec["candidates"] >= 2 and rec["silenced"] >= 1  # tau_p 0.5: every A > 0 token of a random model
    # independent: the update's own S2T loss (registered weighting, policy objective, token-mean)
    lp, ent = actor.backend.token_stats(batch.input_ids, batch.attention_mask, batch.response_mask, grad=True)
    resp = batch.response_mask.bool()
    h = (ent * resp).sum() / resp.sum()
    g_h = torch.autograd.grad(h, params, retain_graph=True)
    ctx = TokenContext(lp, ent, batch.advantages, resp, seed=0)
    tw = get_token_weighting("s2t")(ctx, tau_p=0.5, q=0.5)
    assert int((~tw.denom_mask & resp).sum()) == rec["silenced"]
    loss, _ = compute_policy_objective(lp, lp.detach(), batch.advantages, resp, tw, aggregation="token-mean")
    g_b = torch.autograd.grad(loss, params)
    want = -LR * sum(float((a.double() * b.double()).sum()) for a, b in zip(g_h, g_b, strict=True))
    assert rec["changes"]["B"]["H"]["sgd"] == pytest.approx(want, rel=1e-4, abs=1e-9)
    # the adam column: Adam's (fresh) step for the update's own S2T gradient
    step = probe.adam_step(pr.adam, g_b)
    want_adam = -LR * sum(float((a.double() * b.double()).sum()) for a, b in zip(g_h, step, strict=True))
    assert rec["changes"]["B"]["H"]["adam"] == pytest.approx(want_adam, rel=1e-3, abs=1e-9)
    # the linearization check: real SGD steps for A and B, J_val and H measured exactly
    assert [c["arm"] for c in rec["check"]] == ["A", "B"]
    for c in rec["check"]:
        for m in ("J_val", "H"):
            assert c[m]["agrees"], (c["arm"], m, c[m])
            assert abs(c[m]["predicted"]) > 10 * probe.CHECK_ABS_TOL  # above the float32 floor: a real comparison
            assert c[m]["measured"] == pytest.approx(c[m]["predicted"], rel=0.05)
    # the parameters are restored after the check
    again = probe.measure_batch(pr, batch, seed=0, check=False)
    assert again["changes"]["A"]["H"]["sgd"] == pytest.approx(rec["changes"]["A"]["H"]["sgd"], rel=1e-6)


def test_adam_step_from_saved_state():
    cfg, actor, params, _ = _tiny()
    opt = actor.backend.optimizer
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    fresh = probe.adam_state(opt, params)
    assert fresh.t == 0 and all(not bool(v.any()) for v in fresh.v)
    g = [torch.full_like(p, 0.2) for p in params]
    g[0][0] = 0.0  # a parameter this arm does not move: no step (not 0 / eps)
    # a fresh optimizer: v_hat = g^2, the step g / (|g| + eps) (Adam's first step)
    step = probe.adam_step(fresh, g)
    assert torch.allclose(step[0][1:], torch.full_like(step[0][1:], 0.2 / (0.2 + eps))) and not bool(step[0][0].any())
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    saved = probe.adam_state(opt, params)
    assert saved.t == 1 and torch.allclose(saved.v[1], torch.full_like(params[1], (1 - beta2) * 0.25))
    v_hat = (beta2 * (1 - beta2) * 0.25 + (1 - beta2) * 0.04) / (1 - beta2**2)  # by hand, t + 1 = 2
    step = probe.adam_step(saved, g)
    assert torch.allclose(step[1], torch.full_like(step[1], 0.2 / (math.sqrt(v_hat) + eps)))


def test_worst_check_is_relative_to_the_rules_scale():
    """The summary line's error is read at each row's recorded scale (the agreement rule's), not at the
    arm's own predicted change; rows without a scale are left out, and none at all gives None."""
    from stapo.cli.probe import _worst_check

    def row(arm, j, h):  # (predicted, measured, scale) per metric
        return {"checkpoint": "init", "seed": 0, "batch": 0, "arm": arm,
                "J_val": dict(zip(("predicted", "measured", "scale"), j, strict=False)),
                "H": dict(zip(("predicted", "measured", "scale"), h, strict=False))}

    checks = [row("A", (1e-4, 0.9e-4, 1e-4), (-2e-4, -2e-4, 2e-4)),  # A: J_val 10% of its own change
              row("B", (1e-6, 6e-6, 1e-4), (-2e-4, -2e-4, 2e-4))]  # B: 5e-6 at A's 1e-4 = 5% (500% of its own)
    assert _worst_check(checks) == pytest.approx(0.1)
    checks[1]["J_val"]["measured"] = 3.1e-5  # 3e-5 / 1e-4
    assert _worst_check(checks) == pytest.approx(0.3)
    unscaled = row("B", (1e-6, 1.0), (0.0, 1.0))  # no scale recorded: not read
    assert _worst_check([*checks, unscaled]) == pytest.approx(0.3)
    assert _worst_check([unscaled]) is None
