"""extract_answer's fast marker scan (``extraction._answer_matches``) finds exactly what the regex scan found.

The old implementation is kept here as a copy (``_old_extract_answer``: ``finditer`` over the whole
text) and compared with the module's on a fuzz corpus built to hit the corner cases: "answer" in
every case, the long s (U+017F, which IGNORECASE folds to "s" but ``str.lower`` keeps), the Kelvin
sign, dotted/dotless i (``str.lower`` of U+0130 is two characters), letters glued before "answer"
(the look-behind), overlapping markers, and random Unicode.
"""

from __future__ import annotations

import random
import re
import sys

import pytest

from stapo.verifier_service.grader import extraction as E
from stapo.verifier_service.grader.normalize import strip_delims


def _old_extract_answer(text: str, *, think: str = "optional") -> str | None:
    """extract_answer as of commit 13a7952 (regex ``finditer`` scans), verbatim but for the names and
    the marker filters of the extraction policy (line-opening ``Answer:``, no markdown headings, the
    phrase that holds math, contrasts dropped, one-liners cut inside a math span), which both sides
    share."""
    body = E.apply_think(text, think)
    if body is None:
        return None
    candidates: list[tuple[int, str]] = []
    box = E.last_boxed(body)
    if box is not None:
        candidates.append(box)
    line_matches = [
        m for m in E._ANSWER_LINE_RE.finditer(body) if m.group(1).strip() and E._is_line_marker(body, m)
    ]
    if line_matches:
        m = line_matches[-1]
        candidates.append((m.start(), m.group(1)))
    gsm = [m for m in E._GSM8K_RE.finditer(body) if E._is_gsm8k_marker(m)]
    if gsm:
        candidates.append((gsm[-1].start(), gsm[-1].group(1)))
    if candidates:
        start, raw = max(candidates, key=lambda c: c[0])
        if box is not None and start == box[0]:
            ans = raw.strip()
        else:
            ans = E._from_marker_text(raw)
        return ans or None
    weak = list(E._ANSWER_IS_RE.finditer(body))
    weak = [m for m in weak if re.match(r"(?i)final answer|the answer", m.group(0))]
    if weak:
        ans = E._from_marker_text(E._drop_contrast(E._pick_phrase(weak).group(1)))
        if ans:
            return ans
    i18n = [m for m in E._I18N_ANSWER_RE.finditer(body) if m.group(1).strip()]
    if i18n:
        ans = strip_delims(E._clean_tail(E._pick_phrase(i18n).group(1)))
        if ans:
            return ans
    stripped = body.strip()
    if stripped and "\n" not in stripped and len(stripped) <= E.BARE_MAX_CHARS:
        if E._one_line_closed(stripped) or E._closed_turn(text):  # the policy's cut-off one-liners
            return E._clean_tail(stripped) or None
    return None


PIECES = [
    "answer", "Answer", "ANSWER", "aNsWeR", "anſwer", "ANſWER", "answers", "xanswer", "5answer", "_answer",
    "\u212aanswer", "\u0131answer", "\u0130", "\u0131", "\u212a", "ſ", "é", "É", "answer:", "Answer: ",
    "**Answer:**", "Final Answer:", "final answer is ", "The answer is ", "the answer = ", "answer to this problem is ",
    ":", "：", "*", "**", " ", "  ", "\n", "\t", ".", ". ", ";", "$", "x", "42", "3/4", "\\frac{1}{2}",
    "\\boxed{3}", "\\boxed{", "}", "####", "#### 7", "</think>", "<|im_end|>", "I hope it is correct.",
    "答案是", "Ответ: ", "la réponse est ", "nswer", "answe", "r:", "a", "s", "w",
]  # fmt: skip


def _fuzz_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 14)):
            r = rng.random()
            if r < 0.75:
                parts.append(rng.choice(PIECES))
            elif r < 0.9:
                parts.append("".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(1, 6))))
            else:
                parts.append("".join(chr(rng.randint(0, sys.maxunicode)) for _ in range(rng.randint(1, 3))))
        out.append("".join(parts))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_extract_answer_equals_the_regex_scan_on_fuzz(seed: int) -> None:
    texts = _fuzz_texts(3000, seed)
    for think in ("optional", "ignore"):
        for t in texts:
            assert E.extract_answer(t, think=think) == _old_extract_answer(t, think=think), repr(t)


@pytest.mark.parametrize("seed", range(4))
def test_answer_matches_equals_finditer(seed: int) -> None:
    """Same matches (spans and groups) as finditer, for both regexes it replaces."""
    for t in _fuzz_texts(3000, 100 + seed):
        for regex, back in ((E._ANSWER_LINE_RE, (0,)), (E._ANSWER_IS_RE, (6, 4, 0))):
            got = [(m.span(), m.groups()) for m in E._answer_matches(regex, t, back)]
            want = [(m.span(), m.groups()) for m in regex.finditer(t)]
            assert got == want, repr(t)


def test_corner_cases_by_hand() -> None:
    # hand-written expectations, not only old-vs-new
    assert E.extract_answer("Answer: 3") == "3"
    assert E.extract_answer("xanswer: 3\nstuff") is None  # the look-behind: a letter glued before
    assert E.extract_answer("ſanswer: 3\nstuff") is None  # long s is a letter under IGNORECASE
    assert E.extract_answer("\u212aanswer: 3\nstuff") is None  # so is the Kelvin sign
    assert E.extract_answer("5answer: 3\nstuff") == "3"
    assert E.extract_answer("anſwer: 7\nmore text here") == "7"  # IGNORECASE folds ſ to s
    assert E.extract_answer("\u0130\nAnswer: 8\nmore text") == "8"  # lower() changes the length
    assert E.extract_answer("Answer: 1\nAnswer: 2\nok then") == "2"
    assert E.extract_answer("So the final answer is 12. Done and more words here\nsecond line") == "12"


def test_every_code_point_matching_answer_lowers_to_it_but_long_s() -> None:
    """The premise of _answer_matches: under IGNORECASE, a character matching a letter of "answer"
    lowers to that letter, except U+017F (handled by falling back to finditer)."""
    odd = {}
    for x in "answer":
        r = re.compile("(?i)" + x)
        odd[x] = [c for c in range(sys.maxunicode + 1) if r.fullmatch(chr(c)) and chr(c).lower() != x]
    assert odd == {"a": [], "n": [], "s": [0x17F], "w": [], "e": [], "r": []}


def test_stream_items_unchanged() -> None:
    from stapo.verifier_service.clients.loadgen import build_stream, load_golds

    for style, src in (("answer_line", "dapo17k"), ("boxed", "math500+gsm8k")):
        for p, _g, _m in build_stream(1500, seed=3, style=style, golds=load_golds(source=src)):
            assert E.extract_answer(p) == _old_extract_answer(p)
