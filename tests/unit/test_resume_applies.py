"""A resume that changes a setting uses the new value: what a checkpoint restores never overrides it.

A checkpoint restores state that was built from the config (the optimizer's groups, the LR
scheduler, STARE's weights, the Goldilocks teacher's optimizer). Each check here saves under one
config, loads under another and measures what the next update does, against a hand computation:

* the learning rate: the same gradient from the same restored moments moves the weights in
  proportion to the new rate (AdamW's step is linear in lr when weight decay is 0);
* the schedule (warmup, shape, length, unit): the next update's rate is the new base rate times
  the new multiplier at the restored update count (``lr_multiplier`` by hand);
* betas, eps, weight decay: AdamW's decoupled decay with a zero gradient shrinks a matrix by
  exactly ``1 - lr * wd`` and leaves 1-D tensors alone;
* keys a checkpoint fixes (the model, the backend, the ZeRO stage...) are refused, naming why, and
  every such key exists in the config.

The whole loop (a resumed run's metrics) is tests/e2e/test_rundir.py and
tests/e2e/test_resume_changes.py.
"""

from __future__ import annotations

import pytest
import torch

from stapo.core.config import Config, config_from_dict
from stapo.core.train.rundir import FIXED_AT_START, config_changes, unappliable_changes
from stapo.core.trainer.base import lr_multiplier
from stapo.core.trainer.torch_backend import TorchBackend
from tests.unit.test_trainer_torch import batch, make_cfg, tiny_model


def _train_and_save(tmp_path, steps: int = 3, **trainer) -> TorchBackend:
    backend = TorchBackend(make_cfg(**trainer), tiny_model(0), total_optimizer_steps=10)
    ids, attn, resp = batch()
    for _ in range(steps):
        lp, _ = backend.token_stats(ids, attn, grad=True)
        backend.backward(-(lp * resp).sum() / resp.sum())
        backend.step()
    backend.save(tmp_path / "ckpt")
    return backend


def _resumed(tmp_path, **trainer) -> TorchBackend:
    backend = TorchBackend(make_cfg(**trainer), tiny_model(1), total_optimizer_steps=10)
    backend.load(tmp_path / "ckpt")
    return backend


def _params(backend: TorchBackend) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in backend.model.parameters()])


def _one_step_delta(backend: TorchBackend) -> torch.Tensor:
    ids, attn, resp = batch(seed=7)
    before = _params(backend)
    lp, _ = backend.token_stats(ids, attn, grad=True)
    backend.backward(-(lp * resp).sum() / resp.sum())
    metrics = backend.step()
    assert not metrics.get("skipped")
    return _params(backend) - before


def test_a_changed_learning_rate_scales_the_next_update(tmp_path) -> None:
    _train_and_save(tmp_path, lr=1e-3)
    same = _resumed(tmp_path, lr=1e-3)
    changed = _resumed(tmp_path, lr=5e-3)
    assert changed.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    d_same, d_changed = _one_step_delta(same), _one_step_delta(changed)
    # same restored moments, same gradient: AdamW's step (no weight decay) is linear in lr
    torch.testing.assert_close(d_changed, 5.0 * d_same, rtol=1e-3, atol=1e-6)  # fp32 rounding of p + d


@pytest.mark.parametrize("change", [
    {"warmup_steps": 8},                                   # back into warmup: (3 + 1) / 8 at update 3
    {"lr_schedule": "linear"},                             # 1 - 3/10
    {"lr_schedule": "cosine", "warmup_steps": 2},          # cosine from update 2 over 8
    {"lr_schedule": "linear", "max_steps": 4},             # the plan's length: 4 steps x 1 update
])
def test_the_schedule_restarts_from_the_restored_update_count_with_the_new_shape(tmp_path, change) -> None:
    _train_and_save(tmp_path, lr=1e-3)  # 3 updates at constant 1e-3
    total = change.get("max_steps", 10)
    backend = TorchBackend(make_cfg(lr=3e-3, **change), tiny_model(1), total_optimizer_steps=total)
    backend.load(tmp_path / "ckpt")
    want = 3e-3 * lr_multiplier(3, warmup_steps=change.get("warmup_steps", 0), total_steps=total,
                                schedule=change.get("lr_schedule", "constant"))
    assert backend.current_lr() == pytest.approx(want)
    metrics = backend.step()  # the update after the resume runs at that rate
    assert metrics["lr"] == pytest.approx(want)


