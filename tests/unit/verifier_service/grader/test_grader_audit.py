"""False positives closed at their cause, false negatives of extraction, and auditable verdicts.

Each row is (gold, response, expected), mode ``math``; the comment says which comparison step or
extraction rule the row pins. Expectations are by hand, from what the response means.
"""

from __future__ import annotations

import pickle
import sys
from collections import Counter
from pathlib import Path

import pytest

from stapo.verifier_service import grader
from stapo.verifier_service.grader import RULE_NAMES, Verdict, grade

FALSE_POSITIVES = [
    # a unit word after an expression in a box is a unit: the expression stays whole
    ("10", "\\boxed{10\\pi square units}", False),
    ("10", "\\boxed{10\\pi \\text{ square units}}", False),
    ("10", "\\boxed{10\\sqrt{2} cm}", False),
    ("10", "\\boxed{10 square units}", True),
    ("10\\pi", "\\boxed{10\\pi square units}", True),
    ("233", "The area is \\boxed{233 m^2}", True),
    # "and" / "or" inside a box make a list, never "the last number"
    ("5", "\\boxed{3 and 5}", False),
    ("5", "\\boxed{5 \\text{ or } 3}", False),
    ("3, 5", "\\boxed{3 and 5}", True),
    ("1,3", "\\boxed{3 \\text{ and } 1}", True),
    # a choice letter is the option, not an expression in that letter
    ("C", "\\boxed{c^2}", False),
    ("A", "a = 5", False),
    ("A", "\\boxed{a=5}", False),
    ("C", "\\boxed{C}", True),
    ("C", "The answer is (C).", True),
    ("\\text{(C)}", "\\boxed{\\textbf{(C)}}", True),
    ("C", "(C) 25", True),
    # inequalities read as sets: the connective and the variable matter
    ("(-\\infty,\\infty)", "x > 1 \\text{ and } x < 5", False),
    ("(1,5)", "\\boxed{x > 1 \\text{ and } x < 5}", True),
    ("(1,5)", "\\boxed{x > 1, x < 5}", True),
    ("(1,\\infty)", "x > 1, y > 2", False),
    ("(-\\infty, -2) \\cup (3, \\infty)", "\\boxed{x < -2 \\text{ or } x > 3}", True),
    ("(-\\infty, -2) \\cup (3, \\infty)", "\\boxed{x < -2, x > 3}", True),
    ("(-\\infty, -2) \\cup (3, \\infty)", "\\boxed{x < -2 \\text{ and } x > 3}", False),
    # a gold with a comma is a list, never a decimal comma (keys write decimals with a point)
    ("-3,0", "\\boxed{-3}", False),
    ("-3,0", "\\boxed{-3, 0}", True),
    ("0.5", "\\boxed{0,5}", True),  # a prediction's decimal comma still reads against a non-integer gold
    ("1.22", "\\boxed{1,22}", True),
    ("\\frac{5}{2}", "\\boxed{2,5}", True),
    ("1,22", "1.22", False),  # the gold is the list 1, 22
    ("-3", "\\boxed{-3,0}", False),  # against an integer gold "-3,0" is a list, not -3.0
    ("7", "\\boxed{7,0}", False),
    # digits joined by spaces are several numbers, not the integer they spell
    ("123", "\\boxed{1 2 3}", False),
    ("23", "\\boxed{2 3}", False),
    ("105", "\\boxed{10 5}", False),
    ("123", "\\boxed{1\\,2\\,3}", False),
    ("123", "The answer is $1~2~3$.", False),
    ("1 2 3", "\\boxed{1 2 3}", True),  # the gold written that way
    ("12345", "\\boxed{12 345}", True),  # thousands groups stay a number
    ("1000000", "\\boxed{1\\,000\\,000}", True),
    ("\\frac{11}{4}", "\\boxed{2 3/4}", True),  # a mixed number is not spaced digits
    # rounded golds: only where the answer shows the gold was rounded (an exact value no finite
    # decimal equals, or 2+ more decimals whose digits at the gold's places are not the gold's), at
    # the gold's precision
    ("0.25", "\\boxed{0.2512}", False),  # the gold's digits and more: a longer number
    ("3.75", "\\boxed{3.7549}", False),
    ("1.5", "\\boxed{1.540}", False),
    ("12.5", "\\boxed{12.540}", False),
    ("-0.25", "\\boxed{-0.2512}", False),
    ("3.14", "\\boxed{3.14159}", False),
    ("33.3", "\\boxed{100/3}", True),  # no finite decimal is 100/3: 33.3 was rounded
    ("33.3", "\\boxed{\\frac{100}{3}}", True),
    ("33.3", "\\boxed{\\frac{101}{3}}", False),  # 33.67 does not round to it
    ("2.2361", "\\boxed{2.2360680}", True),  # rounding changed the last digit: 2.2360... -> 2.2361
    ("-0.79", "\\boxed{-0.78540}", True),
    ("0.2499", "\\boxed{0.25}", False),  # fewer digits never match a longer gold
    ("1.5", "1.54", False),
    ("1.5", "\\boxed{1.50}", True),
    ("1.5", "\\boxed{\\frac{31}{20}}", False),
    ("0.264", "\\boxed{0.2644}", False),
    ("0.6667", "\\boxed{\\frac{2}{3}}", True),
    ("0.79", "\\boxed{\\frac{\\pi}{4}}", True),
    ("0.79", "\\boxed{0.78540}", True),
    ("20.39", "\\boxed{20.394}", False),
    ("62.83", "\\boxed{62.9}", False),
    # integers compare exactly
    ("999999999999", "1.0 \\times 10^{12}", False),
    ("3070999999", "\\boxed{3071 \\times 10^{6}}", False),
    ("1450000", "\\boxed{1.45 \\times 10^{6}}", True),
    ("4.5 \\times 10^{33}", "\\boxed{4.5e33}", True),
]

