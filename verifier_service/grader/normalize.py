"""String normalization and exact number parsing for the grader's fast paths.

These run before any sympy work: most RL answers are integers or simple fractions, and an exact
``fractions.Fraction`` comparison is both faster and safer than a symbolic one.

- ``strip_delims``: drop math delimiters ``$``, ``\\(``, ``\\[`` and a trailing full stop.
- ``canonical``: a whitespace/markup-insensitive string form (``\\dfrac``->``\\frac``, no ``\\left``,
  no spacing commands, ``\\text{}`` unwrapped) used for the string-equality fast path.
- ``parse_number``: an exact value for integers, decimals, fractions, thousands separators,
  scientific notation, percent and degree marks; None for anything else.
- ``split_top_level``: split on commas outside brackets (multi-answer golds, tuples).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction

_DELIM_PAIRS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))

_SPACING_RE = re.compile(r"\\[,;:! ]|\\q?quad|~|\\displaystyle\b|\\mathrm\{\s*\}|\\text\{\s*\}")
# "12 and 13", "2 \\text{ or } 3", "(1,2), and (3,4)" -> comma lists (only between math-looking items)
_AND_OR_RE = re.compile(
    r"(?<=[\d})\]])\s*,?\s*(?:\\q?quad\s*)?(?:\\text\{\s*(?:and|or)\s*\}|\b(?:and|or)\b)\s*(?:\\q?quad)?\s*"
    r"(?=[-+\d\\({\[a-zA-Z])"
)

_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)\b\s*(?=[\\(\[{|.)\]}])")
_TEXT_CMD_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}"
)
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\^\s*\{\s*\\circ\s*\}|°|\\degree\b")
_PERCENT_RE = re.compile(r"\s*(?:\\%|%|\\text\{\s*percent\s*\}|\bpercent\b)\s*$")
_UNIT_TAIL_RE = re.compile(
    r"\s*\\(?:text|mbox|mathrm)\s*\{\s*[A-Za-z][A-Za-z .\-/]*\}(?:\s*\^\s*\{?\d\}?)?\s*$"
)
# a bare squared / cubed unit after a number ("233 m^2", "125 cm^3"): area and volume answers
_BARE_UNIT_POW_RE = re.compile(r"(?<=\d)\s+(?:m|cm|mm|km|in|ft|yd|mi|[a-z]{2,10})\s*\^\s*\{?[23]\}?\s*$")


_UNICODE_MAP = {
    "\u2212": "-",
    "\uff0d": "-",
    "\u00d7": "\\times ",
    "\u00b7": "\\cdot ",
    "\u22c5": "\\cdot ",
    "\u00f7": "\\div ",
    "\u2264": "\\le ",
    "\u2a7d": "\\le ",
    "\u2265": "\\ge ",
    "\u2a7e": "\\ge ",
    "\u2260": "\\ne ",
    "\u00b1": "\\pm ",
    "\u2213": "\\mp ",
    "\u221e": "\\infty ",
    "\u03c0": "\\pi ",
    "\u222a": "\\cup ",
    "\u2229": "\\cap ",
    "\u2208": "\\in ",
    "\u03b8": "\\theta ",
    "\u03b1": "\\alpha ",
    "\u03b2": "\\beta ",
    "\u00b2": "^2",
    "\u00b3": "^3",
    "\u00a0": " ",
    "\u2009": " ",
    "\u202f": " ",
    "\u2032": "'",
}
_SQRT_UNI_RE = re.compile(r"\u221a\s*(\{[^{}]*\}|\([^()]*\)|\d+(?:\.\d+)?|[A-Za-z])")


def latexify(s: str) -> str:
    """Plain-text and unicode math from chat models in LaTeX form, so every later step sees one notation.

    ``\u22125`` -> ``-5``, ``2\u221a2`` -> ``2\\sqrt{2}``, ``\u221a(x+1)`` -> ``\\sqrt{x+1}``, ``\u00bd`` -> ``\\frac{1}{2}``,
    ``\u03c0/2`` -> ``\\pi /2``, ``x \u2264 2`` -> ``x \\le 2``, ``(-\u221e, 2]``, ``3\u00d710^5``, ``x**2`` -> ``x^2``.
    ASCII input without ``**`` is returned unchanged (the common case costs one ``isascii``).
    """
    if "**" in s:
        s = s.replace("**", "^")
    if s.isascii():
        return s
    s = _SQRT_UNI_RE.sub(
        lambda m: "\\sqrt{" + (m.group(1)[1:-1] if m.group(1)[0] in "({" else m.group(1)) + "}", s
    )
    out = []
    for ch in s:
        rep = _UNICODE_MAP.get(ch)
        if rep is None and not ch.isascii() and unicodedata.category(ch) == "No":
            try:
                val = Fraction(unicodedata.numeric(ch)).limit_denominator(1000)
            except (TypeError, ValueError):
                val = None
            if val is not None and val.denominator > 1:
                rep = f"\\frac{{{val.numerator}}}{{{val.denominator}}}"
        out.append(ch if rep is None else rep)
    return "".join(out)


_INEQUALITY_RE = re.compile(r"<|>|\\[lg]eq?\b|\\[lg]t\b")


def join_and_or(s: str) -> str:
    """ "3 and 5", "2 \\text{ or } 3" -> "3, 5", "2, 3": words joining math items make a list, so the
    answer is read as the list it is (never searched for its last number)."""
    if ("and" not in s and "or" not in s) or _INEQUALITY_RE.search(s):
        return s  # "x > 1 and x < 5": the connective decides the set (rules.structure.inequalities_as_intervals)
    return _AND_OR_RE.sub(", ", s)


def strip_delims(s: str) -> str:
    """Remove surrounding math delimiters and whitespace, and one trailing full stop outside them."""
    s = s.strip()
    changed = True
    while changed and s:
        changed = False
        if s.endswith(".") and not re.search(r"\d\.$", s[-2:]) and not s.endswith("\\."):
            s = s[:-1].rstrip()
            changed = True
        for lo, hi in _DELIM_PAIRS:
            if len(s) >= len(lo) + len(hi) and s.startswith(lo) and s.endswith(hi):
                inner = s[len(lo) : len(s) - len(hi)]
                if lo == "$" and "$" in inner:
                    continue  # "$a$ and $b$" is not one span
                s = inner.strip()
                changed = True
                break
    return s


def canonical(s: str) -> str:
    """A markup-insensitive form for string equality; equal canonical forms mean equal answers."""
    s = strip_delims(s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\cfrac", "\\frac")
    s = s.replace("{,}", ",").replace("$", " ")
    s = _AND_OR_RE.sub(",", s)
    s = _SPACING_RE.sub("", s)
    s = _LEFT_RIGHT_RE.sub("", s)
    for _ in range(3):
        s2 = _TEXT_CMD_RE.sub(r"\1", s)
        if s2 == s:
            break
        s = s2
    # drop whitespace except between two letters ("\\sin x", "\\pi r^2" keep one space)
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"(?<![A-Za-z]) | (?![A-Za-z])", "", s)
    # one outer pair of grouping braces carries no meaning: "{2,3}" -> "2,3"
    while s.startswith("{") and s.endswith("}") and _outer_pair(s, "{", "}"):
        s = s[1:-1]
    return s


def _outer_pair(s: str, lo: str, hi: str) -> bool:
    """True when the first character's bracket closes at the last character."""
    depth = 0
    for i, c in enumerate(s):
        if c == lo:
            depth += 1
        elif c == hi:
            depth -= 1
            if depth == 0:
                return i == len(s) - 1
    return False


