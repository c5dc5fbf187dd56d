"""Rejections: answers that are surely different from the gold, told without sympy.

Most answers that reach this far on an RL stream are wrong, and ANTLR plus ``simplify`` cost ~20-50 ms
per distinct string. :func:`surely_unequal` runs the family's members, each arguing in its docstring
from math-verify's own comparison why math-verify would say no too: plain arithmetic evaluated by
``numeric.py`` that differs far beyond math-verify's rounding (:func:`numerically_unequal`), words
with no math against a number (:func:`word_soup`), bracketed lists of numbers with an unmatched
element (:func:`brackets_unequal`), assignments ``y = G`` with different right sides
(:func:`equations_unequal`), different interval unions (:func:`interval_sets_unequal`), different
matrices (:func:`matrices_unequal`), cut-off fragments neither latex2sympy nor math-verify's search
can read (:func:`unparseable_fragment`). They only ever say no; every yes still comes from
math-verify. ``tests/unit/verifier_service/grader/test_grader_rejections.py`` and ``tests/unit/verifier_service/grader/test_grader_numeric.py``
check them against it.
"""

from __future__ import annotations

import re

from stapo.verifier_service.grader import mathverify
from stapo.verifier_service.grader.normalize import balanced, split_top_level
from stapo.verifier_service.grader.numeric import clearly_unequal, rational_function
from stapo.verifier_service.grader.numeric import constant as numeric_constant
from stapo.verifier_service.grader.numeric import differ as numeric_differ
from stapo.verifier_service.grader.numeric import evaluate as evaluate_numeric
from stapo.verifier_service.grader.numeric import variables as numeric_variables
from stapo.verifier_service.grader.parsing import AnswerInfo, is_prose, sympy_text
from stapo.verifier_service.grader.rules import RuleVerdict


def surely_unequal(gold: str, pred: str) -> bool:
    """Would math-verify surely say no? Each member below says why; False means "ask math-verify"."""
    return (
        numerically_unequal(gold, pred)
        or word_soup(gold, pred)
        or brackets_unequal(gold, pred)
        or equations_unequal(gold, pred)
        or interval_sets_unequal(gold, pred)
        or matrices_unequal(gold, pred)
        or unparseable_fragment(gold, pred)
    )


