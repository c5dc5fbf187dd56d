"""The ordered table of mode ``math``'s comparison rules, and the comparison that runs it.

``RULES`` lists each family's rules cheapest first; the first rule that says yes or no decides and
names the verdict (``Verdict.rule``). :func:`equiv_rule` runs the whole table on a gold and an
extracted prediction (cached per pair); :func:`equiv` is the same as a yes/no, which the structure
rules receive as ``same`` to compare the parts of an answer (list items, equation sides). The
grader (``grader/__init__.py``) calls :func:`decide` and :func:`equiv_rule`; it adds extraction, modes,
budgets and statuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Literal

from stapo.verifier_service.grader.parsing import AnswerInfo, answer_info
from stapo.verifier_service.grader.rules import RuleVerdict, numbers, rejections, strings, structure, symbolic

Budget = Literal["cheap", "full"]
"""``full``: every rule and math-verify's search (a worker, under a deadline). ``cheap``: only steps
whose cost is linear in short inputs (a process with no deadline); None where they cannot tell."""
UNDECIDED = "undecided"
"""``Verdict.rule`` of an ``undecided`` grade: the table ran out without a verdict."""
RESULT_CACHE_SIZE = 65_536
"""Entries of the per-(gold, prediction) verdict cache (``equiv_rule``)."""

RuleFn = Callable[[str, str, AnswerInfo, AnswerInfo], RuleVerdict]
"""(gold, prediction, the gold's ``AnswerInfo``, the prediction's) -> yes / no / pass."""


@dataclass(frozen=True)
class Rule:
    """One comparison step of mode ``math``: says yes, no, or passes (None)."""

    name: str
    """what ``Verdict.rule`` says when this rule decides"""
    fn: RuleFn
    cheap: bool
    """True: string and exact-number work whose cost is linear in short inputs (no sympy, no
    math-verify), so a process with no deadline may run it (``compare(..., budget="cheap")``)."""


@lru_cache(maxsize=RESULT_CACHE_SIZE)
def equiv_rule(gold: str, pred: str) -> tuple[bool | None, str]:
    """(verdict, name of the rule that decided) for the extracted prediction ``pred`` against ``gold``;
    verdict None (``UNDECIDED``) when no rule could decide: the gold is not readable as math."""
    verdict, name = decide(gold, pred, "full")
    return (None, UNDECIDED) if verdict is None else (verdict, name or "math-verify")


def equiv(gold: str, pred: str) -> bool:
    """Is the extracted prediction ``pred`` the same answer as ``gold``? (``RULES``, cheapest first).
    Inside a rule (list elements, equation sides) an undecided part cannot be shown equal: no."""
    return bool(equiv_rule(gold, pred)[0])


RULES: tuple[Rule, ...] = (
    Rule("empty", strings.rule_empty, cheap=True),
    Rule("spaced-digits", numbers.rule_spaced_digits, cheap=True),
    Rule("same-string", strings.rule_same_string, cheap=True),
    Rule("choice-letter", strings.rule_choice, cheap=True),
    Rule("text", strings.rule_text, cheap=True),
    Rule("base-numeral", numbers.rule_base, cheap=True),
    Rule("exact-number", numbers.rule_exact_number, cheap=True),
    Rule("rounded-gold-number", numbers.rule_rounded_gold_number, cheap=True),
    Rule("clock-time", numbers.rule_clock, cheap=False),
    Rule("unordered-list", partial(structure.rule_unordered_list, same=equiv), cheap=False),
    Rule("function-name", partial(structure.rule_function_name, same=equiv), cheap=False),
    Rule("inequality-set", partial(structure.rule_inequality_set, same=equiv), cheap=False),
    Rule("equation-sides", partial(structure.rule_equation_sides, same=equiv), cheap=False),
    Rule("element-of", partial(structure.rule_element_of, same=equiv), cheap=False),
    Rule("brackets", partial(structure.rule_brackets, same=equiv), cheap=False),
    Rule("rounded-gold", numbers.rule_rounded_gold, cheap=False),
    Rule("compound-quantity", numbers.rule_compound_quantity, cheap=False),
    Rule("surely-unequal", rejections.rule_surely_unequal, cheap=False),
    Rule("math-verify", symbolic.rule_math_verify, cheap=False),
)
"""The comparison of mode ``math`` as an ordered table: each rule says yes, no, or passes (None);
the first that decides gives the verdict and its name (``Verdict.rule``). Cheapest first.
``math-verify`` decides whenever the gold parses; when it does not and no rule before it decided,
the grade's status is ``undecided`` (rule ``UNDECIDED``). Budget ``cheap`` runs the table up to its
first rule that is not cheap: every verdict it gives is the one the whole table gives."""
RULE_NAMES = tuple(r.name for r in RULES)


def decide(gold: str, pred: str, budget: Budget) -> tuple[RuleVerdict, str | None]:
    """(verdict, rule name) of the first rule that decides, or (None, None) when none does."""
    g, p = answer_info(gold), answer_info(pred)
    for rule in RULES:
        if budget == "cheap" and not rule.cheap:
            break  # a costly rule comes first in the full table: what follows it is not the table's verdict
        verdict = rule.fn(gold, pred, g, p)
        if verdict is not None:
            return bool(verdict), rule.name
    return None, None
