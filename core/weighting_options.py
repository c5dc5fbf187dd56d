"""Options of the built-in token weightings, as the registrations in ``stapo.core.algos.weights`` state them.

A token weighting registers with its options model (``register_token_weighting(name, options=...,
reads_stats=...)``); the model's fields are the weighting's keyword arguments, and the config holds
one instance of it (a built-in's section, ``algorithm.s2t`` / ``algorithm.top_entropy`` /
``algorithm.stare``, or ``algorithm.weighting_options`` for a weighting registered elsewhere). The
models live here, apart from the tensor code, because the config is read without torch.

What an options model may declare beyond its fields (the update asks, it never branches on a name):

- :meth:`WeightingOptions.arguments`: the keywords the weighting gets (fields that configure the
  loop or the update rather than the function are left out);
- :meth:`WeightingOptions.fixes_per_step` / :meth:`WeightingOptions.step_arguments`: keywords fixed
  once per step from the step's pre-update entropies (S2T's ``tau_h_scope: step``), which needs the
  step's statistics before a run of several mini-batches changes the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from torch import Tensor


class WeightingOptions(BaseModel):
    """Base of a token weighting's options: unknown keys are errors, values frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments of the weighting: every field, unless a subclass says otherwise."""
        return self.model_dump()

    def fixes_per_step(self) -> bool:
        """Whether some keywords are fixed once per step from the step's entropies (:meth:`step_arguments`)."""
        return False

    def step_arguments(self, entropies: Tensor) -> dict[str, Any]:
        """Keywords fixed for the whole step, from every valid response token's entropy of the step's
        global batch under the pre-update policy (``entropies`` [n_valid], all ranks)."""
        return {}


class S2TOptions(WeightingOptions):
    """STAPO's S2T mask: silence tokens with A > 0, p < tau_p and H < tau_h.

    Provenance tags (docs/algorithms.md, "S2T thresholds"): [paper-reading] = the values a
    machine-written reading of the paper's PDF gives (tau_p 0.002, tau_h at the 80% quantile; the
    paper's own text is not reachable); [ours: measured rate r on model m] = our choice, with the
    silenced rate `stapo calibrate` measured for it. The defaults are [ours].
    """

    tau_p: float = Field(
        0.01, gt=0, lt=1,
        description="Probability threshold (absolute). [ours: measured rate 3.4e-4 on SmolLM2-135M-Instruct, with "
                    "tau_h_quantile 0.05; docs/algorithms.md, S2T thresholds] ([paper-reading]: 0.002).",
    )
    tau_h: float | None = Field(
        None, ge=0, description="Absolute entropy threshold (nats). Set one of tau_h, tau_h_quantile, target_rate."
    )
    tau_h_quantile: float | None = Field(
        0.05,
        gt=0,
        lt=1,
        description="Entropy threshold as a quantile of the global batch's valid-token entropies. [ours: measured "
                    "rate 3.4e-4 on SmolLM2-135M-Instruct, with tau_p 0.01] ([paper-reading]: 0.8).",
    )
    target_rate: float | None = Field(
        None,
        gt=0,
        lt=1,
        description=(
            "Our extension, not the paper's: choose tau_h on each optimizer mini-batch's global tokens (all ranks) "
            "so that this fraction of the valid tokens is silenced (at most: fewer when fewer tokens have A > 0 "
            "and p < tau_p). Instead of tau_h / tau_h_quantile (set tau_h_quantile=null)."
        ),
    )
    tau_h_scope: Literal["step", "minibatch"] = Field(
        "step",
        description=(
            "Population of the tau_h_quantile: `step` = every valid response token of the step's global "
            "batch under the policy at the start of the update (one threshold for all mini-batches and "
            "PPO epochs); `minibatch` = each optimizer mini-batch's tokens under the current policy. "
            "See docs/algorithms.md."
        ),
    )
    watch_steps: int = Field(
        20, ge=1,
        description="Judge the silenced rate over windows of this many steps (a window grows until "
                    "watch_min_rate predicts >= 5 silenced tokens); warn once when it is outside "
                    "[watch_min_rate, watch_max_rate].",
    )
    watch_min_rate: float = Field(
        1e-5, ge=0, le=1,
        description="Warn when a window silenced nothing where this rate predicts >= 5 tokens (0: never).",
    )
    watch_max_rate: float = Field(
        1e-2, gt=0, le=1, description="Warn when a window's silenced fraction exceeds this (1: never)."
    )

    def arguments(self) -> dict[str, Any]:
        """tau_h_scope (the update's choice of population) and the rate watch (the loop's) are not keywords."""
        return self.model_dump(exclude={"tau_h_scope", "watch_steps", "watch_min_rate", "watch_max_rate"})

    def fixes_per_step(self) -> bool:
        """``tau_h_scope: step`` with a quantile: one tau_h for every mini-batch and PPO epoch of the step."""
        return self.tau_h_quantile is not None and self.tau_h_scope == "step"

    def step_arguments(self, entropies: Tensor) -> dict[str, Any]:
        """The step's tau_h: the ``tau_h_quantile`` of the step's global valid-token entropies."""
        if not self.fixes_per_step():
            return {}
        from stapo.core.algos import quantile

        return {"tau_h": quantile(entropies, float(self.tau_h_quantile)), "tau_h_quantile": None, "target_rate": None}

    @model_validator(mode="after")
    def _one_tau_h(self) -> S2TOptions:
        given = [k for k in ("tau_h", "tau_h_quantile", "target_rate") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "set exactly one of tau_h (absolute), tau_h_quantile (e.g. 0.05) and target_rate (e.g. 1e-4); "
                f"got {', '.join(given) or 'none'}: to use another than tau_h_quantile also set tau_h_quantile=null"
            )
        return self


class TopEntropyOptions(WeightingOptions):
    """20-Entropy: gradient only on the top-rho fraction of tokens by entropy."""

    rho: float = Field(0.2, gt=0, le=1, description="Fraction of highest-entropy tokens that keep their gradient.")
    denominator: Literal["kept", "all"] = Field(
        "kept", description="Token-mean denominator: only kept tokens, or all valid tokens."
    )


class StareOptions(WeightingOptions):
    """STARE (arXiv 2606.19236): surprisal-quantile reweighting with a target-entropy gate."""

    top_ratio: float = Field(0.1, ge=0, le=1, description="Top fraction of tokens by surprisal that is reweighted.")
    w: float = Field(1.1, gt=0, description="Weight of high-surprisal positive-advantage tokens.")
    m: float = Field(0.9, gt=0, description="Weight of high-surprisal negative-advantage tokens (variant C2).")
    variant: Literal["O1", "C2"] = Field("O1", description="`O1`: positive side only; `C2`: both sides.")
    target_entropy: float = Field(0.3, ge=0, description="Gate: reweight only when batch mean entropy < this.")
    adaptive: bool = Field(
        False,
        description=(
            "STARE's adaptive schedule (hp-luo/STARE `STAREController`): every step W <- clip(W + alpha * "
            "sgn(H_tgt - H), [1, w_max]) and M <- clip(M - alpha * sgn(H_tgt - H), [m_min, 1]), H the step's "
            "mean entropy. Off: W and M stay fixed (the authors' default)."
        ),
    )
    alpha: float = Field(0.01, ge=0, description="Adaptive schedule step size (authors' default 0.01).")
    w_max: float = Field(1.5, ge=1, description="Adaptive schedule: upper bound of W (authors' default 1.5).")
    m_min: float = Field(0.5, gt=0, le=1, description="Adaptive schedule: lower bound of M (authors' default 0.5).")
