"""One run dir for all ranks, under the deepspeed launcher on 2 CPU ranks (gloo), without `--run-dir`.

* ``deepspeed --num_gpus 2 --no_local_rank --module stapo.cli.main train ...``: one run dir, both
  ranks' checkpoint shards in it; a resume from the step-1 checkpoint (step 2's removed, as after a
  crash) with the same launcher reproduces step 2 exactly;
* the job's log carries each Python warning once (rank 0's) and no progress bars;
* one launcher per "node" (``--hostfile --no_ssh --node_rank=R``, both on this machine): the two
  launchers run in different time zones, so each names a different default run dir from its own
  clock; rank 0's name is the one both use;
* the same launch with each "node" in its own working directory (a run dir the nodes do not share)
  fails at start, naming the rank that cannot see it, and leaves no run dir.

Each launch starts 2 ranks (~1-3 minutes on a busy 2-core machine). Skipped without deepspeed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.long

TIMEOUT_S = 420
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
TRAIN = ["--module", "stapo.cli.main", "train", "--config", "tiny",
         "--set", "trainer.backend=deepspeed", "--set", "trainer.device=auto", "--set", "trainer.max_steps=2",
         "--set", "rollout.prompts_per_step=2", "--set", "rollout.n=4", "--set", "data.val_size=0",
         "--set", "checkpoint.every=1", "--set", "checkpoint.keep_last=3", "--set", "logging.tensorboard=false",
         "--set", "logging.dump_tokens_every=0", "--set", "logging.live=false"]
DETERMINISTIC = ("reward/mean", "actor/loss", "actor/grad_norm", "entropy/mean", "batch/sequences")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, **extra}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_ranks_without_run_dir_write_one_run_dir_and_resume_exactly(tmp_path):
    launch = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(_port()), "--no_local_rank"]
    first = subprocess.run([*launch, *TRAIN], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2]
    ckpt = run / "checkpoints" / "step_000001"
    assert {p.name for p in ckpt.glob("rng_*.pt")} == {"rng_0.pt", "rng_1.pt"}  # both ranks wrote here
    assert first.stdout.count("run dir: ") == 1
    log = first.stdout + first.stderr
    repeated = [ln for ln in log.splitlines() if "Warning:" in ln]
    assert len(repeated) == len(set(repeated)), repeated  # each warning once per job, not once per rank
    assert "\r" not in log and "it/s]" not in log  # no progress bars in a log

    original = _rows(run / "metrics.jsonl")
    shutil.rmtree(run / "checkpoints" / "step_000002")  # as if the run died during step 2's checkpoint
    (run / "summary.json").unlink()
    launch[4] = str(_port())
    again = subprocess.run([*launch, *TRAIN, "--run-dir", str(run.relative_to(tmp_path)), "--resume"], cwd=tmp_path,
                           env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "(step 1)" in again.stdout
    resumed = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2]
    assert {k: resumed[1].get(k) for k in DETERMINISTIC} == {k: original[1].get(k) for k in DETERMINISTIC}

    launch[4] = str(_port())  # the run has finished: every rank stops, rank 0 alone says so
    done = subprocess.run([*launch, *TRAIN, "--run-dir", str(run.relative_to(tmp_path)), "--resume"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(" has finished: its last checkpoint is step 2 of trainer.max_steps=2") == 1, done.stdout


def _two_nodes(tmp_path: Path, cwds: list[Path]) -> list[subprocess.CompletedProcess[str]]:
    """One `deepspeed --no_ssh --node_rank=R` launcher per "node", node 0 on UTC and node 1 nine hours
    ahead, so that their clocks name different default run dirs."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = str(_port())
    procs = []
    for rank, (cwd, tz) in enumerate(zip(cwds, ("UTC", "Asia/Tokyo"), strict=True)):
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh", f"--node_rank={rank}", "--master_addr",
               "127.0.0.1", "--master_port", port, "--no_local_rank", *TRAIN]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=_env(TZ=tz), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out, "") for p, out in zip(procs, outs, strict=True)]


def test_one_launcher_per_node_uses_rank_0s_run_dir(tmp_path):
    done = _two_nodes(tmp_path, [tmp_path / "shared", tmp_path / "shared"])
    for d in done:
        assert d.returncode == 0, d.stdout[-3000:]
    (run,) = (tmp_path / "shared" / "runs").iterdir()
    assert f"run dir: runs/{run.name}" in done[0].stdout and "run dir: " not in done[1].stdout
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2]
    assert {p.name for p in (run / "checkpoints" / "step_000001").glob("rng_*.pt")} == {"rng_0.pt", "rng_1.pt"}


def test_nodes_that_do_not_share_the_run_dir_fail_at_start(tmp_path):
    done = _two_nodes(tmp_path, [tmp_path / "a", tmp_path / "b"])
    assert all(d.returncode != 0 for d in done)
    line = next(x for x in done[0].stdout.splitlines() if "cannot see the run dir" in x)
    assert line.startswith("error: ") and f"rank 1 on {socket.gethostname()} cannot see the run dir runs/stapo-" in line
    assert line.endswith("put --run-dir on a filesystem all nodes share (the same path on each)")
    assert not any((tmp_path / "a" / "runs").iterdir()) and not (tmp_path / "b" / "runs").exists()
    assert "Traceback" not in done[0].stdout
