"""Regression table of the math grader: (gold, prediction, expected) rows kept as data.

The rows live in ``verifier_service/data/grader_cases.jsonl``; each names its ``source`` (the
math-verify test it came from, or the hand-written group). Rows whose upstream label we knowingly
disagree with carry an ``xfail`` reason and run as strict xfails, so a fix shows up as a failure
to update the table. Run: ``pytest tests/unit/verifier_service/grader/test_grader_cases.py``.
"""

from __future__ import annotations

import json
from importlib import resources

import pytest

from stapo.verifier_service.grader import grade


def _load() -> list[dict]:
    text = resources.files("stapo.verifier_service").joinpath("data/grader_cases.jsonl").read_text("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


CASES = _load()


def _param(i: int, row: dict):
    marks = [pytest.mark.xfail(reason=row["xfail"], strict=True)] if "xfail" in row else []
    return pytest.param(row, id=f"{i}-{row['source'].split('::')[-1].split(':')[-1][:30]}", marks=marks)


def test_table_is_well_formed():
    assert len(CASES) >= 300
    for row in CASES:
        assert set(row) <= {"gold", "prediction", "expected", "source", "xfail"}, row
        assert isinstance(row["expected"], bool) and row["source"]


@pytest.mark.parametrize("row", [_param(i, r) for i, r in enumerate(CASES)])
def test_grader_case(row):
    res = grade(row["prediction"], row["gold"])
    assert res.status in ("ok", "no_answer"), res
    assert res.correct is row["expected"], (row["gold"], res.extracted)
