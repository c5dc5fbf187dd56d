"""The DAPO recipe's string-normalization verifier (mode ``dapo``), reimplemented.

DAPO (and JustRL, which reuses it) rewards a response when the text after its last
``Answer:`` equals the gold after both go through the Minerva-style ``normalize_final_answer``
(verl ``verl/utils/reward_score/math_dapo.py``, itself adapted from lm-eval-harness
``hendrycks_math``). No sympy: ``1/2`` and ``0.5`` differ, ``\\frac{1}{2}`` and ``\\dfrac{1}{2}`` differ.
The recipe scores only the last 300 characters of the response; we do the same so the
reward matches published DAPO numbers.

Usage::

    from stapo.verifier_service.grader.dapo import dapo_extract, dapo_normalize
    dapo_normalize(dapo_extract("...\\nAnswer: $1{,}000$"))  # -> "1000"
"""

from __future__ import annotations

import re

TAIL_CHARS = 300
"""The recipe looks only at the end of the response (its longest MATH-500 answer is 159 chars)."""

# Replacements and removals applied in order, as in the Minerva normalizer.
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
    "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
    "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ",
    "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def dapo_extract(text: str) -> str | None:
    """Text after the last ``Answer:`` in the last ``TAIL_CHARS`` characters, or None."""
    found = _ANSWER_RE.findall(text[-TAIL_CHARS:])
    return found[-1] if found else None


def dapo_normalize(answer: str) -> str:
    """Minerva/DAPO ``normalize_final_answer``: keep the last ``=`` side, strip units and markup."""
    s = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", s)
    s = re.sub(r"(\\text\{)(.*?)(\})", r"\2", s)
    s = re.sub(r"(\\textbf\{)(.*?)(\})", r"\2", s)
    s = re.sub(r"(\\overline\{)(.*?)(\})", r"\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", s)
    # shorthand TeX: \fracab -> \frac{a}{b}, \sqrta -> \sqrt{a}
    s = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", s)
    s = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()
