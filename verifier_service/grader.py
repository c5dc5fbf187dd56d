"""The math grader: extract a model's final answer, compare it with a gold answer, return a status.

Math-Verify's shape (``parse`` / ``verify``): :func:`extract` finds the answer, :func:`compare`
judges it against the gold, and :func:`grade` (= ``compare(gold, extract(prediction))``, guarded) is
what every reward path calls (in-process pool, HTTP workers, evals)::

    from stapo.verifier_service.grader import grade
    grade("... so the answer is \\boxed{\\frac{1}{2}}", "0.5")
    # Verdict(correct=True, score=1.0, status='ok', extracted='\\frac{1}{2}', ms=..., rule='exact-number')

Both take a ``budget``: ``"full"`` (a worker, under a deadline) or ``"cheap"`` (the service's server
process, no deadline: markers only, and only the rules of ``RULES`` that declare themselves cheap,
on short strings; None where only the full budget can tell). A cheap verdict is always the full one.

Every verdict names the rule that decided it (``rule``) and the answer it compared (``extracted``);
``stapo verifier explain GOLD RESPONSE`` prints both.

Pipeline of mode ``math`` (policies and their reasons in docs/verifier.md):

1. size check (``too_large``) before any parsing;
2. extraction (``extract.py``, whose docstring states the one extraction policy: the model's last
   committed answer): ``</think>`` rule, last box / line-opening ``Answer:`` / ``####`` value line,
   "the answer is" phrases (the last that states a value; "5, not 4" is 5), a short bare
   prediction; failing all, math-verify's own search for the last LaTeX span or number. Nothing
   found -> ``no_answer``. Inside a marker's answer "and"/"or" make a list and trailing words are a
   unit (``_marker_answer_form``);
3. comparison: the ordered table of named rules ``RULES`` (the first rule that says yes or no
   decides; its name is ``Verdict.rule``), cheapest first: digits joined by spaces (``1 2 3`` is not
   123); canonical string equality; multiple-choice letters;
   text answers; exact numbers (``fractions.Fraction``); unordered multi-answer lists and
   ordered tuples/intervals element by element; finally math-verify's symbolic ``verify`` on
   golds parsed *whole* with latex2sympy (never by regex search, so a single number cannot stand
   for an equation, tuple or set). Before that last step, answers that are surely different are
   rejected without sympy (most answers that get this far on an RL stream are wrong, and ANTLR
   plus ``simplify`` cost ~20-50 ms per distinct string): plain arithmetic evaluated by
   ``numeric.py`` that differs far beyond math-verify's rounding, bracketed lists of numbers with an
   unmatched element, words with no math against a number, assignments ``y = G`` with different
   right sides, different interval unions, different matrices, cut-off fragments that neither
   latex2sympy nor math-verify's search can read (``_surely_unequal``). These only ever say "no";
   every "yes" still comes from math-verify.
   ``tests/unit/test_grader_numeric.py`` and ``tests/unit/test_grader_rejections.py`` check them
   against it.

Mode ``dapo`` is the DAPO recipe's string-normalization verifier (``dapo.py``).

``grade`` never raises for bad data (exceptions become status ``error``); it raises ``ValueError``
only for an unknown ``mode`` or ``think`` (the service maps those to 422). It has no deadline of its
own: math-verify's signal-based timeouts are switched off (they fail off the main thread) and the
worker pool enforces wall-clock deadlines by killing workers.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from functools import lru_cache
from typing import Literal

from stapo.verifier_service import mathverify
from stapo.verifier_service.dapo import TAIL_CHARS, dapo_extract, dapo_normalize
from stapo.verifier_service.extract import (
    THINK_MODES,
    apply_think,
    extract_answer,
    response_finished,
    strip_special_tokens,
)
from stapo.verifier_service.normalize import (
    Num,
    canonical,
    join_and_or,
    latexify,
    numbers_equal,
    parse_number,
    split_top_level,
    strip_delims,
)
from stapo.verifier_service.numeric import cache_clear as numeric_cache_clear
from stapo.verifier_service.numeric import clearly_unequal, rational_function
from stapo.verifier_service.numeric import constant as numeric_constant
from stapo.verifier_service.numeric import differ as numeric_differ
from stapo.verifier_service.numeric import evaluate as evaluate_numeric
from stapo.verifier_service.numeric import variables as numeric_variables

# Math-Verify's shape (parse / verify): extract, compare, grade = compare(extract). evals' maj@k
# clusters answers with answers_equivalent (two extracted answers, no gold).
__all__ = ["Answer", "Verdict", "answers_equivalent", "compare", "extract", "grade"]

Status = Literal["ok", "no_answer", "undecided", "timeout", "error", "too_large"]
"""``ok``: compared, ``correct`` is the verdict. ``no_answer``: the response has no answer (a
computed outcome: wrong). ``undecided``: an answer was found but no rule could compare it with the
gold (the gold is not readable as math): no verdict, ``correct`` is False and means nothing.
``timeout`` / ``error`` / ``too_large``: grading did not run to the end. Only ``ok`` and
``no_answer`` are verdicts; a reward function must not turn the others into a number silently
(``core/rewards.py`` drops their groups and counts them)."""
UNDECIDED = "undecided"
"""``Verdict.rule`` of an ``undecided`` grade: the table ran out without a verdict."""
MAX_CHARS = 20_000
"""Default per-field size limit (prediction and gold each), checked before any parsing."""
RESULT_CACHE_SIZE = 65_536
PARSE_CACHE_SIZE = 16_384

# math-verify warns once when its signal timeouts are disabled; we disable them on purpose.
logging.getLogger("math_verify").setLevel(logging.ERROR)
logger = logging.getLogger(__name__)


Budget = Literal["cheap", "full"]
"""``full``: every rule and math-verify's search (a worker, under a deadline). ``cheap``: only steps
whose cost is linear in short inputs (a process with no deadline); None where they cannot tell."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of grading one prediction: a failure is a status, never a silent ``correct=False``."""

    correct: bool
    score: float
    status: Status
    extracted: str | None
    ms: float = 0.0
    rule: str | None = None
    """The name of the rule that decided (``RULES`` in mode ``math``, ``"dapo"`` in mode ``dapo``;
    ``"no-answer"`` when nothing was extracted; ``UNDECIDED`` with status ``undecided``; None when
    no rule ran: ``too_large``, ``error``, ``timeout``). Fresh, cheap and cached verdicts all carry it."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Answer:
    """A response's final answer as :func:`extract` found it: what :func:`compare` reads."""

    text: str | None
    """Mode ``math``: the answer in the form the rules read; mode ``dapo``: the raw ``Answer:`` line
    (unstripped: the DAPO normalizer reads it so). None: the response has no answer."""
    mode: str = "math"

    @property
    def status(self) -> Status:
        return "ok" if self.text is not None else "no_answer"

    @property
    def extracted(self) -> str | None:
        """The answer as a verdict reports it (``Verdict.extracted``)."""
        if self.text is None or self.mode != "dapo":
            return self.text
        return self.text.strip()