def rule_surely_unequal(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    return False if surely_unequal(gold, pred) else None


# the left side of a predicted equation that latex2sympy surely parses: "f(x)", "y", "c^2", ...
_FUNC_LHS_RE = re.compile(r"^\s*[a-ce-hj-zA-CF-HJ-Z]\s*\(\s*[a-ce-hj-zA-CF-HJ-Z]\s*\)\s*$")


def numerically_unequal(gold: str, pred: str) -> bool:
    """Would math-verify surely say no? Both sides evaluate (numeric.py) and differ beyond tolerance.

    Reads the strings latex2sympy would get (``sympy_text``). A predicted equation ``x = 49``
    (``a = b = c``, ``f(x) = ...``) against a gold that is not one is compared through its last
    right-hand side, which is what math-verify does with it; every side must parse, so the parse is
    the same. Strings that math-verify reads in complex mode (``\\mathbb{C}``, a lone ``i``) are
    left to it: there ``i`` may be the imaginary unit, here it is a variable.
    """
    g = sympy_text(gold)
    p = sympy_text(pred)
    if g is None or p is None or "=" in g:
        return False
    complex_mode = mathverify.load()["complex_mode"]
    if complex_mode(g) or complex_mode(p):
        return False
    if "=" in p:
        sides = p.split("=")
        if evaluate_numeric(sides[-1]) is None or not all(
            evaluate_numeric(x) is not None or _FUNC_LHS_RE.match(x) for x in sides[:-1]
        ):
            return False
        p = sides[-1]
    if clearly_unequal(g, p):
        return True
    # a tuple / interval / set of two or more distinct numbers is never one number
    gb = _bracket_values(gold)
    pv = evaluate_numeric(p)
    return gb is not None and len(set(gb[1])) >= 2 and pv is not None and pv[0] == pv[1]


# letters, spaces, commas, full stops: no operator that could make letters cancel (":" divides,
# "-" subtracts, "!" and "'" are postfix operators to latex2sympy)
_SOUP_RE = re.compile(r"[A-Za-z\s.,]*")
# a lone "e" is Euler's number. ("d x" is latex2sympy's DIFFERENTIAL token, but outside ``\\frac{d}{dx}``
# and ``\\int`` it becomes the plain symbol ``dx`` (``convert_atom``); both need a backslash, which the
# soup excludes, so words holding "d" + letter stay products of symbols.)
_SOUP_RISKY_RE = re.compile(r"(?i)\be\b")
# a letter latex2sympy surely reads as a free variable: not e (Euler's number), not i / j (the imaginary
# unit in complex mode: "iiii" could be 1)
_SOUP_VARIABLE_RE = re.compile(r"[a-df-hk-zA-DF-HK-Z]")
# words that latex2sympy's lexer reads as functions or constants even without a backslash
_LEXER_WORDS_RE = re.compile(
    r"(?i)gcd|lcm|floor|ceil|ar(?:c)?(?:sin|cos|tan)|eye|zeros|ones|cols|rows|diag|norm|rank|trace|rref|stack"
    r"|null|orthogonal|eigen|svd|inf|oo|matrix|det|pi"
)


# a power of a letter with a positive integer exponent ("c^2" in "By the Pythagorean theorem, c^2"):
# still a non-constant factor of the monomial (an exponent 0 could make it 1, so it is not allowed)
_SOUP_POW_RE = re.compile(r"(?<=[A-Za-z])\^(?:[1-9]|\{[1-9]\d?\})")


def _soup(text: str) -> bool:
    """Letters, spaces, commas, full stops, and powers ``c^2`` of single letters; nothing else."""
    return _SOUP_RE.fullmatch(_SOUP_POW_RE.sub("", text)) is not None


def word_soup(gold: str, pred: str) -> bool:
    """Plain words with no math ("Therefore the sum of t", a response cut after ``</think>``) vs a
    constant, an interval / union of intervals, or a matrix.

    latex2sympy would read the words as a product of one-letter variables (T*h*E*r*...), a
    monomial that cannot equal a constant gold; it costs ~50 ms of parsing and ``simplify`` to
    find that out. Decided only when the normalized text (normalization turns "infinity" into
    ``\\infty``) is letters, spaces, commas and full stops (no operator that could make letters
    cancel) and powers of letters with a positive integer exponent (``c^2``: a factor of the
    monomial), has no word the LaTeX lexer knows and no lone "e", keeps a letter other than
    e / i / j. Commas make a finite set of such monomials (``{c^2, B*y*t*h*E*...}``), which is
    not ``{constant}`` either (``sympy_compare_sets``: a symmetric difference that is not empty,
    element-wise comparisons of a monomial with a number). Text golds were compared as text before
    (step 2). Words with a "d" before a letter ("sides", "reconsider": latex2sympy's differential
    token) count as soup: the token is the plain symbol ``dx`` outside ``\\frac{d}{dx}`` and
    ``\\int``, which need a backslash.

    If latex2sympy fails on the normalized text (a full stop), ``sympy_parse`` lets math-verify
    search the raw prediction: with no digit except in such an exponent (its number patterns need
    a digit after a space, ``=`` or the start), no ``\\``, brackets or ``\\boxed`` and at most one
    ``$`` (every LaTeX pattern needs a closing delimiter: ``So the remaining quantity is $``), it
    finds nothing, and no answer is "no" too.

    A gold with variables (``x^3 + 3x - 6``, numeric.py's subset, not complex): every comma item
    of the soup must hold a letter the gold lacks (not d / e / i / j); then gold minus monomial
    changes with that letter, so it is not zero (``sympy_numeric_eq``, ``simplify``). A gold that
    is one letter goes through ``sympy_compare_symbols`` (names concatenated): left to it.

    Other golds: a matrix is never a monomial or a set (``sympy_numeric_eq`` and ``simplify`` of
    a matrix minus a scalar raise, caught as False; its ``str`` is no symbol's name); an interval
    or union of intervals with constant ends is not a finite set of monomials (its symmetric
    difference with one is not empty, and the open-interval-vs-two-elements rule compares its
    constant ends with monomials).
    """
    if not _soup(pred.replace("$", "")) or pred.count("$") > 1 or not is_prose(pred):
        return False
    norm = sympy_text(pred)
    if norm is None or not _soup(norm) or _LEXER_WORDS_RE.search(norm):
        return False
    words = _SOUP_POW_RE.sub("", norm)
    if _LEXER_WORDS_RE.search(words) or _SOUP_RISKY_RE.search(words) or not _SOUP_VARIABLE_RE.search(words):
        return False  # a variable must remain, and nothing may turn the product into a constant
    g = sympy_text(gold)
    if g is None:
        return False
    vals = evaluate_numeric(g) if "=" not in g else None
    if vals is not None and vals[0] == vals[1]:
        return True
    if vals is not None:  # an expression with variables: each item needs a letter the gold lacks
        gvars = numeric_variables(g)
        if gvars is None or mathverify.load()["complex_mode"](g) or len(gvars) == len(g.strip()) == 1:
            return False  # a one-letter gold meets math-verify's name-concatenation rule: left to it
        return all(
            any(c not in gvars and c not in "deij" for c in item.lower() if c.isalpha())
            for item in words.split(",")
        )
    return _matrix_cells(gold) is not None or _interval_union(gold) is not None


def _bracket_values(text: str) -> tuple[str, tuple] | None:
    """("(", values) for a bracketed list of plain numbers, as latex2sympy would read it, else None."""
    norm = sympy_text(text)
    if norm is None:
        return None
    body = norm.replace("\\left", "").replace("\\right", "").strip()
    if len(body) < 2 or body[0] not in "([" or body[-1] not in ")]":
        return None
    inner = body[1:-1]
    if not balanced(inner):
        return None
    parts = split_top_level(inner)
    if len(parts) < 2:
        return None
    vals = []
    for part in parts:
        v = evaluate_numeric(part)
        if v is None or v[0] != v[1] or abs(v[0].imag) > 0:
            return None  # a variable, or not real
        vals.append(v[0].real)
    return body[0] + body[-1], tuple(vals)


def brackets_unequal(gold: str, pred: str) -> bool:
    """Tuples / intervals of plain numbers with the same brackets, where some gold value has no match.

    Whatever math-verify reads them as (interval, tuple, finite set, ordered or not), an element
    of the gold that equals no element of the prediction makes them different. No reading drops
    an element: latex2sympy makes ``(5, 2)`` a tuple, not an empty interval, and ``[2, 2]`` the set {2}.
    """
    g, p = _bracket_values(gold), _bracket_values(pred)
    if g is None or p is None or g[0] != p[0] or len(g[1]) != len(p[1]):
        return False
    return any(all(numeric_differ(a, b) for b in p[1]) for a in g[1])


# the left side of an assignment: one letter (not e: Euler's number; d: a differential; i: the
# imaginary unit in complex mode)
_ASSIGNED_LETTER_RE = re.compile(r"^\s*([a-cf-hj-zA-CF-HJ-Z])\s*$")


def _assignment(text: str) -> tuple[str, str] | None:
    """(letter, right side) of ``L = G``, as latex2sympy would read it, when G is a rational function
    of letters other than L (numeric.py's subset); else None."""
    norm = sympy_text(text)
    if norm is None or norm.count("=") != 1 or mathverify.load()["complex_mode"](norm):
        return None
    lhs, rhs = norm.split("=")
    m = _ASSIGNED_LETTER_RE.match(lhs)
    if m is None:
        return None
    letter = m.group(1)
    names = numeric_variables(rhs)
    if (
        names is None
        or letter.lower() in names
        or not rational_function(rhs)
        or evaluate_numeric(rhs) is None
    ):
        return None
    return letter, rhs


def equations_unequal(gold: str, pred: str) -> bool:
    """Two assignments ``y = G`` and ``y = P`` (the same letter) whose right sides differ at a point.

    math-verify (``sympy_expr_eq`` -> ``sympy_compare_relational``) says yes in three ways, and none
    can hold when G and P (rational functions, neither containing y) differ numerically:

    - same relation: ``y - G`` vs ``y - P``; their difference is ``P - G``, not zero (the numeric
      premise of ``numerically_unequal``: a difference beyond ``numeric.REL_TOL`` at a point is
      far beyond the 6-decimal rounding and ``evalf(chop=True)`` of ``sympy_numeric_eq``, and
      ``simplify`` keeps values);
    - flipped: ``y - G`` vs ``P - y``; the difference ``2y - G - P`` varies with y;
    - ``sympy_solve_and_compare``: ``solve`` of each equation for its free symbols is a list of
      dicts ``{s: v}``; math-verify needs both lists equally long (``zip(strict=True)``) and every
      pair with the same symbol and equal values. The gold's list is never empty (``solve_linear``
      always solves ``y - G`` for y, the coefficient being 1: either ``{y: G}`` is kept or an earlier
      symbol was solved), so the vacuous ``all([])`` cannot happen. A pair for ``s = y`` compares G
      with P: unequal. A pair for another letter ``s = x`` with equal values v means both
      ``G(x = v) = y`` and ``P(x = v) = y`` hold on the curve x = v(y, ...), and v takes a whole
      interval of values as y varies (``G(x = v) = y`` forces v to move with y); two rational
      functions that agree there, for every value of the other letters, are identical, so G = P
      everywhere: contradiction.

    Both sides must be one letter and one ``=`` (chains and ``f(x)`` are left to math-verify);
    ``exact_constants_equal`` never applies to equations.
    """
    if "=" not in gold or "=" not in pred:
        return False
    g, p = _assignment(gold), _assignment(pred)
    return g is not None and p is not None and g[0] == p[0] and clearly_unequal(g[1], p[1])


_CUP_RE = re.compile(r"\\cup(?![A-Za-z])")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?=\s*[()\[\]])")
_INFTY_RE = re.compile(r"^([+-]?)\s*\\infty$")
_INF = object()  # marks an infinite endpoint (its sign is known from its side)


