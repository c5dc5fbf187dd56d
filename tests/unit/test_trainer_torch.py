"""Torch trainer backend on a tiny random Llama: token stats, gradients, steps, schedule, checkpoints.

Every expectation is either hand-computed (LR multipliers, clipping) or a naive reference that
materializes the full ``[B, L, V]`` logits (what the memory-bounded path must reproduce).
Run: ``pytest tests/unit/test_trainer_torch.py`` (a few seconds on CPU).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stapo.core.config import config_from_dict
from stapo.core.trainer import BACKENDS, build_trainer_backend, get_backend_class, register_backend
from stapo.core.trainer.base import TrainerBackend, lr_multiplier, position_ids_from_mask
from stapo.core.trainer.torch_backend import TorchBackend

V = 64


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    return LlamaForCausalLM(cfg)


def make_cfg(**trainer):
    base = {"device": "cpu", "lr": 1e-2, "logits_chunk_size": 7}
    base.update(trainer)
    return config_from_dict({"trainer": base})


def make_backend(seed: int = 0, total: int = 10, **trainer) -> TorchBackend:
    return TorchBackend(make_cfg(**trainer), tiny_model(seed), total_optimizer_steps=total)


def batch(seed: int = 1):
    """Rollout-shaped batch: left-padded prompts, right-padded responses. [B=3, L=9]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (3, 9), generator=g)
    attn = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1, 1, 1, 0],  # 2 left pads, response ends early
            [1, 1, 1, 1, 1, 1, 1, 1, 1],
            [0, 1, 1, 1, 1, 1, 1, 0, 0],
        ]
    )
    resp = torch.zeros(3, 9, dtype=torch.bool)
    resp[:, 5:] = True
    resp &= attn.bool()
    return ids, attn, resp