FALSE_NEGATIVES = [
    # text after the box does not override it
    ("5", "\\boxed{5}\n\n#### Verification\nWe check 2+3=5 and 4.", True),
    ("5", "So $\\boxed{5}$.\n\nDouble-check: the answer: 4 would break the second condition.", True),
    ("4", "So $\\boxed{5}$.\n\nDouble-check: the answer: 4 would break the second condition.", False),
    ("18", "She makes 9 * 2 = 18 dollars.\n#### 18", True),
    ("7", "Work.\nAnswer: 7\n\nAnother line.", True),
    ("7", "**Final Answer:** 7", True),
    # "X, not Y"
    ("5", "the answer is 5, not 4", True),
    ("4", "the answer is 5, not 4", False),
    ("5", "Therefore, the answer is $5$ rather than $4$.", True),
    # a later mention of "answer" checks the answer, it does not replace it
    ("5", "因此，最终答案是 $5$。我们可以验证这个答案是正确的。", True),
    ("5", "La réponse est $5$. Vérifions que cette réponse est correcte.", True),
    ("5", "Итак, ответ: $5$. Проверим, что ответ верный.", True),
    ("5", "Also ist die Antwort $5$. Die Antwort ergibt sich aus der Rechnung.", True),
    ("6", "Also ist die Antwort $5$. Die Antwort ergibt sich aus der Rechnung.", False),
    ("12", "So the final answer is 12. I checked that the answer is correct.", True),
    # base subscript when the gold is the digits the question asked for
    ("616", "\\boxed{616_9}", True),
    ("616", "\\boxed{617_9}", False),
    ("42", "\\boxed{52_8}", True),  # the value in base ten
    # a text gold against the same word written plainly
    ("\\text{No}", "\\boxed{no}", True),
    ("\\text{No}", "\\boxed{yes}", False),
    ("\\text{Yes}", "\\boxed{\\text{YES}}", True),
]


@pytest.mark.parametrize(("gold", "response", "expected"), FALSE_POSITIVES + FALSE_NEGATIVES)
def test_verdict(gold, response, expected):
    res = grade(response, gold)
    assert res.status == "ok" and res.correct is expected, res


