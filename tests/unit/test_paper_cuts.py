"""Small things a newcomer trips on: a split that leaves almost nothing to train on, a recipe's
source cut mid-sentence, every rank repeating the same warnings, progress bars in a log file, a
README that lists fewer recipes than configs/ holds or never says how `stapo` gets on the PATH, a
removed option's message in pydantic's words, a Ctrl-C in `stapo eval` that says nothing."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest

from stapo.cli.common import PER_RANK_NOISE, quiet_job_noise
from stapo.cli.prepare import split_warning
from stapo.cli.recipes import recipe_header
from stapo.configs import preset_names, preset_path


def test_prepare_says_when_validation_takes_most_of_a_small_file(tmp_path: Path, stapo_main) -> None:
    src = tmp_path / "small.jsonl"
    src.write_text("".join(json.dumps({"problem": f"{i} + 1 = ?", "answer": str(i + 1)}) + "\n" for i in range(42)))
    code, out, err = stapo_main("prepare", "--source", str(src), "--out", str(tmp_path / "p"))
    assert code == 0, err
    assert err.strip() == ("warning: data.val_size=40 held out 40 of 42 prompts for validation, leaving 2 to train "
                           "on; --set data.val_size=N (e.g. 4) keeps more for training")
    code, _out, err = stapo_main("prepare", "--source", str(src), "--set", "data.val_size=4", "--out",
                                 str(tmp_path / "q"))
    assert code == 0 and "warning" not in err
    assert split_warning({"files": {"train.jsonl": {"rows": 5}, "val.jsonl": {"rows": 5}}}, 5) is None


def test_every_recipe_source_is_read_whole() -> None:
    """A source wrapped over several comment lines is one sentence, its parentheses closed."""
    for name in preset_names():
        h = recipe_header(preset_path(name))
        assert h["source"].count("(") == h["source"].count(")"), (name, h["source"])
        assert h["recipe"].count("(") == h["recipe"].count(")"), (name, h["recipe"])
    async_ = recipe_header(preset_path("stapo-async"))["source"]
    assert "(ESS-scaled LR, minimum-variance off-policy baseline;" in async_
    assert async_.endswith("rollout.async and algorithm.off_policy only (docs/async.md).")
    assert not recipe_header(preset_path("stapo-deep"))["source"].endswith("isolates the layer.")  # the next note


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def test_ranks_other_than_0_keep_errors_only_and_logs_get_no_progress_bars() -> None:
    env: dict[str, str] = {"RANK": "1"}
    logger = logging.getLogger(PER_RANK_NOISE[0])  # DeepSpeed's
    keep = _Keep()
    logger.addHandler(keep)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with quiet_job_noise(env, terminal=False):
                warnings.warn("a FutureWarning every rank prints", FutureWarning, stacklevel=1)
                logger.warning("Setting accelerator to CPU.")
                logger.error("a real failure")
                assert env["HF_HUB_DISABLE_PROGRESS_BARS"] == env["TQDM_DISABLE"] == "1"
                assert env["TRANSFORMERS_VERBOSITY"] == "error"
            assert seen == []
            assert keep.records == ["a real failure"]
            assert env == {"RANK": "1"}  # put back
            warnings.warn("after the command", FutureWarning, stacklevel=1)
            assert len(seen) == 1
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with quiet_job_noise(env := {"RANK": "0"}, terminal=True):
                warnings.warn("rank 0 says it once", FutureWarning, stacklevel=1)
                logger.warning("rank 0 warns")
                assert env == {"RANK": "0"}  # a terminal keeps its bars
            assert len(seen) == 1 and keep.records[-1] == "rank 0 warns"
    finally:
        logger.removeHandler(keep)
    assert "TQDM_DISABLE" not in os.environ or os.environ.get("TQDM_DISABLE") == "1"


ROOT = Path(__file__).resolve().parents[2]


def test_recipes_wraps_a_long_source_at_80_columns_and_cuts_nothing(stapo_main, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _err = stapo_main("recipes")
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 80
    source = recipe_header(preset_path("justrl-fullmask"))["source"]
    assert source.endswith("The paper runs it on JustRL's setting; here it shares STAPO's, so it differs from stapo "
                           "in the mask alone [ours: a matched control].")
    block = out[out.index("\njustrl-fullmask "):]
    block = block[:block.index("\nlp-reg ")]
    assert " ".join(block.split()).endswith(f"source: {source}")  # every word, in order


def test_readme_lists_every_recipe_in_configs() -> None:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Configuration"):text.index("## Documentation")]
    listed = set(re.findall(r"`([a-z0-9-]+)`", section))
    shipped = {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert shipped - listed == set(), "README's Configuration section omits these presets"


def test_readme_says_how_stapo_gets_on_the_path_before_the_first_ten_minutes() -> None:
    """Its `make setup` and `. .venv/bin/activate` lines come before the block of `stapo` commands, and
    both work: the target exists (a dry run), and activating puts this checkout's .venv/bin/stapo first."""
    text = (ROOT / "README.md").read_text()
    first_ten = text.index("## Your first ten minutes")
    assert -1 < text.index("\nmake setup ") < first_ten and -1 < text.index("\n. .venv/bin/activate ") < first_ten
    assert subprocess.run(["make", "-n", "setup"], cwd=ROOT, capture_output=True, timeout=60).returncode == 0
    if not (ROOT / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv in this checkout (`make setup` makes it)")
    found = subprocess.run(["bash", "-c", ". .venv/bin/activate && command -v stapo"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
    assert found.stdout.strip() == str(ROOT / ".venv" / "bin" / "stapo")


def test_a_removed_option_in_yaml_reads_as_the_set_message_does(tmp_path: Path, stapo_main) -> None:
    cfg = tmp_path / "old.yaml"
    cfg.write_text("extends: tiny\nalgorithm:\n  s2t: {tau_h: 0.5}\n")
    code, _out, err = stapo_main("train", "--config", str(cfg))
    assert code == 2 and "Value error" not in err
    assert err.splitlines()[1] == ("  algorithm.s2t.tau_h is not an option: S2T's tau_h is the q-th quantile of the "
                                   "candidates' entropies per mini-batch: set algorithm.s2t.q")


def test_ctrl_c_in_eval_says_what_is_kept_and_the_command_that_resumes(tmp_path: Path, stapo_main,
                                                                         monkeypatch) -> None:
    """The interrupt lands inside the runner (stood in: it has written three graded samples of two
    problems, as the real runner writes each sample when it is graded)."""
    import stapo.evals.runner as runner

    out = tmp_path / "ev"

    def interrupted(*_a, **_k):
        out.mkdir()
        rows = [{"benchmark": "gsm8k", "problem_id": pid, "sample": i} for pid, i in (("1", 0), ("1", 1), ("2", 0))]
        (out / runner.SAMPLES_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "evaluate", interrupted)
    argv = ("eval", "--model", "tiny-random", "--benchmarks", "gsm8k", "--k", "2", "--out", str(out))
    code, _out, err = stapo_main(*argv)
    assert code == 130
    assert err.strip().splitlines() == [
        f"eval interrupted: 3 graded samples kept in {out / 'samples.jsonl'} (problems sampled: gsm8k 2); problems "
        "with all their samples are not sampled again.",
        f"resume with the same command: stapo eval --model tiny-random --benchmarks gsm8k --k 2 --out {out}"]



def test_readme_gpu_torch_line_reaches_pip() -> None:
    """README's GPU line (`make TORCH=... test`) installs that torch build: a dry run of the install step
    with every target remade (-B) shows pip given exactly the README's TORCH value. The install itself
    needs the GPU machine's index; docs/gpu.md says so."""
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("make TORCH="))
    torch_spec = re.match(r'make TORCH="([^"]+)" test', line).group(1)
    dry = subprocess.run(["make", "-n", "-B", f"TORCH={torch_spec}", "setup"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert f"pip install -q {torch_spec}\n" in dry.stdout
