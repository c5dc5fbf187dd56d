"""Every shipped recipe passes the launch checks at 1 and 8 ranks, and the rollout fleet is probed
before the policy loads.

- Each preset of configs/ goes through what `stapo train` checks before anything loads
  (:func:`stapo.core.train.prepare.check_inputs`, :func:`stapo.core.train.prepare.check_launch`) under the variables
  a launcher sets, at 1 and 8 ranks. Stand-ins, because this machine has no GPU: ``vllm`` is a
  stub module (the CUDA wheel cannot be installed here) and a recipe's ``rollout.server.urls`` point
  at one loopback HTTP server answering ``/health`` and ``/weight_info`` as ``vllm serve`` does in
  dev mode. The one-process recipes (torch backend: tiny, demo) must refuse 8 ranks in one line.
- A rank count that does not divide ``rollout.prompts_per_step`` names the nearest valid counts.
- A dead rollout server stops `stapo train` in seconds, in one line naming ``rollout.server.urls``
  and ``stapo rollout serve``, before the policy loads; a server started without dev mode is named too.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from stapo.configs import preset_names, preset_path
from stapo.core.config import load_config
from stapo.core.train.prepare import LaunchError, check_inputs, check_launch

ONE_PROCESS = {"tiny", "demo"}  # CPU recipes: trainer.backend=torch, one process by design


class _Served(BaseHTTPRequestHandler):
    """``GET /health`` 200; ``GET /weight_info`` 200 in dev mode, 404 without (vLLM mounts it only then)."""

    dev_mode = True

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        ok = self.path == "/health" or (self.path == "/weight_info" and self.dev_mode)
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def served():
    handler = type("Handler", (_Served,), {"dev_mode": True})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_env(world: int) -> dict[str, str]:
    """What deepspeed / torchrun give rank 0 of a ``world``-rank launch (none for one process)."""
    if world == 1:
        return {}
    return {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(min(world, 8)),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("world", [1, 8])
@pytest.mark.parametrize("name", preset_names())
def test_every_shipped_recipe_passes_the_launch_checks(name: str, world: int, served, monkeypatch) -> None:
    url, _ = served
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # stand-in: no CUDA wheel here
    cfg = load_config(preset_path(name))
    if cfg.rollout.engine == "vllm_server":
        cfg = load_config(preset_path(name), [f"rollout.server.urls=[{url}]"])
    check_inputs(cfg)
    if world > 1 and name in ONE_PROCESS:
        with pytest.raises(LaunchError, match=r"^trainer\.backend=torch trains in one process, but this launch has 8"):
            check_launch(cfg, launcher_env(world))
        return
    check_launch(cfg, launcher_env(world))


def test_the_async_recipe_runs_on_an_engine_that_supports_async() -> None:
    """The colocated engine cannot generate while the learners train: refused at launch, naming it."""
    cfg = load_config(preset_path("stapo-async"), ["rollout.engine=vllm"])
    with pytest.raises(LaunchError, match=r"^rollout\.async\.enabled supports rollout\.engine=hf or vllm_server"):
        check_launch(cfg, launcher_env(8))


def test_ranks_that_do_not_divide_the_prompts_name_the_nearest_counts() -> None:
    cfg = load_config(preset_path("tiny"), ["trainer.backend=deepspeed", "rollout.prompts_per_step=256"])
    with pytest.raises(LaunchError) as err:
        check_launch(cfg, launcher_env(6))
    assert "the nearest valid counts are 252 or 258" in str(err.value)
    cfg = load_config(preset_path("tiny"), ["trainer.backend=deepspeed", "rollout.prompts_per_step=4"])
    with pytest.raises(LaunchError, match="the nearest valid counts are 6 "):
        check_launch(cfg, launcher_env(6))


def test_a_dead_rollout_server_is_reported_in_seconds_before_the_policy_loads(stapo_main, monkeypatch,
                                                                              tmp_path) -> None:
    from stapo.core.trainer import models

    loads: list[str] = []
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: loads.append("policy") or pytest.fail("loaded"))
    url = f"http://127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    code, _out, err = stapo_main("train", "--config", "tiny", "--run-dir", str(tmp_path / "r"),
                                 "--set", "rollout.engine=vllm_server", "--set", f"rollout.server.urls=[{url}]")
    took = time.monotonic() - t0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: rollout.server.urls: {url} did not answer") and "stapo rollout serve" in lines[0]
    assert took < 10 and not loads and not (tmp_path / "r").exists()


def test_a_server_started_without_dev_mode_is_named(served) -> None:
    url, handler = served
    cfg = load_config(preset_path("tiny"), ["rollout.engine=vllm_server", f"rollout.server.urls=[{url}]"])
    check_launch(cfg, {})
    handler.dev_mode = False
    with pytest.raises(LaunchError, match=r"^rollout\.server\.urls: .* runs without VLLM_SERVER_DEV_MODE=1.*stapo rollout serve"):
        check_launch(cfg, {})


# The learner ranks of each documented fleet layout (docs/rollout.md, "Servers"): one node, GPUs 0-3
# learn; several nodes, two learner nodes of 8 GPUs.
FLEET_RANKS = [4, 16]


def _fleet_train_lines() -> list[list[str]]:
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "rollout.md").read_text()
    section = text[text.index("## Servers"):]
    lines = [ln.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S) for ln in block.splitlines()]
    return [shlex.split(ln)[1:] for ln in lines if ln.startswith("stapo train")]


def test_the_documented_fleet_layouts_plan_and_pass_the_launch_checks(served, monkeypatch) -> None:
    """Each documented fleet `stapo train` line at its layout's rank count: `--plan` fits (exit 0,
    learners planned without a KV cache) and the launch checks pass with its URLs answered by a
    loopback stand-in of `vllm serve`."""
    import json
    import re

    from typer.testing import CliRunner

    from stapo.cli.main import app

    url, _ = served
    lines = _fleet_train_lines()
    assert len(lines) == len(FLEET_RANKS)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for args, ranks in zip(lines, FLEET_RANKS, strict=True):
        res = CliRunner().invoke(app, [*args, "--plan", "--world-size", str(ranks), "--json"])
        plan = json.loads(res.stdout)
        assert res.exit_code == 0 and plan["fits"] and plan["kv_cache_gib"] == 0, (args, res.output)
        assert set(plan["phases_gib"]) == {"update", "weight push"}
        sets = [re.sub(r"urls=\[.*\]", f"urls=[{url}]", a) for a in args[args.index("--set"):] if a != "--set"]
        cfg = load_config(preset_path(args[args.index("--config") + 1]), sets)
        check_launch(cfg, launcher_env(ranks))
