"""The grader's parsing layer: what one answer string says, before any comparison with a gold.

Math-Verify keeps ``parse`` apart from ``verify``; so does the grader. This module reads one string
at a time and never sees the other side:

- the forms the comparison rules read (``verifier_service/grader/rules/``): :func:`answer_info` (canonical
  string, number, option letter, words, equation sides, list items, bracketed group),
  :func:`sympy_text` (the LaTeX latex2sympy gets) and :func:`sympy_parse` (its sympy forms), each
  cached per string: golds repeat across a group of G samples, predictions across epochs;
- the extraction steps of mode ``math`` that come after ``extraction.py``'s markers:
  :func:`marker_answer_form` (a marker's answer in the form the rules read), :func:`is_prose`,
  :func:`search_fallback` (math-verify's own search, for responses with no marker) and
  :func:`gold_answer` (the answer part of a gold string).

math-verify is reached through ``mathverify.py`` (``mathverify.load``), the one module that owns its internals.
Imported by the rules and by the grader package's own module (``grader/__init__.py``); it imports neither.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import lru_cache

from stapo.verifier_service.grader import mathverify
from stapo.verifier_service.grader.extraction import extract_answer, last_boxed
from stapo.verifier_service.grader.normalize import (
    Num,
    balanced,
    canonical,
    join_and_or,
    latexify,
    parse_number,
    split_top_level,
    strip_delims,
)
from stapo.verifier_service.grader.numeric import evaluate as evaluate_numeric

PARSE_CACHE_SIZE = 16_384
"""Entries of each per-string cache (``answer_info``, ``sympy_text``, ``sympy_parse``)."""

# math-verify warns once when its signal timeouts are disabled; they are disabled on purpose (the
# worker pool enforces deadlines by killing workers)
logging.getLogger("math_verify").setLevel(logging.ERROR)


_TRIG_RE = re.compile(r"\\(?:sin|cos|tan|cot|sec|csc)\b")
_DEG_NUM_RE = re.compile(r"(\d+(?:\.\d+)?)\s*\^\s*(?:\{\s*\\circ\s*\}|\\circ)")


@lru_cache(maxsize=PARSE_CACHE_SIZE)
def sympy_text(text: str) -> str | None:
    """The LaTeX string that latex2sympy gets for an answer: delimiters off, math-verify's normalization.

    Shared by the symbolic step and the numeric fast path, so both read the very same string.
    None when normalization fails or leaves nothing.
    """
    mv = mathverify.load()
    body = strip_delims(text)
    if not body:
        return None
    if "circ" in body and _TRIG_RE.search(body):
        # degrees inside trigonometry are an angle unit, not a suffix to drop: 30^\\circ -> (30\\pi/180)
        body = _DEG_NUM_RE.sub(lambda m: f"({m.group(1)}\\pi/180)", body)
    try:
        norm = mv["normalize_latex"](body, mv["norm"])
        if norm.strip() != body.strip() and _LETTER_RE.search(norm):
            # unit stripping must not eat a variable of a symbolic answer ("\\frac{1}{m} t" is t/m, not 1/m):
            # units follow numbers, so an answer that still has variables keeps its trailing letters
            norm = mv["normalize_latex"](body, mv["norm_keep_units"])
    except Exception:
        return None
    return norm if norm.strip() else None


@lru_cache(maxsize=PARSE_CACHE_SIZE)
def sympy_parse(text: str, allow_search: bool) -> tuple:
    """Sympy forms of an answer string.

    The whole string is normalized and parsed as one LaTeX expression. Only when that fails and
    ``allow_search`` is set (predictions, not golds) do we let math-verify search the text for its
    last LaTeX span or number.
    """
    mv = mathverify.load()
    if not strip_delims(text):
        return ()
    norm = sympy_text(text)
    if norm is not None:
        try:
            return (mv["parse_latex"](norm),)
        except Exception:
            pass
    if not allow_search:
        return ()
    found = mv["parse"](
        text, extraction_config=mv["search_cfg"], fallback_mode="no_fallback", parsing_timeout=None
    )
    return tuple(found)

# a letter that is a variable, not part of a command name (\frac, \sqrt) or of a word
_LETTER_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z](?![A-Za-z])")
_CHOICE_RE = re.compile(r"^\(?([A-E])\)?$")
_TEXT_RE = re.compile(r"^[A-Za-z][A-Za-z'\- ]*[A-Za-z]$")
_MATH_WORDS = {"sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "sqrt", "pi", "infty", "frac"}
_EQ_SPLIT_RE = re.compile(r"(?<![<>!\\])=")


@dataclass(frozen=True)
class AnswerInfo:
    """What the fast paths need to know about one answer string (cached per string)."""

    canon: str
    num: Num | None
    choice: str | None
    text: str | None  # casefolded words, for text answers like \text{Evelyn}
    eq_parts: tuple[str, ...]  # split on top-level '=' (1 part when it is not an equation)
    items: tuple[str, ...]  # top-level comma items of an unbracketed list (1 when not a list)
    bracket: tuple[str, str, tuple[str, ...]] | None  # ("(", ")", items) for tuples/intervals/sets


def _text_form(canon: str, raw: str) -> str | None:
    if not _TEXT_RE.match(canon.replace("\\", "")) or "\\" in canon.replace("\\text", ""):
        return None
    words = re.findall(r"[A-Za-z]+", canon)
    has_text_cmd = "\\text" in raw or "\\mathrm" in raw or "\\textbf" in raw
    if not has_text_cmd and not any(len(w) >= 3 and w.lower() not in _MATH_WORDS for w in words):
        return None
    out = " ".join(w.lower() for w in re.findall(r"[A-Za-z]+", re.sub(r"\\text[a-z]*", "", canon)))
    return re.sub(r"^(?:the|an|a) ", "", out)


def plain_words(canon: str) -> str | None:
    """Lower-cased words of a canonical string that is only letters and spaces, else None."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z' \-]*", canon):
        return None
    out = " ".join(w.lower() for w in re.findall(r"[A-Za-z]+", canon))
    return re.sub(r"^(?:the|an|a) ", "", out)


