"""Off-policy pieces (VCPO's ESS step scaling and minimum-variance baseline, AReaL's decoupled
behaviour weight): hand-computed values on tiny tensors, the limits at w = 1 everywhere, and the
baseline inside the update against an independent computation on a tiny model."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from stapo.core.algos import (
    TokenContext,
    get_advantage,
    get_aggregation,
    get_policy_loss,
    get_token_weighting,
)
from stapo.core.algos.offpolicy import (
    behaviour_weights,
    effective_sample_size,
    ess_lr_scale,
    grouped_min_variance_advantages,
    min_variance_advantages,
    min_variance_baseline,
    ratio_stats,
    sequence_importance_weights,
    with_behaviour_weights,
)


def test_ess_hand_values() -> None:
    assert effective_sample_size(torch.ones(4)) == (4.0, 1.0)
    ess, ratio = effective_sample_size(torch.tensor([1.0, 3.0]))  # 4^2 / (1 + 9)
    assert ess == pytest.approx(1.6) and ratio == pytest.approx(0.8)
    ess, ratio = effective_sample_size(torch.tensor([2.0, 0.0, 0.0, 0.0]))  # one sample carries it all
    assert ess == pytest.approx(1.0) and ratio == pytest.approx(0.25)
    # invalid entries count neither in the sums nor in N
    ess, ratio = effective_sample_size(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([True, True, False]))
    assert ess == pytest.approx(1.6) and ratio == pytest.approx(0.8)
    assert effective_sample_size(torch.tensor([5.0]), torch.tensor([False])) == (0.0, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        effective_sample_size(torch.tensor([-1.0, 1.0]))


def test_ess_all_reduce_sums_over_ranks() -> None:
    # two "ranks" holding [1] and [3]: the reduced sums are those of [1, 3]
    other = torch.tensor([3.0, 9.0, 1.0], dtype=torch.float64)
    ess, ratio = effective_sample_size(torch.tensor([1.0]), all_reduce_sum=lambda s: s + other)
    assert ess == pytest.approx(1.6) and ratio == pytest.approx(0.8)


def test_lr_scale_rules() -> None:
    assert ess_lr_scale(0.25) == pytest.approx(0.5)  # sqrt rule, the authors' default
    assert ess_lr_scale(0.25, rule="linear") == pytest.approx(0.25)
    assert ess_lr_scale(0.25, base_ratio=0.5) == pytest.approx(math.sqrt(0.5))
    assert ess_lr_scale(0.9, base_ratio=0.5) == 1.0  # never above the configured LR
    with pytest.raises(ValueError, match="rule"):
        ess_lr_scale(0.5, rule="cube")
    with pytest.raises(ValueError, match="base ESS ratio"):
        ess_lr_scale(0.5, base_ratio=0.0)


def test_w_one_everywhere_is_a_no_op() -> None:
    lp = torch.log(torch.tensor([[0.3, 0.2, 0.9], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[True, True, False], [True, True, True]])
    w_seq = sequence_importance_weights(lp, lp.clone(), mask)
    assert w_seq.tolist() == [1.0, 1.0]
    _, ratio = effective_sample_size(w_seq)
    assert ess_lr_scale(ratio) == 1.0 and ess_lr_scale(ratio, rule="linear") == 1.0
    bw = behaviour_weights(lp, lp.clone(), mask)
    assert bw.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def test_sequence_weights_are_products_over_valid_tokens() -> None:
    prox = torch.tensor([[0.1, 0.2, 5.0], [0.0, 0.0, 0.0]])
    beh = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [False, False, False]])
    w = sequence_importance_weights(prox, beh, mask)
    assert w[0].item() == pytest.approx(math.exp(0.3)) and w[1].item() == 1.0  # no valid token: ratio 1
    w_big = sequence_importance_weights(torch.full((1, 4), 10.0), torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool))
    assert w_big.item() == pytest.approx(math.exp(20.0))  # clamped, finite


def test_min_variance_baseline_hand_values() -> None:
    r = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    w = torch.tensor([[1.0, 1.0], [2.0, 1.0]])
    g2 = torch.tensor([[1.0, 3.0], [1.0, 1.0]])
    # group 0: W = [1, 3] -> b = 1 / 4; group 1: W = [4, 1] -> b = 4 / 5
    assert min_variance_baseline(r, w, g2).tolist() == pytest.approx([0.25, 0.8])
    # all-zero W falls back to the mean
    assert min_variance_baseline(r[:1], w[:1], torch.zeros(1, 2)).tolist() == [0.5]
    with pytest.raises(ValueError, match="grad_sq_norms"):
        min_variance_baseline(r, w, torch.ones(3))


def test_min_variance_advantages_hand_values() -> None:
    """Uniform W: (R - mean) / population std for GRPO (the authors' ``torch.std(unbiased=False)``),
    R - mean for Dr. GRPO; a group whose std is 0 stays unscaled."""
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    ones = torch.ones_like(r)
    g2 = torch.full_like(r, 7.0)
    assert min_variance_advantages(r, ones, g2, scale_by_std=True)[0].tolist() == pytest.approx([1, -1, -1, 1])
    assert min_variance_advantages(r, ones, g2, scale_by_std=True)[1].tolist() == [0.0] * 4
    assert torch.allclose(min_variance_advantages(r, ones, g2, scale_by_std=False), get_advantage("dr_grpo")(r))
    # and departs from them when one sample's weight dominates: b moves toward that sample's reward
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    w = torch.tensor([[3.0, 1.0, 1.0, 1.0]])
    adv = min_variance_advantages(r, w, torch.full_like(r, 7.0), scale_by_std=False)
    assert adv[0].tolist() == pytest.approx([1 - 10 / 12, -10 / 12, -10 / 12, 1 - 10 / 12])


def test_grouped_min_variance_advantages_hand_values() -> None:
    """One mini-batch's rows, two groups interleaved: each group gets its own b and std.
    Group 7 (rows 0, 2): R = [1, 0], w = [1, 2], ||g||^2 = [1, 1] -> W = [1, 4], b = 1/5,
    population std 1/2 -> A = [(1 - 0.2) / 0.5, (0 - 0.2) / 0.5] = [1.6, -0.4].
    Group 3 (rows 1, 3): R = [0, 1], w = [1, 1], ||g||^2 = [3, 1] -> W = [3, 1], b = 1/4 -> A = [-0.5, 1.5]."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    w = torch.tensor([1.0, 1.0, 2.0, 1.0])
    g2 = torch.tensor([1.0, 3.0, 1.0, 1.0], dtype=torch.float64)
    before = (r.clone(), w.clone(), g2.clone())
    adv = grouped_min_variance_advantages(r, [7, 3, 7, 3], w, g2, scale_by_std=True)
    assert adv.dtype == torch.float64 and adv.tolist() == pytest.approx([1.6, -0.5, -0.4, 1.5])
    # unscaled (Dr. GRPO): R - b
    assert grouped_min_variance_advantages(r, [7, 3, 7, 3], w, g2, scale_by_std=False).tolist() == pytest.approx(
        [0.8, -0.25, -0.2, 0.75])
    assert all(torch.equal(a, b) for a, b in zip(before, (r, w, g2), strict=True))  # inputs untouched


def test_row_advantages_replace_response_tokens_of_real_rows_only() -> None:
    from stapo.core.train.off_policy import with_row_advantages

    adv = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.0, 0.2], [9.0, 9.0, 9.0]])  # row 2: a padding row
    mask = torch.tensor([[False, True, True], [False, False, True], [True, True, True]])
    out = with_row_advantages(adv, mask, torch.tensor([1.5, -2.0], dtype=torch.float64))
    assert out.tolist() == [[0.0, 1.5, 1.5], [0.0, 0.0, -2.0], [9.0, 9.0, 9.0]] and out.dtype == adv.dtype
    assert adv[0].tolist() == [0.0, 0.5, 0.5]  # a new tensor: the input stays


