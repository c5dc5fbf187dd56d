"""The additive terms (KL to the frozen reference, Lp-Reg's proxy KL) through the real update:
the fused LM-head path gives the same gradient as the unfused one, and each term changes it.
(2 PPO epochs x 2 mini-batches: 4 optimizer updates per call, as in test_fused_loss.py.)"""

from __future__ import annotations

import pytest
import torch
from hook_driver import before_update, run_hooks
from test_fused_loss import make_backend, make_cfg, old_stats, rl_batch  # same folder: shared fixtures

from stapo.core.train.update import Actor, UpdateInputs

TERMS = {
    "kl-ref": {"token_weighting": "none", "kl_coef": 0.5, "kl": {"reference": "initial", "dtype": "float32"}},
    "kl-ref-k1": {"token_weighting": "none", "kl_coef": 0.5, "kl": {"reference": "initial", "estimator": "k1"}},
    "lp-reg": {"token_weighting": "none", "lp_reg": {"enabled": True, "rho": 0.5, "min_p": 0.5, "coef": 5.0}},
}


def grads_of(cfg, with_extras=True):
    b = make_backend(cfg)
    batch = rl_batch(b.model.config.vocab_size)
    old_lp, old_ent = old_stats(b, batch)
    hooks = run_hooks(cfg, b) if with_extras else run_hooks(cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(
        update={"kl_coef": 0.0, "lp_reg": cfg.algorithm.lp_reg.model_copy(update={"enabled": False})})}), b)
    _, m = before_update(hooks, batch, old_lp, old_ent, micro_batch=2)
    grads = []
    real_step = b.step

    def step(**kw):
        grads.append({n: p.grad.detach().clone() for n, p in b.model.named_parameters() if p.grad is not None})
        return real_step(**kw)

    b.step = step
    Actor(cfg, b, hooks).update(UpdateInputs(batch, old_lp, old_ent, step=1))
    return grads, m, hooks


@pytest.mark.parametrize("name", list(TERMS))
def test_terms_fused_equal_unfused_and_matter(name):
    alg = TERMS[name]
    g_f, m, hooks = grads_of(make_cfg(trainer={"fused_loss": True}, algorithm=alg))
    g_u, _, _ = grads_of(make_cfg(trainer={"fused_loss": False}, algorithm=alg))
    for n in g_u[0]:  # the first update: same weights on both paths
        torch.testing.assert_close(g_f[0][n], g_u[0][n], atol=1e-6, rtol=1e-4, msg=n)
    g_0, _, _ = grads_of(make_cfg(trainer={"fused_loss": False}, algorithm=alg), with_extras=False)
    # the last of the 4 updates: the policy has left the reference (k3's gradient is 0 AT the reference)
    diff = max((g_u[-1][n] - g_0[-1][n]).abs().max().item() for n in g_u[-1])
    assert diff > 1e-4, "the term did not change the gradient"
    if name.startswith("kl"):
        assert "actor/kl" in m and hooks.get("kl_reference").reference is not None
    else:
        proxy_lp = hooks.get("lp_reg").proxy_lp
        assert proxy_lp is not None and (proxy_lp != 0).any()
