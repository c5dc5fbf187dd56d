"""Hand-computed checks of the mechanisms that make each recipe what its paper says.

DAPO: dynamic sampling on accuracy, +1/-1 rewards with the overlong penalty, overlong filtering.
KL to a frozen reference model (k1/k2/k3, loss or reward). Lp-Reg's min-p proxy and its KL term on a
tiny vocabulary. STARE's adaptive (W, M) schedule. The entropy bonus's gradient sign.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hook_driver import before_update, forwards, run_hooks

from stapo.core.algos import (
    TokenContext,
    dynamic_sampling_values,
    get_aggregation,
    get_kl_estimator,
    get_token_weighting,
    overlong_filter_keep,
)
from stapo.core.algos.lpreg import (
    PROXY_FLOOR,
    lp_reg_count,
    lp_reg_select,
    minp_proxy_logprobs,
    minp_stats_from_logits,
)
from stapo.core.algos.regularizers import entropy_bonus, kl_token_term, lp_reg_token_term
from stapo.core.algos.stare import StareSchedule, stare_schedule_step
from stapo.core.config import TinyModel, config_from_dict
from stapo.core.rollout.rollouts import mixed_groups
from stapo.core.train import loop
from stapo.core.train.hooks import Hooks, StepState
from stapo.core.train.reference import ReferencePolicy, minp_stats_batched
from stapo.core.trainer.base import compute_token_stats
from stapo.core.trainer.models import build_tiny_model

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def seq(group, correct, reward, n_tokens=3, finish="stop"):
    s = loop.Sequence_([1], [2] * n_tokens, finish, "", "0", group=group)
    s.correct, s.reward = correct, reward
    return s


# ----------------------------------------------------------------------------- DAPO


def test_dynamic_sampling_filters_on_accuracy_not_shaped_reward():
    # g0: all correct, but lengths differ so the shaped rewards differ (1, .5, 1, .75): DAPO drops it
    # (0 < #correct < G fails); filtering on the reward would keep it. g1: one right: kept by both.
    # g2: all wrong, equal rewards: dropped by both.
    g0 = [seq(0, True, r) for r in (1.0, 0.5, 1.0, 0.75)]
    g1 = [seq(1, c, r) for c, r in ((True, 1.0), (False, -1.0), (False, -1.0), (False, -1.0))]
    g2 = [seq(2, False, -1.0) for _ in range(4)]
    seqs = g0 + g1 + g2
    assert {s.group for s in mixed_groups(seqs, "acc")} == {1}
    assert {s.group for s in mixed_groups(seqs, "reward")} == {0, 1}
    vals = dynamic_sampling_values(t([[1.0, 0.5]]), t([[1.0, 1.0]]), metric="acc")
    assert vals.tolist() == [[1.0, 1.0]]
    with pytest.raises(ValueError, match="dynamic_sampling_metric"):
        dynamic_sampling_values(t([[1.0]]), t([[1.0]]), metric="seq_reward")


def test_default_metric_is_accuracy():
    cfg = config_from_dict({})
    assert cfg.algorithm.dynamic_sampling_metric == "acc"


def test_plus_minus_one_rewards_with_overlong_penalty():
    # max_new_tokens 10, buffer 4: no penalty up to length 6, then -(L - 6) / 4, -1 at 10.
    cfg = config_from_dict({
        "rollout": {"max_new_tokens": 10},
        "algorithm": {"overlong": {"enabled": True, "buffer": 4, "penalty": 1.0}},
        "reward": {"scale": {"correct": 1.0, "wrong": -1.0}},
    })
    from stapo.core.task.rewards import scale_reward

    correct, lengths = [True, True, False, False], [5, 8, 10, 6]
    seqs = [seq(0, c, scale_reward(c, 1.0, -1.0), n_tokens=n) for c, n in zip(correct, lengths, strict=True)]
    kept = loop.shape_and_advantage(cfg, seqs)
    assert [s.reward for s in kept] == pytest.approx([1.0, 0.5, -2.0, -1.0])
    r = [1.0, 0.5, -2.0, -1.0]
    mean = sum(r) / 4  # -0.375
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / 3)  # unbiased, 1.376893
    assert [s.advantage for s in kept] == pytest.approx([(x - mean) / (std + 1e-6) for x in r], rel=1e-5)


def test_reward_scale_through_the_real_grader():
    from stapo.core.config import RewardConfig
    from stapo.core.task.rewards import RewardFunction
    from stapo.verifier_service.server.pool import GraderPool

    pool = GraderPool(workers=1, deadline_s=5.0)
    try:
        fn = RewardFunction(RewardConfig(scale={"correct": 1.0, "wrong": -1.0}), grader=pool)
        out = fn([r"\boxed{7}", r"\boxed{8}", "no answer here"], ["7", "7", "7"])
    finally:
        pool.close()
    assert out.rewards == [1.0, -1.0, -1.0]
    # older configs: reward.correct / reward.incorrect map onto reward.scale
    assert RewardConfig(correct=2.0, incorrect=-0.5).scale.model_dump() == {"correct": 2.0, "wrong": -0.5}


def test_overlong_filter_masks_exactly_the_truncated_samples():
    assert overlong_filter_keep(["stop", "length", "stop", "length"]).tolist() == [True, False, True, False]
    seqs = [seq(0, False, 0.0, finish=f) for f in ("length", "stop", "stop")]
    on = run_hooks(config_from_dict({"algorithm": {"overlong": {"filter": True}}})).get("overlong_filter")
    st = StepState(1, seqs, list(seqs), {})
    assert on.on_batch(st).keep == (False, True, True)  # what it returns; the loop's phase applies it:
    assert Hooks({"overlong_filter": on}).on_batch(st) == (replace(st, kept=seqs[1:]), {})  # rows leave ``kept``
    assert run_hooks(config_from_dict({})).get("overlong_filter") is None  # off: no hook, every row stays


# ----------------------------------------------------------------------------- KL to a reference


def test_kl_estimators_by_hand():
    lp, ref = t([[math.log(0.5)]]), t([[math.log(0.25)]])
    k1, k2, k3 = (get_kl_estimator(k)(lp, ref).item() for k in ("k1", "k2", "k3"))
    assert k1 == pytest.approx(math.log(2))  # log(pi / ref)
    assert k2 == pytest.approx(0.5 * math.log(2) ** 2)
    assert k3 == pytest.approx(0.5 + math.log(2) - 1)  # ref/pi - log(ref/pi) - 1 = .5 + .693 - 1


def _verl_low_var_kl(logprob: float, ref_logprob: float) -> float:
    """verl core_algos.kl_penalty_forward("low_var_kl"), rewritten in plain floats (the independent side)."""
    kl = max(-20.0, min(20.0, ref_logprob - logprob))
    return max(-10.0, min(10.0, math.exp(kl) - kl - 1))


@pytest.mark.parametrize("log_ratio", [-6.0, -1.0, 0.5, 2.0, -2.5])
def test_k3_is_clamped_as_verl_value_and_gradient(log_ratio):
    """log(pi / ref) = -6: k3 = e^6 - 6 - 1 = 396.43 unclamped (d/dlogp = 1 - e^6 = -402.43); verl clamps
    the value to 10, and past the clamp the token has no gradient."""
    ref = -1.0
    d = -log_ratio  # log(ref / pi)
    for name, want, want_grad in (
        ("k3", _verl_low_var_kl(ref + log_ratio, ref), 0.0 if math.exp(d) - d - 1 > 10 else 1 - math.exp(d)),
        ("k3_unclamped", math.exp(d) - d - 1, 1 - math.exp(d)),
    ):
        lp = torch.tensor([[ref + log_ratio]], dtype=torch.float64, requires_grad=True)
        k = get_kl_estimator(name)(lp, torch.tensor([[ref]], dtype=torch.float64))
        k.sum().backward()
        assert k.item() == pytest.approx(want, rel=1e-9), name
        assert lp.grad.item() == pytest.approx(want_grad, rel=1e-9, abs=1e-12), name
    if log_ratio == -6.0:  # the k3 blow-up, by hand
        assert math.exp(6) - 7 == pytest.approx(396.43, abs=0.01) and _verl_low_var_kl(-7.0, -1.0) == 10.0


def _tiny():
    torch.manual_seed(0)
    return build_tiny_model(TinyModel(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0))


def _logprobs_by_full_logits(model, ids):
    """Independent of compute_token_stats: the model's own logits, log_softmax, gather."""
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].double()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))  # [B, L], position 0 predicts nothing


