"""Imported once by the pool's fork server so that every grading worker is born warm.

Importing this module imports the grader, math-verify, sympy and latex2sympy, grades a few
items and parses a few generic LaTeX shapes (ANTLR builds its parser tables lazily, on the first
parse of each shape: ~1 s in all). The pool's fork server
imports it before forking any worker (``set_forkserver_preload``), so a worker that replaces a
killed one is ready in milliseconds instead of seconds. Nothing else should import it.
"""

from __future__ import annotations

import contextlib

from stapo.verifier_service.grader import grade
from stapo.verifier_service.grader.parsing import sympy_parse

WARMUP_ITEMS: tuple[tuple[str, str, str], ...] = (
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", "math"),
    ("$x^2 + 2x + 1$", "(x+1)^2", "math"),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt2}{2}", "math"),
    ("Answer: 12", "12", "dapo"),
    # no marker: math-verify's search compiles its extraction regexes on first use (~30 ms)
    ("First 3 + 4 = 7, then we double it to get 14", "14", "math"),
    ("so x = 5", "7", "math"),
    # the numeric fast paths (mpmath contexts, parser tables) and a tuple
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{5}", "math"),
    ("\\boxed{(1, 3)}", "(1, 2)", "math"),
)


WARMUP_LATEX: tuple[str, ...] = (
    "\\left[ 1, \\frac{\\pi}{3} \\right]", "(1, 2)", "\\left( -\\frac{1}{2}, 3 \\right)", "(0,1) \\cup (2,3)",
    "y = 3x - 1", "\\sin x + \\cos x", "\\tan \\theta", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "x^2 + 2x + 1",
    "\\{1, 2, 3\\}", "x \\le 3", "2 \\sqrt{3} - 1", "\\frac{\\sqrt{2}}{2}", "3 + 4i", "f(x) = x^2 + 1",
    "\\log_2 8", "\\text{(B)}", "a = 2, b = 3", "[-2, 5)", "\\infty", "10^\\circ", "\\dfrac{3}{4}",
)  # fmt: skip
"""Generic LaTeX shapes parsed once in the fork server: ANTLR builds its prediction tables (DFA)
lazily, per process, on the first parse of each shape (a first interval costs ~200 ms, later ones
less). Parsed before forking, the tables are shared by every worker instead of rebuilt in each."""


def warm() -> None:
    """Grade the warm-up items; failures are ignored (a worker must start even if one case breaks)."""
    for pred, gold, mode in WARMUP_ITEMS:
        with contextlib.suppress(Exception):
            grade(pred, gold, mode)
    for latex in WARMUP_LATEX:
        with contextlib.suppress(Exception):
            sympy_parse(latex, False)
    sympy_parse.cache_clear()  # keep the tables, not the answers


warm()