LEAD = "We begin by expanding the expression and collecting like terms.\n"
CUT_OFF_TAILS = [
    # cut off mid-work with no committed answer: the last number passed through is not an answer
    ("5", LEAD + "Substituting 5 into the second equation, we get", "no_answer"),
    ("5", LEAD + "The partial sum is 5, and the next term gives $\\boxed{", "no_answer"),
    ("5", LEAD + "First we find that $y = 5$. Then we need to compute $\\frac{", "no_answer"),
    ("12", LEAD + "The rectangle is $3$ by $4$, so its area is $3 \\times 4 =", "no_answer"),
    (
        "\\dfrac{33}{100}",
        LEAD + "The partial sum is \\dfrac{33}{100}, and the next term gives $\\boxed{",
        "no_answer",
    ),
    (
        "\\dfrac{33}{100}",
        LEAD + "Substituting \\dfrac{33}{100} into the second equation, we get",
        "no_answer",
    ),
    # the short final section after a closed </think>, cut inside a math span or brace: no answer
    ("6", "<think>\nc^2 = 36, so c = 6.\n</think>\n\nBy the Pythagorean theorem, $c^2 = 6", "no_answer"),
    ("255", "<think>\nok\n</think>\n\nLet me double-check: $\\frac{255", "no_answer"),
    ("6", "By the Pythagorean theorem, $c = 6$<|im_end|>", True),  # closed turn: an answer
    # a commitment before the cut still counts
    ("5", LEAD + "Thus $\\boxed{5}$.\n\nLet me double-check: $\\frac{", True),
    ("\\dfrac{33}{100}", LEAD + "So the answer is $\\dfrac{33}{100}$.\n\nWait, let me re-check: $x = ", True),
    # a response that is just an answer, or finishes on a statement of the value, is graded
    ("5", "5", True),
    ("5", "$x = 5$", True),
    ("28\\%", "28 percent", True),
    ("5", LEAD + "x = 5", True),
    ("120", LEAD + "The volume of the box is 120", True),
    ("120", LEAD + "The volume of the box is $120$ cubic units.", True),
    ("\\dfrac{33}{100}", LEAD + "The probability is $\\dfrac{33}{100}$.", True),
    ("\\dfrac{33}{100}", LEAD + "The probability is $\\frac{34}{100}$.", False),
    # the model closed its turn (an end-of-turn token after the text): finished wherever it stops
    ("2/3", LEAD + "Therefore the probability that Alice wins is 2/3. <|im_start|>user", True),
]


@pytest.mark.parametrize(("gold", "response", "expected"), CUT_OFF_TAILS)
def test_cut_off_tails(gold, response, expected):
    """Extraction policy: without a marker only a finished response is searched for its answer."""
    res = grade(response, gold)
    if expected == "no_answer":
        assert res.status == "no_answer" and not res.correct and res.rule == "no-answer", res
    else:
        assert res.status == "ok" and res.correct is expected, res


@pytest.mark.parametrize(
    ("text", "finished"),
    [
        ("5", True),
        ("so x = 5", True),
        ("so $x = 5$.", True),
        ("**5**", True),
        ("y = 2x", True),
        ("it grows by 100%.", True),
        ("the value is \\pi", True),
        ("|x - 3|", True),
        ("所以答案是 5。", True),
        ("we get", False),
        ("the product of", False),
        ("x^2 + ", False),
        ("a, b,", False),
        ("then $\\frac{1}{2", False),
        ("so $x = 5", False),
        ("\\[ x = 5", False),
        ("然后我们计算", False),
        ("<pad><pad>so we get", False),  # padding before the text is not the end of a turn
        ("so we get<|im_end|>", True),
        ("so we get</s><pad>", True),
        ("<think>x = 5</think>\n\nwe get", False),
        ("", False),
    ],
)
def test_response_finished(text, finished):
    from stapo.verifier_service.grader.extraction import response_finished

    assert response_finished(text) is finished


def test_undecided_is_a_status_not_a_verdict():
    """A gold no rule can read: the grade says so instead of guessing "wrong"."""
    res = grade("\\boxed{3}", "@#")
    got = (res.status, res.correct, res.score, res.rule, res.extracted)
    assert got == ("undecided", False, 0.0, "undecided", "3")
    assert grade("\\boxed{@#}", "@#").correct  # equal strings still decide
    # math-verify reads N as n: the gold "N=n" parses to Eq(n, n), which its solve-and-compare calls
    # equal to any equation with no solutions ("N = n + 1" -> Eq(n, n + 1)): no comparison is possible
    assert grade("\\boxed{N = n + 1}", "$N=n$").status == "undecided"
    assert grade("\\boxed{N = n}", "$N=n$").correct
    assert grade("no answer, and it goes on.\nand on", "@#").status == "no_answer"  # nothing to compare
    wrong = grade("\\boxed{@#}", "\\frac{1}{2}")  # an unreadable *answer* is wrong, as in math-verify
    assert (wrong.status, wrong.correct) == ("ok", False)


