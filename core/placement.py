"""Which device a rank uses: one pure function of the launcher's environment, decided once per process.

Under a launcher (``deepspeed``, ``torchrun``, ``srun`` with the variables exported) every process
of a node sees the same GPUs; the rank with ``LOCAL_RANK = i`` takes ``cuda:i``. A launcher that
gives each process exactly one visible GPU (``CUDA_VISIBLE_DEVICES`` with one id per task, as
Slurm's ``--gpus-per-task=1`` does) leaves every rank ``cuda:0``, which is then its own GPU; any other
node with fewer GPUs than ranks is refused rather than stacking ranks on one GPU.

Libraries index GPUs by ``LOCAL_RANK`` themselves: DeepSpeed's engine calls
``set_device(LOCAL_RANK)``, ``zero.Init`` places partitions on it, and vLLM's external launcher
requires ``LOCAL_RANK < device count`` and takes ``cuda:LOCAL_RANK``. With one GPU per task a rank
with ``LOCAL_RANK = 3`` sees one GPU, and those would fail with "invalid device ordinal". So
:func:`apply` presents ``LOCAL_RANK`` as the index of the rank's device in this process
(:func:`presented_env`: ``0`` there), keeping the launcher's value in ``STAPO_LAUNCHER_LOCAL_RANK``.
vLLM's tensor parallelism under one GPU per task is refused in one line naming the Slurm setting
(its group's workers need each other's GPUs visible).
Everything of the rank lives on that device or shares it: the policy (loaded on the CPU, moved by
the trainer backend), the KL reference model (built by the backend beside the policy), the
colocated vLLM engine (vLLM's ``external_launcher`` executor reads the same ``RANK`` /
``LOCAL_RANK``), the asynchronous rollout producer (a process of rank 0 that inherits rank 0's
variables, so it shares rank 0's GPU). The grading pool runs on CPU cores only.

:func:`place` is pure (environment, visible GPU count, ``trainer.device``, tensor-parallel size in,
:class:`Placement` out) so every combination is unit-tested without a GPU. :func:`apply` then
calls ``torch.cuda.set_device`` — before anything allocates on a GPU, or the CUDA context and the
first tensors land on GPU 0 for every rank of the node. :func:`rank_placement` is both, for this
process, and is what the loop calls first.

Usage::

    placement = rank_placement(cfg.trainer.device, tp_size=cfg.rollout.vllm.tensor_parallel_size)
    model, tok = load_policy(cfg.model, device="cpu", compute_device=placement.device)
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["Placement", "launch_world_size", "place", "apply", "presented_env", "rank_placement", "resolve_device", "visible_cuda_devices"]


@dataclass(frozen=True)
class Placement:
    """This rank's place. ``device``: ``"cuda:i"`` or ``"cpu"`` (or the explicit ``trainer.device``).

    ``tp_group``: index of this rank's tensor-parallel group of vLLM (consecutive ranks
    ``[g*tp, (g+1)*tp)``), which is also the engine's data-parallel replica index and so its seed
    offset: the ranks of one group must sample identically, different groups differently.
    ``physical_gpu``: the id in ``CUDA_VISIBLE_DEVICES`` behind ``device`` (for messages), or None.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: str
    tp_size: int = 1
    physical_gpu: str | None = None

    @property
    def tp_group(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def describe(self) -> str:
        """One line a rank prints about itself: ``rank 3/8 (local 3/8) on cuda:3 (GPU 3)``."""
        gpu = f" (GPU {self.physical_gpu})" if self.physical_gpu is not None else ""
        tp = f", vLLM tensor-parallel group {self.tp_group}" if self.tp_size > 1 else ""
        return (f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}) "
                f"on {self.device}{gpu}{tp}")


    def record(self, folder: Path, device: object = None) -> Path:
        """Write ``rank<r>.json`` (this placement, the host, the pid and the device the backend
        reports) into ``folder``: on a multi-node job, where each rank landed."""
        folder.mkdir(parents=True, exist_ok=True)
        row = {**asdict(self), "host": socket.gethostname(), "pid": os.getpid(),
               "backend_device": str(device if device is not None else self.device)}
        path = folder / f"rank{self.rank}.json"
        path.write_text(json.dumps(row) + "\n")
        return path


