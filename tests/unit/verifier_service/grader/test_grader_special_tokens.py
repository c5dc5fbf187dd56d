"""End-of-turn and other chat-template special tokens never change a grade.

OpenRLHF decodes prompt + response with ``skip_special_tokens=False``, so the text it grades ends
in the model's end-of-turn token, often followed by padding. A grader that reads the raw text
extracts ``3`` from ``Answer: 3/4<|im_end|>`` (math) or matches nothing (dapo); integers happen to
pass, so the answers here are fractions, roots and tuples.
"""

from __future__ import annotations

import pytest

from stapo.verifier_service.grader import extract, grade
from stapo.verifier_service.grader.extraction import SPECIAL_TOKENS, extract_answer, strip_special_tokens

END_TOKENS = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "</s>",
    "<|end|>",
    "<end_of_turn>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<|end_of_text|>",
    "<eos>",
]
ANSWERS = [("3/4", "3/4"), ("\\sqrt{2}", "\\sqrt{2}"), ("(1, 2)", "(1,2)"), ("-\\frac{1}{3}", "-\\frac13")]


@pytest.mark.parametrize("mode", ["math", "dapo"])
@pytest.mark.parametrize("tok", END_TOKENS)
def test_answer_line_followed_by_end_token_grades_right(mode, tok):
    for ans, gold in ANSWERS:
        for tail in (tok, tok + "\n", tok + "<|endoftext|>" * 5, tok + "\n<|im_start|>user\nthanks"):
            pred = f"Let me think.\nAnswer: {ans}{tail}"
            r = grade(pred, gold, mode)
            assert r.correct and r.status == "ok", (mode, pred, r)


@pytest.mark.parametrize("tok", END_TOKENS)
def test_boxed_and_bare_answers_with_end_tokens(tok):
    assert grade(f"so \\boxed{{\\frac{{3}}{{4}}}}{tok}", "0.75").correct
    assert grade(f"3/4{tok}", "3/4").correct  # a bare short prediction
    assert not grade(f"Answer: 3/5{tok}", "3/4").correct  # a wrong answer stays wrong


def test_openrlhf_style_query_with_padding_and_template():
    q = (
        "<|endoftext|><|endoftext|><|im_start|>system\nAnswer: 7<|im_end|>\n<|im_start|>user\nWhat is 3/4?"
        "<|im_end|>\n<|im_start|>assistant\nIt is\nAnswer: 3/4<|im_end|><|endoftext|><|endoftext|>"
    )
    assert grade(q, "3/4", "dapo").correct
    assert grade(q, "3/4").correct


def test_dapo_tail_window_is_measured_after_stripping_padding():
    # 300-char DAPO window: 80 pad tokens (1,040 chars) after the answer must not push it out
    pred = "Answer: 1/2<|im_end|>" + "<|endoftext|>" * 80
    assert grade(pred, "\\frac{1}{2}", "dapo").status == "ok"


def test_extra_special_tokens_parameter():
    pred = "Answer: 2/3<|my_eot|>"  # the generic <|...|> shape is already covered
    assert grade(pred, "2/3").correct
    pred = "Answer: 2/3[[END]]"
    assert not grade(pred, "2/3").correct
    assert grade(pred, "2/3", special_tokens=("[[END]]",)).correct
    assert grade(pred, "2/3", "dapo", special_tokens=("[[END]]",)).correct


def test_every_listed_token_is_removed():
    for tok in SPECIAL_TOKENS:
        assert strip_special_tokens(f"a{tok}b") == "a\nb", tok


def test_list_and_helpers():
    for tok in ("<|im_end|>", "<|eot_id|>", "</s>", "<end_of_turn>", "<\uff5cend\u2581of\u2581sentence\uff5c>"):
        assert tok in SPECIAL_TOKENS
    assert strip_special_tokens("x < 3 and y > 2") == "x < 3 and y > 2"  # comparison signs are not tokens
    assert extract_answer("Answer: 3/4<|im_end|>") == "3/4"
    assert _found("Answer: 3/4<|im_end|>") == ("ok", "3/4")
    assert _found("Answer: 3/4<|im_end|>", "dapo") == ("ok", "3/4")
    assert _found("no answer here at all, and it is rather long text that goes on " * 3) == (
        "no_answer",
        None,
    )
    with pytest.raises(ValueError, match="mode"):
        extract("1", "bogus")


def _found(prediction: str, mode: str = "math") -> tuple[str, str | None]:
    a = extract(prediction, mode)
    return a.status, a.extracted


def test_extract_agrees_with_grade():
    preds = ["so \\boxed{\\frac12}<|im_end|>", "Answer: 0.5</s>", "The answer is $1/2$.", "1/2", "hello"]
    for p in preds:
        for mode in ("math", "dapo"):
            assert _found(p, mode)[1] == grade(p, "1/2", mode).extracted, (p, mode)
