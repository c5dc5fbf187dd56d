"""Number rules: digits joined by spaces, base-subscript numerals, exact numbers, rounded golds,
clock times, compound quantities; and the grader's policy settings (the rounded-gold policy is the one).

Exact numbers compare as ``fractions.Fraction`` (``normalize.parse_number``); the rounded-gold
policy (``GraderSettings.rounded_gold``) reads an answer's value with ``numeric.py`` (mpmath). The
rules up to ``rule_rounded_gold_number`` are cheap; ``rule_clock``, ``rule_rounded_gold`` and
``rule_compound_quantity`` run with the full budget only (their place in ``table.RULES``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from fractions import Fraction

from stapo.verifier_service.grader.normalize import Num, canonical, numbers_equal, parse_number, strip_delims
from stapo.verifier_service.grader.numeric import evaluate as evaluate_numeric
from stapo.verifier_service.grader.parsing import AnswerInfo, sympy_text
from stapo.verifier_service.grader.rules import RuleVerdict


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class GraderSettings:
    """The grader's policies a user may choose, one frozen object per process (``SETTINGS``;
    ``grader.configure`` replaces it).

    Each field has an environment twin read at import (``GraderSettings.from_env``), so a worker
    process started by the pool or the service gets the same policies as its parent's environment.
    """

    rounded_gold: bool = True
    """``STAPO_GRADER_ROUNDED_GOLD``: a decimal gold (``0.6667``, ``0.79``: Minerva / OlympiadBench
    physics keys) accepts an answer that shows the gold was rounded and rounds to it at the gold's
    precision (``\\frac{2}{3}``, ``\\frac{\\pi}{4}``, ``0.78540``; ``_rounded_gold_match``). Off: only exact
    matches (exact golds are never matched by shorter decimals either way: docs/verifier.md)."""

    @classmethod
    def from_env(cls) -> GraderSettings:
        return cls(
            rounded_gold=_env_flag("STAPO_GRADER_ROUNDED_GOLD", True),
        )


SETTINGS = GraderSettings.from_env()
"""This process's grading policies (read them here; change them with ``grader.configure``)."""


def use_settings(new: GraderSettings) -> GraderSettings:
    """Make ``new`` this process's policies; returns the previous ones. The caches are the caller's
    to empty (``grader.configure`` does both)."""
    global SETTINGS
    old, SETTINGS = SETTINGS, new
    return old


# a numeral with a base subscript: 52_8, 4210_{5}, 1A_{16}
_BASE_NUM_RE = re.compile(r"^(?=[0-9A-F]*\d)([0-9A-F]+)_\{?(\d{1,2})\}?$")
_DEC_COMMA_RE = re.compile(r"^-?\d+,(?:\d{1,2}|\d{4,})$|^-?0,\d+$")


def _decimal_comma(info: AnswerInfo, raw: str) -> Num | None:
    """``1000,99`` read as a decimal comma (only when it cannot be a thousands separator, and never
    ``-9, 0``: a comma followed by a space separates list items)."""
    if _DEC_COMMA_RE.match(info.canon) and not re.search(r",\s", raw):
        return parse_number(info.canon.replace(",", "."))
    return None


def _base_value(m: re.Match) -> int | None:
    digits, base = m.group(1), int(m.group(2))
    try:
        return int(digits, base) if 2 <= base <= 36 else None
    except ValueError:
        return None


def _base_equal(gb: re.Match | None, pb: re.Match | None, g: AnswerInfo, p: AnswerInfo) -> bool:
    """Base-subscript numerals: same base and value; a gold ``52_8`` also accepts the bare digits ``52``
    (the question already named the base); a bare gold accepts a numeral of the same value."""
    if gb is not None and pb is not None:
        return (
            gb.group(2) == pb.group(2) and _base_value(gb) is not None and _base_value(gb) == _base_value(pb)
        )
    if gb is not None:
        return p.num is not None and not p.num.decimal and p.canon.lstrip("0") == gb.group(1).lstrip("0")
    if g.num is not None and pb is not None:
        # a bare gold is either the digits the question asked for in its base ("616" for 616_9)
        # or the value itself
        if (
            not g.num.decimal
            and g.canon.lstrip("0") == pb.group(1).lstrip("0")
            and _base_value(pb) is not None
        ):
            return True
        v = _base_value(pb)
        return v is not None and g.num.value == v
    return False


