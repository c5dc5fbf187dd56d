"""Options of the built-in policy losses, as their registrations in ``stapo.core.algos`` state them.

A policy loss registers with its options model (``register_policy_loss(name, options=...,
elementwise=...)``); the model's fields are the loss's keyword arguments beyond the clip ranges
(``eps_low``, ``eps_high``, ``dual_clip_c``, which every loss gets from ``algorithm``), and the config
holds one instance of it: the section of ``algorithm`` whose type is that model (``algorithm.maspo``).
The update finds the section through the registration (``AlgorithmConfig.policy_loss_options``),
never by the loss's name. The models live here, apart from the tensor code, because the config is
read without torch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class PolicyLossOptions(BaseModel):
    """Base of a policy loss's options: unknown keys are errors, values frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments of the loss: every field."""
        return self.model_dump()


class MaspoOptions(PolicyLossOptions):
    """MASPO (arXiv 2602.17550): soft Gaussian gate, mass-adaptive limiter, asymmetric risk controller.

    Defaults are the authors' README recommendation (github.com/VenomRose-Juri/MASPO-RL)."""

    sigma_base: float = Field(1.0, gt=0, description="Base gate width sigma_base (authors: 1; they suggest 1, 2, 3).")
    alpha: float = Field(0.3, ge=0, description="Mass-adaptive exponent: sigma_base / p_old^alpha (authors: 0.3-0.5).")
    sigma_high: float = Field(10.0, gt=0, description="Upper bound of the mass-adaptive width (authors: 10).")
    beta_pos: float = Field(0.03, ge=0, description="Risk controller for A > 0: width x (1 + beta_pos A) (authors: 0.03).")
    beta_neg: float = Field(0.03, ge=0, description="Risk controller for A < 0: width x 1 / (1 - beta_neg A) (authors: 0.03).")
    adv_low: float = Field(0.1, gt=0, description="Lower clamp of the risk factor (authors: 0.1).")
    adv_high: float = Field(10.0, gt=0, description="Upper clamp of the risk factor (authors: 10).")
