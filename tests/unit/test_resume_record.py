"""A resume keeps the run's record: changes to how it trains are refused without --allow-changes;
allowed ones are recorded with the step they take effect, and config.yaml keeps the first config.

The refusal is checked on a run dir with a checkpoint folder but no weights (``meta.json`` only):
the check runs before the model loads, so nothing heavier is needed. The real resume (weights,
steps, the record after training) is in tests/e2e/test_rundir.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from stapo.configs import preset_path
from stapo.core.config import load_config, save_config
from stapo.core.train.rundir import (
    CHANGES_NAME,
    config_changes,
    describe_config_changes,
    read_config_changes,
    record_config_changes,
    resume_config_data,
)

TINY = preset_path("tiny")


def _run_with_checkpoint(tmp_path: Path, step: int = 2) -> Path:
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": step, "extra": {}}))
    save_config(load_config(TINY, ["trainer.max_steps=2"]), run / "config.yaml")
    return run


def _dump(cfg) -> dict:
    return cfg.model_dump(mode="json", by_alias=True)


def test_changes_are_listed_by_key_and_bookkeeping_is_told_apart() -> None:
    a = _dump(load_config(TINY))
    b = _dump(load_config(TINY, ["trainer.lr=0.5", "trainer.max_steps=9", "logging.live=false"]))
    changes = config_changes(a, b)
    assert [(c.key, c.bookkeeping) for c in changes] == [
        ("logging.live", True), ("trainer.lr", False), ("trainer.max_steps", True)]
    assert str(changes[1]) == "trainer.lr 0.001 -> 0.5"


def test_record_replays_in_order_and_a_second_resume_of_one_checkpoint_replaces_its_row(tmp_path: Path) -> None:
    run = _run_with_checkpoint(tmp_path)
    first = yaml.safe_load((run / "config.yaml").read_text())
    new = _dump(load_config(TINY, ["trainer.max_steps=4", "trainer.lr=0.5"]))
    assert [str(c) for c in record_config_changes(run, 2, new)] == ["trainer.lr 0.001 -> 0.5", "trainer.max_steps 2 -> 4"]
    assert resume_config_data(run, 2)["trainer"]["lr"] == 0.5  # the pending row (step 3) goes on
    # the same checkpoint resumed again with another lr: one row for step 3, against the first config
    again = _dump(load_config(TINY, ["trainer.max_steps=4", "trainer.lr=0.25"]))
    record_config_changes(run, 2, again)
    rows = read_config_changes(run)
    assert [r["step"] for r in rows] == [3]
    assert {c["key"]: (c["old"], c["new"]) for c in rows[0]["changes"]} == {
        "trainer.lr": (0.001, 0.25), "trainer.max_steps": (2, 4)}
    # a later checkpoint (step 4) resumed with a new sampling temperature: a second row, old = the lr run's
    later = _dump(load_config(TINY, ["trainer.max_steps=6", "trainer.lr=0.25", "rollout.temperature=0.5"]))
    record_config_changes(run, 4, later)
    assert describe_config_changes(run, bookkeeping=False) == [
        "from step 3: trainer.lr 0.001 -> 0.25", "from step 5: rollout.temperature 1.0 -> 0.5"]
    assert describe_config_changes(run, up_to=4) == ["from step 3: trainer.lr 0.001 -> 0.25, trainer.max_steps 2 -> 4"]
    assert yaml.safe_load((run / "config.yaml").read_text()) == first  # never rewritten here
    # the same config again: no change, and the rows up to the checkpoint stay
    record_config_changes(run, 4, resume_config_data(run, 3))
    assert [r["step"] for r in read_config_changes(run)] == [3]


def test_resume_that_changes_training_is_refused_in_one_line_naming_each_key(tmp_path: Path, stapo_main) -> None:
    run = _run_with_checkpoint(tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, out, err = stapo_main("train", "--run-dir", str(run), "--resume", "--set", "trainer.lr=0.5",
                                "--set", "algorithm.s2t.tau_p=0.5", "--set", "trainer.max_steps=4")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        f"error: --resume would change how {run} trains from step 3: algorithm.s2t.tau_p 0.1 -> 0.5; "
        "trainer.lr 0.001 -> 0.5. Add --allow-changes to go on with them (config.yaml keeps the run's first "
        "config; config_changes.jsonl records them), or drop them (trainer.max_steps, logging, checkpoint, "
        "eval.every... need no flag)"]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    # --config on a resume is checked against the run's config the same way
    code, _o, err = stapo_main("train", "--run-dir", str(run), "--resume", "--config", "demo")
    assert code == 2 and "model.name_or_path" in err and len(err.strip().splitlines()) == 1
    code, _o, err = stapo_main("train", "--run-dir", str(run), "--allow-changes", "--config", "tiny")
    assert code == 2 and err.strip() == "error: --allow-changes goes with --resume (it lets a resume change how the run trains)"
    assert not (run / CHANGES_NAME).exists()


def test_a_change_a_checkpoint_fixes_is_refused_even_with_allow_changes(tmp_path: Path, stapo_main) -> None:
    run = _run_with_checkpoint(tmp_path)
    code, out, err = stapo_main("train", "--run-dir", str(run), "--resume", "--allow-changes", "--set",
                                "model.name_or_path=gpt2", "--set", "trainer.backend=deepspeed", "--set", "trainer.lr=0.5")
    assert code == 2 and out == ""
    [line] = err.strip().splitlines()
    assert line.startswith(f'error: --resume cannot change {run} from step 3: model.name_or_path "tiny-random" -> '
                           '"gpt2" (the checkpoint holds the weights of the model the run started from;')
    assert "; trainer.backend \"torch\" -> \"deepspeed\" (a checkpoint loads into the backend that wrote it" in line
    assert "trainer.lr" not in line  # that one applies
    assert not (run / CHANGES_NAME).exists()


def test_a_resume_that_fails_before_its_first_step_leaves_the_record_as_it_was(tmp_path, stapo_main, monkeypatch):
    """A failed start: its changes never ran, the record is put back. An interrupted one (Ctrl-C)
    keeps its row, so the printed `--resume` goes on with the changes the user allowed."""
    from stapo.cli import train

    run = _run_with_checkpoint(tmp_path)
    args = ("train", "--run-dir", str(run), "--resume", "--set", "trainer.lr=0.5", "--set", "trainer.max_steps=4",
            "--allow-changes")

    def fails(*_a, **_k):
        raise RuntimeError("a bug at start-up")

    monkeypatch.setattr(train, "run_training", fails)
    code, out, _err = stapo_main(*args)
    assert code == 1 and "resuming with changes from step 3" in out
    assert not (run / CHANGES_NAME).exists()

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run_training", interrupted)
    code, _out, err = stapo_main(*args)
    assert code == 130 and f"resume with: stapo train --run-dir {run} --resume" in err
    assert describe_config_changes(run) == ["from step 3: trainer.lr 0.001 -> 0.5, trainer.max_steps 2 -> 4"]
    assert resume_config_data(run, 2)["trainer"]["lr"] == 0.5  # the printed command goes on at lr 0.5