def test_behaviour_weight_cap_keeps_denominator() -> None:
    prox = torch.log(torch.tensor([[0.4, 0.9, 0.5]]))
    beh = torch.log(torch.tensor([[0.2, 0.1, 0.5]]))
    mask = torch.tensor([[True, True, True]])
    w = behaviour_weights(prox, beh, mask, cap=5.0)
    assert w[0].tolist() == pytest.approx([2.0, 0.0, 1.0])  # 9 > cap: filtered
    with pytest.raises(ValueError, match="> 1"):
        behaviour_weights(prox, beh, mask, cap=1.0)
    st = ratio_stats(prox, beh, mask)
    assert st["count"] == 3 and st["sum"] == pytest.approx(12.0) and st["max"] == pytest.approx(9.0)


def test_decoupled_loss_hand_value() -> None:
    """pi = 0.5, pi_prox = 0.4, mu = 0.2, A = 1: clip ratio 1.25 (inside 1 + 0.28) on pi/pi_prox,
    behaviour weight 2 -> loss -2.5; a second token with A = 1 and pi/pi_prox = 2 is clipped at 1.28
    with weight 1 -> -1.28; token-mean over the 2 tokens."""
    lp = torch.log(torch.tensor([[0.5, 0.8]]))
    prox = torch.log(torch.tensor([[0.4, 0.4]]))
    beh = torch.log(torch.tensor([[0.2, 0.4]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.ones(1, 2)
    per_tok, _ = get_policy_loss("ppo_clip")(lp, prox, adv, mask, eps_low=0.2, eps_high=0.28)
    ctx = TokenContext(prox, torch.ones(1, 2), adv, mask)
    tw = with_behaviour_weights(get_token_weighting("none")(ctx), behaviour_weights(prox, beh, mask))
    agg = get_aggregation("token-mean")
    loss = agg.aggregate(per_tok, tw, normalizer=agg.normalizer(tw, mask))
    assert loss.item() == pytest.approx((-2.5 - 1.28) / 2, rel=1e-6)


def test_lr_scaled_step_uses_scaled_lr_and_leaves_the_schedule_alone() -> None:
    """``scaled_lr`` (what both backends' ``step(lr_scale=...)`` run under): the step sees lr x scale;
    after an applied step the schedule's next LR stands, after a skipped one the LR is put back."""
    from stapo.core.train.off_policy import OffPolicyStep
    from stapo.core.trainer.base import scaled_lr

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p, torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2})
    # one sequence carries the whole mini-batch: ESS / N = 1/4, the linear rule's multiplier 0.25
    off = OffPolicyStep(torch.ones(4, 1), torch.tensor([2.0, 0.0, 0.0, 0.0], dtype=torch.float64), {},
                        lr_rule=functools.partial(ess_lr_scale, rule="linear"))
    rows = torch.arange(4)
    off.weigh(_weights(4), rows)
    scale = off.take_lr_scale()
    assert scale == pytest.approx(0.25) and off.take_lr_scale() == 1.0  # one step's multiplier, taken once
    with scaled_lr(opt, scale):
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.025, 0.05])  # every group
        opt.param_groups[0]["lr"] = 0.05  # an applied step: the schedule set the next LR
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.2])  # its value stands; group 1 back
    opt.param_groups[0]["lr"] = 0.1
    with scaled_lr(opt, scale):
        pass  # a skipped step: the schedule did not move
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]  # restored exactly
    assert off.metrics["offpolicy/lr_scale"] == pytest.approx((0.25 + 1.0) / 2)


