"""CLI: the command list, --version, clear errors for bad configs before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from stapo.cli.main import app
from stapo.configs import preset_path

runner = CliRunner()


def test_help_lists_commands():
    out = runner.invoke(app, ["--help"])
    assert out.exit_code == 0
    for cmd in ["prepare", "train", "eval", "compare", "verifier", "inspect", "calibrate", "probe"]:
        assert cmd in out.output


def test_version():
    out = runner.invoke(app, ["--version"])
    assert out.exit_code == 0 and out.output.startswith("stapo ")


# ----------------------------------------------------------------------------- errors at the boundary
# Each case runs the real entry point in-process (`main()`, as the `stapo` script does): exit status,
# the first line of the message, and that nothing was written.


def _first(text: str) -> str:
    return text.strip().splitlines()[0]


def test_bad_config_fails_before_model_load(monkeypatch, capsys, tmp_path, stapo_main):
    code, _out, err = stapo_main("train", "--config", "tiny", "--set", "algorithm.tau_hh=1",
                            "--run-dir", str(tmp_path / "r"))
    assert code == 2
    assert "algorithm.tau_hh: unknown field" in err
    assert not (tmp_path / "r").exists()  # nothing was written, no model was loaded


def test_unknown_preset_lists_presets(monkeypatch, capsys, tmp_path, stapo_main):
    code, _out, err = stapo_main("train", "--config", "nope", "--run-dir", str(tmp_path / "r"))
    assert code == 2 and "presets:" in err and "tiny" in err


def test_resume_needs_run_dir(monkeypatch, capsys, stapo_main):
    code, _out, err = stapo_main("train", "--resume")
    assert code == 2 and "--resume needs --run-dir" in err


def _train_fails(stapo_main, tmp_path, *sets: str) -> str:
    run = tmp_path / "run"
    args = ["train", "--config", "tiny", "--run-dir", str(run)]
    for s in sets:
        args += ["--set", s]
    code, _out, err = stapo_main(*args)
    assert code == 2, err
    assert not run.exists()  # checked before the run dir was made
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2
    return _first(err)


def test_missing_model_path(monkeypatch, capsys, tmp_path, stapo_main):
    line = _train_fails(stapo_main, tmp_path, f"model.name_or_path={tmp_path / 'nope' / 'model'}")
    assert line.startswith("error: model.name_or_path:") and "does not exist" in line and "tiny-random" in line


def test_folder_that_is_not_a_model(monkeypatch, capsys, tmp_path, stapo_main):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("hi")
    line = _train_fails(stapo_main, tmp_path, f"model.name_or_path={folder}")
    assert line.startswith(f"error: model.name_or_path: {folder} is a folder but not a model (no config.json)")


def test_binary_data_file(monkeypatch, capsys, tmp_path, stapo_main):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"problem": "1+1", "answer": "2"}\n\x9b\xff\x00binary')
    line = _train_fails(stapo_main, tmp_path, f"data.source={data}")
    assert line == (f"error: data.source: {data} is not UTF-8 text (byte 0x9b at offset 34); give a "
                    ".jsonl/.json file of UTF-8 text, or a .parquet file")


def test_binary_data_file_in_prepare(monkeypatch, capsys, tmp_path, stapo_main):
    data = tmp_path / "data.json"
    data.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    out = tmp_path / "prepared"
    code, _o, err = stapo_main("prepare", "--source", str(data), "--out", str(out))
    assert code == 2 and _first(err).startswith(f"error: data.source: {data} is not UTF-8 text (byte 0x89")
    assert not out.exists()


def test_missing_data_file_says_not_found(monkeypatch, capsys, tmp_path, stapo_main):
    line = _train_fails(stapo_main, tmp_path, f"data.source={tmp_path / 'missing.jsonl'}")
    assert line.startswith(f"error: data.source: file not found: {tmp_path / 'missing.jsonl'}")
    # a bare name that is neither a file nor a known source is still "unknown source"
    line = _train_fails(stapo_main, tmp_path, "data.source=gsm9k")
    assert line.startswith("error: data.source: unknown source 'gsm9k'")


def test_empty_config_is_an_error(monkeypatch, capsys, tmp_path, stapo_main):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("\n# nothing here\n")
    code, _o, err = stapo_main("train", "--config", str(cfg), "--run-dir", str(tmp_path / "r"))
    assert code == 2 and _first(err).startswith(f"error: {cfg}: the config file is empty")
    assert not (tmp_path / "r").exists()


def test_unexpected_error_is_short_and_debug_shows_traceback(monkeypatch, capsys, tmp_path, stapo_main):
    from stapo.cli import train

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(train, "run_training", boom)
    args = ["train", "--config", "tiny", "--run-dir", str(tmp_path / "r")]
    code, _o, err = stapo_main(*args)
    assert code == 1 and _first(err) == "error: RuntimeError: boom"
    assert "--debug" in err.splitlines()[1] and "Traceback" not in err
    assert not (tmp_path / "r").exists()
    code, _o, err = stapo_main(*args, "--debug")
    assert code == 1 and "Traceback (most recent call last)" in err and "RuntimeError: boom" in err


# ----------------------------------------------------------------------------- resume and Ctrl-C


def test_resume_without_checkpoint_refuses(monkeypatch, capsys, tmp_path, stapo_main):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text((preset_path("tiny")).read_text())
    before = sorted(p.name for p in run.iterdir())
    code, _o, err = stapo_main("train", "--config", "tiny", "--run-dir", str(run), "--resume")
    assert code == 2
    assert _first(err).startswith(f"error: {run} has no checkpoint to resume from")
    assert "--fresh" in err
    assert sorted(p.name for p in run.iterdir()) == before


def _interrupt_at(monkeypatch, step: int) -> None:
    """Ctrl-C right after step ``step`` logged its metrics (before its periodic checkpoint):
    a KeyboardInterrupt from inside the real loop."""
    from stapo.cli import train

    real = train.run_training

    def run_training(prepared, *, log):
        def log_then_interrupt(msg: str) -> None:
            log(msg)
            if msg.startswith(f"step {step}/"):
                raise KeyboardInterrupt

        return real(prepared, log=log_then_interrupt)

    monkeypatch.setattr(train, "run_training", run_training)


FAST = ["--set", "logging.tensorboard=false", "--set", "logging.dump_tokens_every=0", "--set", "data.val_size=0"]


def _after(err: str, prefix: str) -> list[str]:
    """The lines of ``err`` from the first that starts with ``prefix`` (library noise before it)."""
    lines = err.strip().splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith(prefix)):]


def test_ctrl_c_names_checkpoint_and_resume_command(monkeypatch, capsys, tmp_path, stapo_main):
    """A real tiny run interrupted after step 2 (checkpoint of step 1); the printed command resumes it."""
    run = tmp_path / "run"
    _interrupt_at(monkeypatch, 2)
    code, _o, err = stapo_main("train", "--config", "tiny", "--run-dir", str(run), *FAST,
                          "--set", "trainer.max_steps=3", "--set", "checkpoint.every=1")
    assert code == 130
    lines = _after(err, "interrupted")
    assert lines[0] == f"interrupted during step 3 of 3; 2 step(s) done (metrics: {run / 'metrics.jsonl'})"
    assert lines[1] == f"last checkpoint: {run / 'checkpoints' / 'step_000001'}"
    assert lines[2] == f"resume with: stapo train --run-dir {run} --resume"
    assert "lost" not in err and "Traceback" not in err
    monkeypatch.undo()
    code, out, err = stapo_main(*lines[2].split(": ", 1)[1].split()[1:])  # the exact command
    assert code == 0, err
    assert "(step 1)" in out and "done: 3 steps" in out


def test_ctrl_c_without_checkpoint_then_fresh(monkeypatch, capsys, tmp_path, stapo_main):
    from stapo.cli import train
    from stapo.core.train.loop import TrainResult

    run = tmp_path / "run"
    calls = []

    def interrupted(prepared, **_kw):
        run_dir = prepared.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(preset_path("tiny").read_text())
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        raise KeyboardInterrupt

    def finishes(prepared, **_kw):
        calls.append(prepared.resume)
        return TrainResult(prepared.run_dir, prepared.cfg.trainer.max_steps, None, None, 0.0)

    monkeypatch.setattr(train, "run_training", interrupted)
    code, _o, err = stapo_main("train", "--config", "tiny", "--run-dir", str(run))
    assert code == 130
    assert err.strip().splitlines() == [
        f"interrupted during step 2 of 3; 1 step(s) done (metrics: {run / 'metrics.jsonl'})",
        "no checkpoint yet (checkpoint.every=0 writes one only at the end)",
        f"start it over with: stapo train --run-dir {run} --resume --fresh",
    ]
    monkeypatch.setattr(train, "run_training", finishes)
    code, _o, err = stapo_main("train", "--run-dir", str(run), "--resume")  # no --fresh: refused
    assert code == 2 and _first(err).startswith(f"error: {run} has no checkpoint to resume from")
    code, out, err = stapo_main("train", "--run-dir", str(run), "--resume", "--fresh")
    assert code == 0, err
    assert f"{run} has no checkpoint: starting over from step 0 (--fresh)" in out.splitlines()
    assert calls == [True]


# ----------------------------------------------------------------------------- recipes at tiny scale


def test_recipe_method_keys_apply_to_tiny():
    """Every shipped recipe's method keys load onto the tiny config; scale keys stay tiny's."""
    from stapo.configs import preset_names
    from stapo.core.config import load_config
    from stapo.core.train.prepare import method_overrides

    tiny = load_config(preset_path("tiny"))
    for name in preset_names():
        recipe = load_config(preset_path(name))
        cfg = load_config(preset_path("tiny"), method_overrides(preset_path(name), tiny.rollout.max_new_tokens))
        assert 0 < cfg.algorithm.overlong.buffer <= cfg.rollout.max_new_tokens, name  # a length: rescaled
        assert cfg.algorithm.name == recipe.algorithm.name, name
        assert cfg.algorithm.token_weighting == recipe.algorithm.token_weighting, name
        assert cfg.data.sampler == recipe.data.sampler, name
        # not the method: model, backend, batch, length, reward scale, schedule stay the tiny config's
        assert cfg.model == tiny.model and cfg.trainer.backend == tiny.trainer.backend == "torch", name
        assert (cfg.rollout.n, cfg.rollout.max_new_tokens) == (tiny.rollout.n, tiny.rollout.max_new_tokens), name
        assert cfg.algorithm.mini_batches == tiny.algorithm.mini_batches, name
        assert cfg.reward.scale == tiny.reward.scale and cfg.trainer.lr == tiny.trainer.lr, name
    grpo = load_config(preset_path("tiny"), method_overrides(preset_path("grpo")))
    assert (grpo.algorithm.eps_low, grpo.algorithm.eps_high, grpo.algorithm.aggregation) == (
        0.2, 0.2, "seq-mean-token-mean")


def test_train_recipe_flag_and_set_order(monkeypatch, capsys, tmp_path, stapo_main, stub_train):
    seen = stub_train
    code, _o, err = stapo_main("train", "--config", "tiny", "--recipe", "grpo",
                          "--set", "algorithm.eps_high=0.3", "--run-dir", str(tmp_path / "r"))
    assert code == 0, err
    assert "warning" not in err
    cfg = seen[0]
    assert (cfg.algorithm.name, cfg.algorithm.token_weighting, cfg.model.name_or_path) == ("grpo", "none", "tiny-random")
    assert cfg.algorithm.eps_high == 0.3  # --set wins over the recipe


def test_a_name_that_is_not_what_runs_is_refused(monkeypatch, capsys, tmp_path, stapo_main, stub_train):
    code, _o, err = stapo_main("train", "--config", "tiny", "--set", "algorithm.name=grpo",
                          "--run-dir", str(tmp_path / "r"))
    assert code == 2 and not stub_train
    assert err.strip().splitlines() == [
        "error: algorithm.name=grpo, but algorithm.token_weighting='s2t' (the grpo recipe: 'none'): the run would be "
        "reported as grpo. `--recipe grpo` runs the grpo recipe's method; this config's method is stapo's: "
        "--set algorithm.name=stapo names it so"]
    code, _o, err = stapo_main("train", "--config", "tiny", "--set", "algorithm.name=stapoo",
                          "--run-dir", str(tmp_path / "r"))
    assert code == 2 and err.startswith("error: --set algorithm.name=stapoo: no recipe is called stapoo")
    assert "`--recipe NAME`" in err and len(err.strip().splitlines()) == 1
    # the S2T mode is part of the method: a mode only one recipe has is not another recipe's name
    code, _o, err = stapo_main("train", "--config", "tiny", "--set", "algorithm.s2t.silence=random",
                          "--run-dir", str(tmp_path / "r"))
    assert code == 2 and "algorithm.s2t.silence='random' (the stapo recipe: 'lowest_entropy')" in err, err
    assert "stapo-random" in err  # the recipe whose method it is
    assert not stub_train
    code, _o, err = stapo_main("train", "--config", "tiny", "--run-dir", str(tmp_path / "r2"))
    assert code == 0 and "error" not in err  # tiny is labelled stapo and is STAPO's method
    # a layer under its recipe's name, and a method no recipe has under a new name, go on
    code, _o, err = stapo_main("train", "--config", "tiny", "--set", "algorithm.name=stapo-goldilocks",
                               "--set", "data.sampler=goldilocks", "--run-dir", str(tmp_path / "r3"))
    assert code == 0, err
    code, _o, err = stapo_main("train", "--config", "tiny", "--set", "algorithm.name=mine", "--set",
                               "algorithm.advantage=rloo", "--run-dir", str(tmp_path / "r4"))
    assert code == 0, err


def test_unknown_recipe(monkeypatch, capsys, tmp_path, stapo_main):
    code, _o, err = stapo_main("train", "--config", "tiny", "--recipe", "grp0",
                          "--run-dir", str(tmp_path / "r"))
    assert code == 2 and _first(err).startswith("error: recipe 'grp0' is neither a file nor a preset; did you mean "
                                                "grpo? presets:")
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- the tiny run itself

TOLERATED: tuple[str, ...] = ()
"""Warnings tolerated: none (transformers' `past_key_values` deprecation is gone: the KV cache goes
in through the `cache` keyword)."""


@pytest.fixture(scope="module")
def tiny_cli_run(tmp_path_factory):
    """`stapo train --config tiny` as a user runs it (a subprocess: every line it prints, warnings of
    libraries and of grader processes included), a few steps."""
    run = tmp_path_factory.mktemp("tiny") / "run"
    res = subprocess.run(
        [sys.executable, "-m", "stapo.cli.main", "train", "--config", "tiny", "--run-dir", str(run),
         "--set", "trainer.max_steps=5"],
        capture_output=True, text=True, timeout=600,
    )
    return res, run


def test_tiny_run_prints_no_warning(tiny_cli_run):
    res, _run = tiny_cli_run
    assert res.returncode == 0, res.stderr[-3000:]
    lines = (res.stdout + res.stderr).splitlines()
    warnings = [ln for ln in lines if "warn" in ln.lower() and not any(t in ln for t in TOLERATED)]
    assert warnings == []
    assert not [ln for ln in lines if "Traceback" in ln or "error" in ln.lower()]


def test_tiny_run_updates_in_most_steps(tiny_cli_run):
    """The tiny task gives mixed rewards, so most steps have non-zero advantages and a gradient."""
    from stapo.core.tracking import read_jsonl

    res, run = tiny_cli_run
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert len(rows) == 5
    moved = [r["actor/grad_norm"] > 0 for r in rows]
    assert sum(moved) >= 4, [r["actor/grad_norm"] for r in rows]  # measured: 5 of 5 (seeded)
    assert all(0 < r["reward/mean"] < 1 for r in rows if r["actor/grad_norm"] > 0)


def test_compare_without_baseline_numbers_says_no_deltas(monkeypatch, capsys, tmp_path, stapo_main):
    """A training run first and an eval dir second: there is nothing to take deltas against."""
    from test_compare import write_eval_dir, write_train_run  # (tests/unit is on sys.path)

    a = write_train_run(tmp_path, "a", steps=6, reward_slope=0.01, entropy0=1.0, val=[0.1, 0.2], algorithm="grpo")
    b = write_eval_dir(tmp_path, "b", {"math500": (4, 0.5, 0.7, 0.6)})
    code, out, err = stapo_main("compare", str(a), str(b), "--out", str(tmp_path / "cmp"))
    assert code == 0, err
    flat = " ".join(out.split())  # a table title wraps to the table's width
    assert "avg@k (%) — no deltas: the baseline a has no eval results" in flat and "deltas vs a" not in flat


def test_help_placeholders_and_examples():
    for cmd in (["train"], ["eval"], ["compare"], ["inspect"], ["prepare"], ["verifier"], ["calibrate"], ["probe"]):
        text = runner.invoke(app, [*cmd, "--help"], env={"COLUMNS": "200"}).output
        assert "Examples:" in text, cmd
        for odd in ("<bool>", "{runs}", "[[SOURCE]]", "<list[str]>"):
            assert odd not in text, (cmd, odd)
    assert "default 127.0.0.1" in runner.invoke(app, ["verifier", "serve", "--help"], env={"COLUMNS": "200"}).output
    listing = runner.invoke(app, ["recipes"], env={"COLUMNS": "200"}).output
    demo = next(line for line in listing.splitlines() if line.startswith("demo "))
    assert demo.rstrip().endswith("single-digit addition (`stapo train` runs it)")


def test_tiny_task_answers_fit_one_digit_token():
    """The tiny preset's task and vocabulary: every answer is one digit, and one token of the tiny
    digits vocabulary (so a one-token response can be right); letters read as <unk>."""
    from stapo.core.config import load_config
    from stapo.core.task.data import load_prompts
    from stapo.core.trainer.models import load_tokenizer

    cfg = load_config(preset_path("tiny"))
    tok = load_tokenizer(cfg.model)
    assert len(tok) == 15  # 5 special tokens + 10 digits
    train, val = load_prompts(cfg.data, tok)
    assert len(train) + len(val) == 55  # every a + b <= 9 with one-digit a, b
    for rec in train + val:
        assert 0 <= int(rec.answer) <= 9
        assert tok.decode(tok(rec.answer)["input_ids"]) == rec.answer
    assert tok.decode(tok("What is 3 + 4?")["input_ids"]) == "<unk>" * 8 + "3" + "<unk>" * 3 + "4<unk>"
