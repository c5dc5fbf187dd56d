"""2 learner ranks (torchrun, gloo, DeepSpeed ZeRO-3) training through rollout servers, asynchronously.

The servers are loopback stand-ins of `vllm serve` (tests/service/vllm_fake.py: a real vLLM server
cannot run in the default suite) living in this test's process; the ranks are real processes of the
real CLI. What can fail here: under ZeRO-3 only rank 0 writes the weights while both ranks join the
gathers, a push waits for both ranks' batches of the older version (one barrier before, one after),
each rank samples its own share of every step with its own seed through the servers, and the servers
end with the learner's final weights at version `max_steps`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.long

from tests.e2e.test_multirank_loop import torchrun  # noqa: E402
from tests.service.vllm_fake import FakeVLLMServer  # noqa: E402


def test_two_ranks_train_asynchronously_through_two_servers(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.rollout.base import call_seed
    from stapo.core.trainer.models import load_policy

    model, tok = load_policy(load_config(preset_path("tiny")).model)
    with FakeVLLMServer(copy.deepcopy(model), tok) as s1, FakeVLLMServer(copy.deepcopy(model), tok) as s2:
        run_dir = tmp_path / "run"
        torchrun(["-m", "stapo.cli.main", "train", "--config", "tiny", "--run-dir", str(run_dir),
                  "--set", "trainer.backend=deepspeed", "--set", "trainer.zero_stage=3",
                  "--set", "trainer.max_steps=2", "--set", "logging.live=false", "--set", "eval.every=0",
                  "--set", "checkpoint.export_hf=true",
                  "--set", "rollout.engine=vllm_server", "--set", f"rollout.server.urls=[{s1.url},{s2.url}]",
                  "--set", f"rollout.server.weights_dir={tmp_path / 'weights'}",
                  "--set", "rollout.async.enabled=true", "--set", "rollout.async.max_staleness=1",
                  "--set", "algorithm.name=stapo-async"], tmp_path)
        assert s1.weight_version == s2.weight_version == "2"
        seeds = {r["seed"] for s in (s1, s2) for r in s.requests}
        for step in (1, 2):
            for rank in (0, 1):
                assert call_seed(0, step, 0, rank) in seeds, (step, rank)
        final: dict[str, torch.Tensor] = {}
        for f in sorted((run_dir / "final").glob("*.safetensors")):
            final.update(load_file(str(f)))
        for srv in (s1, s2):
            for name, p in srv.model.named_parameters():
                assert torch.equal(p.detach(), final[name].to(p.dtype)), name