def _strip_bracket(s: str) -> tuple[str, str, str] | None:
    """("(", ")", inner) when ``s`` is one bracketed group (after canonical form), else None."""
    for lo in ("\\{", "(", "["):
        if s.startswith(lo):
            for hi in (")", "]", "\\}"):
                if s.endswith(hi) and len(s) >= len(lo) + len(hi):
                    inner = s[len(lo) : len(s) - len(hi)]
                    # the opening bracket must close at the very end
                    if balanced(inner):
                        return lo, hi, inner
    return None


@lru_cache(maxsize=PARSE_CACHE_SIZE)
def answer_info(s: str) -> AnswerInfo:
    canon = canonical(s)
    num = parse_number(s)
    m = _CHOICE_RE.match(canon)
    choice = m.group(1) if m else None
    text = _text_form(canon, s) if num is None and choice is None else None
    eq_parts = tuple(p for p in _EQ_SPLIT_RE.split(canon)) if "=" in canon else (canon,)
    items: tuple[str, ...] = (canon,)
    bracket = None
    if num is None:
        br = _strip_bracket(canon)
        if br is not None:
            inner_items = tuple(split_top_level(br[2]))
            if len(inner_items) >= 2:
                bracket = (br[0], br[1], inner_items)
        else:
            parts = split_top_level(canon)
            if len(parts) >= 2 and all(parts):
                items = tuple(parts)
    return AnswerInfo(canon, num, choice, text, eq_parts, items, bracket)


