"""The one module that touches math-verify (and latex2sympy2_extended) beyond its documented calls.

Why a seam: stapo relies on a handful of math-verify behaviours, some of them internals (module
globals of ``math_verify.parser`` that its search looks up at call time, the group names of its
LaTeX regexes, the string it reports with ``fallback_mode="first_match"``). Upgrading math-verify
is then this file and ``tests/unit/verifier_service/grader/test_grader_mathverify.py`` (one test per behaviour relied on).

What lives here:

- :func:`load`: math-verify's public functions and the normalization configs the grader uses,
  imported once (sympy + ANTLR, ~1 s), with the search oracles installed;
- the search oracles: while :func:`search` runs with ``oracle=True`` on this thread, the parse
  attempts of math-verify's search are answered "parses" where the string it reports cannot depend
  on them (``parsing.search_fallback`` says why that is exact); every other caller gets the real
  functions.

Written against math-verify 0.9 (``parser.extract_target_from_pred``, ``parser.parse_latex_cached``,
``parser.extract_latex``, ``parser.parse_expr_cached``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_MV: dict[str, Any] | None = None
_STATE = threading.local()
_PARSES = None


def load() -> dict[str, Any]:
    """math-verify's functions and configs (keys: parse, verify, normalize_latex, parse_latex, norm,
    norm_keep_units, search_cfg, complex_mode), imported once, search oracles installed."""
    global _MV
    if _MV is None:
        from latex2sympy2_extended.latex2sympy2 import NormalizationConfig, normalize_latex
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
        from math_verify import parser as mv_parser
        from math_verify.grader import should_treat_as_complex
        from math_verify.parser import parse_latex_cached

        if not getattr(mv_parser.parse_latex_cached, "stapo_oracle", False):
            mv_parser.parse_latex_cached = _parse_oracle(mv_parser.parse_latex_cached)
        if not getattr(mv_parser.extract_latex, "stapo_oracle", False):
            mv_parser.extract_latex = _match_oracle(mv_parser.extract_latex)
        if not getattr(mv_parser.parse_expr_cached, "stapo_oracle", False):
            mv_parser.parse_expr_cached = _expr_oracle(mv_parser.parse_expr_cached)

        def norm(units: bool) -> Any:
            return NormalizationConfig(
                basic_latex=True,
                units=units,
                malformed_operators=True,
                nits=True,
                boxed="all",
                equations=False,
            )

        _MV = {
            "norm": norm(True),
            "norm_keep_units": norm(False),
            "parse": parse,
            "verify": verify,
            "normalize_latex": normalize_latex,
            "parse_latex": parse_latex_cached,
            "search_cfg": (LatexExtractionConfig(), ExprExtractionConfig()),
            "complex_mode": should_treat_as_complex,
        }
    return _MV


def search(body: str, *, oracle: bool, surely_parses: Callable[[str], bool]) -> list:
    """math-verify's own search of ``body`` (last LaTeX span, else last number), ``first_match``
    fallback: the list ``parse`` returns. With ``oracle`` the parse attempts are answered as above;
    ``surely_parses(latex)`` says which many-group candidates parse without ANTLR."""
    mv = load()
    _STATE.active = oracle
    _STATE.surely_parses = surely_parses
    try:
        return mv["parse"](
            body, extraction_config=mv["search_cfg"], fallback_mode="first_match", parsing_timeout=None
        )
    finally:
        _STATE.active = False
        _STATE.single = False


def stand_in():
    """The object the oracles return for "this parses": a sympy object, so math-verify's percent
    wrapping and set building still work on it."""
    global _PARSES
    if _PARSES is None:
        import sympy

        _PARSES = sympy.Symbol("stapo_parses")
    return _PARSES


def _parse_oracle(real: Callable) -> Callable:
    """Wrap ``parse_latex_cached`` (a module global of ``math_verify.parser``, looked up at call time)."""

    def parse_latex_cached(latex: str):
        if getattr(_STATE, "active", False) and (
            getattr(_STATE, "single", False) or _STATE.surely_parses(latex)
        ):
            return stand_in()
        return real(latex)

    parse_latex_cached.stapo_oracle = True  # type: ignore[attr-defined]
    parse_latex_cached.cache_info = real.cache_info  # type: ignore[attr-defined]
    parse_latex_cached.cache_clear = real.cache_clear  # type: ignore[attr-defined]
    return parse_latex_cached


def _match_oracle(real: Callable) -> Callable:
    """Wrap ``extract_latex``: inside the search, a match with ONE LaTeX group parses.

    math-verify's search keeps trying matches (rightmost first, by priority) until one parses, but
    the string it reports with ``fallback_mode="first_match"`` is the text of the *first* match it
    tried, computed before parsing. Only a match with several LaTeX groups ("$a$ and $b$") reports a
    string that depends on parsing (all groups parse: joined with "and"; else the first), so those
    still get the real answer (or ``surely_parses``).
    """

    def extract_latex(match, latex_config):
        if not getattr(_STATE, "active", False):
            return real(match, latex_config)
        groups = sum(
            1
            for name, val in match.groupdict().items()
            if val and (name.startswith("first_latex") or (name.startswith("next") and "_latex" in name))
        )
        _STATE.single = groups == 1
        try:
            return real(match, latex_config)
        finally:
            _STATE.single = False

    extract_latex.stapo_oracle = True  # type: ignore[attr-defined]
    extract_latex.cache_info = getattr(real, "cache_info", None)  # type: ignore[attr-defined]
    extract_latex.cache_clear = getattr(real, "cache_clear", None)  # type: ignore[attr-defined]
    return extract_latex


def _expr_oracle(real: Callable) -> Callable:
    """Wrap ``parse_expr_cached`` (sympy's ``parse_expr`` of a plain-text expression match): inside the
    search it "parses"; the reported string is the match text either way."""

    def parse_expr_cached(expr: str):
        if getattr(_STATE, "active", False):
            return stand_in()
        return real(expr)

    parse_expr_cached.stapo_oracle = True  # type: ignore[attr-defined]
    parse_expr_cached.cache_info = getattr(real, "cache_info", None)  # type: ignore[attr-defined]
    parse_expr_cached.cache_clear = getattr(real, "cache_clear", None)  # type: ignore[attr-defined]
    return parse_expr_cached