def test_a_rollout_step_schedule_takes_the_new_length(tmp_path) -> None:
    from stapo.core.trainer.base import begin_rollout_step

    unit = {"lr_schedule_unit": "rollout_step", "lr_schedule": "linear"}
    _train_and_save(tmp_path, lr=1e-3, max_steps=5, **unit)
    backend = _resumed(tmp_path, lr=1e-3, max_steps=20, **unit)
    begin_rollout_step(backend, 4)  # rollout step 4 of 20: 1 - 3/20 (of 5 it would be 1 - 3/5)
    assert backend.current_lr() == pytest.approx(1e-3 * (1 - 3 / 20))


def test_weight_decay_betas_and_eps_are_the_new_ones(tmp_path) -> None:
    _train_and_save(tmp_path, lr=1e-2, weight_decay=0.0)
    backend = _resumed(tmp_path, lr=1e-2, weight_decay=0.5, betas=(0.5, 0.9), adam_eps=1e-3)
    for group in backend.optimizer.param_groups:
        assert group["betas"] == (0.5, 0.9) and group["eps"] == 1e-3
    # the decoupled decay alone: with every gradient zero AdamW's step is p <- p (1 - lr wd) on the
    # decay group (matrices), and the moments' part is exp_avg-driven: zero them to isolate the decay
    for state in backend.optimizer.state.values():
        state["exp_avg"].zero_()
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    for p in backend.model.parameters():
        p.grad = torch.zeros_like(p)
    backend.step()
    for name, p in backend.model.named_parameters():
        factor = 1 - 1e-2 * 0.5 if p.ndim >= 2 else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, msg=name)


def _dump(**sections) -> dict:
    return config_from_dict(sections).model_dump(mode="json", by_alias=True)


def test_keys_a_checkpoint_fixes_are_refused_naming_why() -> None:
    a = _dump(model={"name_or_path": "tiny-random"}, trainer={"backend": "torch"})
    b = _dump(model={"name_or_path": "Qwen/Qwen3-1.7B-Base"}, trainer={"backend": "deepspeed", "lr": 0.5})
    lines = unappliable_changes(config_changes(a, b), b)
    assert len(lines) == 2  # the lr change applies; the model and the backend do not
    assert lines[0].startswith('model.name_or_path "tiny-random" -> "Qwen/Qwen3-1.7B-Base" (the checkpoint holds')
    assert lines[1].startswith("trainer.backend")


def test_stare_weights_are_fixed_only_while_they_adapt() -> None:
    a = _dump(algorithm={"stare": {"w": 1.1}})
    b = _dump(algorithm={"stare": {"w": 1.3}})
    assert unappliable_changes(config_changes(a, b), b) == []
    a2 = _dump(algorithm={"stare": {"w": 1.1, "adaptive": True}})
    b2 = _dump(algorithm={"stare": {"w": 1.3, "adaptive": True}})
    assert "adaptive schedule" in unappliable_changes(config_changes(a2, b2), b2)[0]


def test_stare_hook_restores_weights_only_while_they_adapt() -> None:
    from stapo.core.train.extras import StareController

    saved = {"w": 1.4, "m": 0.7, "current_entropy": 0.2}
    fixed = StareController(config_from_dict({"algorithm": {"stare": {"w": 1.2, "m": 0.8}}}))
    fixed.load_state_dict(saved)
    assert (fixed.stare.w, fixed.stare.m) == (1.2, 0.8)  # the config's (a resume may change them)
    adaptive = StareController(config_from_dict({"algorithm": {"stare": {"w": 1.2, "m": 0.8, "adaptive": True}}}))
    adaptive.load_state_dict(saved)
    assert (adaptive.stare.w, adaptive.stare.m) == (1.4, 0.7)  # the schedule goes on


def test_goldilocks_teacher_takes_the_new_learning_rate() -> None:
    from stapo.core.task.sampler import GoldilocksSampler

    def make(lr: float) -> GoldilocksSampler:
        return GoldilocksSampler(8, lambda i: torch.ones(4) * i, 4, data_seed=0, lr=lr)

    old = make(0.05)
    new = make(0.2)
    new.load_state_dict(old.state_dict())
    assert [g["lr"] for g in new.opt.param_groups] == [0.2]


def _leaf_keys(model: type, prefix: str = "") -> set[str]:
    from pydantic import BaseModel

    keys: set[str] = set()
    for name, field in model.model_fields.items():
        alias = field.alias or name
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.add(f"{prefix}{alias}.")
            keys |= _leaf_keys(ann, f"{prefix}{alias}.")
        else:
            keys.add(f"{prefix}{alias}")
    return keys


def test_every_fixed_key_is_a_config_key() -> None:
    assert set(FIXED_AT_START) <= _leaf_keys(Config)
