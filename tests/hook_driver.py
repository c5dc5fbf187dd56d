"""Driving the loop from a test: the config's hooks built by the registry as the loop builds them,
the ``before_update`` phase on a batch the test made, and a whole ``loop.train`` that hands back the
run it built. Imported by tests (``from hook_driver import ...``; tests/ is on sys.path through its
conftest, and multi-rank workers put it there themselves)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HookRun:
    """What the hook factories read from a run (``loop._Run``), for tests that drive the update's
    phases themselves: the config, the trainer backend (None: layers that need no model) and the
    prompt sampler."""

    cfg: Any
    backend: Any = None
    sampler: Any = None


def run_hooks(cfg: Any, backend: Any = None) -> Any:
    """The config's hooks, built by the registry the way ``loop._Run`` builds them."""
    from stapo.core.train.extras import build_hooks

    return build_hooks(HookRun(cfg, backend))


def before_update(hooks: Any, batch: Any, old_lp: Any, old_ent: Any, *, micro_batch: Any, temperature: float = 1.0,
                  calls: int | None = None, pad_row: int | None = None, kept: Any = ()) -> tuple[Any, dict]:
    """The loop's ``before_update`` phase after its old pass (``loop.update_step``) on a batch the
    test built: (the step's state, with what the hooks published there, and the phase's metrics)."""
    from stapo.core.train.extras import StepState
    from stapo.core.train.update import MicroSpec

    spec = micro_batch if isinstance(micro_batch, MicroSpec) else MicroSpec(int(micro_batch))
    st = StepState(0, list(kept), list(kept), {}, batch=batch, pad_row=pad_row, spec=spec, calls=calls,
                   temperature=temperature, old_lp=old_lp, old_ent=old_ent)
    return st, hooks.before_update(st)


def train_keeping_run(cfg: Any, run_dir: Any, log: Any = lambda _m: None) -> tuple[Any, Any]:
    """``loop.train(cfg, run_dir)`` -> (its result, the run it built): for tests that look at the
    trained model or the rollout engine afterwards (``train`` does not hand its run out)."""
    from stapo.core.train import loop

    seen: dict[str, Any] = {}
    orig = loop._Run.__init__

    def keep(self: Any, *a: Any, **kw: Any) -> None:
        orig(self, *a, **kw)
        seen["run"] = self

    loop._Run.__init__ = keep
    try:
        result = loop.train(cfg, run_dir, log=log)
    finally:
        loop._Run.__init__ = orig
    return result, seen["run"]
