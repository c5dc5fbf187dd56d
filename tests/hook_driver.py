"""Driving the loop from a test: the config's hooks built by the registry as the loop builds them,
the ``before_update`` phase on a batch the test made, and a whole run trained and handed back. Imported by tests (``from hook_driver import ...``; tests/ is on sys.path through its
conftest, and multi-rank workers put it there themselves)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HookRun:
    """What the hook factories read from a run (``stapo.core.train.run.Run``), for tests that drive the update's
    phases themselves: the config, the trainer backend (None: layers that need no model) and the
    prompt sampler."""

    cfg: Any
    backend: Any = None
    sampler: Any = None


def run_hooks(cfg: Any, backend: Any = None) -> Any:
    """The config's hooks, built by the registry the way ``Run.build`` builds them."""
    from stapo.core.train.extras import build_hooks

    return build_hooks(HookRun(cfg, backend))


def forwards(batch: Any, micro_batch: int, *, calls: int = 1, pad_row: int | None = None) -> list[Any]:
    """The forwards of a pass over ``batch``'s real rows (all, or those before ``pad_row``) in rows of
    ``micro_batch``, as the busiest of several ranks would have them: at least ``calls``, those past
    the real rows on ``pad_row`` (``stapo.core.train.micro.micro_batches``)."""
    import torch

    from stapo.core.batch import Batch
    from stapo.core.train.micro import MicroSpec, micro_batches

    if not isinstance(batch, Batch):  # (input_ids, attention_mask, response_mask)
        batch = Batch(*batch, torch.zeros(batch[0].shape))
    real = batch.input_ids.shape[0] if pad_row is None else pad_row
    return micro_batches(batch, [torch.arange(real)], MicroSpec(micro_batch), pad_row=pad_row, min_forwards=calls)[0]


def before_update(hooks: Any, batch: Any, old_lp: Any, old_ent: Any, *, micro_batch: int = 1, calls: int = 1,
                  pad_row: int | None = None, micros: Any = None, temperature: float = 1.0,
                  kept: Any = ()) -> tuple[Any, dict]:
    """The loop's ``before_update`` phase after its old pass (``loop.update_step``) on a batch the
    test built, whose forwards are ``micros`` (else :func:`forwards` of ``micro_batch``, ``calls``,
    ``pad_row``): (the step's state, with what the hooks added to it, and the phase's metrics)."""
    from stapo.core.train.hooks import StepState

    if micros is None and hasattr(batch, "attention_mask"):
        micros = forwards(batch, micro_batch, calls=calls, pad_row=pad_row)
    st = StepState(0, list(kept), list(kept), {}, batch=batch, micros=micros, temperature=temperature,
                   old_lp=old_lp, old_ent=old_ent)
    return hooks.before_update(st)


def train_keeping_run(cfg: Any, run_dir: Any, log: Any = lambda _m: None) -> tuple[Any, Any]:
    """``train(Run.build(cfg, run_dir))`` -> (its result, the run): for tests that look at the
    trained model or the rollout engine afterwards."""
    from stapo.core.train.loop import train
    from stapo.core.train.run import Run

    run = Run.build(cfg, run_dir, log=log)
    return train(run), run
