"""Trainer backends: the learner side of the RL loop, chosen by ``trainer.backend``.

``BACKENDS`` maps a name to ``"module:Class"``; the module is imported only when the backend is
built, so ``stapo`` imports (and its tests run) without DeepSpeed installed.

    from stapo.core.trainer import build_trainer_backend
    model, tok = load_policy(cfg.model, init_context=load_context(cfg))  # ZeRO-3: built partitioned
    backend = build_trainer_backend(cfg, model)          # cfg.trainer.backend: "torch" | "deepspeed"
    lp, ent = backend.token_stats(input_ids, attention_mask, grad=True)
    backend.backward(loss); metrics = backend.step()

The contract is :class:`stapo.core.trainer.base.TrainerBackend`; ``docs/training-backends.md`` has
the details (accumulation, data parallelism, checkpoints, multi-node launch).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from stapo.core.lazy import LazyRegistry
from stapo.core.trainer.base import TrainerBackend, lr_multiplier, planned_optimizer_steps

__all__ = [
    "BACKENDS",
    "TrainerBackend",
    "build_trainer_backend",
    "get_backend_class",
    "load_context",
    "register_backend",
    "lr_multiplier",
    "planned_optimizer_steps",
]

BACKENDS = LazyRegistry(
    "trainer backend",
    {
        "torch": "stapo.core.trainer.torch_backend:TorchBackend",
        "deepspeed": "stapo.core.trainer.deepspeed_backend:DeepSpeedBackend",
    },
    hints={"deepspeed": "install the `train` extra: pip install 'stapo[train]'"},
)
register_backend = BACKENDS.add  # name, "module:Class"; a taken name is an error
get_backend_class = BACKENDS.load  # imports lazily; a miss lists the valid names


def build_trainer_backend(
    cfg: Any, model: Any, *, total_optimizer_steps: int | None = None
) -> TrainerBackend:
    """Build ``cfg.trainer.backend`` around ``model`` (an HF causal LM, not yet moved or wrapped).

    ``total_optimizer_steps`` is the LR schedule's length; by default the planned
    ``max_steps * ppo_epochs * mini_batches``.
    """
    total = planned_optimizer_steps(cfg) if total_optimizer_steps is None else total_optimizer_steps
    return get_backend_class(cfg.trainer.backend)(cfg, model, total_optimizer_steps=total)


def load_context(cfg: Any) -> AbstractContextManager[Any]:
    """The context to load the policy under for ``cfg.trainer.backend``.

    A backend class that builds its model in a particular way offers a ``load_context(cfg)``
    classmethod (DeepSpeed at ZeRO-3: partitioned as it is built, see
    :meth:`~stapo.core.trainer.deepspeed_backend.DeepSpeedBackend.load_context`); the others load
    the whole model on the CPU and place it themselves (an empty context).
    """
    make = getattr(get_backend_class(cfg.trainer.backend), "load_context", None)
    return make(cfg) if make is not None else nullcontext()
