"""A run dir belongs to one run: real `stapo train` processes racing, killed, stopped by SIGTERM.

* two trainings into one dir: the second (and a `--resume`) refuses in one line naming the holder,
  and the first run's files are exactly its own (steps 1..4, its config, one event file);
* a holder killed with SIGKILL leaves its lock file; the next run takes it over and says whose it was;
* a start-up failure (a prompt file without the problem field, found when the data loads, after the
  model) leaves no run dir;
* `--resume` of a finished run changes nothing; `--resume --fresh` on a missing dir starts a run;
* SIGTERM mid-run: the step in flight finishes, a checkpoint of it is written, exit status 143 with the
  resume command; that command reproduces the uninterrupted run's later steps exactly;
* the exported model is readable like every other file of the run (0644 under umask 022);
* a resume that changes trainer.lr is refused without --allow-changes; with it the run goes on at the
  new lr (the metrics' actor/lr, not only the record), config.yaml keeps the first config and config_changes.jsonl says from which step; a later
  plain resume that extends trainer.max_steps keeps the changed lr.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stapo.core.train.rundir import LOCK_NAME, RunDirBusy, lock_run_dir

pytestmark = pytest.mark.long  # real training processes, a few seconds each

STAPO = [sys.executable, "-m", "stapo.cli.main", "train"]
FAST = ["--set", "logging.tensorboard=false", "--set", "logging.dump_tokens_every=0", "--set", "data.val_size=0",
        "--set", "logging.live=false"]
TIMEOUT_S = 240


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*STAPO, *args], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd,
                          umask=0o022)


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*STAPO, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, umask=0o022)


def _wait_for(cond, what: str, proc: subprocess.Popen[str] | None = None) -> None:
    t0 = time.time()
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited ({proc.returncode}) before {what}: {proc.stderr.read()[-2000:]}")
        assert time.time() - t0 < TIMEOUT_S, f"timed out waiting for {what}"
        time.sleep(0.05)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _lock_holder(run: Path) -> dict:
    try:
        return json.loads((run / LOCK_NAME).read_text() or "{}")
    except (FileNotFoundError, ValueError):
        return {}


def test_second_run_into_a_busy_dir_refuses_and_the_first_stays_whole(tmp_path):
    run = tmp_path / "x"
    first = _start("--config", "tiny", "--run-dir", str(run), "--set", "trainer.max_steps=4")  # docs/architecture.md
    _wait_for(lambda: _lock_holder(run).get("pid") == first.pid, "the first run's lock", first)
    for extra in (["--config", "tiny", "--recipe", "grpo", "--run-dir", str(run), "--set", "trainer.max_steps=2"],
                  ["--run-dir", str(run), "--resume"]):
        second = _run(*extra)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {run} is in use by another run (pid {first.pid} on "), lines
        assert lines[0].endswith("wait for it to end or pick another --run-dir")
    _out, err = first.communicate(timeout=TIMEOUT_S)
    assert first.returncode == 0, err[-2000:]
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2, 3, 4]
    config = (run / "config.yaml").read_text()
    assert "max_steps: 4" in config and "token_weighting: s2t" in config
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert not (run / LOCK_NAME).exists()  # released

    # a finished run: --resume says so and touches nothing
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    again = _run("--run-dir", str(run), "--resume")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().splitlines()[-1] == (f"{run} has finished: its last checkpoint is step 4 of trainer.max_steps=4; "
                                    "nothing to do (to train further: --resume --set trainer.max_steps=N)")
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before

    # the exported model is readable like everything else in the run dir (umask 022 in the child)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [run / "config.yaml", *(run / "final").iterdir()]}
    assert set(modes.values()) == {0o644}, modes


def test_lock_of_a_killed_run_is_taken_over(tmp_path):
    run = tmp_path / "x"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from stapo.core.train.rundir import lock_run_dir; lock_run_dir(sys.argv[1]); "
        "print('held', flush=True); time.sleep(600)"), str(run)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunDirBusy, match=f"pid {holder.pid} on "):
        lock_run_dir(run)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert _lock_holder(run)["pid"] == holder.pid  # the dead holder's file is still there
    done = _run("--config", "tiny", "--run-dir", str(run), "--set", "trainer.max_steps=1", *FAST)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.startswith(f"note: {run}: taking over the lock of a run that is no longer running "
                                  f"(pid {holder.pid} on "), done.stderr[:500]
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1]


def test_start_up_failure_leaves_no_run_dir_and_fresh_starts_a_missing_one(tmp_path):
    run = tmp_path / "x"
    data = tmp_path / "prompts.jsonl"  # readable text, but no `problem` field: found when the data loads
    data.write_text('{"text": "what is 1+1"}\n')
    failed = _run("--config", "tiny", "--run-dir", str(run), *FAST, "--set", f"data.source={data}")
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert failed.stderr.strip().splitlines()[-1].startswith("error: data.problem_field: field 'problem' not found")
    assert not run.exists()

    started = _run("--run-dir", str(run), "--resume", "--fresh", "--config", "tiny", "--set", "trainer.max_steps=1",
                   *FAST)
    assert started.returncode == 0, started.stderr[-2000:]
    assert f"{run} has no checkpoint: starting over from step 0 (--fresh)" in started.stdout.splitlines()
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1]


DETERMINISTIC = ("reward/mean", "actor/loss", "actor/grad_norm", "entropy/mean", "stapo/silenced_count")


def test_sigterm_checkpoints_the_step_in_flight_and_resume_continues_exactly(tmp_path):
    whole = _run("--config", "tiny", "--run-dir", str(tmp_path / "whole"), "--set", "trainer.max_steps=5")
    assert whole.returncode == 0, whole.stderr[-2000:]

    run = tmp_path / "stopped"
    proc = _start("--config", "tiny", "--run-dir", str(run), "--set", "trainer.max_steps=5")
    _wait_for(lambda: len(_rows(run / "metrics.jsonl")) >= 1, "step 1", proc)
    proc.send_signal(signal.SIGTERM)  # during step 2 (or later): that step finishes, then the run stops
    _out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 143, err[-2000:]
    done = len(_rows(run / "metrics.jsonl"))
    assert 1 <= done < 5
    lines = err.strip().splitlines()[-3:]
    assert lines == [
        f"stopped by SIGTERM after step {done} of 5; {done} step(s) done (metrics: {run / 'metrics.jsonl'})",
        f"last checkpoint: {run / 'checkpoints' / f'step_{done:06d}'}",
        f"resume with: stapo train --run-dir {run} --resume",
    ], err[-2000:]
    assert "Traceback" not in err

    resumed = _run(*lines[-1].split(": ", 1)[1].split()[2:])  # the printed command
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    ours, theirs = _rows(run / "metrics.jsonl"), _rows(tmp_path / "whole" / "metrics.jsonl")
    assert [r["step"] for r in ours] == [1, 2, 3, 4, 5]
    for a, b in zip(ours, theirs, strict=True):
        assert {k: a.get(k) for k in DETERMINISTIC} == {k: b.get(k) for k in DETERMINISTIC}, a["step"]


def test_sigterm_without_on_signal_stops_at_once(tmp_path):
    run = tmp_path / "x"
    proc = _start("--config", "tiny", "--run-dir", str(run), "--set", "trainer.max_steps=50", *FAST,
                  "--set", "checkpoint.on_signal=false")
    _wait_for(lambda: len(_rows(run / "metrics.jsonl")) >= 1, "step 1", proc)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 143, err[-2000:]
    assert "stopped by SIGTERM during step " in err and "no checkpoint yet" in err
    assert not (run / "checkpoints").exists() and "Traceback" not in err


def test_resume_with_a_changed_lr_is_refused_then_recorded(tmp_path):
    run = tmp_path / "r"
    first = _run("--config", "tiny", "--run-dir", str(run), "--set", "trainer.max_steps=2", *FAST)
    assert first.returncode == 0, first.stderr[-2000:]
    config = (run / "config.yaml").read_text()
    refused = _run("--run-dir", str(run), "--resume", "--set", "trainer.lr=0.5", "--set", "trainer.max_steps=3")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "trainer.lr 0.001 -> 0.5. Add --allow-changes" in refused.stderr
    allowed = _run("--run-dir", str(run), "--resume", "--set", "trainer.lr=0.5", "--set", "trainer.max_steps=3",
                   "--allow-changes")
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "resuming with changes from step 3" in allowed.stdout
    longer = _run("--run-dir", str(run), "--resume", "--set", "trainer.max_steps=4")  # bookkeeping: no flag
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2, 3, 4]
    # what the run did, not only its record: the optimizer ran at the new rate from step 3 on
    assert [r["actor/lr"] for r in _rows(run / "metrics.jsonl")] == [0.001, 0.001, 0.5, 0.5]
    assert (run / "config.yaml").read_text() == config  # the first config
    rows = _rows(run / "config_changes.jsonl")
    assert [(r["step"], [(c["key"], c["old"], c["new"]) for c in r["changes"]]) for r in rows] == [
        (3, [("trainer.lr", 0.001, 0.5), ("trainer.max_steps", 2, 3)]), (4, [("trainer.max_steps", 3, 4)])]
    assert "lr: 0.5" in (run / "checkpoints" / "step_000004" / "config.yaml").read_text()  # what step 4 ran