def _endpoint(text: str):
    """(value, text) of a finite endpoint; ("-inf" / "+inf", None) for infinities; None otherwise."""
    text = text.strip()
    m = _INFTY_RE.match(text)
    if m:
        return ("-inf" if m.group(1) == "-" else "+inf", None)
    v = numeric_constant(text)
    return None if v is None else (v, text.replace(" ", ""))


def _interval_union(text: str) -> tuple | None:
    """An interval or a union of intervals with constant endpoints, as latex2sympy reads it:
    a tuple of (lo, lo_closed, hi, hi_closed), lo/hi = (value, text) or None for -oo / +oo; else None.

    Only ``(a, b)`` / ``[a, b]`` / half-open pieces joined by ``\\cup``, with lo < hi clearly (then
    latex2sympy reads ``(a, b)`` as an open interval, not a tuple) and ``-\\infty`` / ``\\infty``
    only where they make sense. sympy makes infinite ends open: ``[-\\infty, 3)`` is ``(-oo, 3)``.
    """
    return _union_of(sympy_text(text))


def _union_of(norm: str | None) -> tuple | None:
    """``_interval_union`` of an already normalized text."""
    if norm is None or "\\in" in norm.replace("\\infty", "") or mathverify.load()["complex_mode"](norm):
        return None
    out = []
    for piece in _CUP_RE.split(_LEFT_RIGHT_RE.sub("", norm)):
        piece = piece.strip()
        if len(piece) < 5 or piece[0] not in "([" or piece[-1] not in ")]" or not balanced(piece[1:-1]):
            return None
        parts = split_top_level(piece[1:-1])
        if len(parts) != 2:
            return None
        lo, hi = _endpoint(parts[0]), _endpoint(parts[1])
        if lo is None or hi is None or lo[0] == "+inf" or hi[0] == "-inf":
            return None
        lo_closed, hi_closed = piece[0] == "[", piece[-1] == "]"
        if lo[0] == "-inf":
            lo, lo_closed = None, False
        if hi[0] == "+inf":
            hi, hi_closed = None, False
        if lo is not None and hi is not None and (lo[0] >= hi[0] or not numeric_differ(lo[0], hi[0])):
            return None  # (5, 2), (2, 2): a tuple to latex2sympy
        out.append((lo, lo_closed, hi, hi_closed))
    return tuple(out)