@dataclass(frozen=True)
class Num:
    """An exactly parsed number: its value, whether it was written with a decimal point, and marks."""

    value: Fraction
    decimal: bool
    percent: bool = False
    degree: bool = False


_INT_RE = r"(?:[1-9]\d{0,2}(?:,\d{3})+|\d+)"
_DEC_RE = rf"(?:{_INT_RE}(?:\.\d*)?|\.\d+)"
_PLAIN_NUM_RE = re.compile(rf"^([+-]?)({_DEC_RE})(?:[eE]([+-]?\d+))?$")
_TIMES_POW_RE = re.compile(r"^(.+?)\s*(?:\\times|\\cdot|\*|x|×)\s*10\s*\^\s*\{?\s*([+-]?\d+)\s*\}?$")
_POW10_RE = re.compile(r"^10\s*\^\s*\{?\s*([+-]?\d+)\s*\}?$")
_FRAC_RE = re.compile(
    r"^([+-]?)\\frac\s*(?:\{\s*([+-]?[\d.]+)\s*\}|(\d))\s*(?:\{\s*([+-]?[\d.]+)\s*\}|(\d))$"
)
_REPEAT_RE = re.compile(r"^([+-]?)(\d*)\.(\d*)\\overline\{?(\d{1,12})\}?$")
_SLASH_RE = re.compile(r"^([+-]?)\s*([\d.]+)\s*/\s*([\d.]+)$")
# mixed numbers "2 3/4", "2\frac{3}{4}", "2\frac34" (proper fraction part only): PRM800K reads them as
# 2 + 3/4, and so does latex2sympy for "2\frac{3}{4}"
_MIXED_RE = re.compile(
    r"^([+-]?)(\d+)(?:\s+(\d+)\s*/\s*(\d+)|\s*\\frac\s*(?:\{\s*(\d+)\s*\}|(\d))\s*(?:\{\s*(\d+)\s*\}|(\d)))$"
)


