"""The run's hooks, assembled: importing this module imports every module that registers a hook (the
stability layers, the async hook, the S2T watch, DEEP-GRPO) and registers the always-on ``sampler``
hook, so :func:`build_hooks` finds a factory for every name of
:data:`stapo.core.train.hooks.HOOK_ORDER`. The interface, the registry and the order are
``stapo.core.train.hooks``'s; the names below stay importable from here."""

from __future__ import annotations

from typing import Any, ClassVar

from stapo.core.train.async_hook import AsyncHook
from stapo.core.train.checkpoint import legacy_hook_state
from stapo.core.train.deep_grpo import DeepGRPO
from stapo.core.train.hooks import HOOK_ORDER, HOOKS, Hooks, LoopHook, StepState, build_hooks, register_hook
from stapo.core.train.s2t_watch import S2TWatch
from stapo.core.train.stability import KLInReward, KLReference, LpReg, OverlongFilter, StareController

__all__ = [
    "HOOKS", "HOOK_ORDER", "AsyncHook", "DeepGRPO", "Hooks", "KLInReward", "KLReference", "LoopHook", "LpReg",
    "OverlongFilter", "S2TWatch", "SamplerHook", "StareController", "StepState", "build_hooks", "legacy_hook_state",
    "register_hook",
]


class SamplerHook(LoopHook):
    """The prompt sampler's end of step (Goldilocks: the teacher's update and metrics, every rank) and
    its state on resume. The sampler itself is ``run.sampler`` (the loop's sampling asks it)."""

    name: ClassVar[str] = "sampler"

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def on_batch(self, st: StepState) -> dict[str, float]:
        return self.sampler.end_step(st.step)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


@register_hook("sampler")
def _sampler_hook(run: Any) -> LoopHook | None:
    return SamplerHook(run.sampler)
