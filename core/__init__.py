"""The RL engine, in layers (docs/architecture.md; each module's docstring says what it is for).

The module paths of the flat layout (``stapo.core.models``, ``stapo.core.loop``, ...) import for one
release, with a DeprecationWarning naming the new path (:data:`MOVED`, :mod:`stapo.moved`).
"""

from __future__ import annotations

from stapo.moved import register

MOVED = {
    "stapo.core.data": "stapo.core.task.data",
    "stapo.core.rewards": "stapo.core.task.rewards",
    "stapo.core.sampler": "stapo.core.task.sampler",
    "stapo.core.models": "stapo.core.trainer.models",
    "stapo.core.distributed": "stapo.core.trainer.distributed",
    "stapo.core.rollouts": "stapo.core.rollout.rollouts",
    "stapo.core.async_rollout": "stapo.core.rollout.async_rollout",
    "stapo.core.calibrate": "stapo.core.train.calibrate",
    "stapo.core.checkpoint": "stapo.core.train.checkpoint",
    "stapo.core.deep_grpo": "stapo.core.train.deep_grpo",
    "stapo.core.extras": "stapo.core.train.extras",
    "stapo.core.loop": "stapo.core.train.loop",
    "stapo.core.micro": "stapo.core.train.micro",
    "stapo.core.plan": "stapo.core.train.plan",
    "stapo.core.reference": "stapo.core.train.reference",
    "stapo.core.run": "stapo.core.train.run",
    "stapo.core.rundir": "stapo.core.train.rundir",
    "stapo.core.s2t_watch": "stapo.core.train.s2t_watch",
    "stapo.core.update": "stapo.core.train.update",
    "stapo.core.algos.vcpo": "stapo.core.train.off_policy",
}
"""Module paths of stapo 0.1's flat ``core/`` (and of VCPO's update code, once in ``algos``) and where
the layer layout put each (docs/architecture.md, "Where did it move"). For one release an old path
still imports, with a DeprecationWarning naming the new one; stapo 0.2 drops them."""

register(MOVED, "stapo.core is laid out by layer")
