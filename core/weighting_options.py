"""Options of the built-in token weightings, as the registrations in ``stapo.core.algos.weights`` state them.

A token weighting registers with its options model (``register_token_weighting(name, options=...,
reads_stats=...)``); the model's fields are the weighting's keyword arguments, and the config holds
one instance of it (a built-in's section, ``algorithm.s2t`` / ``algorithm.top_entropy`` /
``algorithm.stare``, or ``algorithm.weighting_options`` for a weighting registered elsewhere). The
models live here, apart from the tensor code, because the config is read without torch.

What an options model may declare beyond its fields (the update asks, it never branches on a name):
:meth:`WeightingOptions.arguments`, the keywords the weighting gets (fields that configure the loop
or the update rather than the function are left out).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class WeightingOptions(BaseModel):
    """Base of a token weighting's options: unknown keys are errors, values frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments of the weighting: every field, unless a subclass says otherwise."""
        return self.model_dump()


REMOVED_S2T_KEYS = {
    "tau_h": "S2T's tau_h is the q-th quantile of the candidates' entropies per mini-batch: set algorithm.s2t.q",
    "tau_h_quantile": "the quantile is over the candidates (A > 0, p < tau_p) of each mini-batch: set "
                      "algorithm.s2t.q (the paper's 0.75)",
    "tau_h_scope": "tau_h^(q) is taken per optimizer mini-batch under the current policy (the paper's Algorithm 1)",
    "target_rate": "the silenced rate is an outcome of the model, not a setting: see it with `stapo calibrate`",
    "watch_min_rate": "the rate watch warns when a window silences nothing and compares the run's rate with the "
                      "paper's ~1e-4",
    "watch_max_rate": "the rate watch compares the run's rate with the paper's ~1e-4 in a note",
}
"""Keys of earlier S2T sections, each with the one line that replaces it (a config naming one is refused)."""


S2T_SILENCE = ("lowest_entropy", "highest_entropy", "random", "all", "complement")
"""Which candidates S2T silences: the paper's rule, its masking-strategy ablations (Sec. 4) and the
complement of the rule (what it keeps); ``stapo.core.algos.weights.s2t_weighting`` implements each."""


class S2TOptions(WeightingOptions):
    """STAPO's S2T rule (arXiv 2602.15620v1, Sec. 3, Algorithm 1; docs/algorithms.md, "S2T").

    In each optimizer mini-batch, the candidates are the valid tokens with A > 0 and p < tau_p (over
    every rank); tau_h^(q) is the q-th quantile of their entropies; candidates with H < tau_h^(q) are
    silenced (weight 0, out of the denominator). p and H are the current policy's, from the update's
    own forward. ``silence`` selects the paper's masking-strategy ablations over the same candidates.
    """

    REMOVED_KEYS: ClassVar[dict[str, str]] = REMOVED_S2T_KEYS

    tau_p: float = Field(
        0.002, gt=0, lt=1,
        description="Probability threshold (absolute): candidates have p < tau_p. [paper v1: 0.002, 'across all "
                    "experiments']",
    )
    q: float = Field(
        0.75, ge=0, le=1,
        description="tau_h^(q) is the q-th quantile of the candidates' entropies in each mini-batch; candidates "
                    "below it are silenced (about a q share of them). [paper v1: 75%]",
    )
    silence: Literal[S2T_SILENCE] = Field(  # type: ignore[valid-type]
        "lowest_entropy",
        description="Which candidates are silenced: `lowest_entropy` (STAPO: H < tau_h^(q)); the paper's ablations, "
                    "their thresholds ours [ours]: `highest_entropy` (the top-entropy q share), `complement` (H >= "
                    "tau_h^(q): the candidates STAPO keeps), `random` (as many as STAPO would, drawn at random, "
                    "seeded by trainer.seed), `all` (every candidate: JustRL-FullMask).",
    )
    watch_steps: int = Field(
        20, ge=1,
        description="The rate watch judges windows of this many steps (a window grows until the paper's ~1e-4 "
                    "rate predicts >= 5 silenced tokens): it warns once when a window silences nothing, and notes "
                    "once when the run's rate is far above the paper's.",
    )

    def arguments(self) -> dict[str, Any]:
        """The rate watch (the loop's) is not a keyword of the weighting."""
        return self.model_dump(exclude={"watch_steps"})

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, why in cls.REMOVED_KEYS.items():
                if key in data:
                    raise ValueError(f"algorithm.s2t.{key} is not an option: {why}")
        return data


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