def _int(env: Mapping[str, str], key: str, default: int | None) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def launch_world_size(env: Mapping[str, str] = os.environ) -> int:
    """The launch's number of ranks: ``WORLD_SIZE`` (deepspeed, torchrun, Slurm), 1 without a launcher.
    The one reader of the variable: the launch checks, the memory plan and :func:`place` ask it."""
    world = _int(env, "WORLD_SIZE", 1)
    assert world is not None
    return world


def visible_cuda_devices(env: Mapping[str, str]) -> list[str] | None:
    """The ids listed in ``CUDA_VISIBLE_DEVICES`` (None when it is unset)."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [x.strip() for x in raw.split(",") if x.strip()]


def place(env: Mapping[str, str], *, cuda_devices: int, requested: str = "auto", tp_size: int = 1) -> Placement:
    """This rank's :class:`Placement` from the launcher's variables; pure.

    ``env``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (torchrun; the deepspeed
    launcher's ``LOCAL_SIZE``), ``CUDA_VISIBLE_DEVICES``
    (each optional; alone, a process is rank 0 of 1). ``cuda_devices``: GPUs this process sees
    (``torch.cuda.device_count()``, which already honours ``CUDA_VISIBLE_DEVICES``). ``requested``:
    ``trainer.device`` (``auto``, ``cpu``, ``cuda`` or ``cuda:i``). ``tp_size``: vLLM's tensor-parallel
    size; its groups are consecutive ranks of one node. Errors name the variable or config key.
    """
    world = launch_world_size(env)
    rank = _int(env, "RANK", 0)
    assert rank is not None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    local_rank = _int(env, "LOCAL_RANK", None)
    if local_rank is None:
        if world > 1:
            raise ValueError(f"LOCAL_RANK is unset with WORLD_SIZE={world}: launch with deepspeed, torchrun "
                             "or export LOCAL_RANK per process (Slurm: LOCAL_RANK=$SLURM_LOCALID)")
        local_rank = 0
    local_world = _int(env, "LOCAL_WORLD_SIZE", _int(env, "LOCAL_SIZE", None))  # torchrun; deepspeed
    if local_world is None:  # a bare launcher: at most one rank per visible GPU
        # (one process: a LOCAL_RANK of its own, e.g. presented for trainer.device=cuda:i, names its GPU)
        local_world = local_rank + 1 if world == 1 else max(local_rank + 1, min(world, max(cuda_devices, 1)))
    if not 0 <= local_rank < local_world:
        raise ValueError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world}")
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"rollout.vllm.tensor_parallel_size ({tp_size}) must divide the number of ranks ({world})")
    if tp_size > 1 and local_world % tp_size:
        raise ValueError(f"rollout.vllm.tensor_parallel_size ({tp_size}) must divide the ranks per node "
                         f"({local_world}): a tensor-parallel group stays on one node")

    visible = visible_cuda_devices(env)
    kind = "cuda" if requested == "auto" else requested.split(":", 1)[0]
    if requested == "cpu" or (requested == "auto" and cuda_devices == 0):
        return Placement(rank, world, local_rank, local_world, "cpu", tp_size)
    if kind != "cuda":
        if world > 1:
            raise ValueError(f"trainer.device={requested!r}: with {world} ranks use `auto`, `cuda` or `cpu`")
        return Placement(rank, world, local_rank, local_world, requested, tp_size)
    if cuda_devices == 0:
        raise ValueError(f"trainer.device is {requested!r} but CUDA is not available here; use `cpu` or `auto`")
    if ":" in requested:
        if world > 1:
            raise ValueError(f"trainer.device={requested!r} pins one GPU, but {world} ranks each take their "
                             "own (cuda:LOCAL_RANK): use `auto` or `cuda`")
        index = int(requested.split(":", 1)[1])
    elif cuda_devices >= local_world:
        index = local_rank
    elif cuda_devices == 1 and visible is not None and len(visible) == 1:
        if tp_size > 1:
            raise ValueError(
                f"rollout.vllm.tensor_parallel_size={tp_size} with one GPU visible per process "
                f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}, as Slurm's --gpus-per-task=1 sets): "
                "a tensor-parallel group needs its GPUs visible to each of its processes; launch with "
                "--gpus-per-node (every GPU of the node visible to its tasks) instead of --gpus-per-task=1")
        index = 0  # one GPU made visible to each process (CUDA_VISIBLE_DEVICES per task): its own
    else:
        raise ValueError(f"{local_world} ranks on this node but {cuda_devices} GPUs visible "
                         f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}): launch one rank per GPU")
    if not 0 <= index < cuda_devices:
        raise ValueError(f"trainer.device={requested!r}: this process sees {cuda_devices} GPUs")
    physical = visible[index] if visible is not None and index < len(visible) else str(index)
    return Placement(rank, world, local_rank, local_world, f"cuda:{index}", tp_size, physical)


def presented_env(placement: Placement, env: Mapping[str, str]) -> dict[str, str]:
    """The variables to set so that what reads ``LOCAL_RANK`` as a GPU index (DeepSpeed, ``zero.Init``,
    vLLM's external launcher) lands on ``placement.device``; pure. ``{}`` when ``LOCAL_RANK`` already
    is the device's index (a launcher that shows every rank the node's GPUs). Otherwise (one GPU
    visible per task: device ``cuda:0`` for ``LOCAL_RANK = 3``) ``LOCAL_RANK`` becomes the index and
    the launcher's value moves to ``STAPO_LAUNCHER_LOCAL_RANK``."""
    if not placement.is_cuda:
        return {}
    index = int(placement.device.split(":", 1)[1]) if ":" in placement.device else 0
    if index == placement.local_rank and env.get("LOCAL_RANK", "0") == str(index):
        return {}
    return {"LOCAL_RANK": str(index), "STAPO_LAUNCHER_LOCAL_RANK": str(placement.local_rank)}


def apply(placement: Placement, env: dict[str, str] | None = None) -> None:
    """``torch.cuda.set_device`` for a CUDA placement (call before the first CUDA allocation), and
    ``LOCAL_RANK`` presented as that device's index (:func:`presented_env`) in ``env`` (this
    process's environment by default) before DeepSpeed or vLLM read it."""
    if placement.is_cuda:
        target = os.environ if env is None else env
        target.update(presented_env(placement, target))
        torch.cuda.set_device(torch.device(placement.device))


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_placement(requested: str = "auto", *, tp_size: int = 1) -> Placement:
    """:func:`place` for this process, then :func:`apply`: the first thing a training process does."""
    placement = place(os.environ, cuda_devices=_cuda_devices(), requested=requested, tp_size=tp_size)
    apply(placement)
    return placement


def resolve_device(name: str | torch.device) -> torch.device:
    """A device name -> ``torch.device``: ``auto`` / ``cuda`` as :func:`place` decides for this process
    (``cuda:LOCAL_RANK`` under a launcher), an explicit one (``cpu``, ``cuda:1``) as given."""
    if isinstance(name, torch.device):
        return name
    if name in ("auto", "cuda"):
        return torch.device(place(os.environ, cuda_devices=_cuda_devices(), requested=name).device)
    try:
        dev = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"trainer.device: cannot parse {name!r} ({err})") from None
    if dev.type == "cuda" and not _cuda_devices():
        raise ValueError(f"trainer.device is {name!r} but CUDA is not available here; use `cpu` or `auto`")
    return dev
