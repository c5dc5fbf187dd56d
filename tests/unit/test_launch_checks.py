"""What `stapo train` checks before anything loads, and how a launch of several ranks reports it.

- each check of :func:`stapo.core.train.prepare.check_launch` fails with one line naming its config key:
  the one-process torch backend under a launcher, ranks that do not divide ``rollout.prompts_per_step``, a vLLM that does not import, a
  ``reward.urls`` entry that does not resolve, does not answer, or answers ``/readyz`` with 503
  (a real HTTP server on loopback); a ready one passes;
- the overlong buffer longer than the response is a config error naming ``algorithm.overlong.buffer``;
- under a launcher, a job-wide error is printed by each node's first rank only, never with the
  "unexpected" label, and a rank's own failure names its rank and host;
- the grading pool's default size is the node's cores divided by the ranks on the node;
- ``trainer.dist_timeout_s`` reaches DeepSpeed's process-group init (a recording stand-in for
  ``deepspeed.init_distributed``: the real group is made once per process, by the e2e tests).
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from stapo.cli import main as cli_main
from stapo.configs import preset_path
from stapo.core.config import ConfigError, load_config
from stapo.core.task.rewards import grader_workers_per_rank
from stapo.core.train.prepare import LaunchError, check_launch
from stapo.verifier_service.server.settings import default_workers


def tiny(*overrides: str):
    return load_config(preset_path("tiny"), list(overrides))


def test_ranks_must_divide_the_prompts_per_step() -> None:
    cfg = tiny("rollout.prompts_per_step=8", "trainer.backend=deepspeed")
    check_launch(cfg, {"WORLD_SIZE": "2"})
    check_launch(cfg, {})  # one process
    with pytest.raises(LaunchError, match=r"^rollout\.prompts_per_step \(8\) must be divisible by the number of ranks \(3\)"):
        check_launch(cfg, {"WORLD_SIZE": "3"})


def test_several_ranks_need_a_backend_that_spans_them() -> None:
    """The torch backend is one process: under a launcher each rank would train its own copy."""
    check_launch(tiny(), {})
    with pytest.raises(LaunchError, match=r"^trainer\.backend=torch trains in one process, but this launch has 2 ranks"):
        check_launch(tiny(), {"WORLD_SIZE": "2"})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_a_vllm_engine_that_does_not_import_names_the_key() -> None:
    with pytest.raises(LaunchError, match=r"^rollout\.engine=vllm, but vllm does not import \(ModuleNotFoundError"):
        check_launch(tiny("rollout.engine=vllm"), {})


class _Readyz(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/readyz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def readyz_server():
    """A real HTTP server on loopback whose /readyz answers ``handler.status``."""
    handler = type("Handler", (_Readyz,), {"status": 200})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_reward_urls_resolve_and_answer_readyz(readyz_server) -> None:
    url, handler = readyz_server
    check_launch(tiny(f"reward.urls=[{url}]"), {})
    handler.status = 503
    with pytest.raises(LaunchError, match=r"^reward\.urls: .*/readyz answered 503"):
        check_launch(tiny(f"reward.urls=[{url}]"), {})
    with pytest.raises(LaunchError, match=r"^reward\.urls: cannot resolve 'verifier\.invalid'"):
        check_launch(tiny("reward.urls=[http://verifier.invalid:8000]"), {})
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(LaunchError, match=r"^reward\.urls: http://127\.0\.0\.1:\d+/readyz did not answer"):
        check_launch(tiny(f"reward.urls=[http://127.0.0.1:{closed}]"), {})


def test_overlong_buffer_must_fit_the_response() -> None:
    tiny("algorithm.overlong.enabled=false", "algorithm.overlong.buffer=7")  # off: the buffer is unused
    tiny("algorithm.overlong.enabled=true", "algorithm.overlong.buffer=8", "rollout.max_new_tokens=8")
    with pytest.raises(ConfigError, match=r"algorithm\.overlong\.buffer \(7\) must be at most rollout\.max_new_tokens \(1\)"):
        tiny("algorithm.overlong.enabled=true", "algorithm.overlong.buffer=7")


def _run_main(monkeypatch, capsys, env: dict[str, str], *args: str) -> tuple[int, str]:
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["stapo", *args])
    with pytest.raises(SystemExit) as exc:
        cli_main.main()
    return int(exc.value.code), capsys.readouterr().err


def test_a_job_wide_error_prints_once_per_node(monkeypatch, capsys, tmp_path) -> None:
    """3 ranks on one node (the launchers' variables): rank 0 prints the line; ranks 1 and 2 exit 2
    silently. A second node's first rank (RANK 3, LOCAL_RANK 0) prints it for its node."""
    args = ("train", "--config", "tiny", "--run-dir", str(tmp_path / "run"), "--set", "trainer.backend=deepspeed")
    outputs = []
    for rank, local in ((0, 0), (1, 1), (2, 2), (3, 0)):
        code, err = _run_main(monkeypatch, capsys, {"WORLD_SIZE": "3", "RANK": str(rank), "LOCAL_RANK": str(local)}, *args)
        assert code == 2
        outputs.append(err)
    assert outputs[1] == outputs[2] == ""
    for err in (outputs[0], outputs[3]):
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "rollout.prompts_per_step (8)" in lines[0], err
        assert "unexpected" not in err
    assert not (tmp_path / "run").exists()


def _tools(folder, *names: str) -> str:
    """A PATH of one folder holding executables with these names (stand-ins: only their presence is read)."""
    folder.mkdir()
    for name in names:
        (folder / name).write_text("#!/bin/sh\nexit 0\n")
        (folder / name).chmod(0o755)
    return str(folder)


def test_offload_optimizer_names_the_missing_compiler_and_ninja(monkeypatch, capsys, tmp_path) -> None:
    """DeepSpeed's PyPI release compiles CPU Adam at first use: without ``c++`` ($CXX) and ``ninja`` on
    PATH, `stapo train` says so in one line before anything loads (this venv's DeepSpeed has no prebuilt op)."""
    cfg = tiny("trainer.backend=deepspeed", "trainer.zero_stage=1", "trainer.offload_optimizer=true")
    check_launch(cfg, {"PATH": _tools(tmp_path / "both", "c++", "ninja")})
    check_launch(cfg, {"PATH": _tools(tmp_path / "gxx", "g++", "ninja"), "CXX": "g++"})
    check_launch(tiny("trainer.backend=deepspeed", "trainer.zero_stage=1"), {"PATH": ""})  # no offload: no build
    with pytest.raises(LaunchError, match=r"^trainer\.offload_optimizer=true: DeepSpeed compiles its CPU Adam .* "
                                       r"missing: c\+\+\. Install them"):
        check_launch(cfg, {"PATH": _tools(tmp_path / "ninja", "ninja")})
    args = ("train", "--config", "tiny", "--run-dir", str(tmp_path / "run"), "--set", "trainer.backend=deepspeed",
            "--set", "trainer.zero_stage=1", "--set", "trainer.offload_optimizer=true")
    code, err = _run_main(monkeypatch, capsys, {"PATH": _tools(tmp_path / "none")}, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "missing: c++, ninja" in lines[0], err
    assert not (tmp_path / "run").exists()


def test_a_ranks_own_failure_names_rank_and_host(monkeypatch, capsys, tmp_path) -> None:
    """An error that is the rank's own (here: --resume of a run dir without config.yaml) carries
    ``rank R/W on HOST``; without a launcher the line has no prefix."""
    args = ("train", "--run-dir", str(tmp_path / "nothing"), "--resume")
    code, err = _run_main(monkeypatch, capsys, {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, *args)
    assert code == 2 and f"rank 1/2 on {socket.gethostname()}: " in err and "has no config.yaml" in err
    code, err = _run_main(monkeypatch, capsys, {}, *args)
    assert code == 2 and "rank " not in err and "has no config.yaml" in err


def test_grading_workers_are_the_nodes_cores_divided_by_its_ranks() -> None:
    cores = default_workers()
    assert grader_workers_per_rank({}) == cores
    assert grader_workers_per_rank({"LOCAL_WORLD_SIZE": "2"}) == max(1, cores // 2)  # torchrun
    assert grader_workers_per_rank({"LOCAL_SIZE": "2"}) == max(1, cores // 2)  # the deepspeed launcher
    assert grader_workers_per_rank({"LOCAL_WORLD_SIZE": str(cores * 8)}) == 1


def test_dist_timeout_reaches_deepspeeds_group_init(monkeypatch) -> None:
    pytest.importorskip("deepspeed")
    import torch.distributed as dist

    from stapo.core.trainer import deepspeed_backend

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    seen = {}

    class Recorder:
        @staticmethod
        def init_distributed(**kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(deepspeed_backend.os, "environ", {})  # the variables it sets stay in this test
    deepspeed_backend.init_distributed(Recorder, cpu=False, timeout_s=5400.0)
    assert seen["timeout"] == timedelta(seconds=5400)
    assert tiny().trainer.dist_timeout_s == 3600.0  # the default: above one generation round at 8B
