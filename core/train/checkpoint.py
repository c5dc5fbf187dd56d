"""Atomic checkpoints and exact resume.

A checkpoint is a folder ``RUN/checkpoints/step_000010/`` holding the trainer backend's state
(model + optimizer + scheduler, written by ``backend.save``), every RNG state, the data cursor and
the config. It is written to a temporary sibling and renamed into place, so a run killed at any
moment leaves either the whole checkpoint or none of it; older ones beyond ``keep_last`` are
removed only after the new one is in place.

Exactness: the loop re-seeds every RNG from ``(trainer.seed, step)`` at the start of each step
and draws prompts from a seeded permutation indexed by step, so resuming at step k replays steps
k+1.. bit for bit on CPU; the RNG states stored here make that explicit and cover code that
consumes randomness between steps.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stapo.core.config import Config, save_config

__all__ = ["CheckpointState", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints",
           "checkpoint_step", "legacy_hook_state"]

_PREFIX = "step_"


@dataclass
class CheckpointState:
    """What a checkpoint restores besides the backend's own state."""

    step: int
    extra: dict[str, Any]


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / "meta.json").exists()]
    return sorted(done, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder holds (``step_000010`` -> 10)."""
    return int(Path(path).name[len(_PREFIX) :])


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def _barrier() -> None:
    """Wait for every data-parallel rank (no-op in a single process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(
    run_dir: Path, *, step: int, backend: Any, cfg: Config, extra: dict[str, Any] | None = None, keep_last: int = 2
) -> Path:
    """Write ``checkpoints/step_N`` atomically and prune to the newest ``keep_last``.

    Every rank calls this (ZeRO shards are saved collectively); rank 0 alone creates, finalizes
    and prunes folders, with barriers between the phases.
    """
    rank = int(getattr(backend, "rank", 0))
    root = Path(run_dir) / "checkpoints"
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f".tmp-{_PREFIX}{step:06d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    backend.save(tmp / "trainer")
    torch.save(_rng_state(), tmp / f"rng_{rank}.pt")
    _barrier()
    if rank == 0:
        save_config(cfg, tmp / "config.yaml")
        # meta.json last: its presence marks a complete checkpoint.
        (tmp / "meta.json").write_text(json.dumps({"step": step, "extra": extra or {}}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, *, backend: Any) -> CheckpointState:
    """Restore the backend and the RNG states from a checkpoint folder."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    backend.load(path / "trainer")
    _set_rng_state(torch.load(path / f"rng_{int(getattr(backend, 'rank', 0))}.pt", weights_only=False))
    return CheckpointState(step=int(meta["step"]), extra=meta.get("extra", {}))


def legacy_hook_state(extra: dict[str, Any]) -> dict[str, Any]:
    """Hook states by name from a checkpoint's ``extra``, also one written by an older layout.

    Older checkpoints kept the states under ``extras`` / ``layers`` (before the hooks had names), or
    under ``hooks`` with one ``regularizers`` hook bundling the KL reference, Lp-Reg, STARE and the
    overlong filter; of those only STARE's controller had state (``{"stare": {w, m, ...}}``), which
    is now the ``stare`` hook's own."""
    if "hooks" in extra:
        hooks = dict(extra["hooks"])
    else:
        layers = extra.get("layers", {})
        hooks = {"regularizers": extra.get("extras", {}), "sampler": layers.get("sampler", {}),
                 "deep_grpo": layers.get("deep_grpo", {})}
    bundled = hooks.pop("regularizers", None) or {}
    if bundled.get("stare") and not hooks.get("stare"):
        hooks["stare"] = dict(bundled["stare"])
    return hooks
