"""The symbolic rule: math-verify's ``verify`` on golds parsed whole, exact constants at 50 digits.

The last rule of the table, and the only one that says yes to answers the cheaper rules could not
match. Golds are parsed whole with latex2sympy (``parsing.sympy_parse`` without search), never by a
regex search, so a single number cannot stand for an equation, tuple or set. sympy is already
loaded when these functions run (math-verify's parse returned its objects); they import it there.
"""

from __future__ import annotations

from stapo.verifier_service.grader import mathverify
from stapo.verifier_service.grader.parsing import AnswerInfo, sympy_parse
from stapo.verifier_service.grader.rules import RuleVerdict


def rule_math_verify(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    # math-verify's symbolic verify on golds parsed whole; exact constants compared at 50 digits.
    # A gold that does not parse cannot be compared at all: undecided (None; the grade's status says
    # so), never a guess. An answer that does not parse is "no", as in math-verify (``verify`` of an
    # empty parse is False): the model's unreadable answer is its own failure, an unreadable gold is not.
    gold_exprs = sympy_parse(gold, False)
    if not gold_exprs or constant_relation(gold_exprs):
        return None
    pred_exprs = sympy_parse(pred, True)
    if not pred_exprs:
        return False
    verify = mathverify.load()["verify"]
    ok = bool(verify(list(gold_exprs), list(pred_exprs), timeout_seconds=None, allow_set_relation_comp=True))
    exact = exact_constants_equal(gold_exprs, pred_exprs)
    return exact if exact is not None else ok


def constant_relation(exprs: tuple) -> bool:
    """A gold equation whose sides differ by a constant as parsed (``N=n``: math-verify reads ``N``
    as ``n``, giving ``Eq(n, n)``). Solved for its symbols it has no solution list to compare, and
    math-verify's solve-and-compare (``sympy_solve_and_compare``: ``all`` over zipped empty lists)
    then calls it equal to any other such equation (``N = n + 1``): no comparison is possible."""
    from sympy import Eq, Expr  # loaded already: math-verify's parse returned sympy objects

    for e in exprs:  # sides that are expressions only: tuples ("(p,q)=(3,2)") and sets do not subtract
        if isinstance(e, Eq) and isinstance(e.lhs, Expr) and isinstance(e.rhs, Expr):
            if not (e.lhs - e.rhs).free_symbols:
                return True
    return False


def exact_constants_equal(gold_exprs: tuple, pred_exprs: tuple) -> bool | None:
    """Equality of two exact real constants (no decimal anywhere) at 50 digits, relative; None otherwise.

    math-verify compares numbers after rounding to 6 decimals, an absolute tolerance: it calls
    ``\\frac{1}{3^{60}}`` and ``\\frac{1}{3^{59}}`` equal. And ``simplify`` misses identities such as
    ``\\tan 15^\\circ = 1/\\tan 75^\\circ``. Two exact constants (no float, so no rounding was meant)
    are equal when their 50-digit values agree to 1e-40 relative (or both are 0) and different when
    they differ beyond 1e-30; in between, or for anything that is not a plain real constant, None
    (math-verify decides). Answers written with a decimal keep math-verify's rounding policy.
    """
    import sympy

    g = next((e for e in gold_exprs if isinstance(e, sympy.Expr)), None)
    p = next((e for e in pred_exprs if isinstance(e, sympy.Expr)), None)
    if g is None or p is None:
        return None
    try:
        if not (g.is_number and p.is_number) or g.atoms(sympy.Float) or p.atoms(sympy.Float):
            return None
        if g.is_rational and p.is_rational:
            gr, pr = g.doit(), p.doit()  # latex2sympy leaves powers unevaluated
            if isinstance(gr, sympy.Rational) and isinstance(pr, sympy.Rational):
                return bool(gr == pr)  # integers and fractions: exactly (3^{100} + 3 != 3^{100})
        gv, pv = sympy.N(g, 60), sympy.N(p, 60)
        if not (gv.is_real and pv.is_real and gv.is_finite and pv.is_finite):
            return None
        scale = max(abs(gv), abs(pv))
        if scale == 0:
            return True
        diff = abs(gv - pv) / scale
        if diff <= sympy.Float("1e-40", 60):
            return True
        if diff > sympy.Float("1e-30", 60):
            return False
        return None
    except Exception:  # noqa: BLE001 - undecided: keep math-verify's answer
        return None
