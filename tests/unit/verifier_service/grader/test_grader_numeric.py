"""The grader's fast paths (``verifier_service/grader/numeric.py`` and the shortcuts in ``rules/rejections.py``).

They may only make grading faster, never change a verdict, so besides hand-computed values the
tests compare them with what they stand in for:

- the numeric parser against latex2sympy itself, value for value, on fixed and generated strings;
- every rejection against math-verify's ``verify`` on the same strings;
- whole-item grading with the fast paths on and off, on an RL-shaped stream (``loadgen``);
- the search oracle (``parsing.search_fallback``) against math-verify's unpatched search.

Run: ``pytest tests/unit/verifier_service/grader/test_grader_numeric.py`` (~10 s).
"""

from __future__ import annotations

import random

import mpmath
import pytest
import sympy

from stapo.verifier_service import grader
from stapo.verifier_service.clients.loadgen import build_stream
from stapo.verifier_service.grader import mathverify, numeric, parsing
from stapo.verifier_service.grader.numeric import clearly_unequal, evaluate, parse
from stapo.verifier_service.grader.rules import rejections


def _v(s: str) -> complex:
    vals = evaluate(s)
    assert vals is not None, s
    return complex(vals[0])


# --------------------------------------------------------------------------- hand-computed values


@pytest.mark.parametrize(
    "s,expected",
    [
        ("12", 12),
        ("-3.5", -3.5),
        ("\\frac{1}{2}", 0.5),
        ("\\dfrac{3}{4}", 0.75),
        ("2\\sqrt{3}", 2 * 3**0.5),
        ("\\sqrt[3]{8}", 2),
        ("\\frac{\\sqrt{3}}{2}", 3**0.5 / 2),
        ("2^{10}", 1024),
        ("2^3", 8),
        ("\\pi^2/8", 3.141592653589793**2 / 8),
        ("1 + 2 \\cdot 3", 7),
        ("2 \\times 3 - 4 / 8", 5.5),
        ("-2^2", -4),  # unary minus applies to the power
        ("\\left(1+\\pi\\right)(2)", 2 * (1 + 3.141592653589793)),
        ("\\left(1+2\\right)(3)", None),  # 3(3) is the mixed number 3 + 3 to latex2sympy: undecided
        ("{7}", 7),
    ],
)
def test_constant_values(s, expected):
    if expected is None:
        assert evaluate(s) is None
    else:
        assert abs(_v(s) - expected) < 1e-12


def test_implicit_product_binds_tighter_than_division():
    # latex2sympy: unary -> postfix+ below mp, so 1/2x is 1/(2x)
    x = numeric._POINTS[0]["x"]
    assert abs(_v("1/2x") - 1 / (2 * complex(x))) < 1e-12


def test_letters_are_case_insensitive_variables():
    assert evaluate("X+1") == evaluate("x+1")
    assert evaluate("x") != evaluate("y")


@pytest.mark.parametrize(
    "s",
    [
        "2\\frac{1}{2}",  # mixed number 5/2 for latex2sympy
        "2(3)",  # read as 2 + 3 by latex2sympy's mixed-number rule
        "2 3",
        "x2",
        "x^23",  # x^{23} for latex2sympy
        "2^3^2",
        "e^2",
        "dx",
        "d \\cdot 2",
        "f(x)",
        "x^2(y)",
        "\\pi(2)",
        "(1,2)",
        "x_1",
        "3!",
        "\\sin x",
        "abc",
        "x = 2",
        "x \\le 2",
        "10\\%",
        "\\left\\{1\\right\\}",
        "\\frac12",
        "",
    ],
)
def test_outside_the_subset_is_undecided(s):
    assert parse(s) is None or evaluate(s) is None


def test_untrustworthy_values_are_undecided():
    assert evaluate("\\frac{1}{0}") is None
    assert evaluate("10^{40}") is None  # above MAX_MAGNITUDE
    assert evaluate("2^{2000}") is None  # huge exponent
    assert evaluate("1" + "+1" * 200) is None  # longer than MAX_LEN


def test_clearly_unequal_is_one_sided():
    assert clearly_unequal("2\\sqrt{3}", "2\\sqrt{5}")
    assert clearly_unequal("x^2+1", "x^2+2")
    assert not clearly_unequal("x^2+1", "1+x^2")
    assert not clearly_unequal("\\frac{1}{3}", "0.333333")  # within math-verify's float rounding
    assert not clearly_unequal("\\frac{1}{3}", "0.333334")  # close: left to math-verify
    assert clearly_unequal("\\frac{1}{3}", "0.33")
    assert not clearly_unequal("\\sin x", "0")  # undecided, not unequal


# --------------------------------------------------------------------------- against latex2sympy