def _union_pieces(unions: list[tuple]) -> list[tuple[bool, ...]] | None:
    """Each union as the membership of the line's elementary pieces (gaps and endpoints), or None
    when two endpoints are neither the same text nor clearly apart (then their order is unsure)."""
    ends = sorted(
        {e for u in unions for iv in u for e in (iv[0], iv[2]) if e is not None}, key=lambda e: e[0]
    )
    rank: dict[tuple, int] = {}
    r = -1
    for k, e in enumerate(ends):
        if k == 0 or numeric_differ(ends[k - 1][0], e[0]):
            r += 1
        elif ends[k - 1][1] != e[1]:
            return None
        rank[e] = r
    m = r + 1  # piece 2k+1 is the k-th endpoint; 2k, 2k+2 the gaps on either side
    out = []
    for u in unions:
        inside = [False] * (2 * m + 1)
        for lo, lo_closed, hi, hi_closed in u:
            start = 0 if lo is None else 2 * rank[lo] + (1 if lo_closed else 2)
            end = 2 * m if hi is None else 2 * rank[hi] + (1 if hi_closed else 0)
            for k in range(start, end + 1):
                inside[k] = True
        out.append(tuple(inside))
    return out


_IN_SET_RE = re.compile(r"^\s*([A-Za-z])\s*\\in(?![A-Za-z])(.+)$", re.S)


