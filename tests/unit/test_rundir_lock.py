"""The run-dir lock in one process, and what an early interrupt says (only files that exist).

Races between real processes, a SIGKILLed holder, SIGTERM and multi-rank naming are in
tests/e2e/test_rundir.py and tests/e2e/test_multirank_rundir.py.
"""

from __future__ import annotations

import json
import os

import pytest

from stapo.core.train.rundir import LOCK_NAME, RunDirBusy, check_not_busy, lock_run_dir


def test_lock_names_its_holder_refuses_a_second_and_is_removed_on_release(tmp_path):
    run = tmp_path / "a" / "run"
    lock = lock_run_dir(run)  # makes the folder
    holder = json.loads((run / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] and holder["started"] > 0
    assert lock.previous is None
    with pytest.raises(RunDirBusy, match=rf"^{run} is in use by another run \(pid {os.getpid()} on "):
        lock_run_dir(run)  # another open file of the same process: refused like another process
    with pytest.raises(RunDirBusy):
        check_not_busy(run)
    lock.release()
    assert not (run / LOCK_NAME).exists()
    check_not_busy(run)  # free: nothing raised, nothing written
    assert list(run.iterdir()) == []
    again = lock_run_dir(run)
    assert again.previous is None  # a released lock is not a dead holder
    again.release()


def test_a_lock_file_nobody_holds_is_a_dead_holder(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "node-7", "pid": 4242, "started": 0}))
    lock = lock_run_dir(tmp_path)
    assert lock.previous is not None and lock.previous.startswith("pid 4242 on node-7, started ")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def _interrupt_on(monkeypatch, prefix: str) -> None:
    """Ctrl-C in the real loop right after it logs a line starting with ``prefix``."""
    from stapo.cli import train

    real = train.run_training

    def run_training(prepared, *, log):
        def log_then_interrupt(msg: str) -> None:
            log(msg)
            if msg.startswith(prefix):
                raise KeyboardInterrupt

        return real(prepared, log=log_then_interrupt)

    monkeypatch.setattr(train, "run_training", run_training)


TINY = ["train", "--config", "tiny", "--set", "logging.dump_tokens_every=0", "--set", "logging.live=false"]


def test_interrupt_while_loading_leaves_nothing(monkeypatch, capsys, tmp_path, stapo_main):
    run = tmp_path / "run"
    _interrupt_on(monkeypatch, "policy ")  # the model is loaded, nothing written yet
    code, _o, err = stapo_main(*TINY, "--run-dir", str(run))
    assert code == 130
    assert err.strip().splitlines()[-2:] == [
        "interrupted before the first step finished; 0 step(s) done",
        f"nothing was kept in {run}; run the same command to start again",
    ]
    assert not run.exists()


def test_interrupt_before_step_one_keeps_only_the_config(monkeypatch, capsys, tmp_path, stapo_main):
    run = tmp_path / "run"
    _interrupt_on(monkeypatch, "validation before training")  # val.jsonl and an event file were written
    code, _o, err = stapo_main(*TINY, "--run-dir", str(run))
    assert code == 130
    assert err.strip().splitlines()[-3:] == [
        "interrupted before the first step finished; 0 step(s) done",
        "no checkpoint yet (checkpoint.every=0 writes one only at the end)",
        f"start it over with: stapo train --run-dir {run} --resume --fresh",
    ]
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]
    monkeypatch.undo()
    code, out, err = stapo_main("train", "--run-dir", str(run), "--resume", "--fresh",
                           "--set", "trainer.max_steps=1")
    assert code == 0, err
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