_FIXED = [
    "\\frac{\\sqrt{3}}{2}", "2\\sqrt{3} - 1", "\\frac{5\\pi^2}{4}", "x^2 + 2x + 1", "(x+1)^2", "3x - 4y",
    "\\frac{x}{2y}", "1/2x", "a/b/c", "-x^2", "\\sqrt{x^2}", "2^{-1}", "\\sqrt[3]{-8}", "(-8)^{1/3}",
    "0.5 \\pi", "12 \\cdot 3 - 1", "\\left( 3 + x \\right)^2", "{x}^{2}", "\\pi r^2", "\\frac{1}{\\sqrt{2}}",
    "2 \\div 4", "3 \\times 10^{5}", "x y^2 z", "n^2 - n", "100", "0.25", "\\frac{14}{3}", "-1", "7i - 2",
    "\\sqrt{2} \\sqrt{2}", "(1)(2)", "4 (x + 1)", "\\frac{2}{3}\\pi", "o o",
]  # fmt: skip


def _latex2sympy_values(s: str) -> list[complex] | None:
    """latex2sympy's reading of ``s`` (after math-verify's normalization), evaluated at our points."""
    norm = parsing.sympy_text(s)
    assert norm is not None
    expr = mathverify.load()["parse_latex"](norm)
    syms = sorted(expr.free_symbols, key=lambda x: x.name)
    if any(x.name not in numeric._POINTS[0] for x in syms):
        return None
    fn = sympy.lambdify(syms, expr, modules="mpmath")
    mpmath.mp.dps = 30
    try:
        return [complex(fn(*[pt[x.name] for x in syms])) for pt in numeric._POINTS]
    finally:
        mpmath.mp.dps = 15


def _gen(r: random.Random, depth: int) -> str:
    if depth <= 0 or r.random() < 0.25:
        k = r.random()
        if k < 0.45:
            return str(r.randint(0, 20))
        if k < 0.55:
            return f"{r.randint(0, 9)}.{r.randint(0, 99)}"
        return r.choice("xyabnto") if k < 0.9 else "\\pi"
    a, b = _gen(r, depth - 1), _gen(r, depth - 1)
    return r.choice(
        [
            f"{a}+{b}", f"{a} - {b}", f"{a} \\cdot {b}", f"{a}/{b}", f"\\frac{{{a}}}{{{b}}}", f"\\sqrt{{{a}}}",
            f"{a}^{{{r.randint(0, 3)}}}", f"{a}^{r.randint(0, 9)}", f"({a})", f"-{a}", f"{a}{b}", f"{a} {b}",
            f"\\left({a}\\right)", f"{{{a}}}({b})",
        ]
    )  # fmt: skip


def _same_as_latex2sympy(s: str) -> None:
    mine = evaluate(parsing.sympy_text(s) or "")
    if mine is None:
        return
    ref = _latex2sympy_values(s)
    if ref is None:
        return
    for a, b in zip(mine, ref, strict=True):
        assert abs(complex(a) - b) <= 1e-9 * max(1.0, abs(b)), (s, complex(a), b)


@pytest.mark.parametrize("s", _FIXED)
def test_fixed_strings_read_like_latex2sympy(s):
    _same_as_latex2sympy(s)


def test_fixed_strings_are_mostly_inside_the_subset():
    outside = [s for s in _FIXED if evaluate(parsing.sympy_text(s)) is None]
    assert outside == ["(1)(2)"]  # 1 then the rational 2: a mixed number to latex2sympy


@pytest.mark.timeout(60)
def test_generated_strings_read_like_latex2sympy():
    """60 random expressions from the subset's grammar (mixed numbers, implicit products, powers)."""
    r = random.Random(1234)
    checked = 0
    for _ in range(80):
        s = _gen(r, r.randint(1, 3))
        if evaluate(parsing.sympy_text(s) or "") is not None:
            _same_as_latex2sympy(s)
            checked += 1
    assert checked >= 50


# --------------------------------------------------------------------------- fast paths vs the exact path


def _real_search(monkeypatch) -> None:
    """math-verify's search as it is, every parse attempt run (``mathverify.search`` without its oracle)."""
    real = mathverify.search
    monkeypatch.setattr(mathverify, "search", lambda body, **kw: real(body, oracle=False, surely_parses=kw["surely_parses"]))


def _exact_only(monkeypatch) -> None:
    """Switch every grader shortcut off: grade() by the exact path alone."""
    monkeypatch.setattr(rejections, "numerically_unequal", lambda g, p: False)
    monkeypatch.setattr(rejections, "word_soup", lambda g, p: False)
    monkeypatch.setattr(rejections, "brackets_unequal", lambda g, p: False)
    monkeypatch.setattr(parsing, "surely_parses", lambda latex: False)
    _real_search(monkeypatch)
    grader.cache_clear()


def _grade_all(items):
    return [grader.grade(p, g, m) for p, g, m in items]


_REJECT_PAIRS = [
    ("2\\sqrt{3}", "2\\sqrt{5}"), ("\\frac{5\\pi^2}{4}", "\\frac{5\\pi^2}{2}"), ("12", "x = 7"),
    ("20", "f(x) = x^2 - 45x + 11"), ("(3, -13)", "(3, -14)"), ("[2, 5)", "[2, 6)"), ("(1, 2)", "3"),
    ("34", "Therefore the sum of t"), ("9", "Multiplying both sides"), ("12", "so dx then we"),
    ("5", "Hmm, wait. Let me reconsider the"), ("7i - 2", "75"), ("x^2+1", "x^2-1"), ("\\frac{\\sqrt{3}}{2}", "0.87"),
]  # fmt: skip


