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

Math-Verify keeps its parser apart from its grader; so does this one, in three layers that import
one way (``parsing.py`` <- ``rules/`` <- this module):

- ``parsing.py``: what one string says (the forms the rules read, cached per string; the
  extraction steps after the markers: the marker answer's form, the prose check, math-verify's
  search, the gold's answer part);
- ``rules/``: the comparison rules by family (``strings``, ``numbers``, ``structure``,
  ``rejections``, ``symbolic``) and ``rules/table.py``, their ordered table ``RULES``;
- this module: the public API, the modes, budgets, statuses and guards.

Pipeline of mode ``math`` (policies and their reasons in docs/verifier.md):

1. size check (``too_large``) before any parsing;
2. extraction (``extraction.py``, whose docstring states the one extraction policy: the model's last
   committed answer): ``</think>`` rule, last box / line-opening ``Answer:`` / ``####`` value line,
   "the answer is" phrases (the last that states a value; "5, not 4" is 5), a short bare
   prediction; failing all, math-verify's own search for the last LaTeX span or number
   (``parsing.search_fallback``). Nothing found -> ``no_answer``. Inside a marker's answer
   "and"/"or" make a list and trailing words are a unit (``parsing.marker_answer_form``);
3. comparison: the ordered table of named rules ``RULES`` (the first rule that says yes or no
   decides; its name is ``Verdict.rule``), cheapest first: digits joined by spaces (``1 2 3`` is not
   123); canonical string equality; multiple-choice letters; text answers; exact numbers
   (``fractions.Fraction``); unordered multi-answer lists and ordered tuples/intervals element by
   element; finally math-verify's symbolic ``verify`` on golds parsed *whole* with latex2sympy
   (never by regex search, so a single number cannot stand for an equation, tuple or set). Before
   that last step, answers that are surely different are rejected without sympy
   (``rules/rejections.py``: they only ever say "no"; every "yes" still comes from math-verify).

Mode ``dapo`` is the DAPO recipe's string-normalization verifier (``dapo.py``).

``grade`` never raises for bad data (exceptions become status ``error``); it raises ``ValueError``
only for an unknown ``mode`` or ``think`` (the service maps those to 422). It has no deadline of its
own: math-verify's signal-based timeouts are switched off (they fail off the main thread) and the
worker pool enforces wall-clock deadlines by killing workers.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Literal

from stapo.verifier_service.grader.dapo import TAIL_CHARS, dapo_extract, dapo_normalize
from stapo.verifier_service.grader.extraction import (
    THINK_MODES,
    apply_think,
    extract_answer,
    response_finished,
    strip_special_tokens,
)
from stapo.verifier_service.grader.normalize import latexify, strip_delims
from stapo.verifier_service.grader.numeric import cache_clear as numeric_cache_clear
from stapo.verifier_service.grader.parsing import (
    answer_info,
    gold_answer,
    is_prose,
    marker_answer_form,
    search_fallback,
    sympy_parse,
    sympy_text,
)
from stapo.verifier_service.grader.rules import numbers
from stapo.verifier_service.grader.rules.numbers import GraderSettings  # re-exported with configure
from stapo.verifier_service.grader.rules.table import RULE_NAMES as RULE_NAMES  # re-exported: the rule table
from stapo.verifier_service.grader.rules.table import RULES as RULES
from stapo.verifier_service.grader.rules.table import UNDECIDED as UNDECIDED
from stapo.verifier_service.grader.rules.table import Budget, decide, equiv, equiv_rule

# Math-Verify's shape (parse / verify): extract, compare, grade = compare(extract). evals' maj@k
# clusters answers with answers_equivalent (two extracted answers, no gold).
__all__ = ["Answer", "Verdict", "answers_equivalent", "compare", "extract", "grade"]

Status = Literal["ok", "no_answer", "undecided", "timeout", "error", "too_large"]
"""``ok``: compared, ``correct`` is the verdict. ``no_answer``: the response has no answer (a
computed outcome: wrong). ``undecided``: an answer was found but no rule could compare it with the
gold (the gold is not readable as math): no verdict, ``correct`` is False and means nothing.
``timeout`` / ``error`` / ``too_large``: grading did not run to the end. Only ``ok`` and
``no_answer`` are verdicts; a reward function must not turn the others into a number silently
(``core/task/rewards.py`` drops their groups and counts them)."""
MAX_CHARS = 20_000
"""Default per-field size limit (prediction and gold each), checked before any parsing."""
logger = logging.getLogger(__name__)


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


def configure(settings: GraderSettings | None = None, *, rounded_gold: bool | None = None) -> GraderSettings:
    """Set this process's grading policies (the service/pool would call it in each worker at start);
    returns the previous settings, so a caller can restore them (``configure()`` reads them).

    ``settings`` replaces the whole object; ``rounded_gold`` changes that one field. Changing a
    policy empties the result caches (a cached verdict was computed under the old one).
    """
    old = numbers.SETTINGS
    new = settings if settings is not None else old
    if rounded_gold is not None:
        new = replace(new, rounded_gold=bool(rounded_gold))
    if new != old:
        numbers.use_settings(new)
        cache_clear()
    return old


def answers_equivalent(a: str, b: str) -> bool:
    """Whether two extracted answers are the same (for maj@k clustering); ``a`` plays the gold."""
    try:
        return equiv(latexify(a), latexify(b))
    except Exception:
        logger.debug("answers_equivalent failed", exc_info=True)
        return False


def cache_info() -> dict[str, dict[str, int]]:
    """Hit/miss counters of the bounded caches (the service exports them as Prometheus metrics)."""
    out = {}
    for name, fn in (("result", equiv_rule), ("answer_info", answer_info), ("sympy_parse", sympy_parse)):
        ci = fn.cache_info()
        out[name] = {"hits": ci.hits, "misses": ci.misses, "size": ci.currsize, "maxsize": ci.maxsize or 0}
    return out


def cache_clear() -> None:
    """Empty every cache (tests, benchmarks)."""
    for fn in (equiv_rule, answer_info, sympy_parse, sympy_text):
        fn.cache_clear()
    numeric_cache_clear()


# ---------------------------------------------------------------------------------------------
# modes
# ---------------------------------------------------------------------------------------------
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
        extracted, prose = marker_answer_form(extracted)
    if extracted is None or prose:
        if extracted is None and not response_finished(prediction, think=think):
            return Answer(None)  # cut off mid-work with no marker: nothing was committed to
        if budget == "cheap":
            return None
        body = extracted if extracted is not None else apply_think(prediction, think)
        if body is None or not body.strip():
            return Answer(None)
        found = search_fallback(body)
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
        verdict, rule = decide(gold_ans, answer, "cheap")
        return None if verdict is None or rule is None else (verdict, "ok", rule)
    if _SENTENCE_RE.search(answer) and is_prose(answer):
        # A sentence left after math-verify's search (words it found no math in, or a span of words
        # around math it reported as its first candidate: "Let me double-check: $\frac{255", a
        # response cut off after ``</think>``) is compared as text only: the cheap rules. Only three
        # words in a row count: a single word ("infinity") or juxtaposed variables ("RCs") still go
        # to sympy. That is how math-verify compares a string it could not parse (string equality,
        # ``compare_single_extraction``); latex2sympy would read the words as products of one-letter
        # symbols and spend 10-50 ms in ANTLR and sympy to find them unequal.
        verdict, rule = decide(gold_ans, answer, "cheap")
        return verdict is True, "ok", rule if verdict is not None else "prose-as-text"
    correct, rule = equiv_rule(gold_ans, answer)
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
    ``special_tokens``: model-specific tokens removed on top of ``extraction.SPECIAL_TOKENS`` (the common
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