def _in_union(text: str) -> tuple | None:
    """The union of ``x \\in U`` (latex2sympy: ``Eq(x, U)``, U an ``_interval_union``), else None."""
    norm = sympy_text(text)
    m = _IN_SET_RE.match(norm) if norm is not None and "\\in" in norm else None
    return _union_of(m.group(2)) if m else None


def _numeric_equation(text: str) -> bool:
    """latex2sympy reads it as an equation (or a chain): every ``=`` side in numeric.py's subset."""
    norm = sympy_text(text)
    if norm is None or "=" not in norm or mathverify.load()["complex_mode"](norm):
        return False
    sides = norm.split("=")
    return all(evaluate_numeric(x) is not None or _FUNC_LHS_RE.match(x) for x in sides) and any(
        evaluate_numeric(x) is not None for x in sides
    )


def interval_sets_unequal(gold: str, pred: str) -> bool:
    """Intervals / unions of intervals with constant endpoints that are different sets, or such a set
    against a single number or expression.

    math-verify (``sympy_expr_eq`` -> ``sympy_compare_sets``) calls two sets equal when they are the
    same object, when sympy proves their symmetric difference empty, or, for an open interval against
    a 2-element finite set or tuple, element by element (``(1, 2)`` = ``1, 2``); both Interval ->
    ``sympy_compare_interval``: the same ends and open/closed flags. A number becomes ``{n}``. So
    two unions that differ as sets of reals (an end moved beyond ``numeric.REL_TOL``, an end open in
    one and closed in the other, a piece more) are unequal in every one of those ways, and a union of
    intervals of positive length is never one number (the 2-element rule needs a finite set of two,
    which neither side is); the same holds for any one expression of numeric.py's subset, with
    variables or not (``{x^2 - 21x + 10}``: one element). The sets are compared exactly on the
    line cut at every endpoint; two endpoints that are close but not the same text are undecided.
    Single intervals vs single
    intervals are included (``(1, 2)`` vs ``[1, 2)``), tuples are not (``(5, 2)``: lo must be < hi).

    A gold ``x \\in U`` is ``Eq(x, U)`` to latex2sympy. Against a prediction that is not an
    equation math-verify compares U with it (the assignment gold is unwrapped): the rules above
    apply to U. Against ``y \\in V``: two ``Eq`` are equal only as the same object (so only if U
    and V are), and its relational comparisons fail (``x - U``: TypeError; ``solve``: TypeError), so
    different sets are "no". Against an equation of numeric.py's subset (``\\frac{518}{7} = 74``,
    ``f(x) = x^2 - 21x + 10``): those same relational comparisons fail, "no".
    """
    gin = _in_union(gold) if "\\in" in gold else None
    if gin is not None:
        # gold Eq(x, U): against an equation math-verify subtracts a set (TypeError, caught) and
        # solve fails; against an ``x \\in`` answer, Eq == Eq needs the same U; against anything
        # else it compares U itself (``sympy_expr_eq`` unwraps an assignment gold)
        if _numeric_equation(pred):
            return True
        pin = _in_union(pred) if "\\in" in pred else None
        if pin is not None:
            pieces = _union_pieces([gin, pin])
            return pieces is not None and pieces[0] != pieces[1]
        if "=" in pred or "\\in" in pred:
            return False
    gu = gin if gin is not None else _interval_union(gold) if gold.lstrip()[:1] in ("(", "[", "\\") else None
    pu = _interval_union(pred) if pred.lstrip()[:1] in ("(", "[", "\\") else None
    if gu is not None and pu is not None:
        pieces = _union_pieces([gu, pu])
        return pieces is not None and pieces[0] != pieces[1]
    if gu is None and pu is None:
        return False
    other = pred if gu is not None else gold
    norm = sympy_text(other)
    return (
        norm is not None
        and "=" not in norm
        and not mathverify.load()["complex_mode"](norm)
        and evaluate_numeric(norm) is not None
    )


