"""Numeric evaluation of plain LaTeX arithmetic: reject clearly unequal answers without sympy.

Why: on an RL reward stream most answers that reach the grader's symbolic step are *wrong*
(a near-miss value, an equation from a cut-off response), and math-verify spends ~20 ms per
distinct string in ANTLR parsing and sympy ``simplify`` to say so. Evaluating both sides as
numbers takes microseconds. This module only ever proves inequality; equality is still decided
by the exact path (math-verify), so it can make the grader faster but never more lenient.

The accepted language is a deliberately small subset of what latex2sympy parses, read with
latex2sympy's own precedences (checked against it by ``tests/unit/verifier_service/grader/test_grader_numeric.py``):
integers and decimals, ``+ - * / \\cdot \\times \\div``, implicit products (which bind tighter
than ``/``: ``1/2x`` is ``1/(2x)``), ``^{...}`` / ``^d`` / ``^x`` (one level), ``\\frac{a}{b}``
(also ``\\dfrac``, ``\\tfrac``), ``\\sqrt{a}``, ``\\sqrt[n]{a}``, ``\\pi``, ``( )`` / ``{ }`` groups,
``\\left`` / ``\\right``, a degree sign ``^\\circ`` / ``^{\\circ}`` (latex2sympy keeps the value: the grader's
degrees-are-a-unit policy), and single-letter variables (lower-cased, as latex2sympy does). ``e`` and
``d`` are refused (latex2sympy may read ``e`` as Euler's number and ``d x`` as a differential);
``i`` is a plain variable here, so callers leave strings that math-verify reads in complex mode to
math-verify. Anything else -- commas, brackets, relations, functions (``f(x)``, ``\\pi(x)``),
subscripts, factorials, text, an integer next to a rational constant (latex2sympy reads
``2\\frac{1}{2}`` and even ``2(3)`` as mixed numbers) -- gives ``None``: undecided.

Variables are evaluated at a few fixed positive points, the same value for the same letter on
both sides; two expressions that differ at one point of their common domain are not identically
equal, so math-verify could not prove them equal either. Values are computed with mpmath at 50
digits; a result whose intermediate values grew past ``MAX_MAGNITUDE`` (cancellation risk) is
undecided. The rejection threshold (``REL_TOL`` relative, ``REL_TOL`` absolute below 1) is far wider than
math-verify's own 6-decimal rounding of floats, so a pair it would accept is never rejected.

Usage::

    from stapo.verifier_service.grader.numeric import clearly_unequal, evaluate
    evaluate("\\frac{\\sqrt{3}}{2}")            # (mpc(0.866...),) one value per evaluation point
    clearly_unequal("2\\sqrt{3}", "2\\sqrt{5}")  # True
    clearly_unequal("x^2+1", "1+x^2")           # False (equal, or undecided: ask math-verify)
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

import mpmath

__all__ = [
    "MAX_MAGNITUDE",
    "REL_TOL",
    "clearly_unequal",
    "constant",
    "differ",
    "evaluate",
    "parse",
    "rational_function",
    "variables",
]

REL_TOL = 1e-5
"""Reject only when |a - b| > REL_TOL * max(1, |a|, |b|) at some evaluation point."""
MAX_MAGNITUDE = mpmath.mpf(10) ** 30
"""Intermediate values above this are undecided: with 50 digits, rounding stays below 1e-20."""
MAX_LEN = 200
"""Longer strings are left to math-verify (RL answers are short; this bounds parser work)."""

_CTX = mpmath.MPContext()
_CTX.dps = 50
# positive, irrational-looking, distinct per letter; two points per variable
_POINTS = (
    {
        c: _CTX.mpf(0.5) + _CTX.mpf(k) * _CTX.mpf("0.1373") + _CTX.sqrt(k + 2) / 7
        for k, c in enumerate("abcdfghijklmnopqrstuvwxyz")
    },
    {
        c: _CTX.mpf(1.9) + _CTX.mpf(k) * _CTX.mpf("0.0917") + _CTX.sqrt(k + 3) / 5
        for k, c in enumerate("abcdfghijklmnopqrstuvwxyz")
    },
)

_TOKEN_RE = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<cmd>\\[A-Za-z]+)|(?P<letter>[A-Za-z])|(?P<op>[-+*/^(){}\[\]]))"
)
_MUL_CMDS = {"\\cdot", "\\times"}
_FRAC_CMDS = {"\\frac", "\\dfrac", "\\tfrac"}


class Undecided(Exception):
    """The string is outside the subset, or its value cannot be trusted; ask the exact path."""


# --------------------------------------------------------------------------- parsing
# AST nodes are tuples: ("num", Fraction, text), ("var", name), ("pi",), ("neg", a),
# ("add", a, b), ("sub", a, b), ("mul", a, b), ("div", a, b), ("imul", (f1, f2, ...)),
# ("pow", a, b), ("sqrt", a, n or None)


def _tokenize(s: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    s = s.rstrip()
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if m is None or m.end() == pos:
            raise Undecided(f"unsupported character at {pos}")
        kind = m.lastgroup
        text = m.group(kind)
        pos = m.end()
        if kind == "cmd":
            if text in ("\\left", "\\right"):
                nxt = _TOKEN_RE.match(s, pos)
                if nxt is None or nxt.group("op") != ("(" if text == "\\left" else ")"):
                    raise Undecided(f"{text} without a parenthesis")
                continue
            if text == "\\circ":
                # only latex2sympy's degree tokens ^\circ and ^{\circ}, written without spaces
                st = m.start("cmd")
                if not (s[st - 1 : st] == "^" or (s[st - 2 : st] == "^{" and s[pos : pos + 1] == "}")):
                    raise Undecided("\\circ outside a degree sign")
            elif text not in _MUL_CMDS and text not in _FRAC_CMDS and text not in ("\\div", "\\sqrt", "\\pi"):
                raise Undecided(f"command {text}")
        if kind == "letter":
            text = text.lower()
            if text in ("d", "e"):
                raise Undecided("e may be Euler's number, d starts a differential (d x, d\\cdot)")
            if out and out[-1][0] == "letter" and len(out) >= 2 and out[-2][0] == "letter":
                raise Undecided("three letters in a row read as a word")
        out.append((kind, text))
    return out


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.t = tokens
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self, text: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (text is not None and tok[1] != text):
            raise Undecided(f"expected {text!r}")
        self.i += 1
        return tok

    def additive(self) -> tuple:
        node = self.mp()
        while (tok := self.peek()) is not None and tok[1] in ("+", "-"):
            self.i += 1
            node = ("add" if tok[1] == "+" else "sub", node, self.mp())
        return node

    def mp(self) -> tuple:
        node = self.unary()
        while (tok := self.peek()) is not None and (tok[1] in ("*", "/", "\\div") or tok[1] in _MUL_CMDS):
            self.i += 1
            rhs = self.unary()
            node = ("div", node, rhs) if tok[1] in ("/", "\\div") else ("mul", node, rhs)
        return node

    def unary(self) -> tuple:
        tok = self.peek()
        if tok is not None and tok[1] in ("+", "-"):
            self.i += 1
            inner = self.unary()
            return ("neg", inner) if tok[1] == "-" else inner
        factors = [self.postfix()]
        while self._starts_postfix():
            prev = factors[-1]
            head = prev[1] if prev[0] == "pow" else prev
            if head[0] in ("var", "pi") and self.peek() == ("op", "("):
                raise Undecided("f(x), f^2(x), \\pi(x) are function calls to latex2sympy")
            if self.peek()[0] == "num":
                raise Undecided("a number after a factor: '2 3' is a mixed number, 'x2' a name")
            factors.append(self.postfix())
        return factors[0] if len(factors) == 1 else ("imul", tuple(factors))

    def _starts_postfix(self) -> bool:
        tok = self.peek()
        if tok is None:
            return False
        kind, text = tok
        return kind in ("num", "letter") or text in ("(", "{", "\\sqrt", "\\pi") or text in _FRAC_CMDS

    def _degree_ahead(self) -> int:
        """How many tokens a degree sign (``^\\circ``, ``^{\\circ}``) here takes, else 0."""
        t, i = self.t, self.i
        if i + 1 < len(t) and t[i] == ("op", "^"):
            if t[i + 1] == ("cmd", "\\circ"):
                return 2
            if (
                i + 3 < len(t)
                and t[i + 1] == ("op", "{")
                and t[i + 2] == ("cmd", "\\circ")
                and t[i + 3] == ("op", "}")
            ):
                return 4
        return 0

    def postfix(self) -> tuple:
        base = self.comp()
        if self.peek() == ("op", "^") and not self._degree_ahead():
            self.i += 1
            base = ("pow", base, self.sup())
        while n := self._degree_ahead():
            self.i += n  # a degree sign: latex2sympy (convert_degrees=False) keeps the value, 30^\\circ = 30
        if self.peek() == ("op", "^"):
            raise Undecided("x^a^b: latex2sympy groups it left to right")
        return base

    def sup(self) -> tuple:
        tok = self.take()
        kind, text = tok
        if text == "{":
            node = self.additive()
            self.take("}")
            return node
        if kind == "num" and len(text) == 1:
            return ("num", Fraction(text), text)
        if kind == "letter":
            return ("var", text)
        if text == "\\pi":
            return ("pi",)
        raise Undecided("unsupported exponent")

    def comp(self) -> tuple:
        kind, text = self.take()
        if kind == "num":
            return ("num", Fraction(text), text)
        if kind == "letter":
            return ("var", text)
        if text == "\\pi":
            return ("pi",)
        if text in ("(", "{"):
            node = self.additive()
            self.take(")" if text == "(" else "}")
            return node
        if text in _FRAC_CMDS:
            self.take("{")
            num = self.additive()
            self.take("}")
            self.take("{")
            den = self.additive()
            self.take("}")
            return ("div", num, den)
        if text == "\\sqrt":
            n = None
            if self.peek() == ("op", "["):
                self.i += 1
                n = self.additive()
                self.take("]")
            self.take("{")
            node = self.additive()
            self.take("}")
            return ("sqrt", node, n)
        raise Undecided(f"unexpected {text!r}")


@lru_cache(maxsize=16_384)
def _parse_cached(s: str) -> tuple | None:
    try:
        p = _Parser(_tokenize(s))
        if not p.t:
            return None
        node = p.additive()
        if p.peek() is not None:
            return None
        return node
    except (Undecided, RecursionError, ValueError):
        return None


def parse(s: str) -> tuple | None:
    """The AST of ``s`` when it is inside the supported subset, else None."""
    if len(s) > MAX_LEN:
        return None
    return _parse_cached(s)


# --------------------------------------------------------------------------- evaluation


def _has_var(node: tuple) -> bool:
    if node[0] == "var":
        return True
    if node[0] in ("num", "pi"):
        return False
    if node[0] == "imul":
        return any(_has_var(f) for f in node[1])
    return any(_has_var(x) for x in node[1:] if isinstance(x, tuple))


def _looks_rational(v) -> bool:
    """Could sympy hold this value as a Rational? (exactly a fraction with a small denominator)."""
    if abs(v.imag) > 1e-30:
        return False
    x = v.real
    man, exp = x.man_exp if hasattr(x, "man_exp") else (0, 0)
    approx = Fraction(int(man)) * (Fraction(2) ** int(exp)) if man else Fraction(0)
    q = approx.limit_denominator(10**6)
    return abs(x - _CTX.mpf(q.numerator) / q.denominator) <= 1e-25 * max(1, abs(x))


def _is_integer(v) -> bool:
    return abs(v.imag) <= 1e-30 and abs(v.real - _CTX.nint(v.real)) <= 1e-25 * max(1, abs(v.real))


def _ev(node: tuple, point: dict):
    kind = node[0]
    if kind == "num":
        v = _CTX.mpc(_CTX.mpf(node[2]))
    elif kind == "var":
        v = _CTX.mpc(point[node[1]])
    elif kind == "pi":
        v = _CTX.mpc(_CTX.pi)
    elif kind == "neg":
        v = -_ev(node[1], point)
    elif kind == "add":
        v = _ev(node[1], point) + _ev(node[2], point)
    elif kind == "sub":
        v = _ev(node[1], point) - _ev(node[2], point)
    elif kind == "mul":
        v = _ev(node[1], point) * _ev(node[2], point)
    elif kind == "div":
        den = _ev(node[2], point)
        if abs(den) < 1e-20:
            raise Undecided("division by ~0")
        v = _ev(node[1], point) / den
    elif kind == "imul":
        factors = node[1]
        vals = [_ev(f, point) for f in factors]
        # latex2sympy reads "Integer  positive-Rational" as a mixed fraction (2\frac{1}{2} = 5/2,
        # even 2(3) = 5): undecided whenever that reading is possible at some split.
        for k in range(len(factors) - 1):
            if _has_var(factors[k]) or not _is_integer(vals[k]):
                continue
            rest = factors[k + 1 :]
            if any(_has_var(f) for f in rest):
                continue
            prod = _CTX.mpc(1)
            for x in vals[k + 1 :]:
                prod *= x
            if prod.real > 0 and _looks_rational(prod):
                raise Undecided("possible mixed fraction")
        v = _CTX.mpc(1)
        for x in vals:
            v *= x
    elif kind == "pow":
        base, ex = _ev(node[1], point), _ev(node[2], point)
        if abs(ex) > 1000:
            raise Undecided("huge exponent")
        if abs(base) < 1e-20 and ex.real <= 0:
            raise Undecided("0 to a non-positive power")
        v = base**ex if abs(base) >= 1e-20 else _CTX.mpc(0)
    elif kind == "sqrt":
        x = _ev(node[1], point)
        if node[2] is None:
            v = _CTX.sqrt(x)
        else:
            n = _ev(node[2], point)
            if abs(n) < 1e-20:
                raise Undecided("0th root")
            v = x ** (1 / n) if abs(x) >= 1e-20 else _CTX.mpc(0)
    else:  # pragma: no cover - the parser makes no other node
        raise Undecided(kind)
    if not _CTX.isfinite(v.real) or not _CTX.isfinite(v.imag) or abs(v) > MAX_MAGNITUDE:
        raise Undecided("value too large to trust")
    return v


@lru_cache(maxsize=16_384)
def evaluate(s: str) -> tuple | None:
    """Values of ``s`` at the evaluation points (one per point), or None when undecided."""
    node = parse(s)
    if node is None:
        return None
    try:
        return tuple(_ev(node, pt) for pt in _POINTS)
    except (Undecided, ZeroDivisionError, ValueError, OverflowError):
        return None


def variables(s: str) -> frozenset[str] | None:
    """The (lower-cased) letters of ``s`` as latex2sympy's variables, or None outside the subset."""
    node = parse(s)
    if node is None:
        return None
    out: set[str] = set()

    def walk(n: tuple) -> None:
        if n[0] == "var":
            out.add(n[1])
        elif n[0] == "imul":
            for f in n[1]:
                walk(f)
        else:
            for x in n[1:]:
                if isinstance(x, tuple):
                    walk(x)

    walk(node)
    return frozenset(out)