# ---------------------------------------------------------------------------------------------
# parsing (cached): golds repeat across a group of G samples, predictions repeat across epochs
# ---------------------------------------------------------------------------------------------
def _mv() -> dict:
    """math-verify's functions and configs, imported once (``mathverify.load``: the one seam)."""
    return mathverify.load()


_TRIG_RE = re.compile(r"\\(?:sin|cos|tan|cot|sec|csc)\b")
_DEG_NUM_RE = re.compile(r"(\d+(?:\.\d+)?)\s*\^\s*(?:\{\s*\\circ\s*\}|\\circ)")


@lru_cache(maxsize=PARSE_CACHE_SIZE)
def _sympy_text(text: str) -> str | None:
    """The LaTeX string that latex2sympy gets for an answer: delimiters off, math-verify's normalization.

    Shared by the symbolic step and the numeric fast path, so both read the very same string.
    None when normalization fails or leaves nothing.
    """
    mv = _mv()
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
def _sympy_parse(text: str, allow_search: bool) -> tuple:
    """Sympy forms of an answer string.

    The whole string is normalized and parsed as one LaTeX expression. Only when that fails and
    ``allow_search`` is set (predictions, not golds) do we let math-verify search the text for its
    last LaTeX span or number.
    """
    mv = _mv()
    if not strip_delims(text):
        return ()
    norm = _sympy_text(text)
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
# a numeral with a base subscript: 52_8, 4210_{5}, 1A_{16}
_BASE_NUM_RE = re.compile(r"^(?=[0-9A-F]*\d)([0-9A-F]+)_\{?(\d{1,2})\}?$")
_CHOICE_RE = re.compile(r"^\(?([A-E])\)?$")
_PRED_CHOICE_RE = re.compile(r"^(?:option|choice)?\(?([A-Ea-e])\)?(?:$|[.:)]|(?=[^A-Za-z]))")
_TEXT_RE = re.compile(r"^[A-Za-z][A-Za-z'\- ]*[A-Za-z]$")
_MATH_WORDS = {"sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "sqrt", "pi", "infty", "frac"}
_EQ_SPLIT_RE = re.compile(r"(?<![<>!\\])=")
_ASSIGN_LHS_RE = re.compile(r"^\s*[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?(?:\([^()=]*\))?\s*$")
_BRACKETS = {"(": ")", "[": "]", "\\{": "\\}"}


@dataclass(frozen=True)
class _Info:
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


def _plain_words(canon: str) -> str | None:
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
                    if _balanced(inner):
                        return lo, hi, inner
    return None


def _balanced(s: str) -> bool:
    depth = 0
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and s[i + 1] in "{}":
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if depth < 0:
            return False
        i += 1
    return depth == 0


@lru_cache(maxsize=PARSE_CACHE_SIZE)
def _info(s: str) -> _Info:
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
    return _Info(canon, num, choice, text, eq_parts, items, bracket)


def _pred_choice(canon: str) -> str | None:
    """The option letter a predicted answer names ("C", "(c)", "C.", "(C) 25", "option C"), else None.

    A letter followed by math (``c^2``, ``a=5``, ``c2``) is an expression in a variable that happens
    to share the letter, not the option: after a bare letter only ".", ":", ")" or words may follow.
    """
    m = _PRED_CHOICE_RE.match(canon)
    if m is None:
        return None
    rest = canon[m.end() :]
    in_parens = ")" in canon[m.start(1) : m.end() + 1]
    if rest and not in_parens and not rest[0].isspace() and canon[m.end() - 1] not in ".:":
        return None  # "c^2", "a=5", "c2": math in that letter
    if rest.lstrip()[:1] in ("=", "^", "_", "+", "-", "*", "/", "\\", "<", ">"):
        return None
    return m.group(1).upper()


def _match_unordered(golds: tuple[str, ...], preds: tuple[str, ...]) -> bool:
    """Every gold item matched by a distinct prediction item (small lists; greedy with backtracking)."""
    if len(golds) != len(preds):
        return False
    used = [False] * len(preds)

    def rec(i: int) -> bool:
        if i == len(golds):
            return True
        for j, p in enumerate(preds):
            if not used[j] and _equiv(golds[i], p):
                used[j] = True
                if rec(i + 1):
                    return True
                used[j] = False
        return False

    return rec(0)


_DEC_COMMA_RE = re.compile(r"^-?\d+,(?:\d{1,2}|\d{4,})$|^-?0,\d+$")
_COEF_LHS_RE = re.compile(r"^-?\d+(?:\.\d+)?[A-Za-z]")
_IN_RE = re.compile(r"^[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?\\in(.+)$")


def _decimal_comma(info: _Info, raw: str) -> Num | None:
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


def _base_equal(gb: re.Match | None, pb: re.Match | None, g: _Info, p: _Info) -> bool:
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


RuleVerdict = bool | None
"""A rule's answer: True / False decides, None passes to the next rule."""
RuleFn = Callable[[str, str, "_Info", "_Info"], RuleVerdict]


def _rule_empty(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    return False if not g.canon or not p.canon else None


_SPACE_RE = re.compile(r"\\[,;: ]|\\q?quad|~")
_SPACED_DIGITS_RE = re.compile(r"^[+-]?\d+(?: \d+)+$")
_THOUSANDS_SPACED_RE = re.compile(r"^[+-]?\d{1,3}(?: \d{3})+$")


def _spaced_digits(s: str) -> str | None:
    """``s`` as digit groups joined by spaces (``1 2 3``, ``10 5``; LaTeX spaces count) when that is
    all it is and the groups are not thousands (``12 345`` is a number); else None."""
    t = " ".join(_SPACE_RE.sub(" ", strip_delims(s)).split())
    return t if _SPACED_DIGITS_RE.match(t) and not _THOUSANDS_SPACED_RE.match(t) else None


def _rule_spaced_digits(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    # digits joined by spaces are several numbers, not the integer they spell ("1 2 3" is not 123;
    # canonical() drops those spaces). A gold written the same way passes on to string equality.
    spaced = _spaced_digits(pred)
    if spaced is None:
        return None
    return None if _spaced_digits(gold) == spaced else False


def _rule_same_string(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    return True if g.canon == p.canon else None


def _rule_choice(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    # multiple choice never goes to sympy; an expression in the letter is not the option
    return _pred_choice(p.canon) == g.choice if g.choice is not None else None


def _rule_text(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    if g.text is None:
        return None
    # a text gold ("Evelyn" is not E*v*e*l*y*n): the prediction's words, however written ("no" for
    # \\text{No}: a short word without \\text is not read as text on its own, but against a text gold it is)
    p_text = p.text if p.text is not None else _plain_words(p.canon)
    return p_text is not None and p_text == g.text


def _rule_base(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    # numerals in another base: the base is part of the answer (4210_5 != 4210_6)
    gb, pb = _BASE_NUM_RE.match(g.canon), _BASE_NUM_RE.match(p.canon)
    if gb is None and pb is None:
        return None
    return _base_equal(gb, pb, g, p)


def _numbers(gold: str, pred: str, g: _Info, p: _Info) -> tuple[Num, Num] | None:
    # decimal commas "1000,99" only when no thousands reading exists, only in predictions (answer
    # keys write decimals with a point, so a gold "-3,0" is a list), and only against a gold that is
    # not an integer: against an integer the reading could only add zeros ("-3,0" for -3), which is
    # what a two-element list looks like
    dec_gold = g.num is not None and g.num.value.denominator != 1
    p_num = p.num or (_decimal_comma(p, pred) if dec_gold else None)
    return (g.num, p_num) if g.num is not None and p_num is not None else None


def _rule_exact_number(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    nums = _numbers(gold, pred, g, p)
    if nums is None:
        return None
    if numbers_equal(*nums):
        return True
    return None if _rounded_number(gold, pred, g, p) else False


def _rounded_number(gold: str, pred: str, g: _Info, p: _Info) -> bool:
    nums = _numbers(gold, pred, g, p)
    return (
        nums is not None
        and not nums[1].percent
        and not nums[1].degree
        and _rounded_gold_match(g, pred, nums[1].value)
    )


def _rule_rounded_gold_number(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    return True if _rounded_number(gold, pred, g, p) else None


def _rule_clock(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    # "1:30 p.m." = "1:30\\text{ pm}" = "13:30"; a clock gold needs a clock answer
    gc = _clock(g.canon)
    if gc is None:
        return None
    pc = _clock(p.canon)
    return pc is not None and _clock_equal(gc, pc)


def _rule_unordered_list(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    # "2, 3" (also against "\\{3, 2\\}"); each item may be "x=2". Says only yes.
    if len(g.items) <= 1:
        return None
    p_items = p.items
    if len(p_items) == 1 and p.bracket is not None and p.bracket[0] == "\\{":
        p_items = p.bracket[2]
    if len(p_items) == 1 and len(p.eq_parts) > 1:
        p_items = _info(p.eq_parts[-1]).items
    if len(p_items) == len(g.items) and _match_unordered(g.items, p_items):
        return True
    return None


def _rule_function_name(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    # "f(x) = 2x+1" = "y = 2x+1" = "g(x) = 2x+1": compare right-hand sides
    if len(g.eq_parts) == 2 and len(p.eq_parts) == 2 and g.eq_parts[0] != p.eq_parts[0]:
        if _fn_lhs_compatible(g.eq_parts[0], p.eq_parts[0]):
            return _equiv(g.eq_parts[1], p.eq_parts[1])
    return None


def _rule_inequality_set(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    # "x < -2 or x > 3" against an interval / union gold: the same set written as intervals
    if _INEQ_IN_RE.search(g.canon):
        return None
    union = _inequalities_as_intervals(p.canon, pred)
    if union is not None and union != p.canon:
        return _equiv(gold, union)
    return None


def _rule_equation_sides(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    # follow the gold's form: "x=2" vs "2" and "2" vs "x=2" compare right-hand sides
    g_eq, p_eq = len(g.eq_parts) > 1, len(p.eq_parts) > 1
    if p_eq and not g_eq and len(g.items) == 1:
        if _COEF_LHS_RE.match(p.eq_parts[0]):
            return False  # "2x=2" is an equation to solve, not the value 2
        if _equiv(gold, p.eq_parts[-1]):
            return True
    elif (
        g_eq
        and not p_eq
        and len(g.eq_parts) == 2
        and _ASSIGN_LHS_RE.match(g.eq_parts[0])
        and len(g.items) == 1
    ):
        return _equiv(g.eq_parts[-1], pred)
    return None


def _rule_element_of(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    m = _IN_RE.match(p.canon)
    if m and len(g.eq_parts) == 1 and "\\in" not in g.canon:
        return _equiv(gold, m.group(1))
    return None


def _rule_brackets(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    # tuples / intervals / sets: same brackets, elements in order (sets: any order). Says only yes.
    if g.bracket is not None and p.bracket is not None:
        (glo, ghi, gi), (plo, phi, pi) = g.bracket, p.bracket
        if len(gi) == len(pi):
            if glo == "\\{" and plo == "\\{":
                if _match_unordered(gi, pi):
                    return True
            elif glo == plo and ghi == phi and all(_equiv(a, b) for a, b in zip(gi, pi, strict=True)):
                return True
    elif g.bracket is not None and g.bracket[0] == "\\{" and len(p.items) == len(g.bracket[2]) > 1:
        if _match_unordered(g.bracket[2], p.items):
            return True
    return None


def _rule_rounded_gold(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    # a gold shown rounded (0.6667) and an exact answer that rounds to it (\\frac{2}{3}). Says only yes.
    return True if g.num is not None and g.num.decimal and _rounded_gold_match(g, pred, None) else None


def _rule_compound_quantity(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    return False if g.num is not None and _compound_quantity(pred) else None


def _rule_surely_unequal(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    return False if _surely_unequal(gold, pred) else None


def _rule_math_verify(gold: str, pred: str, g: _Info, p: _Info) -> RuleVerdict:
    # math-verify's symbolic verify on golds parsed whole; exact constants compared at 50 digits.
    # A gold that does not parse cannot be compared at all: undecided (None; the grade's status says
    # so), never a guess. An answer that does not parse is "no", as in math-verify (``verify`` of an
    # empty parse is False): the model's unreadable answer is its own failure, an unreadable gold is not.
    gold_exprs = _sympy_parse(gold, False)
    if not gold_exprs or _constant_relation(gold_exprs):
        return None
    pred_exprs = _sympy_parse(pred, True)
    if not pred_exprs:
        return False
    verify = _mv()["verify"]
    ok = bool(verify(list(gold_exprs), list(pred_exprs), timeout_seconds=None, allow_set_relation_comp=True))
    exact = _exact_constants_equal(gold_exprs, pred_exprs)
    return exact if exact is not None else ok


def _constant_relation(exprs: tuple) -> bool:
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


@dataclass(frozen=True)
class Rule:
    """One comparison step of mode ``math``: says yes, no, or passes (None)."""

    name: str
    """what ``Verdict.rule`` says when this rule decides"""
    fn: RuleFn
    cheap: bool
    """True: string and exact-number work whose cost is linear in short inputs (no sympy, no
    math-verify), so a process with no deadline may run it (``compare(..., budget="cheap")``)."""


RULES: tuple[Rule, ...] = (
    Rule("empty", _rule_empty, cheap=True),
    Rule("spaced-digits", _rule_spaced_digits, cheap=True),
    Rule("same-string", _rule_same_string, cheap=True),
    Rule("choice-letter", _rule_choice, cheap=True),
    Rule("text", _rule_text, cheap=True),
    Rule("base-numeral", _rule_base, cheap=True),
    Rule("exact-number", _rule_exact_number, cheap=True),
    Rule("rounded-gold-number", _rule_rounded_gold_number, cheap=True),
    Rule("clock-time", _rule_clock, cheap=False),
    Rule("unordered-list", _rule_unordered_list, cheap=False),
    Rule("function-name", _rule_function_name, cheap=False),
    Rule("inequality-set", _rule_inequality_set, cheap=False),
    Rule("equation-sides", _rule_equation_sides, cheap=False),
    Rule("element-of", _rule_element_of, cheap=False),
    Rule("brackets", _rule_brackets, cheap=False),
    Rule("rounded-gold", _rule_rounded_gold, cheap=False),
    Rule("compound-quantity", _rule_compound_quantity, cheap=False),
    Rule("surely-unequal", _rule_surely_unequal, cheap=False),
    Rule("math-verify", _rule_math_verify, cheap=False),
)
"""The comparison of mode ``math`` as an ordered table: each rule says yes, no, or passes (None);
the first that decides gives the verdict and its name (``Verdict.rule``). Cheapest first.
``math-verify`` decides whenever the gold parses; when it does not and no rule before it decided,
the grade's status is ``undecided`` (rule ``UNDECIDED``). Budget ``cheap`` runs the table up to its
first rule that is not cheap: every verdict it gives is the one the whole table gives."""
RULE_NAMES = tuple(r.name for r in RULES)


def _decide(gold: str, pred: str, budget: Budget) -> tuple[RuleVerdict, str | None]:
    g, p = _info(gold), _info(pred)
    for rule in RULES:
        if budget == "cheap" and not rule.cheap:
            break  # a costly rule comes first in the full table: what follows it is not the table's verdict
        verdict = rule.fn(gold, pred, g, p)
        if verdict is not None:
            return bool(verdict), rule.name
    return None, None


@lru_cache(maxsize=RESULT_CACHE_SIZE)
def _equiv_rule(gold: str, pred: str) -> tuple[bool | None, str]:
    """(verdict, name of the rule that decided) for the extracted prediction ``pred`` against ``gold``;
    verdict None (``UNDECIDED``) when no rule could decide: the gold is not readable as math."""
    verdict, name = _decide(gold, pred, "full")
    return (None, UNDECIDED) if verdict is None else (verdict, name or "math-verify")


def _equiv(gold: str, pred: str) -> bool:
    """Is the extracted prediction ``pred`` the same answer as ``gold``? (``RULES``, cheapest first).
    Inside a rule (list elements, equation sides) an undecided part cannot be shown equal: no."""
    return bool(_equiv_rule(gold, pred)[0])


_NUM_TOKEN_RE = re.compile(r"\d+(?:\.\d+)?")


def _compound_quantity(pred: str) -> bool:
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


def _exact_constants_equal(gold_exprs: tuple, pred_exprs: tuple) -> bool | None:
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


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class GraderSettings:
    """The grader's policies a user may choose, one frozen object per process (``SETTINGS``;
    ``configure`` replaces it).

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
"""This process's grading policies (read them here; change them with ``configure``)."""


def configure(settings: GraderSettings | None = None, *, rounded_gold: bool | None = None) -> GraderSettings:
    """Set this process's grading policies (the service/pool would call it in each worker at start);
    returns the previous settings, so a caller can restore them.

    ``settings`` replaces the whole object; ``rounded_gold`` changes that one field. Changing a
    policy empties the result caches (a cached verdict was computed under the old one).
    """
    global SETTINGS
    old = SETTINGS
    new = settings if settings is not None else old
    if rounded_gold is not None:
        new = replace(new, rounded_gold=bool(rounded_gold))
    if new != old:
        SETTINGS = new
        cache_clear()
    return old


_PLAIN_DEC_RE = re.compile(r"^-?(\d+)\.(\d+)$")


EXTRA_DIGITS = 2
"""A decimal answer counts as more precise than a rounded gold from this many more decimals on."""


def _rounded_gold_match(g: _Info, pred: str, pred_value: Fraction | None) -> bool:
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
    text = _sympy_text(pred)
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


def _inequalities_as_intervals(canon: str, raw: str) -> str | None:
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


# the left side of a predicted equation that latex2sympy surely parses: "f(x)", "y", "c^2", ...
_FUNC_LHS_RE = re.compile(r"^\s*[a-ce-hj-zA-CF-HJ-Z]\s*\(\s*[a-ce-hj-zA-CF-HJ-Z]\s*\)\s*$")


def _numerically_unequal(gold: str, pred: str) -> bool:
    """Would math-verify surely say no? Both sides evaluate (numeric.py) and differ beyond tolerance.

    Reads the strings latex2sympy would get (``_sympy_text``). A predicted equation ``x = 49``
    (``a = b = c``, ``f(x) = ...``) against a gold that is not one is compared through its last
    right-hand side, which is what math-verify does with it; every side must parse, so the parse is
    the same. Strings that math-verify reads in complex mode (``\\mathbb{C}``, a lone ``i``) are
    left to it: there ``i`` may be the imaginary unit, here it is a variable.
    """
    g = _sympy_text(gold)
    p = _sympy_text(pred)
    if g is None or p is None or "=" in g:
        return False
    complex_mode = _mv()["complex_mode"]
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


def _word_soup(gold: str, pred: str) -> bool:
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

    If latex2sympy fails on the normalized text (a full stop), ``_sympy_parse`` lets math-verify
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
    if not _soup(pred.replace("$", "")) or pred.count("$") > 1 or not _is_prose(pred):
        return False
    norm = _sympy_text(pred)
    if norm is None or not _soup(norm) or _LEXER_WORDS_RE.search(norm):
        return False
    words = _SOUP_POW_RE.sub("", norm)
    if _LEXER_WORDS_RE.search(words) or _SOUP_RISKY_RE.search(words) or not _SOUP_VARIABLE_RE.search(words):
        return False  # a variable must remain, and nothing may turn the product into a constant
    g = _sympy_text(gold)
    if g is None:
        return False
    vals = evaluate_numeric(g) if "=" not in g else None
    if vals is not None and vals[0] == vals[1]:
        return True
    if vals is not None:  # an expression with variables: each item needs a letter the gold lacks
        gvars = numeric_variables(g)
        if gvars is None or _mv()["complex_mode"](g) or len(gvars) == len(g.strip()) == 1:
            return False  # a one-letter gold meets math-verify's name-concatenation rule: left to it
        return all(
            any(c not in gvars and c not in "deij" for c in item.lower() if c.isalpha())
            for item in words.split(",")
        )
    return _matrix_cells(gold) is not None or _interval_union(gold) is not None


def _bracket_values(text: str) -> tuple[str, tuple] | None:
    """("(", values) for a bracketed list of plain numbers, as latex2sympy would read it, else None."""
    norm = _sympy_text(text)
    if norm is None:
        return None
    body = norm.replace("\\left", "").replace("\\right", "").strip()
    if len(body) < 2 or body[0] not in "([" or body[-1] not in ")]":
        return None
    inner = body[1:-1]
    if not _balanced(inner):
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


def _brackets_unequal(gold: str, pred: str) -> bool:
    """Tuples / intervals of plain numbers with the same brackets, where some gold value has no match.

    Whatever math-verify reads them as (interval, tuple, finite set, ordered or not), an element
    of the gold that equals no element of the prediction makes them different. No reading drops
    an element: latex2sympy makes ``(5, 2)`` a tuple, not an empty interval, and ``[2, 2]`` the set {2}.
    """
    g, p = _bracket_values(gold), _bracket_values(pred)
    if g is None or p is None or g[0] != p[0] or len(g[1]) != len(p[1]):
        return False
    return any(all(numeric_differ(a, b) for b in p[1]) for a in g[1])


def _surely_unequal(gold: str, pred: str) -> bool:
    """Would math-verify surely say no? Each rule below says why; False means "ask math-verify"."""
    return (
        _numerically_unequal(gold, pred)
        or _word_soup(gold, pred)
        or _brackets_unequal(gold, pred)
        or _equations_unequal(gold, pred)
        or _interval_sets_unequal(gold, pred)
        or _matrices_unequal(gold, pred)
        or _unparseable_fragment(gold, pred)
    )


# the left side of an assignment: one letter (not e: Euler's number; d: a differential; i: the
# imaginary unit in complex mode)
_ASSIGNED_LETTER_RE = re.compile(r"^\s*([a-cf-hj-zA-CF-HJ-Z])\s*$")


def _assignment(text: str) -> tuple[str, str] | None:
    """(letter, right side) of ``L = G``, as latex2sympy would read it, when G is a rational function
    of letters other than L (numeric.py's subset); else None."""
    norm = _sympy_text(text)
    if norm is None or norm.count("=") != 1 or _mv()["complex_mode"](norm):
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


def _equations_unequal(gold: str, pred: str) -> bool:
    """Two assignments ``y = G`` and ``y = P`` (the same letter) whose right sides differ at a point.

    math-verify (``sympy_expr_eq`` -> ``sympy_compare_relational``) says yes in three ways, and none
    can hold when G and P (rational functions, neither containing y) differ numerically:

    - same relation: ``y - G`` vs ``y - P``; their difference is ``P - G``, not zero (the numeric
      premise of ``_numerically_unequal``: a difference beyond ``numeric.REL_TOL`` at a point is
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
    ``_exact_constants_equal`` never applies to equations.
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
    return _union_of(_sympy_text(text))


def _union_of(norm: str | None) -> tuple | None:
    """``_interval_union`` of an already normalized text."""
    if norm is None or "\\in" in norm.replace("\\infty", "") or _mv()["complex_mode"](norm):
        return None
    out = []
    for piece in _CUP_RE.split(_LEFT_RIGHT_RE.sub("", norm)):
        piece = piece.strip()
        if len(piece) < 5 or piece[0] not in "([" or piece[-1] not in ")]" or not _balanced(piece[1:-1]):
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
    norm = _sympy_text(text)
    m = _IN_SET_RE.match(norm) if norm is not None and "\\in" in norm else None
    return _union_of(m.group(2)) if m else None


def _numeric_equation(text: str) -> bool:
    """latex2sympy reads it as an equation (or a chain): every ``=`` side in numeric.py's subset."""
    norm = _sympy_text(text)
    if norm is None or "=" not in norm or _mv()["complex_mode"](norm):
        return False
    sides = norm.split("=")
    return all(evaluate_numeric(x) is not None or _FUNC_LHS_RE.match(x) for x in sides) and any(
        evaluate_numeric(x) is not None for x in sides
    )


def _interval_sets_unequal(gold: str, pred: str) -> bool:
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
    norm = _sympy_text(other)
    return (
        norm is not None
        and "=" not in norm
        and not _mv()["complex_mode"](norm)
        and evaluate_numeric(norm) is not None
    )


# the commands latex2sympy lexes as tokens without braces of their own (no \text{...}-style token
# that swallows braces, no \begin{...}); anything else makes _unparseable_fragment undecided
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


def _unparseable_fragment(gold: str, pred: str) -> bool:
    """A cut-off fragment ("Let me double-check: $\\frac{", "... the case where $n =") that neither
    latex2sympy nor math-verify's search can read: the grader then has no prediction, "no".

    ``_sympy_parse`` gives latex2sympy the normalized text (math-verify's ``parse_latex_cached``,
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
    norm = _sympy_text(pred)
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
    norm = _sympy_text(text)
    if norm is None or _mv()["complex_mode"](norm):
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


def _matrices_unequal(gold: str, pred: str) -> bool:
    """Two matrices of different shapes, or of one shape with an entry that differs numerically.

    latex2sympy reads both as sympy Matrices (``vmatrix`` is a determinant: not matched). math-verify
    (``sympy_expr_eq``): structural equality fails; ``sympy_numeric_eq`` compares same-shape matrices
    entry by entry (all must agree: one entry beyond ``numeric.REL_TOL`` cannot, the premise of
    ``_numerically_unequal``) and returns False for different shapes; ``sympy_symbolic_eq`` needs
    ``simplify(a - b)`` to be the zero matrix (the differing entry is not zero; different shapes
    raise, caught as False). A matrix against a scalar expression of the numeric subset: structural
    equality fails, ``sympy_numeric_eq`` compares ``Matrix == scalar`` (False) or fails on
    ``Matrix - scalar`` (caught), and ``simplify(Matrix - scalar)`` raises (caught). Matrices are not
    ``sympy.Expr``, so ``_exact_constants_equal`` is silent.
    """
    if "\\begin" not in gold and "\\begin" not in pred:
        return False
    g, p = _matrix_cells(gold), _matrix_cells(pred)
    if g is None and p is None:
        return False
    if g is None or p is None:  # a matrix against a scalar expression
        norm = _sympy_text(pred if g is not None else gold)
        return (
            norm is not None
            and "=" not in norm
            and not _mv()["complex_mode"](norm)
            and evaluate_numeric(norm) is not None
        )
    if (len(g), len(g[0])) != (len(p), len(p[0])):
        return True
    return any(
        clearly_unequal(a, b) for ra, rb in zip(g, p, strict=True) for a, b in zip(ra, rb, strict=True)
    )


def answers_equivalent(a: str, b: str) -> bool:
    """Whether two extracted answers are the same (for maj@k clustering); ``a`` plays the gold."""
    try:
        return _equiv(latexify(a), latexify(b))
    except Exception:
        logger.debug("answers_equivalent failed", exc_info=True)
        return False


def cache_info() -> dict[str, dict[str, int]]:
    """Hit/miss counters of the bounded caches (the service exports them as Prometheus metrics)."""
    out = {}
    for name, fn in (("result", _equiv_rule), ("answer_info", _info), ("sympy_parse", _sympy_parse)):
        ci = fn.cache_info()
        out[name] = {"hits": ci.hits, "misses": ci.misses, "size": ci.currsize, "maxsize": ci.maxsize or 0}
    return out


def cache_clear() -> None:
    """Empty every cache (tests, benchmarks)."""
    for fn in (_equiv_rule, _info, _sympy_parse, _sympy_text):
        fn.cache_clear()
    numeric_cache_clear()


# ---------------------------------------------------------------------------------------------
# modes
# ---------------------------------------------------------------------------------------------
def _search_fallback(body: str) -> str | None:
    """math-verify's own search (last LaTeX span, else last number) for responses with no marker.

    We keep only the string it reports (``fallback_mode="first_match"`` appends the text of the
    first candidate it tried). That string never depends on what a candidate parses to, and on
    whether it parses only for a match with several LaTeX groups; so during this call a one-group
    match, a plain-text expression, and any candidate the numeric parser accepts are answered
    "parses" without running ANTLR or sympy (the oracles of ``mathverify.py``, the seam). The search then stops at its first candidate instead of parsing
    every failing one (on cut-off RL responses ~10x less time; tests/unit/test_grader_numeric.py
    compares it with the real search, ``mathverify.search(..., oracle=False)``).
    """
    found = mathverify.search(
        body, oracle=True, surely_parses=lambda latex: _surely_parses(latex)
    )
    strs = [f for f in found if isinstance(f, str) and f.strip()]
    if strs:
        return strs[0].strip()
    if found:  # only a parsed object came back (it may be the stand-in): ask again, for real
        found = mathverify.search(body, oracle=False, surely_parses=lambda latex: False)
    return str(found[0]) if found else None


def _surely_parses(latex: str) -> bool:
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


def _is_prose(s: str) -> bool:
    """Does an extracted answer still contain words ("The volume is 120")? Then we search inside it."""
    bare = _TEXT_ARG_RE.sub(" ", _ENV_RE.sub(" ", s))
    return any(w.lower() not in _MATH_FUNCS for w in _WORD_RE.findall(bare))


def gold_answer(gold: str) -> str:
    """The answer part of a gold string: the last box of a worked solution, else the marker's text, else all.

    Golds are usually bare already; datasets such as Minerva or worked solutions carry a box.
    """
    g = gold.strip()
    if "\\boxed" in g or "\\fbox" in g:
        from stapo.verifier_service.extract import last_boxed

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
    if _is_prose(head) or not re.search(r"[\d\\]", head):
        return ans
    return head


_INNER_DOLLAR_RE = re.compile(r"(?<!\\)\$")


def _marker_answer_form(extracted: str) -> tuple[str, bool]:
    """A marker's answer in the form the comparison reads (LaTeX notation, "and"/"or" lists as comma
    lists, trailing unit words dropped), and whether that form is still prose (``_is_prose``).

    The prose check is returned rather than repeated by the caller: it is most of this function's
    cost on the service's server-process path, which runs it on every first-seen response."""
    extracted = join_and_or(latexify(extracted))
    if not _is_prose(extracted):
        return extracted, False
    if "$" in extracted:
        # math delimiters inside a box ("\\boxed{12 $ and $13}"): without them it may be a list
        bare = " ".join(_INNER_DOLLAR_RE.sub(" ", extracted).split()).strip("\\\"' ")  # quotes around it too
        bare = join_and_or(bare)
        if not _is_prose(bare):
            return bare, False
    extracted = _strip_unit_words(extracted)
    return extracted, _is_prose(extracted)


def _extract_math(prediction: str, think: str, budget: Budget) -> Answer | None:
    """Mode ``math``'s final answer: marker extraction, then math-verify's search for prose or no marker.

    Budget ``cheap`` stops where the search would run (no marker in a finished response, a marker's
    answer that is prose) and on texts whose box matching could take long: None, only ``full`` can tell."""
    if budget == "cheap" and (
        len(prediction) > _CHEAP_MAX_CHARS or prediction.count("boxed") + prediction.count("fbox") > _CHEAP_MAX_BOXES
    ):
        return None
    extracted = extract_answer(prediction, think=think)
    prose = False
    if extracted is not None:
        extracted, prose = _marker_answer_form(extracted)
    if extracted is None or prose:
        if extracted is None and not response_finished(prediction, think=think):
            return Answer(None)  # cut off mid-work with no marker: nothing was committed to
        if budget == "cheap":
            return None
        body = extracted if extracted is not None else apply_think(prediction, think)
        if body is None or not body.strip():
            return Answer(None)
        found = _search_fallback(body)
        if found is not None:
            extracted = found
    return Answer(extracted)


def _extract_dapo(prediction: str, think: str, budget: Budget) -> Answer:
    """Mode ``dapo``'s raw ``Answer:`` text, unstripped: the DAPO normalizer reads it so ("Answer: x is
    a " normalizes differently from "x is a"); ``Answer.extracted`` reports it stripped."""
    body = apply_think(prediction, think)
    return Answer(dapo_extract(body) if body is not None else None, "dapo")


def _math_gold(gold: str) -> str:
    """Mode ``math``'s gold as compared: the answer part of the gold, in LaTeX notation."""
    return latexify(gold_answer(gold))


# three words in a row (not command names): a sentence, not a product of variables ("RCs + LCs^2")
_SENTENCE_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}\s+[A-Za-z]{2,}\s+[A-Za-z]{2,}")


def _compare_math(gold: str, answer: str | None, budget: Budget) -> tuple[bool, Status, str] | None:
    if budget == "cheap" and len(gold) > _CHEAP_MAX_GOLD:
        return None
    gold_ans = _math_gold(gold)
    if not strip_delims(gold_ans):
        if budget == "cheap":
            return None  # an 'error': the full budget reports it
        raise ValueError("gold: empty answer")
    if answer is None:
        return False, "no_answer", "no-answer"
    if budget == "cheap":
        if len(answer) > _CHEAP_MAX_GOLD:
            return None
        verdict, rule = _decide(gold_ans, answer, "cheap")
        return None if verdict is None or rule is None else (verdict, "ok", rule)
    if _SENTENCE_RE.search(answer) and _is_prose(answer):
        # A sentence left after math-verify's search (words it found no math in, or a span of words
        # around math it reported as its first candidate: "Let me double-check: $\frac{255", a
        # response cut off after ``</think>``) is compared as text only: the cheap rules. Only three
        # words in a row count: a single word ("infinity") or juxtaposed variables ("RCs") still go
        # to sympy. That is how math-verify compares a string it could not parse (string equality,
        # ``compare_single_extraction``); latex2sympy would read the words as products of one-letter
        # symbols and spend 10-50 ms in ANTLR and sympy to find them unequal.
        verdict, rule = _decide(gold_ans, answer, "cheap")
        return verdict is True, "ok", rule if verdict is not None else "prose-as-text"
    correct, rule = _equiv_rule(gold_ans, answer)
    if correct is None:
        return False, "undecided", rule
    return correct, "ok", rule


def _compare_dapo(gold: str, answer: str | None, budget: Budget) -> tuple[bool, Status, str] | None:
    if answer is None:
        return False, "no_answer", "no-answer"
    if budget == "cheap" and (len(answer) > TAIL_CHARS or len(gold) > _CHEAP_MAX_GOLD_DAPO):
        return None
    return dapo_normalize(answer) == dapo_normalize(gold), "ok", "dapo"


_CHEAP_MAX_CHARS = 16_000
_CHEAP_MAX_BOXES = 8
"""Budget ``cheap`` extracts from responses this short with this few boxes (box matching is linear
per box: worst case ~10 ms); the rest need the full budget."""
_CHEAP_MAX_GOLD = 64
"""Longest gold and answer (mode ``math``) that budget ``cheap`` compares; RL answers are short."""
_CHEAP_MAX_GOLD_DAPO = 400
"""Longest gold budget ``cheap`` normalizes in mode ``dapo`` (the answer line is <= 300 chars)."""


@dataclass(frozen=True)
class _Mode:
    extract: Callable[[str, str, Budget], Answer | None]
    """(prediction, think, budget) -> the answer; None only under budget ``cheap``"""
    compare: Callable[[str, str | None, Budget], tuple[bool, Status, str] | None]
    """(gold, answer text, budget) -> (correct, status, rule); None only under budget ``cheap``"""


_MODES: dict[str, _Mode] = {
    "math": _Mode(_extract_math, _compare_math),
    "dapo": _Mode(_extract_dapo, _compare_dapo),
}
"""Mode ``math``: markers, math-verify's search, the ``RULES`` table. Mode ``dapo``: the DAPO
recipe's ``Answer:`` line and string normalization (``dapo.py``)."""


def _mode(name: str) -> _Mode:
    try:
        return _MODES[name]
    except KeyError:
        raise ValueError(f"mode: unknown grading mode {name!r}; valid: {', '.join(sorted(_MODES))}") from None


def _check_think(think: str) -> None:
    if think not in THINK_MODES:
        raise ValueError(f"think: unknown mode {think!r}; valid: {', '.join(THINK_MODES)}")


def extract(
    prediction: str,
    mode: str = "math",
    *,
    think: str = "optional",
    special_tokens: tuple[str, ...] = (),
    budget: Budget = "full",
) -> Answer | None:
    """The final answer of a response, exactly as :func:`grade` reads it (no gold needed).

    ``Answer(None, mode)`` when the response has none. Budget ``full`` always answers; budget
    ``cheap`` (for a process with no deadline: the service's server process) runs markers only, on
    bounded texts, and returns None where only the full budget can tell (math-verify's search).
    Raises ``ValueError`` for an unknown ``mode`` or ``think``; bad text is never an exception of its own.
    ``special_tokens``: model-specific tokens removed on top of ``extract.SPECIAL_TOKENS`` (the common
    chat templates' end-of-turn, padding and role tokens).
    """
    fn = _mode(mode).extract
    _check_think(think)
    if special_tokens:
        prediction = strip_special_tokens(prediction, tuple(special_tokens))
    return fn(prediction, think, budget)


def compare(gold: str, answer: Answer, budget: Budget = "full") -> Verdict | None:
    """Is ``answer`` (from :func:`extract`, in its mode) the gold's answer? A :class:`Verdict` naming
    the rule that decided.

    Budget ``full`` always answers (raises ``ValueError`` for an empty gold: :func:`grade` makes that
    an 'error'). Budget ``cheap`` runs only the rules that declare themselves cheap, on short golds
    and answers, and returns None where a costly rule (or an error) would be needed; every verdict it
    gives is the one ``full`` gives.
    """
    t0 = time.perf_counter()
    fn = _mode(answer.mode).compare
    try:
        out = fn(strip_special_tokens(gold), answer.text, budget)
    except Exception:
        if budget == "cheap":
            return None  # the full budget reports what went wrong
        raise
    if out is None:
        return None
    correct, status, rule = out
    correct = bool(correct) and status == "ok"
    extracted = answer.extracted if status != "no_answer" else None
    return Verdict(correct, 1.0 if correct else 0.0, status, extracted, (time.perf_counter() - t0) * 1e3, rule)


def grade(
    prediction: str,
    gold: str,
    mode: str = "math",
    *,
    think: str = "optional",
    max_chars: int = MAX_CHARS,
    special_tokens: tuple[str, ...] = (),
) -> Verdict:
    """``compare(gold, extract(prediction))`` with the full budget, guarded: a size check first
    (``too_large``), and any exception on the data becomes status ``error``. Raises ``ValueError``
    only for an unknown ``mode`` or ``think`` (the service maps those to 422).
    """
    _mode(mode)
    _check_think(think)
    t0 = time.perf_counter()
    try:
        if not isinstance(prediction, str) or not isinstance(gold, str):
            raise TypeError("prediction and gold must be str")
        if len(prediction) > max_chars or len(gold) > max_chars:
            return Verdict(False, 0.0, "too_large", None, (time.perf_counter() - t0) * 1e3)
        answer = extract(prediction, mode, think=think, special_tokens=special_tokens)
        verdict = compare(gold, answer)
    except Exception:
        logger.debug("grading failed", exc_info=True)
        return Verdict(False, 0.0, "error", None, (time.perf_counter() - t0) * 1e3)
    return replace(verdict, ms=(time.perf_counter() - t0) * 1e3)