def test_k1_k3_against_the_frozen_reference_model():
    policy = _tiny()
    ids = torch.tensor([[5, 9, 3, 7, 2, 11], [4, 4, 8, 1, 6, 10]])
    attn = torch.ones_like(ids)
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[:, 3:] = True
    before = _logprobs_by_full_logits(policy, ids)
    ref = ReferencePolicy(policy, dtype="float32", offload=True)
    with torch.no_grad():  # the policy trains on: the reference must not follow
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = loop.Batch(ids, attn, resp, torch.zeros(ids.shape))
    ref_lp = ref.logprobs(batch, forwards(batch, 1), temperature=1.0).double()
    assert torch.allclose(ref_lp[resp], before[resp], atol=1e-5)
    assert all(p.device.type == "cpu" and not p.requires_grad for p in ref.model.parameters())
    now = _logprobs_by_full_logits(policy, ids)
    assert not torch.allclose(now[resp], before[resp], atol=1e-3)
    # per-token k1 / k3 from the two models, by the formulas
    d = (before - now)[resp]  # log ref - log pi
    assert torch.allclose(get_kl_estimator("k1")(now[resp], ref_lp[resp]), -d, atol=1e-5)
    assert torch.allclose(get_kl_estimator("k3")(now[resp], ref_lp[resp]), d.exp() - d - 1, atol=1e-5)
    # bf16 copy: half the bytes, close log-probs
    ref16 = ReferencePolicy(policy, dtype="bfloat16")
    assert ref16.num_bytes() * 2 == ReferencePolicy(policy, dtype="float32").num_bytes()


