"""The RL engine, in layers (docs/architecture.md; each module's docstring says what it is for).

The module paths of the flat layout (``stapo.core.models``, ``stapo.core.loop``, ...) import for one
release, with a DeprecationWarning naming the new path (:data:`MOVED`, :class:`OldPaths`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

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


class OldPaths:
    """Import finder for :data:`MOVED`: an old path gives the module at its new path (the same object,
    so its classes, registries and monkeypatches are the ones the rest of stapo uses) and warns where
    the user's import stands. Placed last on ``sys.meta_path``, so it never shadows a real module."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: object) -> object:
        old, new = spec.name, MOVED[spec.name]
        # stacklevel 2 skips the import system's own frames: the warning names the user's import line
        warnings.warn(f"{old} is an old path of {new} (stapo.core is laid out by layer): import {new}; the "
                      "old path goes in stapo 0.2", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system sets __spec__ to this spec; exec_module restores it
        return module

    def exec_module(self, module: object) -> None:
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, OldPaths) for f in sys.meta_path):
    sys.meta_path.append(OldPaths())