_SPACE_RE = re.compile(r"\\[,;: ]|\\q?quad|~")
_SPACED_DIGITS_RE = re.compile(r"^[+-]?\d+(?: \d+)+$")
_THOUSANDS_SPACED_RE = re.compile(r"^[+-]?\d{1,3}(?: \d{3})+$")


def _spaced_digits(s: str) -> str | None:
    """``s`` as digit groups joined by spaces (``1 2 3``, ``10 5``; LaTeX spaces count) when that is
    all it is and the groups are not thousands (``12 345`` is a number); else None."""
    t = " ".join(_SPACE_RE.sub(" ", strip_delims(s)).split())
    return t if _SPACED_DIGITS_RE.match(t) and not _THOUSANDS_SPACED_RE.match(t) else None


def rule_spaced_digits(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    # digits joined by spaces are several numbers, not the integer they spell ("1 2 3" is not 123;
    # canonical() drops those spaces). A gold written the same way passes on to string equality.
    spaced = _spaced_digits(pred)
    if spaced is None:
        return None
    return None if _spaced_digits(gold) == spaced else False

def rule_base(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    # numerals in another base: the base is part of the answer (4210_5 != 4210_6)
    gb, pb = _BASE_NUM_RE.match(g.canon), _BASE_NUM_RE.match(p.canon)
    if gb is None and pb is None:
        return None
    return _base_equal(gb, pb, g, p)


def _numbers(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> tuple[Num, Num] | None:
    # decimal commas "1000,99" only when no thousands reading exists, only in predictions (answer
    # keys write decimals with a point, so a gold "-3,0" is a list), and only against a gold that is
    # not an integer: against an integer the reading could only add zeros ("-3,0" for -3), which is
    # what a two-element list looks like
    dec_gold = g.num is not None and g.num.value.denominator != 1
    p_num = p.num or (_decimal_comma(p, pred) if dec_gold else None)
    return (g.num, p_num) if g.num is not None and p_num is not None else None


def rule_exact_number(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    nums = _numbers(gold, pred, g, p)
    if nums is None:
        return None
    if numbers_equal(*nums):
        return True
    return None if _rounded_number(gold, pred, g, p) else False


def _rounded_number(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> bool:
    nums = _numbers(gold, pred, g, p)
    return (
        nums is not None
        and not nums[1].percent
        and not nums[1].degree
        and _rounded_gold_match(g, pred, nums[1].value)
    )


def rule_rounded_gold_number(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    return True if _rounded_number(gold, pred, g, p) else None


def rule_clock(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    # "1:30 p.m." = "1:30\\text{ pm}" = "13:30"; a clock gold needs a clock answer
    gc = _clock(g.canon)
    if gc is None:
        return None
    pc = _clock(p.canon)
    return pc is not None and _clock_equal(gc, pc)


def rule_rounded_gold(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    # a gold shown rounded (0.6667) and an exact answer that rounds to it (\\frac{2}{3}). Says only yes.
    return True if g.num is not None and g.num.decimal and _rounded_gold_match(g, pred, None) else None


def rule_compound_quantity(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    return False if g.num is not None and compound_quantity(pred) else None


_NUM_TOKEN_RE = re.compile(r"\d+(?:\.\d+)?")


def compound_quantity(pred: str) -> bool:
    """ "3 hours and 20 minutes", "2 feet 5 inches": two numbers joined by words, not by an operator.

    Against a single-number gold such an answer is not that number, yet math-verify's search
    (units stripped, first number) would read it as ``3``.
    """
    bare = re.sub(r"\\(?:text|mathrm|mbox)\s*\{([^{}]*)\}", r" \1 ", pred)
    nums = list(_NUM_TOKEN_RE.finditer(bare))
    for a, b in zip(nums, nums[1:], strict=False):
        between = bare[a.end() : b.start()]
        if re.search(r"[A-Za-z]{3,}", between) and not re.search(r"[-+*/^=_\\{}(),]", between):
            return True
    return False



_PLAIN_DEC_RE = re.compile(r"^-?(\d+)\.(\d+)$")


EXTRA_DIGITS = 2
"""A decimal answer counts as more precise than a rounded gold from this many more decimals on."""


def _rounded_gold_match(g: AnswerInfo, pred: str, pred_value: Fraction | None) -> bool:
    """The rounded-gold policy: the gold is shown rounded relative to this answer, and the answer rounds
    to it at the gold's precision.

    A decimal gold (>= 2 significant digits) is taken as a rounding only when the answer shows that
    rounding happened: an exact value that no finite decimal equals (``\\frac{1}{7}``, ``\\frac{\\pi}{4}``,
    ``2\\sqrt{3}`` for ``0.143``, ``0.79``, ``3.46``), or a decimal with ``EXTRA_DIGITS`` more decimals
    whose own digits at the gold's places differ from the gold's (``0.78540`` for ``0.79``: rounding
    changed the last shown digit). Shipped decimal golds are almost always exact (``0.25`` is 1/4), and
    the grader cannot see whether a problem asked for rounding, so an answer that is the gold's digits
    followed by more (``0.2512`` for ``0.25``, ``1.540`` for ``1.5``) is a different, longer number,
    not a more precise one. A decimal one digit longer (``1.54`` for ``1.5``) or a terminating
    fraction (``\\frac{31}{20}``) is another short answer, and the gold may be exact as written.
    """
    if not SETTINGS.rounded_gold or g.num is None or g.num.percent:
        return False
    m = _PLAIN_DEC_RE.match(g.canon)
    if m is None:
        return False
    d = len(m.group(2))
    if len((m.group(1) + m.group(2)).lstrip("0")) < 2:
        return False
    pm = _PLAIN_DEC_RE.match(canonical(pred))
    if pm is not None and len(pm.group(2)) < d + EXTRA_DIGITS:
        return False  # not visibly more precise than the gold: it had to match exactly
    if pm is not None and _starts_like(m, pm, d):
        return False  # the gold's digits and more: a longer answer if the gold is exact (0.2512 for 0.25)
    if pred_value is not None:
        if pm is None and _finite_decimal(pred_value):
            return False  # an exact value with a short decimal expansion: another answer
        return abs(pred_value - g.num.value) <= Fraction(1, 2 * 10**d)
    if re.search(r"\d\.\d", pred):
        return False  # an expression holding a decimal: not an exact value
    text = sympy_text(pred)
    # (a degree sign is left to math-verify here: numeric.py reads it for the rejections only)
    vals = evaluate_numeric(text) if text is not None and "=" not in text and "\\circ" not in text else None
    if vals is None or any(v != vals[0] for v in vals) or abs(vals[0].imag) > 0:
        return False
    v = float(vals[0].real)
    scaled = v * 10 ** (d + EXTRA_DIGITS)
    if abs(scaled - round(scaled)) <= 1e-9 * max(1.0, abs(scaled)):
        return False  # its value is a short decimal: another answer, not a more precise one
    return abs(v - float(g.num.value)) <= 0.5 * 10**-d * (1 + 1e-9)


def _starts_like(gm: re.Match, pm: re.Match, d: int) -> bool:
    """Are the decimal answer's digits the gold's ``d`` decimals followed by more (same sign, same
    whole part)? ``gm`` / ``pm``: ``_PLAIN_DEC_RE`` matches of the gold and of the answer."""
    same_sign = gm.string.startswith("-") == pm.string.startswith("-")
    return same_sign and int(gm.group(1)) == int(pm.group(1)) and pm.group(2)[:d] == gm.group(2)


def _finite_decimal(v: Fraction) -> bool:
    """Does ``v`` have a finite decimal expansion (denominator 2^a 5^b)?"""
    den = v.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den == 1


_CLOCK_RE = re.compile(r"^(\d{1,2}):([0-5]\d)(?::([0-5]\d))?(?:([AaPp])\.?[Mm]\.?|(noon|midnight))?$")


def _clock(canon: str) -> tuple[int, int, str | None] | None:
    m = _CLOCK_RE.match(canon.replace("\\text", "").replace(" ", ""))
    if m is None or int(m.group(1)) > 24:
        return None
    ap = (m.group(4) or "").lower() or {"noon": "p", "midnight": "a"}.get(m.group(5) or "")
    return int(m.group(1)), int(m.group(2)), ap


def _clock_equal(a: tuple[int, int, str | None], b: tuple[int, int, str | None]) -> bool:
    """Same time of day; "1:30 pm" = "13:30", "12:00 noon" = "12:00 p.m."; without a.m./p.m. on one
    side, the 12-hour reading."""

    def day(h: int, m: int, ap: str | None) -> int | None:
        if ap is not None:
            return (h % 12 + (12 if ap == "p" else 0)) * 60 + m
        return h * 60 + m if h > 12 or h == 0 else None

    da, db = day(*a), day(*b)
    if da is not None and db is not None:
        return da == db
    return a[0] % 12 == b[0] % 12 and a[1] == b[1]
