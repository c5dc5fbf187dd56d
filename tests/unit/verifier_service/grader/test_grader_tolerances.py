"""Boundary cases for every tolerance constant on the grader's numeric paths: one value just inside,
one just outside, so loosening or tightening a constant (10x, or an off-by-one in a bound) fails here.

Hard-coded inputs on purpose: a test that derived its inputs from the constant would move with it.
When a constant changes on purpose, update its cases here together with the docstring that states it.

verifier_service/grader/numeric.py (the rejection fast path: it may only say "clearly unequal"):
  REL_TOL = 1e-5            |a - b| > REL_TOL * max(1, |a|, |b|): relative above 1, absolute below
  MAX_MAGNITUDE = 1e30      larger intermediate values are undecided
  MAX_LEN = 200             longer strings are undecided
  |exponent| <= 1000        larger exponents are undecided
  |denominator| >= 1e-20    smaller denominators are undecided
verifier_service/grader/rules/symbolic.py and rules/numbers.py:
  exact constants: different beyond 1e-30 relative (50-digit values), else math-verify decides
  rounded gold: within half a unit of the gold's last shown digit (Fraction path, and the float
  path with its 1e-9 slack), else no match
  math-verify's own 6-decimal rounding must survive the numeric rejection (it is never stricter)
"""

from __future__ import annotations

import mpmath
import pytest

from stapo.verifier_service.grader import grade, numeric


@pytest.mark.parametrize(
    ("a", "b", "unequal"),
    [
        ("1", "1.000005", False), ("1", "1.00002", True),  # at 1: the relative and absolute bounds meet
        ("100000", "100000.5", False), ("100000", "100003", True),  # relative above 1 (bound: 1)
        ("0", "0.000009", False), ("0", "0.000011", True),  # absolute floor below 1
        ("0.5", "0.500009", False), ("0.5", "0.500011", True),  # still absolute (max(1, .) = 1)
    ],
)
def test_rel_tol_boundary(a, b, unequal):
    assert numeric.clearly_unequal(a, b) is unequal
    assert numeric.clearly_unequal(b, a) is unequal  # symmetric


def test_rel_tol_within_ten_percent():
    """``differ`` at 0.9 and 1.1 times the tolerance, relative and absolute."""
    one, big = mpmath.mpf(1), mpmath.mpf(10) ** 6
    assert not numeric.differ(one, one + mpmath.mpf("0.9e-5"))
    assert numeric.differ(one, one + mpmath.mpf("1.1e-5"))
    assert not numeric.differ(big, big * (1 + mpmath.mpf("0.9e-5")))
    assert numeric.differ(big, big * (1 + mpmath.mpf("1.1e-5")))
    assert not numeric.differ(mpmath.mpf(0), mpmath.mpf("0.9e-5"))
    assert numeric.differ(mpmath.mpf(0), mpmath.mpf("1.1e-5"))


@pytest.mark.parametrize(
    ("s", "decided"),
    [
        ("9\\cdot10^{29}", True), ("2\\cdot10^{30}", False),  # MAX_MAGNITUDE
        ("1^{1000}", True), ("1^{1001}", False),  # exponent bound
        ("\\frac{1}{10^{-19}}", True), ("\\frac{1}{10^{-21}}", False),  # division by ~0
        ("11" + "+1" * 99, True), ("1" + "+1" * 100, False),  # MAX_LEN: 200 and 201 characters
    ],
)
def test_numeric_guards_boundary(s, decided):
    assert (numeric.evaluate(s) is not None) is decided, s
    if decided:  # and a decided value is right
        want = {"9\\cdot10^{29}": 9e29, "1^{1000}": 1.0, "\\frac{1}{10^{-19}}": 1e19}.get(s, 110.0)
        assert float(numeric.evaluate(s)[0].real) == pytest.approx(want, rel=1e-12)


def g(pred: str, gold: str) -> bool:
    r = grade("so \\boxed{" + pred + "}", gold)
    assert r.status == "ok", r
    return r.correct


@pytest.mark.parametrize(
    ("pred", "gold", "correct"),
    [
        # exact constants: 7e-32 relative is math-verify's call (equal at 6 decimals), 1.4e-30 is "different"
        ("\\sqrt{2}+10^{-31}", "\\sqrt{2}", True),
        ("\\sqrt{2}+2\\cdot10^{-30}", "\\sqrt{2}", False),
        # rounded gold 0.6667 (4 decimals): half a unit (5e-5) away, missed by 1e-9 to 6e-7 either side;
        # none is a short decimal (whether those match is a policy question, not a tolerance)
        ("\\frac{19999501}{30000000}", "0.6667", True), ("\\frac{19999499}{30000000}", "0.6667", False),  # Fraction
        ("0.666650001", "0.6667", True), ("0.666649999", "0.6667", False),  # a longer decimal
        ("\\frac{\\sqrt{444423}}{1000}", "0.6667", True), ("\\frac{\\sqrt{444422}}{1000}", "0.6667", False),  # float
        # math-verify rounds to 6 decimals; the numeric rejection must not be stricter than that
        ("1.0000004", "1", True), ("1.000002", "1", False),
    ],
)
def test_grader_tolerance_boundary(pred, gold, correct):
    assert g(pred, gold) is correct