# the commands latex2sympy lexes as tokens without braces of their own (no \text{...}-style token
# that swallows braces, no \begin{...}); anything else makes unparseable_fragment undecided
_PLAIN_CMDS = frozenset({"\\frac", "\\dfrac", "\\tfrac", "\\sqrt", "\\cdot", "\\times", "\\div", "\\pi"})
_BACKSLASH_RE = re.compile(r"\\[A-Za-z]*")
# a command cut at the end of the text (not right after a "d": latex2sympy's differential token
# "d \\frac" would hold it)
_CUT_CMD_RE = re.compile(r"\\[A-Za-z]+$")
# \frac with its numerator only, at the very end (cut before the denominator)
_HALF_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{[^{}]*\}\s*$")
# an operator that needs something after it, at the very end (not "\\:" / "\\,": skipped spaces)
_TRAILING_OP_RE = re.compile(r"(?<!\\)([=:^+\-*/_,])\s*$")
_CUT_CMDS = frozenset(c[:k] for c in ("\\frac", "\\dfrac", "\\tfrac", "\\sqrt") for k in range(2, len(c) + 1))
"""``\\frac`` / ``\\sqrt`` (they need an argument) and their pieces ``\\fr``, ``\\sq``, ``\\d``, ...
(no lexer token is one of them)."""
# what math-verify's search needs to find anything: a LaTeX span ($...$, $$...$$, \[...\], \(...\),
# " [...] "), \boxed, a complete \frac of two numbers (its plain-text fraction pattern), or a digit
# run where a number may start (checked by _anchored_digits)
_SEARCHABLE_RE = re.compile(r"\[|\]|\\\(|\\boxed|\\frac\{-?\d+(?:[.,]\d+)?\}\{-?\d+(?:[.,]\d+)?\}")
_DIGITS_RE = re.compile(r"\d+")
# characters after which math-verify's number / expression patterns cannot start (they need the
# start, a space or "=" before the number, with at most "-", "(", ".", "**" or a currency sign between)
_NOT_ANCHOR = frozenset("{}^_/+")