def test_kl_term_in_the_loss_and_actor_kl_metric():
    cfg = config_from_dict({"algorithm": {"kl_coef": 0.1, "kl": {"reference": "initial", "dtype": "float32"}}})
    policy = _tiny()
    backend = SimpleNamespace(model=policy, device=torch.device("cpu"), world_size=1)
    hooks = run_hooks(cfg, backend)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.tensor([[5, 9, 3, 7, 2]])
    batch = loop.Batch(ids, torch.ones_like(ids), torch.tensor([[False, False, True, True, True]]),
                       torch.zeros(1, 5))
    with torch.no_grad():
        old_lp, old_ent = compute_token_stats(policy, ids, batch.attention_mask, batch.response_mask, chunk_size=4)
    st, m = before_update(hooks, batch, old_lp, old_ent, micro_batch=1)
    ref_lp = st.ref_lp
    d = (ref_lp - old_lp)[batch.response_mask]
    assert m["actor/kl"] == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-5)
    ctx = TokenContext(old_lp, old_ent, batch.advantages, batch.response_mask)
    (term,) = hooks.terms(ctx, torch.tensor([0]), old_lp)
    assert torch.allclose(term(old_lp)[batch.response_mask], 0.1 * (d.exp() - d - 1))
    assert term(old_lp)[~batch.response_mask].abs().sum() == 0