def _plain(s: str) -> tuple[Fraction, bool] | None:
    m = _PLAIN_NUM_RE.match(s)
    if m is None:
        return None
    sign, body, exp = m.groups()
    body = body.replace(",", "")
    if body in ("", "."):
        return None
    val = Fraction(body)
    if exp is not None:
        if abs(int(exp)) > 400:
            return None
        val *= Fraction(10) ** int(exp)
    if sign == "-":
        val = -val
    return val, ("." in body or exp is not None)


def parse_number(s: str) -> Num | None:
    """Exact value of a plain numeric answer, or None if it is anything more than a number.

    Accepts ``-1,450,000``, ``1{,}000``, ``1\\,000``, ``025``, ``.5``, ``4.5e33``,
    ``4.5 \\times 10^{33}``, ``\\frac{3}{4}``, ``\\frac34``, ``-3/4``, ``50\\%``, ``10^\\circ``,
    ``5\\text{ cm}`` (a trailing unit in ``\\text{}``).
    """
    s = strip_delims(s)
    if not s or len(s) > 100 or ", " in s:
        return None
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = re.sub(r"\\[,!;: ]|~", "", s)
    s = _LEFT_RIGHT_RE.sub("", s)
    s = _UNIT_TAIL_RE.sub("", s)
    s = _BARE_UNIT_POW_RE.sub("", s)
    percent = False
    m = _PERCENT_RE.search(s)
    if m:
        percent = True
        s = s[: m.start()]
    degree = False
    if _DEGREE_RE.search(s):
        s2 = _DEGREE_RE.sub("", s).strip()
        if s2 != s:
            degree = True
            s = s2
    s = s.strip()
    if s.startswith("{") and s.endswith("}") and s.count("{") == 1:
        s = s[1:-1].strip()
    if s.startswith("(") and s.endswith(")") and s.count("(") == 1 and "," not in s:
        s = s[1:-1].strip()
    s = re.sub(r"(?<=\d) (?=\d{3}\b)", "", s)  # "1 000" thousands with a space
    m = _MIXED_RE.match(s)
    if m:
        sign, whole = m.group(1), int(m.group(2))
        a = int(m.group(3) or m.group(5) or m.group(6))
        b = int(m.group(4) or m.group(7) or m.group(8))
        if 0 < a < b:
            val = whole + Fraction(a, b)
            return Num(-val if sign == "-" else val, False, percent, degree)
        return None
    m = _REPEAT_RE.match(s.replace(" ", ""))
    if m:  # 0.1\overline{6} = 1/6 exactly
        sign, whole, fixed, rep = m.groups()
        val = Fraction(int(whole or "0")) + (
            Fraction(int(fixed + rep) - int(fixed or "0"), 10 ** len(fixed) * (10 ** len(rep) - 1))
        )
        return Num(-val if sign == "-" else val, False, percent, degree)
    got = _plain(s.replace(" ", ""))
    if got is not None:
        return Num(got[0], got[1], percent, degree)
    m = _TIMES_POW_RE.match(s)
    if m:
        mant = _plain(m.group(1).replace(" ", ""))
        if mant is not None and abs(int(m.group(2))) <= 400:
            return Num(mant[0] * Fraction(10) ** int(m.group(2)), True, percent, degree)
        return None
    m = _POW10_RE.match(s)
    if m and abs(int(m.group(1))) <= 400:
        return Num(Fraction(10) ** int(m.group(1)), False, percent, degree)
    m = _FRAC_RE.match(s.replace(" ", ""))
    if m:
        sign = m.group(1)
        num = _plain(m.group(2) or m.group(3))
        den = _plain(m.group(4) or m.group(5))
        if num is None or den is None or den[0] == 0:
            return None
        val = num[0] / den[0]
        return Num(-val if sign == "-" else val, num[1] or den[1], percent, degree)
    m = _SLASH_RE.match(s)
    if m:
        num, den = _plain(m.group(2)), _plain(m.group(3))
        if num is None or den is None or den[0] == 0:
            return None
        val = num[0] / den[0]
        return Num(-val if m.group(1) == "-" else val, num[1] or den[1], percent, degree)
    return None


