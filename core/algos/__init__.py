"""stapo's algorithm core: pure tensor functions, registered by name.

Families (each a ``Registry`` with a ``get_*`` accessor that lists valid names on a miss):

- ``ADVANTAGES``    rewards [P, G] -> advantages [P, G]: grpo, dr_grpo, rloo
- ``TOKEN_WEIGHTS`` TokenContext -> TokenWeights: none, s2t (STAPO), top_entropy, stare; each registered
                    with its options model and whether it reads p / H (``register_token_weighting``)
- ``KL_ESTIMATORS`` per-token KL estimators: k1, k2, k3
- ``POLICY_LOSSES`` per-token loss [B, T] + summable metrics: ppo_clip (clip-higher, dual-clip), gspo,
                    maspo (soft mass-adaptive asymmetric trust region, ``maspo.py``); each registered
                    with its options model and whether it is elementwise (``register_policy_loss``)
- ``AGGREGATIONS``  accumulation-safe scalar: token-mean, seq-mean-token-mean, seq-mean-token-sum

plus DAPO's ``dynamic_sampling_filter`` / ``dynamic_sampling_values`` / ``overlong_penalty`` /
``overlong_filter_keep``, ``kl_k3``, ``token_metrics``, additive terms (``regularizers``: KL to a
reference, Lp-Reg's proxy KL in ``lpreg``, the entropy bonus), STARE's schedule (``stare``) and the
public STAPO contract ``s2t_tau_h`` / ``s2t_mask`` / ``stapo_loss``. Formulas and the paper each
piece follows: docs/algorithms.md.
"""

from .advantages import ADVANTAGES, AdvantageFn, get_advantage
from .aggregation import AGGREGATIONS, Aggregation, get_aggregation
from .dapo import dynamic_sampling_filter, dynamic_sampling_values, overlong_filter_keep, overlong_penalty
from .losses import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossFn,
    get_kl_estimator,
    get_policy_loss,
    kl_k3,
    policy_loss_spec,
    register_policy_loss,
)
from .maspo import maspo_loss  # registers "maspo"
from .metrics import COUNT_KEYS, PHASE_KEYS, fractions_from_counts, phase_cells, token_counts, token_metrics
from .objective import compute_policy_objective
from .registry import Registry
from .stapo import stapo_loss
from .weights import (
    TOKEN_WEIGHTS,
    TokenContext,
    TokenWeighting,
    TokenWeightingFn,
    TokenWeights,
    below_thresholds,
    broadcast_advantages,
    get_token_weighting,
    quantile,
    register_token_weighting,
    s2t_candidates,
    s2t_mask,
    s2t_tau_h,
    token_weighting_spec,
    top_fraction_threshold,
)

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "COUNT_KEYS",
    "PHASE_KEYS",
    "TOKEN_WEIGHTS",
    "AdvantageFn",
    "Aggregation",
    "PolicyLossFn",
    "Registry",
    "TokenContext",
    "TokenWeightingFn",
    "TokenWeights",
    "below_thresholds",
    "broadcast_advantages",
    "compute_policy_objective",
    "PolicyLoss",
    "TokenWeighting",
    "policy_loss_spec",
    "register_policy_loss",
    "register_token_weighting",
    "token_weighting_spec",
    "dynamic_sampling_filter",
    "dynamic_sampling_values",
    "fractions_from_counts",
    "get_advantage",
    "get_aggregation",
    "get_kl_estimator",
    "get_policy_loss",
    "get_token_weighting",
    "kl_k3",
    "maspo_loss",
    "overlong_filter_keep",
    "overlong_penalty",
    "phase_cells",
    "quantile",
    "s2t_candidates",
    "s2t_mask",
    "s2t_tau_h",
    "stapo_loss",
    "token_counts",
    "token_metrics",
    "top_fraction_threshold",
]