def test_torch_backend_lr_scale_halves_the_step(one_thread) -> None:
    """``TorchBackend.step(lr_scale=0.5)`` from the same state and gradient moves every parameter by
    half of what ``lr_scale=1`` does (AdamW's update and its decoupled weight decay are both linear in
    the LR), reports the LR it used, and the next step runs at the schedule's LR again."""
    import copy

    from stapo.core.config import config_from_dict
    from stapo.core.trainer.models import load_policy
    from stapo.core.trainer.torch_backend import TorchBackend

    tiny = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32, "seed": 0}
    cfg = config_from_dict({"model": {"name_or_path": "tiny-random", "tiny": tiny},
                            "trainer": {"device": "cpu", "lr": 1e-2, "warmup_steps": 0, "weight_decay": 0.1}})
    model, _ = load_policy(cfg.model, device="cpu")
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))

    def one_step(scale: float) -> tuple[dict[str, torch.Tensor], dict[str, float], TorchBackend]:
        b = TorchBackend(cfg, copy.deepcopy(model), total_optimizer_steps=4)
        lp, _ = b.token_stats(ids, torch.ones_like(ids), grad=True)
        b.backward(-lp.sum())
        before = {n: p.detach().clone() for n, p in b.model.named_parameters()}
        out = b.step(lr_scale=scale)
        return {n: p.detach() - before[n] for n, p in b.model.named_parameters()}, out, b

    full, out1, _ = one_step(1.0)
    half, out_half, b = one_step(0.5)
    assert out1["lr"] == 1e-2 and out_half["lr"] == 0.5e-2
    assert any(float(d.abs().max()) > 0 for d in full.values())
    for n, d in full.items():  # (to the float32 rounding of p + delta, |p| ~ 1)
        assert torch.allclose(half[n], 0.5 * d, rtol=1e-4, atol=1e-6), n
    assert b.current_lr() == 1e-2  # the scale was for that one step


def _weights(b: int):
    from stapo.core.algos.weights import TokenWeights

    return TokenWeights(weights=torch.ones(b, 1), denom_mask=torch.ones(b, 1, dtype=torch.bool), info={})