def _round6(x: Fraction) -> Fraction:
    return Fraction(round(x * 10**6), 10**6)


def numbers_equal(gold: Num, pred: Num) -> bool:
    """Exact comparison with the documented policies.

    - exact (integer/fraction) vs exact: equal values only (``025`` == ``25``).
    - a decimal on either side: equal after rounding both to 6 decimal places, math-verify's
      default (``0.333333`` == ``1/3``, ``0.33`` != ``1/3``), or relatively equal to 1e-9 for huge values.
    - percent: ``50\\%`` matches ``50`` and ``0.5`` (either side may carry the mark); with no mark
      anywhere, ``50`` != ``0.5``. A predicted ``0.12\\%`` does not match a bare gold ``0.12`` (a bare
      gold below 1 is a fraction), while ``12\\%`` matches ``12`` and ``0.12``.
    - degree marks are units: ``10^\\circ`` == ``10``.
    """
    # a bare gold below 1 reads as a fraction: "0.12\\%" is not the answer 0.12 (but "12\\%" is)
    gvals = [] if (pred.percent and not gold.percent and abs(gold.value) < 1) else [gold.value]
    if gold.percent and not pred.percent:
        gvals.append(gold.value / 100)
    if pred.percent and not gold.percent:
        gvals.append(gold.value * 100)
    approx = gold.decimal or pred.decimal
    for g in gvals:
        if g == pred.value:
            return True
        if approx:
            if _round6(g) == _round6(pred.value) and abs(g) >= Fraction(1, 10**4):
                return True
            # relative agreement only between two decimals: an integer gold is exact, and
            # "1.0 \\times 10^{12}" is not 999999999999
            exact_int = (not gold.decimal and g.denominator == 1) or (
                not pred.decimal and pred.value.denominator == 1
            )
            if g != 0 and not exact_int and abs(g - pred.value) <= abs(g) * Fraction(1, 10**9):
                return True
    return False


_OPEN_TO_CLOSE = {"(": ")", "[": "]", "{": "}"}


def bracket_depths(s: str) -> Iterator[tuple[str, int]]:
    """(token, nesting depth after it) along ``s``: a token is one character, or LaTeX's escaped
    brace ``\\{`` / ``\\}`` (two characters), which nests like (), [] and {}."""
    depth = 0
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and s[i + 1] in "{}":
            depth += 1 if s[i + 1] == "{" else -1
            yield s[i : i + 2], depth
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        yield c, depth
        i += 1


def split_top_level(s: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside (), [], {} (``\\{``/``\\left(`` included): ``(1,2), 3`` -> [``(1,2)``, ``3``]."""
    parts: list[str] = []
    cur: list[str] = []
    for token, depth in bracket_depths(s):
        if token == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(token)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def balanced(s: str) -> bool:
    """Does every bracket of ``s`` close, and none close before it opens? (An escaped brace
    ``\\}`` that closes too early is caught by the next character or the final count.)"""
    depth = 0
    for token, depth in bracket_depths(s):
        if len(token) == 1 and depth < 0:
            return False
    return depth == 0
