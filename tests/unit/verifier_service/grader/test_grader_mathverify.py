"""One test per math-verify behaviour the grader relies on (``verifier_service/grader/mathverify.py``, the seam).

Upgrading math-verify: run this file first; a failure names the behaviour that moved.
"""

from __future__ import annotations

import sympy

from stapo.verifier_service.grader import mathverify

MV = mathverify.load()


def test_search_reports_the_first_candidate_text():
    # fallback_mode="first_match" appends the text of the first candidate tried (parsing.search_fallback)
    found = MV["parse"](
        "so we get $x^{2}+1$ at the end", extraction_config=MV["search_cfg"], fallback_mode="first_match",
        parsing_timeout=None,
    )
    assert any(isinstance(f, str) and "x^{2}+1" in f for f in found), found


def test_search_looks_up_parser_globals_at_call_time():
    # the oracles replace module globals of math_verify.parser; the search must call them by name
    from math_verify import parser

    for name in ("parse_latex_cached", "extract_latex", "parse_expr_cached"):
        assert getattr(getattr(parser, name), "stapo_oracle", False), name
    assert hasattr(parser, "extract_target_from_pred")


def test_latex_regex_group_names():
    # _match_oracle counts LaTeX groups by these names
    from math_verify.parser import lazy_latex_regex

    regexes = lazy_latex_regex(MV["search_cfg"][0])
    names = {n for rx, _prio in regexes for n in rx.groupindex}
    assert any(n.startswith("first_latex") for n in names), names


def test_oracle_gives_the_same_string_as_the_real_search():
    bodies = ["the answer is $\\frac{1}{2}$ or so", "we have 3 apples and 7 pears", "$a$ and $b$"]
    fast = [mathverify.search(b, oracle=True, surely_parses=lambda s: False) for b in bodies]
    slow = [mathverify.search(b, oracle=False, surely_parses=lambda s: False) for b in bodies]
    assert [[x for x in f if isinstance(x, str)] for f in fast] == [[x for x in s if isinstance(x, str)] for s in slow]


def test_oracle_is_off_outside_the_search():
    assert MV["parse"]("$2\\sqrt{3}$")[0] == 2 * sympy.sqrt(3)


def test_verify_rounds_numbers_absolutely():
    # why rules/symbolic.py's exact_constants_equal exists: 6-decimal absolute rounding calls tiny values equal
    g, p = MV["parse_latex"]("\\frac{1}{3^{60}}"), MV["parse_latex"]("\\frac{1}{3^{59}}")
    assert MV["verify"]([g], [p], timeout_seconds=None)
    assert not MV["verify"]([MV["parse_latex"]("2")], [MV["parse_latex"]("3")], timeout_seconds=None)


def test_verify_accepts_set_relation_flag_and_intervals():
    g = MV["parse_latex"]("(1,2)")
    assert MV["verify"]([g], [MV["parse_latex"]("(1,2)")], timeout_seconds=None, allow_set_relation_comp=True)


def test_normalize_strips_units_unless_told_not_to():
    assert MV["normalize_latex"]("5\\text{ cm}", MV["norm"]).strip() == "5"
    assert "m" in MV["normalize_latex"]("\\frac{1}{m} t", MV["norm_keep_units"])


def test_complex_mode_detector():
    # a lone i (or \\mathbb{C}) switches math-verify to complex mode: the grader's rules leave those alone
    assert MV["complex_mode"]("2 + i") and MV["complex_mode"]("\\mathbb{C}")
    assert not MV["complex_mode"]("3 + 2x")


def test_parse_latex_reads_the_whole_string():
    expr = MV["parse_latex"]("x^2 + 1")
    x = next(iter(expr.free_symbols))
    assert str(x) == "x" and sympy.expand(expr - x**2 - 1) == 0