def _anchored_digits(text: str) -> bool:
    """Could math-verify's number or expression patterns start at some digit run of ``text``?"""
    for m in _DIGITS_RE.finditer(text):
        before = text[m.start() - 1] if m.start() else ""
        if not (before.isascii() and (before.isalpha() or before in _NOT_ANCHOR)):
            return True
    return False


def unparseable_fragment(gold: str, pred: str) -> bool:
    """A cut-off fragment ("Let me double-check: $\\frac{", "... the case where $n =") that neither
    latex2sympy nor math-verify's search can read: the grader then has no prediction, "no".

    ``sympy_parse`` gives latex2sympy the normalized text (math-verify's ``parse_latex_cached``,
    which retries only the part after the last ``=`` when there are two or more) and, if that
    fails, lets math-verify search the raw text. Both fail for sure when:

    - the normalized text is ASCII, its only commands are ``_PLAIN_CMDS`` and it has no ``=`` and
      a different number of ``{`` and ``}``: every rule of latex2sympy's grammar (PS.g4) that uses
      ``{`` closes it with ``}``, and the only lexer tokens holding braces without a backslash
      (``^{T}``) hold both, so an unbalanced text has no parse tree and the error listener raises;
      or it ends with an operator that needs an operand after it: ``=`` (then exactly one ``=``:
      math-verify retries the part after the last of several), ``:``, ``^``, ``_``, ``+``, ``-``,
      ``*``, ``/`` or ``,`` (``c^`` in "By the Pythagorean theorem, $c^"); in PS.g4 each is infix or
      prefix (``^`` and ``_`` need their argument, ``,`` another element), no token ends with one
      except other infix relations (``<=``, ``!=``), and ``\\:`` / ``\\,`` (skipped spaces) are
      excluded; for any of these the commands before do not matter; or it ends with one backslash (cut inside a
      command, ``$\\``): every lexer token that starts with a backslash has more after it, and
      none that could hold it (``\\text{...}``) is closed, so the lexer's error listener raises
      (for any number of ``=``: math-verify's retry on the last part ends the same way); or it ends
      with ``\\frac`` / ``\\sqrt`` (the grammar needs their braces) or a piece of one (``\\fr``: no
      lexer token), or with ``\\frac{a}`` (the denominator cut off: the ``frac`` rule needs both
      groups), not right after a ``d`` (``d\\frac`` is one differential token);
    - the raw text has at most one ``$`` (every LaTeX pattern needs a closing delimiter), no ``[``,
      ``]``, ``\\(``, ``\\boxed`` or complete ``\\frac{1}{2}``, and every digit run follows a
      letter or one of ``{}^_/+`` (``$\\frac{255``, ``c^2``): math-verify's number and expression
      patterns need the start, a space or ``=`` before a number (with at most ``-``, ``(``, ``.``,
      ``**`` or a currency sign between), so the search finds nothing.

    The gold does not matter. Verified against the real parse and search by the tests.
    """
    if pred.count("$") > 1 or _SEARCHABLE_RE.search(pred) or _anchored_digits(pred):
        return False
    norm = sympy_text(pred)
    if norm is None:
        return False
    if norm.endswith("\\") and not norm.endswith("\\\\"):
        return True  # a lone backslash at the end: no lexer token is a bare backslash
    op = _TRAILING_OP_RE.search(norm)
    if op is not None and (op.group(1) != "=" or norm.count("=") == 1):
        return True  # an operator at the very end: it needs an operand after it
    cut = _CUT_CMD_RE.search(norm)
    if (
        cut is not None
        and cut.group(0) in _CUT_CMDS
        and not norm[: cut.start()].rstrip().endswith(("d", "D", "\\"))
    ):
        return True  # \frac, \sqrt or a piece of one at the very end
    half = _HALF_FRAC_RE.search(norm)
    if half is not None and not norm[: half.start()].rstrip().endswith(("d", "D", "\\")):
        return True  # \frac{a} at the very end: the grammar needs the denominator
    if not norm.isascii() or "<" in norm or ">" in norm:
        return False
    if any(cmd not in _PLAIN_CMDS for cmd in _BACKSLASH_RE.findall(norm)):
        return False
    return "=" not in norm and norm.count("{") != norm.count("}")