def test_kl_in_reward_rewrites_rewards_and_advantages():
    cfg = config_from_dict({"algorithm": {"kl_coef": 0.5, "kl": {"in_reward": True, "estimator": "k1"}}})
    hook = run_hooks(cfg).get("kl_in_reward")
    old = t([[0.0, -1.0, -1.0], [0.0, -2.0, -2.0]], torch.float32)
    mask = torch.tensor([[False, True, True], [False, True, True]])
    batch = loop.Batch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), mask, torch.zeros(2, 3))
    seqs = [seq(0, True, 1.0), seq(0, False, 0.0)]
    # the target kl_reference publishes earlier in the same phase, set by hand
    st = StepState(1, seqs, seqs, {}, batch=batch, old_lp=old, old_ent=torch.zeros(2, 3),
                   ref_lp=t([[0.0, -1.5, -1.0], [0.0, -2.0, -3.0]], torch.float32))
    m = hook.before_update(st)
    # k1 sums: row 0: (-1+1.5) + 0 = 0.5 -> penalty .25; row 1: 0 + (-2+3) = 1 -> penalty .5
    assert [s.reward for s in seqs] == pytest.approx([0.75, -0.5])
    a = (0.75 - 0.125) / (math.sqrt(((0.625) ** 2 * 2) / 1) + 1e-6)
    assert [s.advantage for s in seqs] == pytest.approx([a, -a], rel=1e-5)
    assert batch.advantages[0, 1:].tolist() == pytest.approx([a, a], rel=1e-5) and batch.advantages[0, 0] == 0
    assert m["actor/kl_reward_penalty"] == pytest.approx(0.375)


def test_kl_term_gives_no_penalty_in_the_loss_when_in_reward():
    cfg = config_from_dict({"algorithm": {"kl_coef": 0.5, "kl": {"in_reward": True}}})
    ctx = TokenContext(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2, dtype=torch.bool))
    assert run_hooks(cfg).terms(ctx, torch.tensor([0]), torch.zeros(1, 2)) == []


def test_reference_on_zero3_is_accepted():
    """The frozen reference runs under ZeRO-3, partitioned like the policy (2-rank equality:
    tests/e2e/test_multirank_extras.py, variant kl_ref)."""
    from stapo.core.config import load_config

    cfg = load_config(None, ["algorithm.kl_coef=0.1", "algorithm.kl.reference=initial", "trainer.backend=deepspeed",
                             "trainer.zero_stage=3"])
    assert cfg.trainer.zero_stage == 3 and cfg.algorithm.kl.reference == "initial"


# ----------------------------------------------------------------------------- Lp-Reg


def test_minp_proxy_on_a_tiny_vocabulary():
    p = t([[0.5, 0.3, 0.15, 0.04, 0.01]])
    log_kept, log_pmax = minp_stats_from_logits(p.log(), min_p=0.1)  # floor 0.1 * 0.5 = 0.05
    assert log_kept.exp().item() == pytest.approx(0.95)  # 0.5 + 0.3 + 0.15 survive
    assert log_pmax.exp().item() == pytest.approx(0.5)
    lp = t([[math.log(0.3), math.log(0.04), math.log(0.5)]])  # sampled tokens 1, 3, 0 at the same state
    proxy = minp_proxy_logprobs(lp, log_kept.expand(1, 3), log_pmax.expand(1, 3), min_p=0.1)
    assert proxy[0, 0].exp().item() == pytest.approx(0.3 / 0.95)
    assert proxy[0, 1].item() == PROXY_FLOOR  # below the relative floor: removed from the proxy
    assert proxy[0, 2].exp().item() == pytest.approx(0.5 / 0.95)  # the max itself is kept


def test_minp_stats_from_the_model_match_full_logits():
    model = _tiny()
    ids = torch.tensor([[5, 9, 3, 7, 2, 11]])
    resp = torch.tensor([[False, False, True, True, True, True]])
    batch = loop.Batch(ids, torch.ones_like(ids), resp, torch.zeros(ids.shape))
    kept, pmax = minp_stats_batched(model, batch, forwards(batch, 1), min_p=0.3, temperature=0.7, chunk_size=3)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids).logits[0, :-1].double() / 0.7, -1)  # [L-1, V]
    for pos in range(2, 6):
        q = probs[pos - 1]
        want = q[q >= 0.3 * q.max()].sum()
        assert kept[0, pos].exp().item() == pytest.approx(want.item(), rel=1e-4)
        assert pmax[0, pos].exp().item() == pytest.approx(q.max().item(), rel=1e-4)
    assert kept[0, :2].abs().sum() == 0


