"""MASPO policy loss: hand-computed gate / limiter / controller values, gradient checks, limit cases."""

from __future__ import annotations

import math

import pytest
import torch

from stapo.core.algos import get_policy_loss
from stapo.core.algos.maspo import gaussian_gate, mass_adaptive_sigma, risk_factor

MASPO = get_policy_loss("maspo")
PPO = get_policy_loss("ppo_clip")
AUTHORS = {"sigma_base": 1.0, "alpha": 0.3, "sigma_high": 10.0, "beta_pos": 0.03, "beta_neg": 0.03,
           "adv_low": 0.1, "adv_high": 10.0}


def _t(*xs: float) -> torch.Tensor:
    return torch.tensor([list(xs)], dtype=torch.float64)


def test_registered_next_to_ppo_clip_and_gspo() -> None:
    from stapo.core.algos import POLICY_LOSSES

    assert {"ppo_clip", "gspo", "maspo"} <= set(POLICY_LOSSES.names())


def test_limiter_and_controller_hand_values() -> None:
    # sigma_base / p^alpha clamped to [sigma_base, sigma_high]
    p = torch.tensor([0.5, 0.01, 1e-6, 1.0], dtype=torch.float64)
    got = mass_adaptive_sigma(p, sigma_base=1.0, alpha=0.3, sigma_high=10.0)
    want = [2**0.3, 10**0.6, 10.0, 1.0]  # 1.2311, 3.9811, 63.1 -> 10, 1
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    # 1 + 0.03 A for A > 0; 1 / (1 - 0.03 A) for A <= 0; clamps
    a = torch.tensor([1.0, -2.0, 100.0, -100.0, 0.0], dtype=torch.float64)
    got = risk_factor(a, beta_pos=0.03, beta_neg=0.03, adv_low=0.5, adv_high=2.0)
    assert got.tolist() == pytest.approx([1.03, 1 / 1.06, 2.0, 0.5, 1.0], rel=1e-12)


def test_gate_and_loss_hand_values() -> None:
    # token 0: A=+1, p_old=0.5, w=1.5 -> gated; token 1: A=-2, p_old=0.01, w=0.5 -> gated;
    # token 2: A=+1, w=0.8 -> not gated (the clip would not act either); token 3: A=-2, w=1.3 -> not gated
    old = _t(math.log(0.5), math.log(0.01), math.log(0.5), math.log(0.5))
    w = [1.5, 0.5, 0.8, 1.3]
    new = old + torch.log(_t(*w))
    adv = torch.tensor([[1.0, -2.0, 1.0, -2.0]], dtype=torch.float64)
    mask = torch.ones_like(old, dtype=torch.bool)
    loss, m = MASPO(new, old, adv, mask, **AUTHORS)
    s0 = 2**0.3 * 1.03
    s1 = 10**0.6 / 1.06
    g0 = math.exp(-(0.5**2) / (2 * s0**2))
    g1 = math.exp(-(0.5**2) / (2 * s1**2))
    want = [-1.0 * g0 * 1.5, 2.0 * g1 * 0.5, -1.0 * 0.8, 2.0 * 1.3]
    assert loss[0].tolist() == pytest.approx(want, rel=1e-12)
    assert float(m["gated_count"]) == 2.0
    assert float(m["gate_sum"]) == pytest.approx(g0 + g1, rel=1e-12)
    # the gradient is the gate times the unclipped one: dl/dlogp = -A g w
    new.requires_grad_(True)
    loss, _ = MASPO(new, old, adv, mask, **AUTHORS)
    (grad,) = torch.autograd.grad(loss.sum(), new)
    assert grad[0].tolist() == pytest.approx(want, rel=1e-12)