def search_fallback(body: str) -> str | None:
    """math-verify's own search (last LaTeX span, else last number) for responses with no marker.

    We keep only the string it reports (``fallback_mode="first_match"`` appends the text of the
    first candidate it tried). That string never depends on what a candidate parses to, and on
    whether it parses only for a match with several LaTeX groups; so during this call a one-group
    match, a plain-text expression, and any candidate the numeric parser accepts are answered
    "parses" without running ANTLR or sympy (the oracles of ``mathverify.py``, the seam). The search then stops at its first candidate instead of parsing
    every failing one (on cut-off RL responses ~10x less time; tests/unit/verifier_service/grader/test_grader_numeric.py
    compares it with the real search, ``mathverify.search(..., oracle=False)``).
    """
    found = mathverify.search(
        body, oracle=True, surely_parses=lambda latex: surely_parses(latex)
    )
    strs = [f for f in found if isinstance(f, str) and f.strip()]
    if strs:
        return strs[0].strip()
    if found:  # only a parsed object came back (it may be the stand-in): ask again, for real
        found = mathverify.search(body, oracle=False, surely_parses=lambda latex: False)
    return str(found[0]) if found else None


def surely_parses(latex: str) -> bool:
    """latex2sympy would parse it: every ``=``-separated side is in the numeric subset and evaluates."""
    sides = latex.split("=")
    return all(evaluate_numeric(side) is not None for side in sides)


_WORD_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")
_TEXT_ARG_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox|operatorname|mathbf)\s*\{[^{}]*\}")
_ENV_RE = re.compile(r"\\(?:begin|end)\s*\{[^{}]*\}")
_MATH_FUNCS = _MATH_WORDS | {
    "arcsin",
    "arccos",
    "arctan",
    "max",
    "min",
    "det",
    "gcd",
    "lcm",
    "mod",
    "deg",
    "cis",
}


def is_prose(s: str) -> bool:
    """Does an extracted answer still contain words ("The volume is 120")? Then we search inside it."""
    bare = _TEXT_ARG_RE.sub(" ", _ENV_RE.sub(" ", s))
    return any(w.lower() not in _MATH_FUNCS for w in _WORD_RE.findall(bare))


def gold_answer(gold: str) -> str:
    """The answer part of a gold string: the last box of a worked solution, else the marker's text, else all.

    Golds are usually bare already; datasets such as Minerva or worked solutions carry a box.
    """
    g = gold.strip()
    if "\\boxed" in g or "\\fbox" in g:
        box = last_boxed(g)
        if box is not None:
            return box[1].strip()
    if len(g) > 80 or "\n" in g:
        ans = extract_answer(g, think="ignore")
        if ans:
            return ans
    return g


# plain words at the end of an answer: a unit ("10\\pi square units", "233 m^2 of land"); each word
# starts after whitespace, so there is one way to match (no nested-quantifier backtracking)
_UNIT_WORDS_RE = re.compile(r"(?:\s+[A-Za-z]+\.?)+(?:\s*\^\s*\{?[23]\}?)?\s*\.?$")


def _strip_unit_words(ans: str) -> str:
    """An answer that is math followed only by plain words keeps the math: the words are a unit.

    Without this the words make the answer prose, and the search fallback reads the first number
    of "10\\pi square units" as the answer 10. Only when what is left is not prose itself and
    holds a digit or a command (so "5 apples and 3 oranges" stays prose).
    """
    m = _UNIT_WORDS_RE.search(ans)
    if m is None or m.start() == 0:
        return ans
    head = ans[: m.start()].strip()
    if is_prose(head) or not re.search(r"[\d\\]", head):
        return ans
    return head


_INNER_DOLLAR_RE = re.compile(r"(?<!\\)\$")


def marker_answer_form(extracted: str) -> tuple[str, bool]:
    """A marker's answer in the form the comparison reads (LaTeX notation, "and"/"or" lists as comma
    lists, trailing unit words dropped), and whether that form is still prose (``is_prose``).

    The prose check is returned rather than repeated by the caller: it is most of this function's
    cost on the service's server-process path, which runs it on every first-seen response."""
    extracted = join_and_or(latexify(extracted))
    if not is_prose(extracted):
        return extracted, False
    if "$" in extracted:
        # math delimiters inside a box ("\\boxed{12 $ and $13}"): without them it may be a list
        bare = " ".join(_INNER_DOLLAR_RE.sub(" ", extracted).split()).strip("\\\"' ")  # quotes around it too
        bare = join_and_or(bare)
        if not is_prose(bare):
            return bare, False
    extracted = _strip_unit_words(extracted)
    return extracted, is_prose(extracted)