def test_every_verdict_names_its_rule_and_answer():
    res = grade("so \\boxed{\\frac{1}{2}}", "0.5")
    assert res.correct and res.extracted == "\\frac{1}{2}" and res.rule == "exact-number"
    assert grade("\\boxed{c^2}", "C").rule == "choice-letter"
    assert grade("no answer here, only words that go on.\nand on", "5").rule in ("no-answer", "prose-as-text")
    assert grade("Answer: 7", "7", "dapo").rule == "dapo"
    assert grade("x" * 50, "5", max_chars=10).rule is None  # too_large: no rule ran
    for gold, response, _ in FALSE_POSITIVES + FALSE_NEGATIVES:
        rule = grade(response, gold).rule
        assert rule in RULE_NAMES or rule in ("no-answer", "prose-as-text"), (gold, response, rule)


def test_rule_table_is_ordered_and_ends_in_math_verify():
    assert RULE_NAMES[:3] == ("empty", "spaced-digits", "same-string") and RULE_NAMES[-1] == "math-verify"
    assert len(set(RULE_NAMES)) == len(RULE_NAMES)
    cheap = [r.name for r in grader.RULES if r.cheap]
    assert cheap == list(RULE_NAMES[: len(cheap)]) and cheap[-1] == "rounded-gold-number"


def test_grade_result_is_serializable_and_picklable():
    res = grade("\\boxed{2}", "2")
    assert pickle.loads(pickle.dumps(res)) == res
    d = res.to_dict()
    assert d["rule"] == "same-string" and d["extracted"] == "2"
    assert Verdict(True, 1.0, "ok", "2").rule is None  # positional construction still works


def test_rule_shares_metric():
    from stapo.core.task.rewards import RewardBatch, rule_shares

    def batch(rules):
        n = len(rules)
        return RewardBatch([0.0] * n, [True] * n, [False] * n, [None] * n, ["ok"] * n, rules=Counter(rules))

    got = rule_shares([batch(["same-string", "math-verify", "same-string"]), batch(["none"])])
    assert got == {"reward/rule/math-verify": 0.25, "reward/rule/none": 0.25, "reward/rule/same-string": 0.5}
    assert rule_shares([]) == {}


def test_reward_function_counts_rules():
    from stapo.core.config import RewardConfig
    from stapo.core.task.rewards import RewardFunction

    class Local:
        def grade_many(self, items):
            return [grade(i["prediction"], i["gold"]) for i in items]

    fn = RewardFunction(RewardConfig(), grader=Local())
    out = fn(["\\boxed{2}", "\\boxed{c^2}", "\\boxed{0.5}"], ["2", "C", "\\frac12"])
    assert out.rules == Counter({"same-string": 1, "choice-letter": 1, "exact-number": 1})


def test_reward_function_never_pays_an_undecided_grade(caplog):
    """An undecided grade is no reward: invalid (its group is dropped), not retried, logged, counted
    in the rule shares and toward ``reward.max_failure_frac``."""
    from stapo.core.config import RewardConfig
    from stapo.core.task.rewards import RewardError, RewardFunction, rule_shares

    calls = []

    class Local:
        def grade_many(self, items):
            calls.append(len(items))
            return [grade(i["prediction"], i["gold"]) for i in items]

    fn = RewardFunction(RewardConfig(retries=2, max_failure_frac=0.5), grader=Local())
    with caplog.at_level("WARNING", logger="stapo.core.task.rewards"):
        out = fn(["\\boxed{3}", "\\boxed{2}", "\\boxed{5}"], ["@#", "2", "4"])
    assert out.valid == [False, True, True] and out.correct == [False, True, False]
    assert out.status == ["undecided", "ok", "ok"] and out.retried == 0 and calls == [3]
    assert rule_shares([out])["reward/rule/undecided"] == pytest.approx(1 / 3)
    assert "1/3 rewards undecided" in caplog.text and "'@#'" in caplog.text
    with pytest.raises(RewardError, match=r"2/3 rewards could not be computed.*undecided"):
        fn(["\\boxed{3}", "\\boxed{3}", "\\boxed{2}"], ["@#", "\\foo{3}+", "2"])


