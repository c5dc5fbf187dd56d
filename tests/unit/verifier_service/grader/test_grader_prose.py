"""Sentences left after math-verify's search are compared as text (``grader._SENTENCE_RE``).

A response cut off after ``</think>`` ("Let me double-check: $\\frac{255") or a bare one-line answer
in words has no math for the search to find; latex2sympy would read the words as products of
one-letter symbols (10-50 ms each) to call them unequal. The rule must change no verdict: every item
whose answer is such a sentence is graded with the rule off too and must agree, on the grading
tables, the dev corpus and the RL streams (the held-back corpus is left to
``benchmarks/grader_accuracy.py``).
"""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from stapo.verifier_service import grader
from stapo.verifier_service.clients.loadgen import build_stream, load_golds
from stapo.verifier_service.grader import grade


def _rows(name: str) -> list[tuple[str, str, str]]:
    text = resources.files("stapo.verifier_service").joinpath("data", name).read_text("utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [(r["prediction"], r["gold"], r.get("mode", "math")) for r in rows]


def _items(source: str) -> list[tuple[str, str, str]]:
    if source == "streams":
        return build_stream(3000, seed=21) + build_stream(
            3000, seed=22, style="answer_line", golds=load_golds(source="dapo17k")
        )
    return _rows(source)


@pytest.fixture
def prose_off(monkeypatch):
    """``grade`` with no answer taken for a sentence: every answer goes through the whole rule table."""

    def run(pred: str, gold: str, mode: str):
        with monkeypatch.context() as m:
            m.setattr(grader, "_SENTENCE_RE", re.compile(r"(?!)"))
            return grade(pred, gold, mode)

    return run


@pytest.mark.parametrize(
    "source", ["corpus_dev.jsonl", "grader_cases.jsonl", "grader_heldout.jsonl", "streams"]
)
def test_sentences_as_text_change_no_verdict(source, prose_off):
    checked = 0
    for pred, gold, mode in _items(source):
        on = grade(pred, gold, mode)
        if on.extracted is None or not grader._SENTENCE_RE.search(on.extracted):
            continue
        checked += 1
        off = prose_off(pred, gold, mode)
        assert (on.correct, on.status, on.extracted) == (off.correct, off.status, off.extracted), (
            pred[-100:],
            gold,
        )
    if source == "streams":
        assert checked >= 20  # the cut-off responses of the streams do reach the rule


@pytest.mark.parametrize(
    ("pred", "gold", "correct"),
    [
        ("<think>long work</think>\n\nLet me double-check: $\\frac{255", "85", False),  # cut off
        ("So the remaining quantity is $", "30", False),
        ("no real solutions", "\\text{no real solutions}", True),  # a text answer: equal as text
        ("the answer is no real solutions", "\\text{No real solutions}", True),
        (
            "$\\boxed{\\frac{1}{1+RCs+LCs^2}}$",
            "\\frac{1}{L C s^{2}+R C s+1}",
            True,
        ),  # variables, not a sentence
        ("$\\boxed{infinity}$", "\\infty", True),  # one word: still read by sympy
    ],
)
def test_sentences_by_hand(pred, gold, correct, prose_off):
    assert grade(pred, gold).correct is correct
    assert prose_off(pred, gold, "math").correct is correct  # and the same without the rule
