"""Small things a newcomer trips on: a split that leaves almost nothing to train on, a recipe's
source cut mid-sentence, every rank repeating the same warnings, progress bars in a log file."""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

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