def _rational(n: tuple) -> bool:
    kind = n[0]
    if kind in ("num", "var", "pi"):
        return True
    if kind == "imul":
        return all(_rational(f) for f in n[1])
    if kind == "pow":
        base, ex = n[1], n[2]
        if _has_var(ex):
            return False
        if not _has_var(base):
            return True
        if ex[0] == "neg":
            ex = ex[1]
        return ex[0] == "num" and ex[1].denominator == 1 and _rational(base)
    if kind == "sqrt":
        return not _has_var(n[1]) and (n[2] is None or not _has_var(n[2]))
    return all(_rational(x) for x in n[1:] if isinstance(x, tuple))


def rational_function(s: str) -> bool:
    """Is ``s`` (inside the subset) a rational function of its variables?

    Variables appear only under ``+ - * /`` and integer powers (roots and powers of constants are
    fine: ``\\sqrt{2}x^2``). Two such functions that agree on a curve along which a variable takes
    a whole interval of values agree everywhere, which is what the grader's equation rule needs.
    """
    node = parse(s)
    return node is not None and _rational(node)


def constant(s: str):
    """The real value of ``s`` when it is a constant of the subset (no variable, not complex), else None."""
    node = parse(s)
    if node is None or _has_var(node):
        return None
    vals = evaluate(s)
    if vals is None or abs(vals[0].imag) > 0:
        return None
    return vals[0].real


def differ(a, b) -> bool:
    """Clearly different values: beyond ``REL_TOL`` relative, with an absolute floor of ``REL_TOL``."""
    return abs(a - b) > REL_TOL * max(1, abs(a), abs(b))


def clearly_unequal(gold: str, pred: str) -> bool:
    """True only when both strings evaluate and differ beyond tolerance at some point.

    Both strings must be what latex2sympy would parse (math-verify's normalized form); False
    means "equal or undecided", never "equal".
    """
    ga, pa = evaluate(gold), evaluate(pred)
    if ga is None or pa is None:
        return False
    return any(differ(a, b) for a, b in zip(ga, pa, strict=True))


def cache_clear() -> None:
    _parse_cached.cache_clear()
    evaluate.cache_clear()
