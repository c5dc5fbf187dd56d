"""A run's preparation (stapo.core.train.prepare) gives a run built from Python the protections of `stapo train`.

* A run built with ``Run.build`` into a dir another run holds is refused before anything loads, naming the holder.
* A new run into a dir that holds one is refused; a Python resume that changes how the run trains is refused
  without ``allow_changes`` and, with it, recorded in ``config_changes.jsonl`` (as ``--resume --allow-changes``).
* Following the config from ``stapo train`` (a real tiny run, and ``--plan``), the command calls into the
  library a fixed few times and the library never calls back up into ``stapo.cli``: traced with
  ``sys.setprofile``, every call from a ``stapo.cli`` frame into a ``stapo.core`` function is listed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from stapo.configs import preset_path
from stapo.core.config import load_config, save_config
from stapo.core.train.loop import train
from stapo.core.train.prepare import ResumeError, RunDirError, prepare
from stapo.core.train.run import Run
from stapo.core.train.rundir import CHANGES_NAME, lock_run_dir, read_config_changes

FAST = ["trainer.max_steps=1", "data.val_size=0", "logging.dump_tokens_every=0", "logging.tensorboard=false",
        "logging.live=false"]


def tiny(*overrides: str):
    return load_config(preset_path("tiny"), [*FAST, *overrides])


def _no_model_load(monkeypatch) -> None:
    import stapo.core.trainer.models as models

    def heavy(*_a, **_k):
        raise AssertionError("a model loaded before the refusal")

    monkeypatch.setattr(models, "load_policy", heavy)


def test_a_python_built_run_into_a_held_dir_is_refused(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    held = lock_run_dir(run_dir)  # another run holds it (its lock, as `stapo train` takes it)
    _no_model_load(monkeypatch)
    try:
        with pytest.raises(RunDirError, match=rf"^{run_dir} is in use by another run \(pid \d+ on "):
            Run.build(tiny(), run_dir, log=lambda m: None)
    finally:
        held.release()
    monkeypatch.undo()
    # the lock free, a run builds and holds it until it closes: a second Python run is refused meanwhile
    first = Run.build(tiny(), run_dir, log=lambda m: None)
    try:
        with pytest.raises(RunDirError, match="is in use by another run"):
            Run.build(tiny(), run_dir, log=lambda m: None)
    finally:
        first.close()
    Run.build(tiny(), run_dir, log=lambda m: None).close()  # released with the first run's close


def _run_with_checkpoint(tmp_path: Path, step: int = 2) -> Path:
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": step, "extra": {}}))
    save_config(tiny("trainer.max_steps=2"), run / "config.yaml")
    return run


def test_a_python_resume_is_checked_and_recorded_as_the_commands(tmp_path, monkeypatch):
    run = _run_with_checkpoint(tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    # a new run into a dir that holds one
    with pytest.raises(RunDirError, match=rf"^{run} already holds a run; pass --resume"):
        train(Run.build(tiny("trainer.max_steps=4"), run, log=lambda m: None))
    # a resume that changes the learning rate: refused before the checkpoint loads, naming the key
    with pytest.raises(ResumeError, match=rf"^--resume would change how {run} trains from step 3: trainer.lr "
                                          r"0.001 -> 0.5\. Add --allow-changes"):
        train(Run.build(tiny("trainer.max_steps=4", "trainer.lr=0.5"), run, log=lambda m: None), resume=True)
    # a change a checkpoint fixes: refused with allow_changes too
    _no_model_load(monkeypatch)
    with pytest.raises(ResumeError, match=r"^--resume cannot change .* trainer.backend \"torch\" -> \"deepspeed\""):
        prepare(tiny("trainer.max_steps=4", "trainer.backend=deepspeed"), run, resume=True, allow_changes=True,
                given={"backend": None})
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing written
    # with allow_changes: recorded from the next step, and said
    said: list[str] = []
    with prepare(tiny("trainer.max_steps=4", "trainer.lr=0.5"), run, resume=True, allow_changes=True,
                 log=said.append) as prepared:
        assert prepared.resume is True and [str(c) for c in prepared.changes] == ["trainer.lr 0.001 -> 0.5"]
        (row,) = read_config_changes(run)
        assert row["step"] == 3 and {c["key"]: (c["old"], c["new"]) for c in row["changes"]} == {
            "trainer.lr": (0.001, 0.5), "trainer.max_steps": (2, 4)}
        assert said[0].startswith(f"resuming with changes from step 3 (recorded in {run / CHANGES_NAME}): ")
        with pytest.raises(RunDirError, match="is in use by another run"):  # held while prepared
            prepare(tiny("trainer.max_steps=4", "trainer.lr=0.5"), run, resume=True, allow_changes=True)
    assert not (run / ".lock").exists()


# ----------------------------------------------------------------------------- the command's path


def _entries(call) -> tuple[list[str], list[str]]:
    """Run ``call()`` traced: the ``stapo.core`` functions called from ``stapo.cli`` frames, in order, and
    the ``stapo.cli`` functions called from ``stapo.core`` frames (module bodies, i.e. imports, left out)."""
    down: list[str] = []
    up: list[str] = []

    def module(frame) -> str:
        return frame.f_globals.get("__name__", "") if frame is not None else ""

    def profile(frame, event, _arg):
        if event != "call" or frame.f_code.co_name == "<module>":
            return
        callee, caller = module(frame), module(frame.f_back)
        if callee.startswith("stapo.core") and caller.startswith("stapo.cli"):
            down.append(frame.f_code.co_name)
        elif callee.startswith("stapo.cli") and caller.startswith("stapo.core"):
            up.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return down, up


def test_stapo_train_calls_the_library_three_times_and_is_never_called_back(tmp_path, stapo_main):
    run_dir = tmp_path / "run"
    result: list = []
    down, up = _entries(lambda: result.append(stapo_main("train", "--config", "tiny", "--run-dir", str(run_dir),
                                                         *[a for o in FAST for a in ("--set", o)])))
    code, out, err = result[0]
    assert code == 0, err
    assert "done: 1 steps" in out
    # options -> the config -> the preparation (a context manager) -> train(Run.build(...)); nothing else
    assert down == ["run_config", "prepare", "__enter__", "build", "train", "__exit__"], down
    assert up == []  # the library never returns into the command line's code
    down, up = _entries(lambda: result.append(stapo_main("train", "--config", "tiny", "--plan", "--card-gib", "80")))
    assert result[1][0] == 0, result[1][2]
    assert down == ["run_config", "memory_plan", "report"] and up == [], down