@pytest.mark.parametrize("gold,pred", _REJECT_PAIRS)
def test_rejections_agree_with_math_verify(gold, pred, monkeypatch):
    fast = grader.grade(f"\\boxed{{{pred}}}", gold)
    _exact_only(monkeypatch)
    slow = grader.grade(f"\\boxed{{{pred}}}", gold)
    assert (fast.correct, fast.status, fast.extracted) == (slow.correct, slow.status, slow.extracted)
    assert fast.correct is False


@pytest.mark.timeout(120)
def test_stream_verdicts_do_not_change(monkeypatch):
    """An RL-shaped stream (LaTeX and integer golds, near misses, cut-off responses): same results."""
    items = build_stream(480, seed=11, prompt_pool=60, cutoff_frac=0.15)
    grader.cache_clear()
    fired = {"numerically_unequal": 0, "word_soup": 0, "brackets_unequal": 0, "stand_in": 0}

    def counting(module, name):
        real = getattr(module, name)

        def fn(*args):
            out = real(*args)
            fired[name] += bool(out)
            return out

        return fn

    with monkeypatch.context() as m:
        for name in fired:
            module = mathverify if name == "stand_in" else rejections
            m.setattr(module, name, counting(module, name))
        fast = _grade_all(items)
    # each fast path must have decided a fair number of items (cut-off responses with no marker are
    # no_answer before any comparison, so 9 of the 480 reach each of these two on this stream)
    assert fired["numerically_unequal"] >= 5 and fired["stand_in"] >= 5, fired
    assert fired["word_soup"] >= 5, fired
    _exact_only(monkeypatch)
    slow = _grade_all(items)
    grader.cache_clear()
    diff = [(it[1], a, b) for it, a, b in zip(items, fast, slow, strict=True) if (a.correct, a.status, a.extracted) != (b.correct, b.status, b.extracted)]  # fmt: skip
    assert not diff, diff[:3]


def test_search_oracle_finds_the_same_string(monkeypatch):
    """math-verify's search reports the same candidate with and without the parse oracle."""
    r = random.Random(5)
    bodies = [p for p, _, _ in build_stream(200, seed=3, cutoff_frac=1.0)][:40]
    bodies += [
        "We get $c^2 = 3^2 + 4^2 = 25$ and then",
        "so $x = 49$ into $f(x) = x^2 - 5x + 3$",
        "first $\\frac{1}{2}$ and $\\frac{3}{4}$ then 12% of it",
        f"the values are {r.randint(1, 99)} and $\\sqrt{{2}}$ so",
        # several LaTeX groups in one match: the reported string depends on whether all parse
        "the final answer is $1$ and $\\frac{x}{$",
        "The answers are $x=2$ and $y=\\frac{1}{$",
        "the final answer is $a$ and $b$",
        "so the answer is $\\sqrt{2}$ and $3$",
        # first candidates that latex2sympy / sympy cannot parse, a later one that it can
        "we have $\\frac{1}{$ then 7 and x^^2",
        "then $f(x) = x^2 - 79x + 9$ and $\\begin{matrix}$",
    ]
    fast = [parsing.search_fallback(b) for b in bodies]
    _real_search(monkeypatch)
    slow = [parsing.search_fallback(b) for b in bodies]
    assert fast == slow


def test_oracle_is_off_outside_the_search():
    """Other callers of math-verify in the process get real sympy objects."""
    from math_verify import parse

    mathverify.load()
    got = parse("$2\\sqrt{3}$")
    assert got and got[0] == 2 * sympy.sqrt(3)


@pytest.mark.parametrize(
    "gold,pred,decided",
    [
        ("34", "Therefore the sum of t", True),
        ("34", "By the Pythagorean t", True),
        ("1", "Let me: let me", False),  # ':' divides: (l*E*t*m*E)/(l*E*t*m*E) = 1 to latex2sympy
        ("0", "the x - the x", False),  # '-' could cancel
        ("12", "so the e", False),  # a lone e is Euler's number
        ("12", "so dx then we", True),  # a differential outside \\frac{d}{dx} / \\int is the symbol dx
        ("9", "Multiplying both sides", True),  # "de" is a differential token, still a symbol
        ("5", "Hmm, wait. Let me reconsider the", True),
        ("1", "iiii", False),  # only i's: the imaginary unit in complex mode, i^4 = 1
        ("12", "the rank of it", False),  # a word latex2sympy's lexer knows
        ("12", "it is infinity", False),  # normalized to \infty
        ("\\text{Evelyn}", "Evelyn wins", False),  # text golds are compared as text
        ("x", "the value", False),  # the gold is not a constant
    ],
)
def test_word_soup_only_decides_safe_cases(gold, pred, decided):
    assert rejections.word_soup(grader.latexify(gold), pred) is decided