def test_lp_reg_selection_and_kl_by_hand():
    # one negative row, one positive row; p of the negative row's tokens: .3 .9 .2 .8 .6 .7
    p = t([[0.3, 0.9, 0.2, 0.8, 0.6, 0.7], [0.01, 0.9, 0.9, 0.9, 0.9, 0.9]])
    adv = t([-1.0, 1.0])
    mask = torch.ones(2, 6, dtype=torch.bool)
    sel = lp_reg_select(p.log(), adv, mask, rho=0.5)  # n=6 negatives, k = int(3) = 3 lowest: .2 .3 .6
    assert sel.tolist() == [[True, False, True, False, True, False], [False] * 6]
    assert lp_reg_count(150, 0.01) == 0 and lp_reg_count(250, 0.01) == 2  # the authors' k > 1 rule
    assert not lp_reg_select(p.log(), adv, mask, rho=0.2).any()  # int(1.2) = 1: not applied
    # proxy: token 0 raised by the min-p renormalization (.3 -> .4), token 2 below the floor, token 4 at .5 < .6
    proxy = t([[math.log(0.4), 0.0, PROXY_FLOOR, 0.0, math.log(0.5), 0.0], [0.0] * 6])
    logp = p.log().clone().requires_grad_(True)
    term = lp_reg_token_term(proxy, sel, coef=2.0)
    val = term(logp)
    d = math.log(0.4 / 0.3)  # only token 0 qualifies: selected and logp < proxy
    expect = torch.zeros(2, 6, dtype=D)
    expect[0, 0] = 2.0 * (math.exp(d) - d - 1)
    assert torch.allclose(val, expect)
    val.sum().backward()
    assert logp.grad[0, 0].item() == pytest.approx(2.0 * (1 - 0.4 / 0.3))  # < 0: descent RAISES log p
    assert logp.grad[0, 0] < 0 and logp.grad.abs().sum() == logp.grad[0, 0].abs()


def test_lp_reg_terms_from_the_hook_use_the_rows_and_config():
    cfg = config_from_dict({"algorithm": {"token_weighting": "none", "lp_reg": {"enabled": True, "rho": 0.5, "coef": 1.0}}})
    hooks = run_hooks(cfg)
    p = t([[0.3, 0.9, 0.2, 0.8, 0.6, 0.7]])
    hooks.get("lp_reg").proxy_lp = t([[math.log(0.4), 0.0, PROXY_FLOOR, 0.0, math.log(0.5), 0.0]])  # its before_update's
    ctx = TokenContext(p.log(), torch.zeros(1, 6, dtype=D), t([-1.0]), torch.ones(1, 6, dtype=torch.bool))
    (term,) = hooks.terms(ctx, torch.tensor([0]), p.log())
    assert term.name == "lp_reg" and (term(p.log()) != 0).tolist() == [[True] + [False] * 5]


# ----------------------------------------------------------------------------- STARE schedule


