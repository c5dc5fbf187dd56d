"""Structure rules: answers made of parts, compared part by part.

Unordered lists (``2, 3`` = ``\\{3, 2\\}``), function names (``f(x) = 2x+1`` = ``y = 2x+1``),
inequalities read as the set they describe (``x < -2 or x > 3`` = ``(-\\infty,-2)\\cup(3,\\infty)``),
equation sides (``x=2`` = ``2``), ``x \\in S``, and tuples / intervals / sets element by element.
Each part is compared by ``same`` (the whole table, ``table.equiv``), which the table passes in:
these rules recurse into the table without importing it. They only run with the full budget.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from stapo.verifier_service.grader.numeric import constant as numeric_constant
from stapo.verifier_service.grader.parsing import AnswerInfo, answer_info
from stapo.verifier_service.grader.rules import RuleVerdict

Same = Callable[[str, str], bool]
"""Is the extracted prediction (second) the same answer as the gold (first)? (``table.equiv``)"""

_ASSIGN_LHS_RE = re.compile(r"^\s*[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?(?:\([^()=]*\))?\s*$")
_COEF_LHS_RE = re.compile(r"^-?\d+(?:\.\d+)?[A-Za-z]")
_IN_RE = re.compile(r"^[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?\\in(.+)$")


def _match_unordered(golds: tuple[str, ...], preds: tuple[str, ...], same: Same) -> bool:
    """Every gold item matched by a distinct prediction item (small lists; greedy with backtracking)."""
    if len(golds) != len(preds):
        return False
    used = [False] * len(preds)

    def rec(i: int) -> bool:
        if i == len(golds):
            return True
        for j, p in enumerate(preds):
            if not used[j] and same(golds[i], p):
                used[j] = True
                if rec(i + 1):
                    return True
                used[j] = False
        return False

    return rec(0)

def rule_unordered_list(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo, *, same: Same) -> RuleVerdict:
    # "2, 3" (also against "\\{3, 2\\}"); each item may be "x=2". Says only yes.
    if len(g.items) <= 1:
        return None
    p_items = p.items
    if len(p_items) == 1 and p.bracket is not None and p.bracket[0] == "\\{":
        p_items = p.bracket[2]
    if len(p_items) == 1 and len(p.eq_parts) > 1:
        p_items = answer_info(p.eq_parts[-1]).items
    if len(p_items) == len(g.items) and _match_unordered(g.items, p_items, same):
        return True
    return None


def rule_function_name(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo, *, same: Same) -> RuleVerdict:
    # "f(x) = 2x+1" = "y = 2x+1" = "g(x) = 2x+1": compare right-hand sides
    if len(g.eq_parts) == 2 and len(p.eq_parts) == 2 and g.eq_parts[0] != p.eq_parts[0]:
        if _fn_lhs_compatible(g.eq_parts[0], p.eq_parts[0]):
            return same(g.eq_parts[1], p.eq_parts[1])
    return None


def rule_inequality_set(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo, *, same: Same) -> RuleVerdict:
    # "x < -2 or x > 3" against an interval / union gold: the same set written as intervals
    if _INEQ_IN_RE.search(g.canon):
        return None
    union = inequalities_as_intervals(p.canon, pred)
    if union is not None and union != p.canon:
        return same(gold, union)
    return None


def rule_equation_sides(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo, *, same: Same) -> RuleVerdict:
    # follow the gold's form: "x=2" vs "2" and "2" vs "x=2" compare right-hand sides
    g_eq, p_eq = len(g.eq_parts) > 1, len(p.eq_parts) > 1
    if p_eq and not g_eq and len(g.items) == 1:
        if _COEF_LHS_RE.match(p.eq_parts[0]):
            return False  # "2x=2" is an equation to solve, not the value 2
        if same(gold, p.eq_parts[-1]):
            return True
    elif (
        g_eq
        and not p_eq
        and len(g.eq_parts) == 2
        and _ASSIGN_LHS_RE.match(g.eq_parts[0])
        and len(g.items) == 1
    ):
        return same(g.eq_parts[-1], pred)
    return None


def rule_element_of(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo, *, same: Same) -> RuleVerdict:
    m = _IN_RE.match(p.canon)
    if m and len(g.eq_parts) == 1 and "\\in" not in g.canon:
        return same(gold, m.group(1))
    return None


def rule_brackets(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo, *, same: Same) -> RuleVerdict:
    # tuples / intervals / sets: same brackets, elements in order (sets: any order). Says only yes.
    if g.bracket is not None and p.bracket is not None:
        (glo, ghi, gi), (plo, phi, pi) = g.bracket, p.bracket
        if len(gi) == len(pi):
            if glo == "\\{" and plo == "\\{":
                if _match_unordered(gi, pi, same):
                    return True
            elif glo == plo and ghi == phi and all(same(a, b) for a, b in zip(gi, pi, strict=True)):
                return True
    elif g.bracket is not None and g.bracket[0] == "\\{" and len(p.items) == len(g.bracket[2]) > 1:
        if _match_unordered(g.bracket[2], p.items, same):
            return True
    return None


_FN_CALL_RE = re.compile(r"^([A-Za-z])\(([a-z])\)$")


def _fn_lhs_compatible(a: str, b: str) -> bool:
    """``f(x)`` vs ``y``, or ``f(x)`` vs ``g(x)``: one function written under another name."""
    ma, mb = _FN_CALL_RE.match(a), _FN_CALL_RE.match(b)
    if ma and mb:
        return ma.group(2) == mb.group(2)
    if ma and b == "y" or mb and a == "y":
        return (ma or mb).group(2) == "x"
    return False


_INEQ_IN_RE = re.compile(r"<|>|\\le|\\ge|\\lt|\\gt")
_REL = r"(<|>|\\leq?|\\geq?|\\lt|\\gt)"
_ONE_SIDED_RE = re.compile(rf"^([a-z]){_REL}(.+)$")
_TWO_SIDED_RE = re.compile(rf"^(.+?){_REL}([a-z]){_REL}(.+)$")


_AND_RE = re.compile(r"(?i)\band\b|\\land\b|\\wedge\b")
_OR_RE = re.compile(r"(?i)\bor\b|\\lor\b|\\vee\b|\\cup\b")


def _ray(piece: str) -> tuple[str, tuple] | None:
    """(variable, (lo, lo_closed, hi, hi_closed)) of one inequality ``x > 1`` / ``-2 < x \\le 3``;
    lo / hi are endpoint texts, None for an infinite end."""
    m = _TWO_SIDED_RE.match(piece)
    lows = ("<", "\\le", "\\leq", "\\lt")
    if m and m.group(2) in lows and m.group(4) in lows:
        return m.group(3), (
            m.group(1),
            m.group(2).startswith("\\le"),
            m.group(5),
            m.group(4).startswith("\\le"),
        )
    m = _ONE_SIDED_RE.match(piece)
    if m is None or _INEQ_IN_RE.search(m.group(3)):
        return None
    rel, v = m.group(2), m.group(3)
    closed = rel in ("\\le", "\\leq", "\\ge", "\\geq")
    if rel in ("<", "\\lt", "\\le", "\\leq"):
        return m.group(1), (None, False, v, closed)
    return m.group(1), (v, closed, None, False)


def _intersection(rays: list[tuple]) -> tuple | None:
    """The interval common to all ``rays`` (finite ends must be constants), "empty", or None (undecided)."""
    lo, lo_c, hi, hi_c = None, False, None, False
    for a, a_c, b, b_c in rays:
        for end in (a, b):
            if end is not None and numeric_constant(end) is None:
                return None
        if a is not None and (
            lo is None
            or numeric_constant(a) > numeric_constant(lo)
            or (numeric_constant(a) == numeric_constant(lo) and not a_c)
        ):
            lo, lo_c = a, a_c
        if b is not None and (
            hi is None
            or numeric_constant(b) < numeric_constant(hi)
            or (numeric_constant(b) == numeric_constant(hi) and not b_c)
        ):
            hi, hi_c = b, b_c
    if lo is not None and hi is not None:
        lv, hv = numeric_constant(lo), numeric_constant(hi)
        if lv > hv or (lv == hv and not (lo_c and hi_c)):
            return ("empty",)
    return lo, lo_c, hi, hi_c


def _interval_text(r: tuple) -> str:
    lo, lo_c, hi, hi_c = r
    return (
        ("[" if lo_c else "(")
        + ("-\\infty" if lo is None else lo)
        + ","
        + ("\\infty" if hi is None else hi)
        + ("]" if hi_c else ")")
    )


def inequalities_as_intervals(canon: str, raw: str) -> str | None:
    """Several one-variable inequalities as the set they describe, read with their connective.

    ``x < -2 or x > 3`` -> ``(-\\infty,-2)\\cup(3,\\infty)``; ``x > 1 and x < 5`` -> ``(1,5)``. A bare
    comma is "or" when the pieces are disjoint (a list of solution ranges) and "and" when they
    overlap (``x > 1, x < 5``). Every piece must bound the same variable (``x > 1, y > 2`` is not a
    set of x), else None; both connectives at once, or ends that are not constants where the
    reading needs their order, give None too (undecided: the comparison goes on without this
    reading). An "and" with nothing in common is the empty set.
    """
    if not _INEQ_IN_RE.search(canon):
        return None
    pieces = [x.strip() for x in re.split(r",|\\lor|\\vee|\\cup|\\land|\\wedge", canon) if x.strip()]
    if len(pieces) < 2:
        return None
    rays = [_ray(p) for p in pieces]
    if any(r is None for r in rays) or len({r[0] for r in rays}) != 1:
        return None
    rays_only = [r[1] for r in rays]
    has_and, has_or = _AND_RE.search(raw) is not None, _OR_RE.search(raw) is not None
    if has_and and has_or:
        return None
    if has_or:
        return "\\cup".join(_interval_text(r) for r in rays_only)
    common = _intersection(rays_only)
    if common is None:
        return None
    if common == ("empty",):
        return "\\emptyset" if has_and else "\\cup".join(_interval_text(r) for r in rays_only)
    return _interval_text(common)
