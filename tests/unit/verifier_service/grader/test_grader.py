"""Unit tests of the grader's rules: extraction, statuses, modes, caches, the DAPO normalizer.

Run: ``pytest tests/unit/verifier_service/grader/test_grader.py``. The big (gold, prediction) table is in test_grader_cases.py.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from stapo.verifier_service import grader
from stapo.verifier_service.grader import Verdict, answers_equivalent, cache_info, grade
from stapo.verifier_service.grader.dapo import dapo_extract, dapo_normalize
from stapo.verifier_service.grader.extraction import extract_answer, find_boxes
from stapo.verifier_service.grader.normalize import canonical, latexify, numbers_equal, parse_number
from stapo.verifier_service.grader.rules import table


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{1} then \\boxed{2}", "2"),  # the last of several
        ("\\boxed{2} and then \\boxed{}", "2"),  # an empty box is skipped
        ("\\boxed 5", "5"),  # \boxed without braces
        ("\\fbox{7}", "7"),
        ("$\\boxed{2}$, $\\boxed{3}$", "2, 3"),  # adjacent boxes form one answer
        ("steps\nAnswer: 12", "12"),  # DAPO template
        ("steps\n**Final Answer:** $12$", "12"),
        ("calc <<2*3=6>>\n#### 1,200", "1,200"),  # GSM8K
        ("long reasoning\nThus the answer is 3.5.", "3.5"),  # a closing sentence
        ("Final Answer: The final answer is $4$. I hope it is correct.", "4"),  # Minerva style
        ("42", "42"),  # a bare short prediction is the answer
        ("$\\frac12$", "$\\frac12$"),
        ("x" * 81, None),  # too long to be bare, no marker
        ("line one\nline two", None),  # several lines, no marker
        ("", None),
    ],
)
def test_extraction_rules(text, expected):
    assert extract_answer(text) == expected


def test_boxes_are_brace_matched():
    assert [b[2] for b in find_boxes("\\boxed{a{b}c} \\boxed{\\{1\\}} \\boxed{open")] == ["a{b}c", "\\{1\\}"]


@pytest.mark.parametrize(
    "text,think,expected",
    [
        ("<think>\\boxed{1}</think> \\boxed{2}", "optional", "2"),
        ("\\boxed{2}", "optional", "2"),
        ("\\boxed{2}", "required", None),
        ("<think>\\boxed{1}</think> \\boxed{2}", "required", "2"),
        ("<think>x</think>", "required", None),
        ("\\boxed{1} </think> no answer after", "ignore", "1"),
    ],
)
def test_think_rule(text, think, expected):
    assert extract_answer(text, think=think) == expected


def test_status_ok_and_result_shape():
    res = grade("The answer is \\boxed{\\dfrac{1}{2}}", "0.5")
    assert isinstance(res, Verdict)
    assert (res.correct, res.score, res.status, res.extracted) == (True, 1.0, "ok", "\\dfrac{1}{2}")
    assert set(res.to_dict()) == {"correct", "score", "status", "extracted", "ms", "rule"} and res.ms >= 0
    assert res.rule == "exact-number"
    wrong = grade("\\boxed{3}", "2")
    assert (wrong.correct, wrong.score, wrong.status) == (False, 0.0, "ok")


def test_status_no_answer():
    res = grade("I could not solve it.\nSorry, there is no way to decide here at all.", "2")
    assert (res.correct, res.status, res.extracted) == (False, "no_answer", None)
    assert grade("\\boxed{2}", "2", think="required").status == "no_answer"
    assert grade("no marker here", "2", mode="dapo").status == "no_answer"


def test_status_too_large_checked_before_parsing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("parsed an oversized input")

    monkeypatch.setattr(grader, "extract_answer", boom)
    assert grade("1" * (grader.MAX_CHARS + 1), "1").status == "too_large"
    assert grade("1", "1" * 101, max_chars=100).status == "too_large"


def test_status_error_never_raises(monkeypatch):
    assert grade("\\boxed{2}", "   ").status == "error"  # empty gold
    assert grade(None, "2").status == "error"  # type: ignore[arg-type]

    def boom(*a, **k):
        raise RuntimeError("sympy blew up")

    monkeypatch.setattr(grader, "equiv_rule", boom)  # the comparison's entry point
    res = grade("\\boxed{2}", "2")
    assert (res.correct, res.status) == (False, "error")


def test_unknown_mode_and_think_raise_with_valid_names():
    with pytest.raises(ValueError, match="dapo, math"):
        grade("1", "1", mode="nope")
    with pytest.raises(ValueError, match="optional"):
        grade("1", "1", think="sometimes")


def test_dapo_mode_is_string_exact():
    assert grade("work\nAnswer: $1{,}000$", "1000", mode="dapo").correct
    assert grade("work\nAnswer: \\frac{1}{2}", "\\frac{1}{2}", mode="dapo").correct
    # no sympy in DAPO: 0.5 is not \frac{1}{2} there, while the math mode accepts it
    assert not grade("work\nAnswer: 0.5", "\\frac{1}{2}", mode="dapo").correct
    assert grade("work\nAnswer: 0.5", "\\frac{1}{2}", mode="math").correct


@pytest.mark.parametrize(
    "raw,normalized",
    [
        ("x = 5", "5"),
        ("$\\boxed{12}$", "12"),
        ("10 \\text{ cm}", "10"),
        ("1,000", "1000"),
        ("\\fracab", "\\frac{a}{b}"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("90^\\circ", "90"),
        ("\\text{Evelyn}", "Evelyn"),
    ],
)
def test_dapo_normalize(raw, normalized):
    assert dapo_normalize(raw) == normalized


def test_dapo_extract_uses_last_answer_line_in_tail():
    assert dapo_extract("Answer: 1\nmore\nAnswer: 2") == "2"
    assert dapo_extract("Answer: 1" + "x" * 400) is None


@pytest.mark.parametrize(
    "s,value,decimal,percent",
    [
        ("1,450,000", 1450000, False, False),
        ("025", 25, False, False),
        ("4.5e33", 45 * 10**32, True, False),
        ("4.5 \\times 10^{33}", 45 * 10**32, True, False),
        ("\\frac{3}{4}", 0.75, False, False),
        ("-\\dfrac34", -0.75, False, False),
        ("50\\%", 50, False, True),
        ("$1{,}000$", 1000, False, False),
        ("0.\\overline{3}", Fraction(1, 3), False, False),  # repeating decimals are exact
        ("1.\\overline{27}", Fraction(14, 11), False, False),
        ("-0.1\\overline{6}", Fraction(-1, 6), False, False),
    ],
)
def test_parse_number(s, value, decimal, percent):
    n = parse_number(s)
    assert n is not None and n.value == value and n.decimal is decimal and n.percent is percent


@pytest.mark.parametrize("s", ["2, 3", "x+1", "(1,2)", "\\sqrt{2}", "1,22"])
def test_parse_number_rejects_non_numbers(s):
    assert parse_number(s) is None


def test_canonical_forms():
    assert canonical("\\left( 3, \\dfrac{\\pi}{2} \\right)") == "(3,\\frac{\\pi}{2})"
    assert canonical("$12 \\text{ and } 13$") == "12,13"
    assert canonical("\\sin x") == "\\sin x"


def test_answers_equivalent_for_clustering():
    assert answers_equivalent("\\frac{1}{2}", "0.5")
    assert answers_equivalent("3, 2", "2, 3")
    assert not answers_equivalent("x+y-z+2=0", "5x-7y+11z+4=0")


def test_caches_count_hits_for_a_repeated_gold():
    grader.cache_clear()
    gold = "\\frac{\\sqrt{21}}{5}"
    for _ in range(8):
        grade("so \\boxed{\\sqrt{21}/5}", gold)
    info = cache_info()
    assert info["result"]["hits"] == 7 and info["result"]["misses"] >= 1
    assert info["sympy_parse"]["misses"] >= 1 and info["sympy_parse"]["maxsize"] > 0


@pytest.mark.parametrize(
    "raw,latex",
    [
        ("\u22125", "-5"),  # unicode minus
        ("\u00bd", "\\frac{1}{2}"),
        ("2\u221a2", "2\\sqrt{2}"),
        ("\u221a(x+1)", "\\sqrt{x+1}"),
        ("x**2 + 1", "x^2 + 1"),
        ("(-\u221e, 2]", "(-\\infty , 2]"),
        ("x \u2264 2", "x \\le  2"),
        ("3\u00d710^5", "3\\times 10^5"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),  # ASCII LaTeX passes through unchanged
    ],
)
def test_latexify_plain_text_and_unicode(raw, latex):
    assert latexify(raw) == latex


def test_percent_on_prediction_only():
    # "12%" answers a bare gold 12 or 0.12; "0.12%" is not the fraction 0.12
    assert numbers_equal(parse_number("12"), parse_number("12\\%"))
    assert numbers_equal(parse_number("0.12"), parse_number("12\\%"))
    assert not numbers_equal(parse_number("0.12"), parse_number("0.12\\%"))


@pytest.mark.parametrize(
    "gold,pred,expected",
    [
        ("4210_{5}", "4210_5", True),
        ("4210_{5}", "4210_{6}", False),  # the base is part of the answer
        ("52_8", "52", True),  # the question named the base; bare digits are the numeral
        ("52_8", "42", False),
        ("36", "40_9", True),  # same value
        ("36", "40_8", False),
    ],
)
def test_base_subscript_numerals(gold, pred, expected):
    assert answers_equivalent(gold, pred) is expected


def test_unit_stripping_keeps_variables_of_symbolic_answers():
    # math-verify's unit removal reads a trailing "t" as tonnes; "\\frac{1}{m} t" is t/m
    assert answers_equivalent("\\frac{1}{m} t", "\\frac{t}{m}")
    assert not answers_equivalent("\\frac{1}{m} t", "\\frac{1}{m}")
    assert answers_equivalent("4.4 \\times 10^{7}", "4.4 \\times 10^{7} m")


def test_cheap_budget_runs_the_table_up_to_its_first_costly_rule(monkeypatch):
    """What is cheap is each rule's own declaration, read in table order: a costly rule inserted
    ahead of the cheap ones stops the cheap budget there (it could decide first in the full table)."""
    answer = grader.Answer("12")
    assert grader.compare("12", answer, budget="cheap").rule == "same-string"
    seen = []

    def costly(gold, pred, g, p):
        seen.append(pred)
        return None

    monkeypatch.setattr(table, "RULES", (table.Rule("costly-first", costly, cheap=False), *table.RULES))
    grader.cache_clear()
    assert grader.compare("12", answer, budget="cheap") is None and seen == []
    assert grader.compare("12", answer).rule == "same-string" and seen == ["12"]
    grader.cache_clear()
