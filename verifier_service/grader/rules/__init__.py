"""The comparison rules of the grader's mode ``math``, one module per family.

Each rule reads a gold and an extracted prediction (the strings and their ``parsing.AnswerInfo``)
and says yes (True), no (False) or passes (None). ``table.py`` orders them into ``RULES``, the
table :func:`stapo.verifier_service.grader.compare` runs; the families:

- ``strings.py``: empty answers, equal canonical strings, option letters, text answers;
- ``numbers.py``: digits joined by spaces, base-subscript numerals, exact numbers, rounded golds
  (the grader's one user policy, ``GraderSettings``), clock times, compound quantities;
- ``structure.py``: answers made of parts (lists, equations, inequalities, ``x \\in S``, tuples,
  intervals, sets) compared part by part with the table itself;
- ``rejections.py``: answers that are surely different, told without sympy (they only say no);
- ``symbolic.py``: math-verify's symbolic ``verify``, with exact constants compared at 50 digits.

Imports go one way: ``parsing.py`` <- the families <- ``table.py`` <- ``grader/__init__.py``.
"""

RuleVerdict = bool | None
"""A rule's answer: True / False decides, None passes to the next rule."""
