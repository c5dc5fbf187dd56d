"""The asynchronous rollouts' loop hook (``async``, ``rollout.async.enabled``): round 0 sampled ahead
(``stapo.core.rollout.async_rollout``) and the stale rows' off-policy corrections
(``stapo.core.train.off_policy``)."""

from __future__ import annotations

from typing import Any, ClassVar

from stapo.core.rollout.async_rollout import async_rollouts
from stapo.core.train.hooks import Added, LoopHook, StepState, register_hook
from stapo.core.train.off_policy import off_policy_step
from stapo.core.trainer.distributed import DataParallel

__all__ = ["AsyncHook"]


class AsyncHook(LoopHook):
    """Asynchronous rollouts (``rollout.async.enabled``, docs/async.md): round 0 of the coming steps is
    sampled and graded while the learner updates (``sample``: ``stapo.core.rollout.async_rollout``, through
    the rollout servers or a producer process); stale rows, or VCPO's baseline, need the proximal
    policy's log-probs (``needs_old_stats``) and get their off-policy corrections (``before_update``:
    ``stapo.core.train.off_policy``); each step's weights become the next version (``after_sync``). The
    rollouts start at the first ``sample`` (after a resume's checkpoint and the first validation),
    from the weights of that moment."""

    name: ClassVar[str] = "async"

    def __init__(self, run: Any) -> None:  # (what async rollouts support: the run's preparation checks it)
        self.run = run
        self.dp = DataParallel(run.backend)  # the off-policy decisions are global over ranks
        self.rollouts: Any = None

    def sample(self, step: int) -> tuple[list[Any], dict[str, float]]:
        if self.rollouts is None:
            self.rollouts = async_rollouts(self.run, step - 1)
        return self.rollouts.rollouts(step)

    def needs_old_stats(self, st: StepState) -> bool:
        # whether the step's round 0 is stale is fixed by the step: the same answer on every rank
        return self.rollouts.stale(st.step) or self.run.cfg.algorithm.off_policy.min_variance_baseline

    def before_update(self, st: StepState) -> Added:
        """The step's off-policy corrections (``st.off_policy`` for the update), once the old pass ran."""
        if st.old_lp is None:
            return Added()
        cfg = self.run.cfg
        return Added(off_policy=off_policy_step(cfg.algorithm.off_policy, st.kept, st.batch, st.old_lp, st.step,
                                                scale_by_std=cfg.algorithm.advantage == "grpo", dp=self.dp))

    def after_update(self, st: StepState) -> dict[str, float]:
        # with the LR multipliers the optimizer steps applied
        return dict(st.off_policy.metrics) if st.off_policy is not None else {}

    def after_sync(self, st: StepState) -> None:
        if self.rollouts is not None:
            self.rollouts.publish(st.step)  # version `step`

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()


@register_hook("async")
def _async_hook(run: Any) -> LoopHook | None:
    return AsyncHook(run) if run.cfg.rollout.async_.enabled else None
