"""docs/integrations.md's runnable checks, run as written: OpenRLHF's two shapes (the adapters file's
function in this process; ``/get_reward`` on a service the block starts on its own port) and TRL's
``GRPOTrainer`` on a CPU with a model built in code.

The TRL check needs TRL 1.16 beside stapo: it runs in the integration matrix's TRL virtualenv
(``integrations/envs.py``, built from PyPI once and cached), so it is opt-in: ``STAPO_SLOW=1``.
"""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = (REPO / "docs" / "integrations.md").read_text()


def block_after(marker: str, lang: str) -> str:
    """The first fenced ``lang`` block after ``marker`` on the page."""
    return PAGE.split(marker, 1)[1].split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_VERIFIER_")}
    env["STAPO_VERIFIER_WORKERS"] = "1"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's `stapo`
    return env


def test_openrlhf_adapters_check_runs_as_written(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(block_after("Runnable check of the adapters file's function", "python"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=_env(),
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'rewards': tensor([1., 0.]), 'scores': tensor([1., 0.])" in out.stdout, out.stdout


def test_openrlhf_http_check_starts_its_own_service(tmp_path):
    """The block serves on 8765 itself, waits for readiness, asks ``/get_reward`` and stops its server."""
    block = block_after("and of the HTTP shape, on a service of its own", "bash")
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 8765)) == 0:
            pytest.fail("port 8765 is taken on this machine: the documented check serves there")
    out = subprocess.run(["bash", "-c", block], capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert '{"rewards":[1.0],"scores":[1.0],"extra_logs":{"accuracy":[1.0]' in out.stdout, out.stdout
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", 8765)) != 0, "the block left its server running"


@pytest.mark.skipif(os.environ.get("STAPO_SLOW") != "1", reason="slow (TRL's virtualenv from PyPI): STAPO_SLOW=1")
def test_trl_cpu_snippet_trains_one_step_as_written(tmp_path):
    """One GRPO step on the CPU with no hub (HF_HUB_OFFLINE): the reward function graded every
    completion (a mean of NaN would be TRL's "no reward"); a random model's answers are wrong."""
    sys.path.insert(0, str(REPO / "integrations"))
    from envs import ENVS, build

    py = build(ENVS["trl-1.16.0"])
    script = tmp_path / "grpo_cpu.py"
    script.write_text(block_after("On a CPU,\nwith no hub", "python"))
    env = {**_env(), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([str(py), str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    logged = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert logged == {"rewards/stapo_math_answer/mean": 0.0, "rewards/stapo_math_answer/std": 0.0}, logged
    assert (tmp_path / "out-cpu").is_dir()