def test_stare_schedule_steps_by_hand():
    kw = {"target_entropy": 0.3, "alpha": 0.01, "w_max": 1.5, "m_min": 0.5}
    assert stare_schedule_step(1.1, 0.9, 0.2, **kw) == pytest.approx((1.11, 0.89))  # below target: intensify
    assert stare_schedule_step(1.1, 0.9, 0.5, **kw) == pytest.approx((1.09, 0.91))  # above: relax
    assert stare_schedule_step(1.0, 1.0, 0.5, **kw) == (1.0, 1.0)  # clipped at [1, w_max] / [m_min, 1]
    assert stare_schedule_step(1.495, 0.505, 0.1, **kw) == pytest.approx((1.5, 0.5))
    assert stare_schedule_step(1.1, 0.9, 0.3, **kw) == (1.1, 0.9)  # sgn(0) = 0
    assert stare_schedule_step(1.1, 0.9, float("nan"), **kw) == (1.1, 0.9)
    s = StareSchedule(w=1.1, m=0.9, adaptive=True, **kw)
    for h in (0.1, 0.1, 0.1, 0.6):
        s.update(h)
    assert (s.w, s.m) == pytest.approx((1.12, 0.88)) and s.params()["current_entropy"] == 0.6
    fixed = StareSchedule(w=1.1, m=0.9, adaptive=False, **kw)
    fixed.update(0.1)
    assert (fixed.w, fixed.m) == (1.1, 0.9)


def test_stare_hook_feeds_the_weighting_the_scheduled_weights():
    cfg = config_from_dict({"algorithm": {"token_weighting": "stare",
                                          "stare": {"adaptive": True, "alpha": 0.1, "variant": "C2"}}})
    hooks = run_hooks(cfg)
    mask = torch.ones(2, 5, dtype=torch.bool)
    batch = SimpleNamespace(response_mask=mask)
    ent = torch.full((2, 5), 0.1)  # mean 0.1 < 0.3: gate on, W 1.1 -> 1.2, M 0.9 -> 0.8
    _, m = before_update(hooks, batch, torch.zeros(2, 5), ent, micro_batch=2)
    assert m["stare/reweight_w"] == pytest.approx(1.2) and m["stare/gate_on"] == 1.0
    lp = torch.log(t([[0.9, 0.05, 0.9, 0.9, 0.9], [0.02, 0.9, 0.9, 0.9, 0.9]], torch.float32))
    ctx = TokenContext(lp, ent, torch.tensor([1.0, -1.0]), mask)
    tw = get_token_weighting("stare")(ctx, top_ratio=0.2, variant="C2", target_entropy=0.3, **hooks.weighting_params())
    assert tw.weights[0, 1].item() == pytest.approx(1.2) and tw.weights[1, 0].item() == pytest.approx(0.8)


# ----------------------------------------------------------------------------- entropy bonus


def test_entropy_bonus_gradient_raises_entropy():
    z = torch.tensor([[[3.0, 0.0, -1.0], [0.5, 0.2, 0.1]]], requires_grad=True)  # [B=1, T=2, V=3]
    logp = torch.log_softmax(z, -1)
    ent = -(logp.exp() * logp).sum(-1)  # [1, 2]
    mask = torch.ones(1, 2, dtype=torch.bool)
    tw = get_token_weighting("none")(TokenContext(torch.zeros(1, 2), ent.detach(), torch.zeros(1), mask))
    agg = get_aggregation("token-mean")
    loss = entropy_bonus(ent, tw, agg, agg.normalizer(tw, mask), coef=0.1)
    assert loss.item() == pytest.approx(-0.1 * ent.mean().item())
    loss.backward()
    with torch.no_grad():
        z2 = z - 1.0 * z.grad  # one descent step on the loss
        lp2 = torch.log_softmax(z2, -1)
        ent2 = -(lp2.exp() * lp2).sum(-1)
    assert (ent2 > ent.detach()).all()


def test_entropy_bonus_needs_entropy_grad():
    from stapo.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="trainer.entropy_grad"):
        load_config(None, ["algorithm.entropy_coef=0.01"])
    load_config(None, ["algorithm.entropy_coef=0.01", "trainer.entropy_grad=true"])


def test_kl_term_is_elementwise_for_the_fused_path():
    ref = t([[-1.0, -2.0, -0.5]])
    term = kl_token_term(ref, torch.ones(1, 3, dtype=torch.bool), coef=0.3)
    lp = t([[-1.2, -1.0, -0.4]])
    idx = torch.tensor([2, 0])
    assert torch.allclose(term.flat(idx)(lp[:, idx]), term(lp)[:, idx])  # [1, n]