def test_lr_multiplier_is_each_mini_batchs_ess_summed_over_ranks() -> None:
    """VCPO scales each optimizer step by its own mini-batch's ESS (the authors' code), not once per
    batch: a mini-batch of equal weights runs at the full LR, one dominated by a sequence does not."""
    from stapo.core.train.off_policy import OffPolicyStep

    w = torch.tensor([1.0, 1.0, 4.0, 0.0, 1.0], dtype=torch.float64)  # 5 real rows; row 5 = padding
    off = OffPolicyStep(torch.ones(6, 1), w, {}, lr_rule=ess_lr_scale)  # sqrt rule
    assert off.minibatch_lr_scale(torch.tensor([0, 1, 4])) == 1.0  # equal weights: ESS = N
    # rows 2, 3 (+ the padding row, ignored): ESS = 4^2 / 16 = 1 of N = 2 -> sqrt(1/2)
    assert off.minibatch_lr_scale(torch.tensor([2, 3, 5])) == pytest.approx(math.sqrt(0.5))
    whole = ess_lr_scale(effective_sample_size(w)[1])  # the batch's multiplier: neither of the above
    assert whole != pytest.approx(1.0) and whole != pytest.approx(math.sqrt(0.5))
    # another rank's rows of the same mini-batch, weights [2, 2]: sums (1 + 1 + 2 + 2, 1 + 1 + 4 + 4, 4)
    other = [4.0, 8.0, 2.0]
    two = OffPolicyStep(torch.ones(6, 1), w, {}, lr_rule=ess_lr_scale,
                        sum_ranks=lambda v: [a + b for a, b in zip(v, other, strict=True)])
    assert two.minibatch_lr_scale(torch.tensor([0, 1])) == pytest.approx(math.sqrt(36 / 10 / 4))
    without = OffPolicyStep(torch.ones(6, 1), w, {})  # ess_lr_scaling off
    assert without.minibatch_lr_scale(torch.tensor([2, 3])) == 1.0


def test_behaviour_logprobs_go_to_the_response_positions_of_stale_rows_only() -> None:


    from stapo.core.batch import collate
    from stapo.core.train import loop
    from stapo.core.train.off_policy import behaviour_logprobs

    seqs = [loop.Sequence_([5, 6], [7, 8, 9], "stop", "", "0", group=0, version=0, behaviour_logprobs=[-1.0, -2.0, -3.0]),
            loop.Sequence_([5], [7], "stop", "", "0", group=0, version=2, behaviour_logprobs=[-9.0]),
            loop.Sequence_([5], [7, 8], "stop", "", "0", group=0)]
    batch = collate(seqs, pad_id=0)  # prompt width 2, response width 3
    prox = torch.full(batch.input_ids.shape, -0.5)
    beh, stale = behaviour_logprobs(seqs, batch, prox, step=3)  # weights of version 2 start step 3
    assert stale.tolist() == [True, False, False]
    assert beh[0, 2:].tolist() == [-1.0, -2.0, -3.0]
    assert torch.equal(beh[1:], prox[1:])  # sampled by the current weights: behaviour = proximal, exactly



