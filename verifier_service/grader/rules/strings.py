"""String rules: empty answers, equal canonical strings, option letters, text answers.

Cheap (linear in short inputs, no sympy): budget ``cheap`` runs all of them.
"""

from __future__ import annotations

import re

from stapo.verifier_service.grader.parsing import AnswerInfo, plain_words
from stapo.verifier_service.grader.rules import RuleVerdict

_PRED_CHOICE_RE = re.compile(r"^(?:option|choice)?\(?([A-Ea-e])\)?(?:$|[.:)]|(?=[^A-Za-z]))")


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


def rule_empty(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    return False if not g.canon or not p.canon else None


def rule_same_string(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    return True if g.canon == p.canon else None


def rule_choice(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    # multiple choice never goes to sympy; an expression in the letter is not the option
    return _pred_choice(p.canon) == g.choice if g.choice is not None else None


def rule_text(gold: str, pred: str, g: AnswerInfo, p: AnswerInfo) -> RuleVerdict:
    if g.text is None:
        return None
    # a text gold ("Evelyn" is not E*v*e*l*y*n): the prediction's words, however written ("no" for
    # \\text{No}: a short word without \\text is not read as text on its own, but against a text gold it is)
    p_text = p.text if p.text is not None else plain_words(p.canon)
    return p_text is not None and p_text == g.text
