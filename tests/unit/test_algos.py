"""Algorithm core on tiny tensors: every expected value is worked out by hand in the comments.

Run: .venv/bin/python -m pytest tests/unit/test_algos.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from stapo.core.algos import (
    ADVANTAGES,
    AGGREGATIONS,
    PHASE_KEYS,
    POLICY_LOSSES,
    TOKEN_WEIGHTS,
    Registry,
    TokenContext,
    TokenWeights,
    compute_policy_objective,
    dynamic_sampling_filter,
    get_advantage,
    get_aggregation,
    get_policy_loss,
    get_token_weighting,
    kl_k3,
    overlong_penalty,
    quantile,
    s2t_mask,
    s2t_tau_h,
    stapo_loss,
    token_metrics,
)

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


# ----------------------------------------------------------------------------- registry


def test_registry_duplicate_and_miss():
    reg: Registry[int] = Registry("widget")
    reg.register("a")(1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(2)
    with pytest.raises(KeyError, match="unknown widget 'b'; valid names: a"):
        reg.get("b")
    assert reg.names() == ["a"] and "a" in reg and reg["a"] == 1


def test_real_registries_list_names_on_miss():
    assert set(ADVANTAGES.names()) == {"grpo", "dr_grpo", "rloo"}
    assert set(TOKEN_WEIGHTS.names()) == {"none", "s2t", "top_entropy", "stare"}
    assert set(POLICY_LOSSES.names()) == {"ppo_clip", "gspo", "maspo"}
    assert set(AGGREGATIONS.names()) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum"}
    with pytest.raises(KeyError, match="ppo_clip"):
        get_policy_loss("ppo")
    with pytest.raises(KeyError, match="s2t"):
        get_token_weighting("stapo")
    with pytest.raises(KeyError, match="token-mean"):
        get_aggregation("mean")
    with pytest.raises(ValueError, match="already registered"):
        ADVANTAGES.register("grpo")(lambda r, *, eps=1e-6: r)


# ----------------------------------------------------------------------------- advantages


def test_advantages_hand_computed():
    r = t([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    # grpo: mean .5, unbiased std = sqrt(4 * .25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    a = get_advantage("grpo")(r)
    s = math.sqrt(1 / 3)
    assert torch.allclose(a[0], t([0.5, -0.5, -0.5, 0.5]) / (s + 1e-6))
    assert torch.equal(a[1], torch.zeros(4, dtype=D))  # identical rewards -> 0 (0 / eps)
    # dr_grpo: mean only
    assert torch.allclose(get_advantage("dr_grpo")(r)[0], t([0.5, -0.5, -0.5, 0.5]))
    # rloo: r_i - mean of the 3 others: 1 - 1/3 = 0.6667, 0 - 2/3 = -0.6667
    assert torch.allclose(get_advantage("rloo")(r)[0], t([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    # singleton group: verl's convention mean 0, std 1
    assert torch.allclose(get_advantage("grpo")(t([[0.7]])), t([[0.7 / (1 + 1e-6)]]))
    with pytest.raises(ValueError, match="rloo needs at least 2"):
        get_advantage("rloo")(t([[1.0]]))
    with pytest.raises(ValueError, match=r"rewards must have shape \[P, G\]"):
        get_advantage("grpo")(t([1.0, 0.0]))
    with pytest.raises(ValueError, match="NaN"):
        get_advantage("grpo")(t([[1.0, float("nan")]]))


# ----------------------------------------------------------------------------- DAPO pieces


def test_dynamic_sampling_filter():
    r = t([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.25]])
    assert dynamic_sampling_filter(r).tolist() == [False, True, False, True]


def test_overlong_penalty_values():
    # max_len 10, buffer 4 -> ramp starts after 6: L=8 -> -(8-6)/4 = -0.5; L>=10 -> -1 (10 is the ramp end)
    out = overlong_penalty(torch.tensor([5, 6, 8, 10, 11]), max_len=10, buffer=4)
    assert torch.allclose(out, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    out = overlong_penalty(torch.tensor([7, 12]), max_len=10, buffer=4, penalty=0.5)
    assert torch.allclose(out, torch.tensor([-0.125, -0.5]))  # -(0.5)(1/4), -0.5
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer=0)


# ----------------------------------------------------------------------------- policy losses


def _ratio_batch():
    # row 0: A=+1, ratios .5 .9 1 1.2 1.5 (+pad); row 1: A=-1, ratios .5 .9 1 1.2 1.5 4
    ratios = t([[0.5, 0.9, 1.0, 1.2, 1.5, 1.0], [0.5, 0.9, 1.0, 1.2, 1.5, 4.0]])
    old = torch.full_like(ratios, -1.0)
    logp = (old + ratios.log()).requires_grad_(True)
    adv = t([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    return logp, old, adv, mask


def test_ppo_clip_higher_values_and_grads():
    logp, old, adv, mask = _ratio_batch()
    loss, m = get_policy_loss("ppo_clip")(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    # A=+1: l = max(-r, -clip(r, .8, 1.28)): .5->-.5, .9->-.9, 1->-1, 1.2->-1.2, 1.5->-1.28; pad -> 0
    # A=-1: l = max(r, clip(r)): .5->.8 (clipped), .9, 1, 1.2, 1.5->1.5, 4->4
    exp = t([[-0.5, -0.9, -1.0, -1.2, -1.28, 0.0], [0.8, 0.9, 1.0, 1.2, 1.5, 4.0]])
    assert torch.allclose(loss, exp)
    assert m["clip_high_count"].item() == 1  # r=1.5, A>0
    assert m["clip_low_count"].item() == 1  # r=.5, A<0
    assert m["token_count"].item() == 11
    assert m["ratio_max"].item() == pytest.approx(4.0) and m["ratio_min"].item() == pytest.approx(0.5)
    assert m["ratio_sum"].item() == pytest.approx(5.1 + 9.1)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    # d(-A r)/dlogp = -A r where unclipped; 0 where the clip is active or masked
    exp_g = t([[-0.5, -0.9, -1.0, -1.2, 0.0, 0.0], [0.0, 0.9, 1.0, 1.2, 1.5, 4.0]])
    assert torch.allclose(g, exp_g)


def test_ppo_dual_clip():
    logp, old, adv, mask = _ratio_batch()
    loss, m = get_policy_loss("ppo_clip")(logp, old, adv, mask, dual_clip_c=3.0)
    assert loss[1, 5].item() == pytest.approx(3.0)  # min(4, 3): capped at -c A
    assert m["dual_clip_count"].item() == 1
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert g[1, 5].item() == 0.0
    with pytest.raises(ValueError, match="dual_clip_c"):
        get_policy_loss("ppo_clip")(logp, old, adv, mask, dual_clip_c=0.5)


def test_gspo_sequence_ratio_straight_through():
    # row 0: A=+1, log ratios [log 2, 0] -> s = exp(log2 / 2) = 1.41421 > 1.28: clipped, loss -1.28, no grad
    # row 1: A=-1, log ratios [log .9, log 1.1] -> s = exp((-.10536 + .09531) / 2) = 0.994987 (inside):
    #        loss = s per token; d/dlogp_t = sg[s] = 0.994987 (straight-through token form)
    old = torch.zeros(2, 3, dtype=D)
    logp = t([[math.log(2.0), 0.0, 5.0], [math.log(0.9), math.log(1.1), 7.0]]).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    loss, m = get_policy_loss("gspo")(logp, old, t([1.0, -1.0]), mask, eps_low=0.2, eps_high=0.28)
    s1 = math.exp((math.log(0.9) + math.log(1.1)) / 2)
    assert torch.allclose(loss, t([[-1.28, -1.28, 0.0], [s1, s1, 0.0]]))
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.allclose(g, t([[0.0, 0.0, 0.0], [s1, s1, 0.0]]))
    assert m["clip_high_count"].item() == 2


def test_kl_k3():
    lp = t([[0.0, -1.0]])
    assert torch.allclose(kl_k3(lp, lp), torch.zeros_like(lp))
    # ref - logp = 1 -> e - 1 - 1 = 0.718282
    assert kl_k3(t([[-2.0]]), t([[-1.0]])).item() == pytest.approx(math.e - 2)


# ----------------------------------------------------------------------------- token weightings


def _s2t_batch():
    # row 0 (A=+1): p = .005 .005 .5 .005 .9 | pad ; H = .1 2 .1 .05 .1
    # row 1 (A=-1): all low p / low H, but negative advantage -> never silenced
    p = t([[0.005, 0.005, 0.5, 0.005, 0.9, 0.5], [0.005, 0.005, 0.005, 0.5, 0.5, 0.5]])
    h = t([[0.1, 2.0, 0.1, 0.05, 0.1, 0.1], [0.1, 0.1, 0.1, 3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    return p.log(), h, t([1.0, -1.0]), mask


def test_s2t_hand_computed():
    logp, h, adv, mask = _s2t_batch()
    # silenced: A>0 & p<.01 & H<.5 -> row 0 cols 0 and 3 (col 1 has H=2, col 2/4 have high p)
    sil = s2t_mask(logp, h, adv, mask, tau_p=0.01, tau_h=0.5)
    exp = torch.zeros(2, 6, dtype=torch.bool)
    exp[0, 0] = exp[0, 3] = True
    assert torch.equal(sil, exp)
    # the paper's rule: candidates (A > 0, p < .01) are row 0 cols 0, 1, 3 with H = .1, 2, .05;
    # tau_h^(.75) = quantile([.05, .1, 2], .75) = .1 + .5 * (2 - .1) = 1.05 -> cols 0 and 3 silenced
    tw = get_token_weighting("s2t")(TokenContext(logp, h, adv, mask), tau_p=0.01, q=0.75)
    assert tw.weights[0].tolist() == [0, 1, 1, 0, 1, 0] and tw.weights[1].tolist() == [1] * 6
    assert torch.equal(tw.denom_mask, mask & ~exp)  # silenced tokens leave the denominator
    assert tw.info["tau_h"] == pytest.approx(1.05) and tw.info["silenced_count"] == 2
    assert tw.info["candidates"] == 3
    with pytest.raises(ValueError, match="silence must be one of"):
        get_token_weighting("s2t")(TokenContext(logp, h, adv, mask), tau_p=0.01, silence="lowest")


def test_tau_h_quantile_over_candidates_and_gather():
    logp, h, adv, mask = _s2t_batch()
    # candidates: H = .1, 2, .05 (row 1 has A < 0; cols 2 and 4 of row 0 have p >= .01; col 5 is padding)
    assert s2t_tau_h(logp, h, adv, mask, tau_p=0.01, q=0.75) == pytest.approx(1.05)
    assert s2t_tau_h(logp, h, adv, mask, tau_p=0.01, q=0.5) == pytest.approx(0.1)
    # every valid token's .75 quantile is another number: the population matters
    assert torch.quantile(h[mask], 0.75).item() != pytest.approx(1.05)
    # a gather that appends another rank's candidates (H = 3, 4) changes the threshold:
    # quantile([.05, .1, 2, 3, 4], .75) = 3
    other = torch.tensor([3.0, 4.0], dtype=torch.float64)
    q = s2t_tau_h(logp, h, adv, mask, tau_p=0.01, q=0.75, gather=lambda x: torch.cat([x, other]))
    assert q == pytest.approx(3.0)
    # no candidate (every A <= 0): NaN, and nothing is silenced
    assert math.isnan(s2t_tau_h(logp, h, -adv.abs(), mask, tau_p=0.01, q=0.75))
    tw = get_token_weighting("s2t")(TokenContext(logp, h, -adv.abs(), mask), tau_p=0.01, q=0.75)
    assert torch.equal(tw.denom_mask, mask) and tw.info["silenced_count"] == 0
    big = torch.rand(
        17_000_000, generator=torch.Generator().manual_seed(0)
    )  # past torch.quantile's 16M limit
    assert quantile(big, 0.05) == pytest.approx(0.05, abs=1e-3)


def test_top_entropy_keeps_right_fraction():
    h = t([[0.1, 0.2, 0.3, 0.4, 0.5], [0.6, 0.7, 0.8, 0.9, 1.0]])
    mask = torch.ones(2, 5, dtype=torch.bool)
    ctx = TokenContext(torch.zeros(2, 5, dtype=D), h, t([1.0, -1.0]), mask)
    tw = get_token_weighting("top_entropy")(ctx, rho=0.2)  # ceil(.2 * 10) = 2 -> 0.9, 1.0
    assert tw.weights.sum().item() == 2 and tw.weights[1, 3] == 1 and tw.weights[1, 4] == 1
    assert torch.equal(tw.denom_mask, tw.weights.bool())  # "kept": dropped tokens leave the denominator
    tw = get_token_weighting("top_entropy")(ctx, rho=0.25, denominator="all")  # ceil(2.5) = 3
    assert tw.weights.sum().item() == 3 and torch.equal(tw.denom_mask, mask)
    g = torch.Generator().manual_seed(0)
    hr = torch.rand(40, 50, generator=g, dtype=D)
    mr = torch.rand(40, 50, generator=g) < 0.5
    ctx = TokenContext(torch.zeros_like(hr), hr, torch.ones(40, dtype=D), mr)
    tw = get_token_weighting("top_entropy")(ctx)
    n = int(mr.sum())
    assert tw.weights.sum().item() == math.ceil(0.2 * n)
    assert (tw.weights * ~mr).sum() == 0
    assert hr[tw.weights.bool()].min() >= hr[mr & ~tw.weights.bool()].max()


def test_stare_gate_on_off():
    # row 0 A>0, logp -.1 -3 -.5 -2 -.2: top ceil(.2*5)=1 surprisal is 3.0 (col 1) -> w=1.1
    # row 1 A<0, logp -4 -.1 -.1 -.1 -.1: C2 also scales its top surprisal (col 0) by m=0.9
    logp = t([[-0.1, -3.0, -0.5, -2.0, -0.2], [-4.0, -0.1, -0.1, -0.1, -0.1]])
    h = torch.full((2, 5), 0.2, dtype=D)  # batch mean entropy 0.2
    mask = torch.ones(2, 5, dtype=torch.bool)
    ctx = TokenContext(logp, h, t([1.0, -1.0]), mask)
    fn = get_token_weighting("stare")
    on = fn(ctx, top_ratio=0.2, target_entropy=0.3)  # 0.2 < 0.3: gate on, O1
    assert torch.allclose(on.weights, t([[1, 1.1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    c2 = fn(ctx, top_ratio=0.2, target_entropy=0.3, variant="C2")
    assert torch.allclose(c2.weights, t([[1, 1.1, 1, 1, 1], [0.9, 1, 1, 1, 1]]))
    off = fn(ctx, top_ratio=0.2, target_entropy=0.1, variant="C2")  # 0.2 >= 0.1: gate off
    assert torch.equal(off.weights, torch.ones(2, 5, dtype=D)) and off.info["gate_on"] == 0.0
    forced = fn(ctx, top_ratio=0.2, target_entropy=0.1, current_entropy=0.05)
    assert forced.info["gate_on"] == 1.0
    assert torch.equal(on.denom_mask, mask)


def test_context_validates_fields():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="entropy"):
        TokenContext(x, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="advantages"):
        TokenContext(x, x, torch.zeros(3), torch.ones(2, 3, dtype=torch.bool))


# ----------------------------------------------------------------------------- aggregation


def test_aggregations_hand_computed():
    loss = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    # row 0 keeps only col 0, row 1 keeps all, row 2 fully silenced (no denominator token)
    w = t([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    tw = TokenWeights(weights=w, denom_mask=w.bool())
    out = {}
    for name in AGGREGATIONS.names():
        agg = get_aggregation(name)
        out[name] = agg.aggregate(loss, tw, normalizer=agg.normalizer(tw, mask)).item()
    assert out["token-mean"] == pytest.approx((1 + 4 + 5 + 6) / 4)  # 4.0
    assert out["seq-mean-token-mean"] == pytest.approx((1 / 1 + 15 / 3) / 2)  # 3.0
    assert out["seq-mean-token-sum"] == pytest.approx((1 + 15) / 2)  # 8.0
    # a NaN loss at a zero-weight position cannot leak
    loss2 = loss.clone()
    loss2[2, 2] = float("nan")
    agg = get_aggregation("token-mean")
    assert agg.aggregate(loss2, tw, normalizer=4).item() == pytest.approx(4.0)
    # nothing counted at all -> 0, not NaN
    empty = TokenWeights(weights=torch.zeros(3, 3, dtype=D), denom_mask=torch.zeros(3, 3, dtype=torch.bool))
    assert agg.aggregate(loss, empty, normalizer=agg.normalizer(empty, mask)).item() == 0.0


def _random_batch(seed: int, b: int = 8, tt: int = 7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tt + 1, (b,), generator=g)
    mask = torch.arange(tt).unsqueeze(0) < lengths.unsqueeze(1)  # [B, T] ragged
    logits_p = torch.rand(b, tt, generator=g, dtype=D) * 0.98 + 0.01
    logp = logits_p.log()
    old = logp + 0.3 * torch.randn(b, tt, generator=g, dtype=D)
    ent = torch.rand(b, tt, generator=g, dtype=D) * 2
    adv = torch.randn(b, generator=g, dtype=D)
    return logp, old, ent, adv, mask


@pytest.mark.parametrize("agg_name", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("loss_name", ["ppo_clip", "gspo"])
def test_accumulation_over_micro_batches_equals_one_batch(agg_name, loss_name):
    logp0, old, ent, adv, mask = _random_batch(1)
    params = {"tau_p": 0.5, "q": 0.5}  # silences a sizeable share of tokens
    agg = get_aggregation(agg_name)

    # one batch
    logp = logp0.clone().requires_grad_(True)
    tw = get_token_weighting("s2t")(TokenContext(logp, ent, adv, mask), **params)
    assert tw.info["silenced_count"] > 0
    loss, _ = compute_policy_objective(logp, old, adv, mask, tw, policy_loss=loss_name, aggregation=agg_name)
    (g_full,) = torch.autograd.grad(loss, logp)

    # 4 micro-batches of 2; each computes its own weights with a gather that sees the whole
    # mini-batch (as a DP all-gather would), and the global normalizer is summed first
    logp = logp0.clone().requires_grad_(True)
    all_cand = ent[s2t_mask(logp0, ent, adv, mask, tau_p=0.5, tau_h=math.inf)].double()  # the mini-batch's
    parts = [slice(2 * i, 2 * i + 2) for i in range(4)]
    tws = [
        get_token_weighting("s2t")(
            TokenContext(logp[s], ent[s], adv[s], mask[s], gather=lambda _x: all_cand), **params
        )
        for s in parts
    ]
    assert all(w.info["tau_h"] == tw.info["tau_h"] for w in tws)
    norm = sum(agg.normalizer(w, mask[s]) for w, s in zip(tws, parts, strict=True))
    total = 0.0
    for w, s in zip(tws, parts, strict=True):
        part, _ = compute_policy_objective(
            logp[s], old[s], adv[s], mask[s], w, policy_loss=loss_name, aggregation=agg_name, normalizer=norm
        )
        total = total + part
    (g_acc,) = torch.autograd.grad(total, logp)
    assert torch.allclose(total.detach(), loss.detach(), atol=1e-12)
    assert torch.allclose(g_acc, g_full, atol=1e-6)
    # slicing a mini-batch-wide weighting gives the same per-micro-batch weights
    assert torch.equal(tw.select(parts[1]).weights, tws[1].weights)


# ----------------------------------------------------------------------------- STAPO public contract


def test_silenced_token_gets_exactly_zero_gradient():
    logp0, h, adv, mask = _s2t_batch()
    logp = logp0.clone().requires_grad_(True)
    loss, m = stapo_loss(logp, logp0, adv, h, mask, tau_p=0.01, q=0.75)
    (g,) = torch.autograd.grad(loss, logp)
    assert g[0, 0].item() == 0.0 and g[0, 3].item() == 0.0
    # ratio 1 everywhere: un-silenced valid tokens get -A / (#denominator tokens = 11 - 2 = 9)
    assert g[0, 1].item() == pytest.approx(-1 / 9) and g[1, 0].item() == pytest.approx(1 / 9)
    assert g[0, 5].item() == 0.0  # padding
    assert m["silenced_count"].item() == 2


def test_stapo_equals_clip_higher_when_nothing_silenced():
    logp0, old, ent, adv, mask = _random_batch(3)
    logp = logp0.clone().requires_grad_(True)
    loss, _ = stapo_loss(logp, old, adv, ent, mask, tau_p=1e-9, q=0.75)
    per_tok, _ = get_policy_loss("ppo_clip")(logp, old, adv, mask)
    plain = per_tok.sum() / mask.sum()
    assert torch.allclose(loss, plain)
    g1 = torch.autograd.grad(loss, logp, retain_graph=True)[0]
    g2 = torch.autograd.grad(plain, logp)[0]
    assert torch.allclose(g1, g2)


# ----------------------------------------------------------------------------- metrics


def test_token_metrics_phase_cells():
    logp, h, adv, mask = _s2t_batch()
    ctx = TokenContext(logp, h, adv, mask)
    tw = get_token_weighting("s2t")(ctx, tau_p=0.01, q=0.75)
    m = token_metrics(ctx, tw, tau_p=0.01, tau_h=0.5)
    assert sum(m[k] for k in PHASE_KEYS) == pytest.approx(1.0)
    # 11 valid tokens; silenced = lowp & lowh & pos = 2 -> 2/11
    assert m["stapo/silenced_frac"] == pytest.approx(2 / 11)
    assert m["phase/lowp_lowh_pos"] == pytest.approx(2 / 11)
    assert m["phase/lowp_highh_pos"] == pytest.approx(1 / 11)  # p=.005, H=2
    assert m["phase/highp_lowh_pos"] == pytest.approx(2 / 11)  # p=.5/.9 with H=.1
    assert m["phase/lowp_lowh_neg"] == pytest.approx(3 / 11)
    assert m["phase/highp_highh_neg"] == pytest.approx(3 / 11)
    assert m["entropy/mean"] == pytest.approx(h[mask].mean().item())
    assert m["prob/mean"] == pytest.approx(logp.exp()[mask].mean().item())
    # summed over two identical "ranks": fractions unchanged, counts doubled
    ctx2 = TokenContext(logp, h, adv, mask, all_reduce_sum=lambda x: 2 * x)
    m2 = token_metrics(ctx2, tw, tau_p=0.01, tau_h=0.5)
    assert m2["tokens/valid"] == 22 and m2["stapo/silenced_frac"] == pytest.approx(2 / 11)