def test_vcpo_baseline_per_minibatch_at_the_current_weights(one_thread, monkeypatch) -> None:
    """The update takes VCPO's baseline as the authors' code does, on a fresh batch too: whole groups
    per mini-batch (2 groups, 2 optimizer steps), and at the start of the second mini-batch, at the
    weights the first step left, W_i = w_i^2 ||g_i||^2 with g_i the gradient of min(w_i, C) x the
    summed PPO-clip loss at advantage 1, b = sum W R / sum W, A = (R - b) / population std.
    Checked against the model's own logits on each unpadded row; the mini-batch's loss reads the
    baseline's advantages while the batch's own stay as collated."""
    import copy

    from stapo.core.batch import collate
    from stapo.core.config import config_from_dict
    from stapo.core.train import loop, update
    from stapo.core.train.extras import Hooks
    from stapo.core.train.off_policy import MinVarianceBaseline, OffPolicyStep
    from stapo.core.trainer.models import load_policy
    from stapo.core.trainer.torch_backend import TorchBackend

    tiny = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64, "seed": 0}
    cfg = config_from_dict({
        "model": {"name_or_path": "tiny-random", "tiny": tiny},
        "rollout": {"prompts_per_step": 2, "n": 4, "async": {"enabled": True}},
        "trainer": {"device": "cpu", "lr": 5e-2, "micro_batch_size": 4, "logits_chunk_size": 7, "warmup_steps": 0},
        "algorithm": {"token_weighting": "none", "mini_batches": 2,
                      "off_policy": {"min_variance_baseline": True, "baseline_is_cap": 1.5}}})
    model, _ = load_policy(cfg.model, device="cpu")
    backend = TorchBackend(cfg, model, total_optimizer_steps=2)
    g = torch.Generator().manual_seed(0)
    seqs = []
    for grp, p_len in enumerate((4, 3)):
        prompt = torch.randint(3, model.config.vocab_size, (p_len,), generator=g).tolist()
        for k in range(4):
            resp = torch.randint(3, model.config.vocab_size, (2 + k,), generator=g).tolist()
            seqs.append(loop.Sequence_(prompt, resp, "stop", "", "0", group=grp, reward=float(k % 2 + k // 3)))
    for s_ in seqs:
        s_.advantage = 0.25  # stands for the group-mean advantages; the baseline replaces them
    batch = collate(seqs, pad_id=0)
    w = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 1.0, 3.0, 1.0], dtype=torch.float64)  # sequence weights
    rewards = torch.tensor([s_.reward for s_ in seqs], dtype=torch.float64)
    base = MinVarianceBaseline(rewards=rewards, groups=[s_.group for s_ in seqs], seq_weights=w, is_cap=1.5,
                               scale_by_std=True, group_adv=torch.full((8,), 0.25, dtype=torch.float64))
    step = OffPolicyStep(batch.response_mask.float(), w.float(), {}, baseline=base)
    old_lp, _ = update.Actor(cfg, backend).old_stats(batch)
    snaps: list = []
    seen: list = []
    given: dict[int, float] = {}  # row -> the advantage the baseline gave it
    real_adv = base.advantages

    def spy(rows, g2, seconds=0.0):
        seen.append(list(rows))  # (in the mini-batch's row order)
        snaps.append(copy.deepcopy(backend.model))  # (the weights the mini-batch starts from)
        out = real_adv(rows, g2, seconds)
        given.update(zip(rows, out.tolist(), strict=True))
        return out

    base.advantages = spy
    adv_before = batch.advantages.clone()
    mbs: list = []  # each optimizer mini-batch the update built: its advantages are what its loss reads
    real_mb = update.MiniBatch
    monkeypatch.setattr(update, "MiniBatch", lambda *a, **k: mbs.append(real_mb(*a, **k)) or mbs[-1])
    inputs = update.UpdateInputs(batch, old_lp, None, step=1, off_policy=step)
    update.Actor(cfg, backend, Hooks()).update(inputs)  # (the off-policy step is the input; no layer acts inside)
    assert torch.equal(batch.advantages, adv_before)  # the batch is not rewritten
    assert sorted(sorted(r) for r in seen) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # each group whole, one per optimizer step
    read = torch.cat([mb.adv for mb in mbs])  # [8, L] the rows in mini-batch order
    for k, i in enumerate(i for rows in seen for i in rows):
        m = batch.response_mask[i]
        assert read[k][m].tolist() == pytest.approx([given[i]] * int(m.sum()), rel=1e-6)  # the loss saw them
    second = seen[1]
    ref = snaps[1]  # the weights the second mini-batch started from (its baseline was taken there)
    params = [p for p in ref.parameters() if p.requires_grad]
    eps_low, eps_high = cfg.algorithm.eps_low, cfg.algorithm.eps_high
    W = []
    for i in second:
        s_ = seqs[i]
        ids = torch.tensor([s_.prompt_ids + s_.response_ids])
        logp = torch.log_softmax(ref(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        lp = logp[len(s_.prompt_ids) - 1:]  # [r] log p of the response tokens
        old = old_lp[i][batch.response_mask[i]]  # [r] pi_prox
        ratio = torch.exp(lp - old)
        loss = -torch.minimum(ratio, ratio.clamp(1 - eps_low, 1 + eps_high)).sum() * min(float(w[i]), 1.5)
        gi = torch.autograd.grad(loss, params)
        W.append(float(w[i]) ** 2 * sum(float(x.double().square().sum()) for x in gi))
    r = rewards[second]
    b = sum(Wi * float(ri) for Wi, ri in zip(W, r, strict=True)) / sum(W)
    expect = ((r - b) / r.std(unbiased=False)).tolist()
    got = [given[i] for i in second]
    assert got == pytest.approx(expect, rel=1e-4)
    assert step.metrics["offpolicy/baseline_shift"] > 0 and step.metrics["time/baseline_s"] > 0


def test_vcpo_imports_without_the_async_machinery():
    """VCPO's corrections bind to the update, not to where the rows came from: an update can use
    them without importing the rollout producer or its engines."""
    import subprocess
    import sys

    code = ("import sys, stapo.core.train.off_policy; "
            "print(sorted(m for m in sys.modules if m.startswith(('stapo.core.async', 'stapo.core.rollout'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
