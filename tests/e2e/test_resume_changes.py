"""A resumed run does what its changed config says, from the step the record names.

One tiny run checkpoints at step 2; two copies of it resume to step 3, one with the first config and
one with a changed method and batch (S2T's tau_p, the group size, the response length). Steps 1-2 are the checkpoint's in both; step 3 must show each change in the run's own
metrics: no candidate below a tau_p of 1e-9, half the sequences with n 4, responses longer than the
preset's one token. The optimizer's settings (learning rate, schedule, betas, weight decay) are measured on the
backend in tests/unit/test_resume_applies.py and through the CLI in tests/e2e/test_rundir.py.
"""

from __future__ import annotations

import shutil

import pytest

from stapo.configs import preset_path
from stapo.core.config import load_config
from stapo.core.tracking import read_jsonl
from stapo.core.train.loop import train
from stapo.core.train.run import Run

pytestmark = pytest.mark.long  # three tiny runs

# the tiny preset: one-token answers right about 1 time in 15, so nearly every step has mixed rewards
BASE = ["data.val_size=0", "checkpoint.every=2", "checkpoint.export_hf=false", "logging.dump_tokens_every=0",
        "logging.live=false", "logging.tensorboard=false"]
CHANGED = ["algorithm.s2t.tau_p=1.0e-9", "rollout.n=4", "rollout.max_new_tokens=3"]


def tiny(*overrides: str):
    return load_config(preset_path("tiny"), [*BASE, *overrides])


def _resume(run_dir, *extra: str) -> list[dict]:
    train(Run.build(tiny("trainer.max_steps=3", *extra), run_dir, log=lambda m: None), resume=True,
          allow_changes=bool(extra))  # (--allow-changes: without it a resume with changes is refused)
    return read_jsonl(run_dir / "metrics.jsonl")


def test_a_resume_with_changes_runs_them_from_the_next_step(tmp_path):
    first = tmp_path / "first"
    train(Run.build(tiny("trainer.max_steps=2"), first, log=lambda m: None))
    shutil.copytree(first, tmp_path / "changed")
    same = _resume(first)
    changed = _resume(tmp_path / "changed", *CHANGED)
    assert [r["step"] for r in same] == [r["step"] for r in changed] == [1, 2, 3]
    assert same[:2] == changed[:2]  # the checkpoint's steps, untouched
    s3, c3 = same[2], changed[2]
    assert s3["stapo/candidates"] > 0 and c3["stapo/candidates"] == 0  # tau_p
    assert c3["batch/sequences"] == s3["batch/sequences"] / 2  # n 8 -> 4
    assert s3["response_length/max"] == 1 and c3["response_length/max"] > 1  # max_new_tokens 1 -> 3
