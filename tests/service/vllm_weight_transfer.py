"""Stand-ins for vLLM 0.33's weight-transfer modules, for the ``nccl`` push's tests without vLLM.

vLLM cannot be imported in stapo's test environment (its pins clash; docs/rollout.md). These restate,
from the released 0.33.0 wheel's ``vllm/distributed/weight_transfer/`` (``base.py``, ``clients.py``,
``nccl_engine.py``), what the push relies on:

- :class:`WeightSource`: ``metadata`` an abstract plain ``property``; ``__init_subclass__`` reads the
  subclass's own ``__dict__`` and refuses a ``metadata`` that is not a ``functools.cached_property``;
  ``iter_full()`` / ``implements_iter_full()``; ``owned_names(rank)`` reads ``metadata`` as an attribute;
- :class:`HTTPVLLMWeightSyncClient`: the four RL routes, ``raise_for_status`` on each;
- :class:`NCCLTrainerWeightTransferEngine`: ``trainer_init`` refuses a source without ``iter_full``,
  reads ``source.metadata`` (an attribute) and initialises the server's engine with the wire params;
  ``send_weights`` runs ``/start_weight_update``, ``/update_weights`` concurrently with the broadcast
  of ``iter_full()``'s tensors (checked against the metadata), then ``/finish_weight_update``. The
  broadcast goes one tensor at a time through a :class:`~tests.service.vllm_fake.FakeNCCLGroup` to
  the server (0.33's unpacked mode; its packed mode sends the same bytes in fewer calls).

``install(monkeypatch, server)`` puts them in ``sys.modules`` under vLLM's names.
tests/e2e/test_vllm_weight_source_slow.py (opt-in) runs 0.33's real modules instead.
"""

from __future__ import annotations

import functools
import sys
import types
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import httpx
import torch

from tests.service.vllm_fake import FakeNCCLGroup, FakeVLLMServer


@dataclass(frozen=True)
class ParamMeta:  # name, wire dtype, full shape; owners None: every trainer rank
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = field(default=None, kw_only=True)


class WeightSource(ABC):
    """0.33's base as released: abstract plain property, the ``cls.__dict__`` check, ``iter_full``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("metadata")
        if own is not None and not isinstance(own, functools.cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

    @property
    @abstractmethod
    def metadata(self) -> list[ParamMeta]: ...

    def owned_names(self, rank: int) -> list[str]:
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not WeightSource.iter_full

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_full")


class HTTPVLLMWeightSyncClient:
    def __init__(self, base_url: str, timeout: float = 300) -> None:
        self.base_url, self.timeout = base_url.rstrip("/"), timeout

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        httpx.post(f"{self.base_url}/{path}", json=json, timeout=self.timeout).raise_for_status()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", None if weight_version is None else {"weight_version": weight_version})


@dataclass
class NCCLTrainerInitInfo:
    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2
    rank: int = field(default=0, kw_only=True)
    backend: ClassVar[str] = "nccl"


class NCCLTrainerWeightTransferEngine:
    group_for: ClassVar[FakeVLLMServer | None] = None  # set by install(): where the broadcast lands

    def __init__(self, client: Any, source: WeightSource, rank: int) -> None:
        self.client, self.source, self.rank = client, source, rank
        self.group = FakeNCCLGroup(self.group_for) if rank == 0 else None
        self._sent_meta: list[ParamMeta] | None = None

    @classmethod
    def trainer_init(cls, init_info: NCCLTrainerInitInfo, *, client: Any, source: WeightSource) -> Any:
        if not source.implements_iter_full():
            raise TypeError(f"{type(source).__name__} does not implement iter_full()")
        for m in source.metadata:
            if m.owners is not None and m.owners[0] != 0:
                raise ValueError(f"{m.name} is not sent by rank 0")
        engine = cls(client, source, init_info.rank)
        if init_info.rank == 0:
            payload = {k: v for k, v in asdict(init_info).items() if k != "rank"} | {"rank_offset": 1}
            client.init_weight_transfer_engine(payload)
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata
        if self.rank != 0:
            for _ in self.source.iter_full():  # join the gathers
                pass
            return
        info = {"names": [], "dtype_names": [], "shapes": []}
        if meta != self._sent_meta:
            info = {"names": [m.name for m in meta], "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
                    "shapes": [list(m.shape) for m in meta]}
        self.client.start_weight_update()
        with ThreadPoolExecutor(1) as ex:
            future = ex.submit(self.client.update_weights, info)
            sent = 0
            for name, t in self.source.iter_full():
                m = meta[sent]
                if (name, t.dtype, tuple(t.shape)) != (m.name, m.dtype, m.shape):
                    raise ValueError(f"metadata disagrees with iteration at {sent}: {m.name} vs {name}")
                self.group.broadcast(t.contiguous(), src=0)
                sent += 1
            if sent != len(meta):
                raise ValueError(f"{sent} parameters yielded, {len(meta)} declared")
            future.result()
        self.client.finish_weight_update()
        self._sent_meta = meta


def install(monkeypatch: Any, server: FakeVLLMServer) -> None:
    """vLLM's weight-transfer modules as these stand-ins, broadcasting to ``server``."""
    monkeypatch.setattr(NCCLTrainerWeightTransferEngine, "group_for", server)
    names = {
        "vllm.distributed.weight_transfer.base": {"ParamMeta": ParamMeta, "WeightSource": WeightSource},
        "vllm.distributed.weight_transfer.clients": {"HTTPVLLMWeightSyncClient": HTTPVLLMWeightSyncClient},
        "vllm.distributed.weight_transfer.nccl_engine": {
            "NCCLTrainerInitInfo": NCCLTrainerInitInfo, "NCCLTrainerWeightTransferEngine": NCCLTrainerWeightTransferEngine},
    }
    for pkg in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        mod = types.ModuleType(pkg)
        mod.__path__ = []
        monkeypatch.setitem(sys.modules, pkg, mod)
    for name, attrs in names.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