def test_explain_cli():
    from typer.testing import CliRunner

    from stapo.cli.verifier import app

    res = CliRunner().invoke(app, ["explain", "10", "\\boxed{10\\pi square units}"])
    assert res.exit_code == 0, res.output
    assert "extracted: 10\\pi" in res.output and "wrong" in res.output and "rule:" in res.output
    res = CliRunner().invoke(app, ["explain", "5", "the answer is 5, not 4"])
    assert "extracted: 5" in res.output and "correct" in res.output and "same-string" in res.output
    res = CliRunner().invoke(app, ["explain", "@#", "\\boxed{3}"])
    assert "verdict:   none (status undecided)" in res.output and "rule:      undecided" in res.output
    bad = CliRunner().invoke(app, ["explain", "5", "5", "--mode", "nope"])
    assert bad.exit_code != 0 and "mode" in str(bad.exception)  # main() prints a CLIError as "error: ..."


# ---- the differential harness, dev split only (the held-back split is never read by tests)
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))


def test_differential_generator_splits_and_labels():
    from differential_gen import HELDBACK_SEED, generate

    with pytest.raises(ValueError, match="seed"):
        next(generate(HELDBACK_SEED, 1))
    pairs = list(generate(0, 2))
    fams = {p.family for p in pairs}
    assert {"numbers", "units", "choices", "long_cot", "cutoff", "multilingual"} <= fams
    assert any(p.expected for p in pairs) and any(not p.expected for p in pairs)
    assert pairs == list(generate(0, 2))  # deterministic


@pytest.mark.parametrize(
    "family",
    ["units", "structures", "intervals", "choices", "fracdec", "long_cot", "multilingual", "text", "cutoff"],
)
def test_differential_dev_split_no_false_positive(family):
    """On a small dev sample of the harness, stapo rewards no near miss in the closed families."""
    from differential_gen import generate

    wrong = [
        (p.how, p.gold, p.response[-60:])
        for p in generate(0, 4, families=[family])
        if grade(p.response, p.gold).correct and not p.expected
    ]
    assert not wrong, wrong


def test_cheap_verdicts_name_the_rule_a_worker_would():
    """The server process's cheap path (``compare`` on ``extract``'s answer, budget ``cheap``) gives the
    verdict *and* the rule of a full ``grade``: a cached or inline verdict is as auditable as a fresh one."""
    import json
    from importlib import resources

    from stapo.verifier_service.grader import compare, extract

    text = resources.files("stapo.verifier_service").joinpath("data/corpus_dev.jsonl").read_text("utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()][::7]
    decided = 0
    for row in rows:
        answer = extract(row["prediction"], budget="cheap")
        quick = compare(row["gold"], answer, budget="cheap") if answer is not None else None
        if quick is None:
            continue
        decided += 1
        res = grade(row["prediction"], row["gold"])
        assert (res.correct, res.rule) == (quick.correct, quick.rule), (row, res)
    assert decided > len(rows) // 4, (decided, len(rows))
    dapo = compare("5", extract("Work.\nAnswer: 5", "dapo", budget="cheap"), "cheap")
    assert (dapo.correct, dapo.rule) == (True, "dapo") == (grade("Work.\nAnswer: 5", "5", "dapo").correct, "dapo")


def test_framework_adapters_give_the_failure_value_for_undecided(monkeypatch):
    """verl's adapters (in-process ``prime`` route) treat an undecided grade as a failed item, not as
    a plain 0: the failure value and its status, as for a timeout."""
    from stapo.verifier_service.clients.adapters import compute_score_prime

    monkeypatch.delenv("STAPO_VERIFIER_URL", raising=False)
    assert compute_score_prime("t", "so \\boxed{3}", "@#", failure_score=-7.0) == (-7.0, "undecided")
    assert compute_score_prime("t", "so \\boxed{3}", "3", failure_score=-7.0) == (1.0, "ok")