def test_gaussian_gate_gradcheck() -> None:
    w = torch.tensor([0.3, 0.9, 1.0, 1.4, 2.5], dtype=torch.float64, requires_grad=True)
    s = torch.tensor([0.2, 1.0, 0.5, 3.0, 10.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(gaussian_gate, (w, s))
    assert gaussian_gate(torch.tensor(1.0), torch.tensor(0.1)).item() == 1.0


def _potential(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """An independent smooth objective whose exact gradient is MASPO's: on the gated side
    -A (1 + sigma sqrt(pi/2) erf((w - 1) / (sqrt(2) sigma))), elsewhere -A w. d/dw gives -A g."""
    w = torch.exp(logp - old)
    side = ((adv > 0) & (w > 1)) | ((adv < 0) & (w < 1))
    gated = 1.0 + sigma * math.sqrt(math.pi / 2) * torch.erf((w - 1.0) / (math.sqrt(2.0) * sigma))
    return (-adv * torch.where(side, gated, w)).sum()


def test_gradient_matches_a_gradchecked_potential() -> None:
    g = torch.Generator().manual_seed(0)
    old = torch.log(torch.rand(3, 7, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    # ratios away from 1 so no point sits on the side boundary
    w = torch.where(torch.rand(3, 7, generator=g) < 0.5, 0.4, 1.6).to(torch.float64)
    w = w + 0.2 * torch.rand(3, 7, generator=g, dtype=torch.float64)
    logp = (old + torch.log(w)).requires_grad_(True)
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 7).contiguous()
    mask = torch.ones(3, 7, dtype=torch.bool)
    with torch.no_grad():
        sigma = mass_adaptive_sigma(torch.exp(old), sigma_base=1.0, alpha=0.3, sigma_high=10.0) * risk_factor(
            adv, beta_pos=0.03, beta_neg=0.03, adv_low=0.1, adv_high=10.0)
    assert torch.autograd.gradcheck(lambda lp: _potential(lp, old, adv, sigma), (logp,))
    (g_pot,) = torch.autograd.grad(_potential(logp, old, adv, sigma), logp)
    loss, _ = MASPO(logp, old, adv, mask, **AUTHORS)
    (g_maspo,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(g_maspo, g_pot, rtol=1e-10, atol=1e-12)


def _grad(fn, logp, old, adv, mask, **kw) -> torch.Tensor:
    lp = logp.clone().requires_grad_(True)
    loss, _ = fn(lp, old, adv, mask, **kw)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    return g


def test_limit_sigma_to_zero_is_hard_clip_with_zero_range() -> None:
    g = torch.Generator().manual_seed(1)
    old = torch.log(torch.rand(4, 6, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    logp = old + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0], [0.5], [-2.0]], dtype=torch.float64).expand(4, 6)
    mask = torch.ones(4, 6, dtype=torch.bool)
    tiny = {"sigma_base": 1e-8, "sigma_high": 1e-8, "alpha": 0.0, "beta_pos": 0.0, "beta_neg": 0.0,
            "adv_low": 1.0, "adv_high": 1.0}
    got = _grad(MASPO, logp, old, adv, mask, **tiny)
    want = _grad(PPO, logp, old, adv, mask, eps_low=0.0, eps_high=0.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-300)


def test_limit_sigma_to_infinity_is_unclipped_policy_gradient() -> None:
    g = torch.Generator().manual_seed(2)
    old = torch.log(torch.rand(4, 6, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    logp = old + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64).expand(4, 6)
    mask = torch.ones(4, 6, dtype=torch.bool)
    huge = {"sigma_base": 1e9, "sigma_high": 1e9, "alpha": 0.0, "beta_pos": 0.0, "beta_neg": 0.0}
    got = _grad(MASPO, logp, old, adv, mask, **huge)
    want = -adv * torch.exp(logp - old)  # d(-A w)/dlogp
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_mask_and_dual_clip_errors() -> None:
    old = _t(-1.0, -1.0)
    new = _t(-0.5, -2.0)
    adv = _t(1.0, 1.0)
    mask = torch.tensor([[True, False]])
    loss, m = MASPO(new, old, adv, mask)
    assert loss[0, 1].item() == 0.0 and float(m["token_count"]) == 1.0
    with pytest.raises(ValueError, match="dual clip"):
        MASPO(new, old, adv, mask, dual_clip_c=3.0)
    with pytest.raises(ValueError, match="sigma_base"):
        MASPO(new, old, adv, mask, sigma_base=2.0, sigma_high=1.0)


def test_options_come_from_the_section_the_registration_states() -> None:
    """A loss's keywords beyond the clip ranges come from the ``algorithm`` section whose type is the
    options model it registered with: a loss registered under another name with MASPO's model reads
    ``algorithm.maspo``; one whose model no section holds is refused when the config is built."""
    from stapo.core.algos import POLICY_LOSSES, policy_loss_spec, register_policy_loss
    from stapo.core.config import config_from_dict
    from stapo.core.loss_options import MaspoOptions, PolicyLossOptions
    from stapo.core.train.update import update_parts

    class Unplaced(PolicyLossOptions):
        width: float = 1.0

    assert policy_loss_spec("maspo").options is MaspoOptions and policy_loss_spec("ppo_clip").options is None
    register_policy_loss("soft_alias", options=MaspoOptions, elementwise=True)(MASPO)
    register_policy_loss("unplaced", options=Unplaced, elementwise=False)(PPO)
    try:
        for name in ("maspo", "soft_alias"):
            cfg = config_from_dict({"algorithm": {"policy_loss": name, "maspo": {"alpha": 0.5}}})
            kw = update_parts(cfg).loss_kw
            assert {k: kw[k] for k in AUTHORS} == {**AUTHORS, "alpha": 0.5}, name
        plain = config_from_dict({"algorithm": {"policy_loss": "ppo_clip", "maspo": {"alpha": 0.5}}})
        assert set(update_parts(plain).loss_kw) == {"eps_low", "eps_high", "dual_clip_c"}
        with pytest.raises(ValueError, match="policy_loss: 'unplaced' takes Unplaced"):
            config_from_dict({"algorithm": {"policy_loss": "unplaced"}})
    finally:
        POLICY_LOSSES.unregister("soft_alias")
        POLICY_LOSSES.unregister("unplaced")