_MATRIX_RE = re.compile(r"^\\begin\{(pmatrix|bmatrix|matrix)\}(.*)\\end\{\1\}$", re.S)


def _matrix_cells(text: str) -> tuple[tuple[str, ...], ...] | None:
    """The entries of a ``pmatrix`` / ``bmatrix`` / ``matrix`` of numeric.py's subset, row by row."""
    norm = sympy_text(text)
    if norm is None or mathverify.load()["complex_mode"](norm):
        return None
    m = _MATRIX_RE.match(norm.strip())
    if m is None or "\\begin" in m.group(2):
        return None
    rows = m.group(2).split("\\\\")
    if rows and not rows[-1].strip():
        rows.pop()  # a trailing row break
    cells = tuple(tuple(c.strip() for c in row.split("&")) for row in rows)
    if not cells or len({len(r) for r in cells}) != 1:
        return None
    if any(evaluate_numeric(c) is None for row in cells for c in row):
        return None
    return cells


def matrices_unequal(gold: str, pred: str) -> bool:
    """Two matrices of different shapes, or of one shape with an entry that differs numerically.

    latex2sympy reads both as sympy Matrices (``vmatrix`` is a determinant: not matched). math-verify
    (``sympy_expr_eq``): structural equality fails; ``sympy_numeric_eq`` compares same-shape matrices
    entry by entry (all must agree: one entry beyond ``numeric.REL_TOL`` cannot, the premise of
    ``numerically_unequal``) and returns False for different shapes; ``sympy_symbolic_eq`` needs
    ``simplify(a - b)`` to be the zero matrix (the differing entry is not zero; different shapes
    raise, caught as False). A matrix against a scalar expression of the numeric subset: structural
    equality fails, ``sympy_numeric_eq`` compares ``Matrix == scalar`` (False) or fails on
    ``Matrix - scalar`` (caught), and ``simplify(Matrix - scalar)`` raises (caught). Matrices are not
    ``sympy.Expr``, so ``exact_constants_equal`` is silent.
    """
    if "\\begin" not in gold and "\\begin" not in pred:
        return False
    g, p = _matrix_cells(gold), _matrix_cells(pred)
    if g is None and p is None:
        return False
    if g is None or p is None:  # a matrix against a scalar expression
        norm = sympy_text(pred if g is not None else gold)
        return (
            norm is not None
            and "=" not in norm
            and not mathverify.load()["complex_mode"](norm)
            and evaluate_numeric(norm) is not None
        )
    if (len(g), len(g[0])) != (len(p), len(p[0])):
        return True
    return any(
        clearly_unequal(a, b) for ra, rb in zip(g, p, strict=True) for a, b in zip(ra, rb, strict=True)
    )