def naive_stats(model, ids, attn, temperature=1.0):
    """Full-logits reference: [B, L] log p(ids[t] | <t) and entropy, 0 where t or t-1 is padding."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    lsm = torch.log_softmax(logits[:, :-1].float() / temperature, -1)  # [B, L-1, V]
    lp = lsm.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, L-1]
    ent = -(lsm.exp() * lsm).sum(-1)  # [B, L-1]
    ok = (attn[:, 1:] * attn[:, :-1]).bool()
    z = torch.zeros(ids.shape[0], 1)
    return torch.cat([z, lp * ok], 1), torch.cat([z, ent * ok], 1)


# ----------------------------------------------------------------------------- token stats


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_stats_match_full_logits(temperature):
    b = make_backend()
    ids, attn, _ = batch()
    lp, ent = b.token_stats(ids, attn, grad=False, temperature=temperature)
    ref_lp, ref_ent = naive_stats(b.model, ids, attn, temperature)
    assert lp.shape == ent.shape == (3, 9)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    assert (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    assert (lp[0, :3] == 0).all(), "pads and the first real token (no context) carry no stats"
    assert not lp.requires_grad and not ent.requires_grad


def test_response_mask_restricts_positions():
    b = make_backend()
    ids, attn, resp = batch()
    lp, ent = b.token_stats(ids, attn, resp, grad=False)
    full_lp, full_ent = b.token_stats(ids, attn, grad=False)
    torch.testing.assert_close(lp, full_lp * resp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, full_ent * resp, atol=1e-6, rtol=0)


def test_left_padding_does_not_change_stats():
    """Positions come from the mask: a left-padded copy of a sequence scores exactly like the original."""
    b = make_backend()
    ids, _, _ = batch()
    seq = ids[1, :6]
    plain = b.token_stats(seq[None], torch.ones(1, 6, dtype=torch.long), grad=False)[0][0]
    padded_ids = torch.cat([torch.zeros(3, dtype=torch.long), seq])[None]
    padded_attn = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    padded = b.token_stats(padded_ids, padded_attn, grad=False)[0][0]
    torch.testing.assert_close(padded[3:], plain, atol=1e-5, rtol=0)


def test_gradient_matches_full_logits():
    b = make_backend()
    ids, attn, resp = batch()
    w = torch.linspace(-1, 1, 27).reshape(3, 9)  # arbitrary per-token loss weights
    lp, ent = b.token_stats(ids, attn, resp, grad=True)
    assert lp.requires_grad and not ent.requires_grad, "entropy carries no grad unless entropy_grad"
    (-(lp * w).sum()).backward()
    ours = {n: p.grad.clone() for n, p in b.model.named_parameters()}
    b.zero_grad()
    ref_lp, _ = naive_stats(b.model, ids, attn)
    (-(ref_lp * resp * w).sum()).backward()
    for n, p in b.model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_entropy_grad_option_and_checkpointing():
    """entropy_grad lets gradient through entropies; gradient checkpointing leaves gradients unchanged."""
    ids, attn, _ = batch()
    grads = []
    for gc in (False, True):
        cfg = config_from_dict(
            {"trainer": {"device": "cpu", "entropy_grad": True}, "model": {"gradient_checkpointing": gc}}
        )
        b = TorchBackend(cfg, tiny_model(), total_optimizer_steps=1)
        lp, ent = b.token_stats(ids, attn, grad=True)
        assert ent.requires_grad
        b.backward(ent.sum() - lp.sum())
        grads.append(torch.cat([p.grad.flatten() for p in b.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_logit_scale_folds_into_temperature_and_softcap_uses_logits_path():
    b = make_backend()
    ids, attn, _ = batch()
    ref_lp, ref_ent = naive_stats(b.model, ids, attn, temperature=2.0)
    b.model.config.logits_scaling = 2.0  # Granite-style: logits = lm_head(h) / 2
    lp, ent = b.token_stats(ids, attn, grad=False)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    del b.model.config.logits_scaling
    b.model.config.final_logit_softcapping = 30.0  # Llama ignores it: the logits path must match plain logits
    lp, ent = b.token_stats(ids, attn, grad=False)
    ref_lp, ref_ent = naive_stats(b.model, ids, attn)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)


def test_bad_inputs_name_the_argument():
    b = make_backend()
    ids, attn, resp = batch()
    with pytest.raises(ValueError, match="attention_mask"):
        b.token_stats(ids, attn[:, :5], grad=False)
    with pytest.raises(ValueError, match="response_mask"):
        b.token_stats(ids, attn, resp[:2], grad=False)
    with pytest.raises(ValueError, match="input_ids"):
        b.token_stats(ids[0], attn[0], grad=False)
    with pytest.raises(ValueError, match="scalar"):
        b.backward(torch.ones(2, requires_grad=True))


# ----------------------------------------------------------------------------- steps


def test_step_updates_params_and_reports_pre_clip_norm():
    b = make_backend(max_grad_norm=0.5)
    ids, attn, resp = batch()
    before = [p.detach().clone() for p in b.model.parameters()]
    lp, _ = b.token_stats(ids, attn, resp, grad=True)
    b.backward(-lp.sum() / resp.sum())
    expected = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in b.model.parameters()))
    out = b.step()
    assert out["skipped"] == 0.0 and out["lr"] == pytest.approx(1e-2)
    assert out["grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert expected > 0.5, "the test must exercise clipping"
    assert all(p.grad is None for p in b.model.parameters()), "step zeroes the gradients"
    moved = [not torch.equal(a, p) for a, p in zip(before, b.model.parameters(), strict=True)]
    assert all(moved)


def test_first_adamw_update_hand_formula():
    """First AdamW update after clipping: p -= lr * gc / (|gc| + eps), gc = g * max_norm / (|g| + 1e-6)."""
    b = make_backend(max_grad_norm=0.5, weight_decay=0.1)
    ids, attn, _ = batch()
    lp, _ = b.token_stats(ids, attn, grad=True)
    b.backward(-lp.sum())
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in b.model.parameters()))
    w, gain = b.model.lm_head.weight, b.model.model.norm.weight  # a matrix (decayed) and a 1-D gain (not)
    gw, gg = w.grad * (0.5 / (norm + 1e-6)), gain.grad * (0.5 / (norm + 1e-6))
    w0, g0 = w.detach().clone(), gain.detach().clone()
    b.step()
    lr = 1e-2
    expect_w = w0 * (1 - lr * 0.1) - lr * gw / (gw.abs() + 1e-8)
    expect_g = g0 - lr * gg / (gg.abs() + 1e-8)
    torch.testing.assert_close(w.detach(), expect_w, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(gain.detach(), expect_g, atol=1e-7, rtol=1e-5)


def test_lr_multiplier_hand_values():
    # warmup 2, total 10: updates 0,1 warm up to 1/2, 2/2; then 8 decay steps, progress (s-2)/8
    m = lambda s, sched: lr_multiplier(s, warmup_steps=2, total_steps=10, schedule=sched)  # noqa: E731
    assert [m(s, "constant") for s in (0, 1, 2, 9, 50)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert [m(s, "linear") for s in (0, 1, 2, 4, 6, 9, 10, 20)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.125, 0.0, 0.0]
    assert m(6, "cosine") == pytest.approx(0.5)  # progress 1/2: (1 + cos(pi/2)) / 2
    assert m(4, "cosine") == pytest.approx((1 + math.cos(math.pi / 4)) / 2)  # 0.853553
    assert m(10, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_multiplier(0, warmup_steps=0, total_steps=4, schedule="linear") == 1.0
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_multiplier(0, warmup_steps=0, total_steps=4, schedule="exp")


def test_backend_follows_schedule():
    b = make_backend(total=6, warmup_steps=2, lr_schedule="linear")
    ids, attn, _ = batch()
    lrs = []
    for _ in range(4):
        lp, _ = b.token_stats(ids, attn, grad=True)
        b.backward(-lp.mean())
        lrs.append(b.step()["lr"])
    # 1e-2 * [1/2, 1, 1 - 0/4, 1 - 1/4]
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 7.5e-3])


def test_nonfinite_loss_skips_update():
    b = make_backend(warmup_steps=3)
    ids, attn, _ = batch()
    before = [p.detach().clone() for p in b.model.parameters()]
    lp, _ = b.token_stats(ids, attn, grad=True)
    b.backward(lp.sum() * float("nan"))
    out = b.step()
    assert out["skipped"] == 1.0 and math.isnan(out["grad_norm"])
    assert out["lr"] == pytest.approx(1e-2 / 3)
    assert all(torch.equal(a, p) for a, p in zip(before, b.model.parameters(), strict=True))
    assert all(p.grad is None for p in b.model.parameters())
    assert b.optimizer.state == {} or all(not s for s in b.optimizer.state.values())
    assert b.current_lr() == pytest.approx(1e-2 / 3), "a skipped update does not advance the schedule"
    lp, _ = b.token_stats(ids, attn, grad=True)
    b.backward(-lp.mean())
    assert b.step()["skipped"] == 0.0


def test_accumulated_micro_batches_equal_one_batch():
    """Four micro-batches of sum(loss)/GLOBAL_count give the one-batch token-mean gradient."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (8, 7), generator=g)
    attn = torch.ones(8, 7, dtype=torch.long)
    attn[::3, :2] = 0  # some left padding
    weights = torch.rand(8, 7, generator=g)
    n_global = attn[:, 1:].sum()

    one = make_backend()
    lp, _ = one.token_stats(ids, attn, grad=True)
    one.backward(-(lp * weights).sum() / n_global)
    ref = [p.grad.clone() for p in one.model.parameters()]

    acc = make_backend()
    for i in range(0, 8, 2):
        lp, _ = acc.token_stats(ids[i : i + 2], attn[i : i + 2], grad=True)
        acc.backward(-(lp * weights[i : i + 2]).sum() / n_global)
    for r, p in zip(ref, acc.model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- checkpoints, export


def _train_step(b: TorchBackend, seed: int) -> dict[str, float]:
    ids, attn, resp = batch(seed)
    lp, _ = b.token_stats(ids, attn, resp, grad=True)
    b.backward(-lp.sum() / resp.sum())
    return b.step()


def test_save_load_round_trip_is_exact(tmp_path):
    a = make_backend(warmup_steps=2, lr_schedule="cosine")
    _train_step(a, 1)
    a.save(tmp_path / "ckpt")
    out_a = _train_step(a, 2)

    b = make_backend(seed=123, warmup_steps=2, lr_schedule="cosine")  # different init: load must overwrite
    b.load(tmp_path / "ckpt")
    assert b.scheduler.last_epoch == 1 and b.updates_applied == 1
    sa = next(iter(a.optimizer.state.values()))
    assert int(sa["step"]) == 2
    out_b = _train_step(b, 2)
    assert out_b["lr"] == out_a["lr"] and out_b["grad_norm"] == pytest.approx(out_a["grad_norm"], rel=1e-6)
    for (n, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    for sa, sb in zip(a.optimizer.state.values(), b.optimizer.state.values(), strict=True):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    with pytest.raises(FileNotFoundError, match="trainer_state"):
        b.load(tmp_path / "missing")


def test_sync_and_export(tmp_path):
    b = make_backend()
    names = dict(b.named_parameters_for_sync())
    assert set(names) == {n for n, _ in b.model.named_parameters()}
    assert "lm_head.weight" in names and not names["lm_head.weight"].requires_grad
    _train_step(b, 1)
    b.export_hf(tmp_path / "final", tokenizer=None)
    again = LlamaForCausalLM.from_pretrained(tmp_path / "final")
    for (n, p), q in zip(b.model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), n


# ----------------------------------------------------------------------------- registry


def test_registry_and_protocol():
    assert set(BACKENDS) >= {"torch", "deepspeed"}
    b = build_trainer_backend(make_cfg(), tiny_model())
    assert isinstance(b, TorchBackend) and isinstance(b, TrainerBackend)
    assert b.total_optimizer_steps == 20  # default plan: max_steps 20 * 1 epoch * 1 mini-batch
    t = torch.arange(3.0)
    assert b.all_reduce_sum(t) is t and b.all_gather_1d(t) is t and b.world_size == 1
    with pytest.raises(KeyError, match="valid names: deepspeed, torch"):
        get_backend_class("jax")
    with pytest.raises(ValueError, match="already registered"):
        register_backend("torch", "x:Y")


def test_deepspeed_config_is_built_without_deepspeed():
    """The DS config is a pure function (no deepspeed import): the loop owns the step boundary."""
    from stapo.core.trainer.deepspeed_backend import build_ds_config

    t = make_cfg(zero_stage=1, micro_batch_size=4, max_grad_norm=0.7).trainer
    c = build_ds_config(t, bf16=True, offload=False, own_clip=False)
    assert c["gradient_accumulation_steps"] == 1 and c["managed_gradient_accumulation"] is False
    assert c["train_micro_batch_size_per_gpu"] == 4 and c["gradient_clipping"] == 0.7
    assert c["zero_optimization"] == {"stage": 1, "overlap_comm": False} and c["bf16"] == {"enabled": True}
    assert "optimizer" not in c  # the torch AdamW object is passed in: nothing to compile
    assert build_ds_config(t, bf16=False, offload=False, own_clip=True)["gradient_clipping"] == 0.0
    t3 = make_cfg(zero_stage=3, offload_optimizer=True).trainer
    c3 = build_ds_config(t3, bf16=True, offload=True, own_clip=False)
    assert (
        c3["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and c3["optimizer"]["type"] == "AdamW"
    )
    with pytest.raises(ValueError, match="trainer.offload_optimizer"):
        build_ds_config(make_cfg(zero_stage=0).trainer, bf16=True, offload=True, own_clip=False)


def test_lr_schedule_per_rollout_step_as_verl():
    """lr_schedule_unit=rollout_step: warmup 2 and linear decay over max_steps=4 rollout steps, 3 updates
    per step. Rollout step r (0-based) has multiplier (r+1)/2 while r < 2, then 1 - (r-2)/(4-2):
    [0.5, 1.0, 1.0, 0.5], the same for every update of a step (verl steps its scheduler once per
    update_actor). Counting optimizer updates instead, warmup 2 would end inside the first step."""
    from stapo.core.trainer.base import begin_rollout_step

    b = make_backend(total=12, warmup_steps=2, lr_schedule="linear", lr_schedule_unit="rollout_step", max_steps=4)
    ids, attn, _ = batch()
    lrs: list[list[float]] = []
    for step in (1, 2, 3, 4):
        begin_rollout_step(b, step)
        row = []
        for _ in range(3):
            lp, _ = b.token_stats(ids, attn, grad=True)
            b.backward(-lp.mean())
            row.append(b.step()["lr"])
        lrs.append(row)
    assert lrs == [pytest.approx([1e-2 * m] * 3) for m in (0.5, 1.0, 1.0, 0.5)]
    # resume: a fresh backend told "step 4" is at step 4's LR whatever its update count
    fresh = make_backend(total=12, warmup_steps=2, lr_schedule="linear", lr_schedule_unit="rollout_step", max_steps=4)
    assert fresh.current_lr() == pytest.approx(5e-3)  # before the loop says which step: step 1's LR
    begin_rollout_step(fresh, 4)
    assert fresh.current_lr() == pytest.approx(5e-3) and b.scheduler.lr_lambdas[0].rollout_index == 3
    begin_rollout_step(fresh, 2)
    assert fresh.current_lr() == pytest.approx(1e-2)
    # the optimizer-step unit is untouched by the per-step call
    per_update = make_backend(total=12, warmup_steps=2, lr_schedule="linear")
    begin_rollout_step(per_update, 3)
    assert per_update.current_lr() == pytest.approx(5e-3)
