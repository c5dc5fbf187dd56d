"""Answer extraction: find the final answer inside a full model response.

Extraction policy (which candidate is the answer when a response has several; docs/verifier.md
"Extraction policy" says why):

0. Chat-template special tokens (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ...; ``SPECIAL_TOKENS``)
   are removed first, in every mode.
1. ``think``: "optional" keeps only the text after the last ``</think>`` when there is one,
   "required" answers None when there is no ``</think>``, "ignore" uses the whole text.
2. Strong markers, the one that starts LAST in the text wins:
   the last non-empty ``\\boxed{...}`` / ``\\fbox{...}`` (brace-matched; ``\\boxed 5`` too; boxes
   that follow each other separated only by commas/"and" are one multi-part answer),
   the last ``Answer: ...`` line (DAPO template; ``**Final Answer:**`` too) -- only where "answer"
   opens its line (markdown, "final", "the" and non-letters may precede it) or reads "Final
   Answer:" (Minerva's template puts it after a sentence): "Double-check: the answer: 4 would
   fail" in the text after a box is discussion, not a marker --,
   the last GSM8K ``#### ...`` line -- not a markdown heading (``#### Verification``: text that
   starts with a word is a heading).
3. Weak marker: "the (final) answer is ..." sentences; failing that, the same phrase in other
   languages ("答案是 ...", "la réponse est ...", "die Antwort ist ...", "Ответ: ...", ...). Of several
   such phrases the last one whose value holds math (a digit, ``$`` or a LaTeX command) wins, else
   the last one: a later "the answer is correct" / "这个答案是正确的" checks the answer, it does not
   replace it. The value runs to the end of its sentence, and a contrast after it is dropped
   ("the answer is 5, not 4" -> 5; "rather than", "instead of" too).
4. No marker: a short one-line prediction (``BARE_MAX_CHARS``) is the answer itself ("42",
   "$\\frac12$", "28 percent", "$1,000.99"): the model wrote nothing but it -- unless the line
   stops inside a math span or a brace ("By the theorem, $c^2 = 6", cut at the length limit) and
   the model did not close its turn. Anything else gives
   None, and the grader falls back to math-verify's own extraction (last LaTeX span / last
   number) -- see ``parsing.search_fallback`` -- only when the response is *finished* (``response_finished``:
   the model closed its turn, or the text closes every math delimiter and brace it opens and does
   not stop mid-sentence). A response cut off mid-work ("... Substituting 5 into the second
   equation, we get") has committed to nothing, and the last number it passed through is not its
   answer.

Usage::

    from stapo.verifier_service.grader.extraction import extract_answer
    extract_answer("... so \\boxed{\\frac{1}{2}}")  # -> "\\frac{1}{2}"
"""

from __future__ import annotations

import re

from stapo.verifier_service.grader.normalize import strip_delims

THINK_MODES = ("optional", "required", "ignore")

SPECIAL_TOKENS: tuple[str, ...] = (
    # ChatML (Qwen, Yi, OpenHermes, ...), GPT-2 / Qwen base, Phi-3 / Phi-4
    "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|end|>", "<|endofprompt|>", "<|im_sep|>",
    # Llama 3 / 3.1 / 3.2
    "<|eot_id|>", "<|end_of_text|>", "<|begin_of_text|>", "<|eom_id|>",
    "<|start_header_id|>", "<|end_header_id|>",
    # Llama 2 / Mistral / most SentencePiece models
    "</s>", "<s>", "<unk>", "<pad>", "[PAD]", "[/INST]", "[INST]",
    # Gemma
    "<end_of_turn>", "<start_of_turn>", "<eos>", "<bos>",
    # DeepSeek V2/V3/R1 (full-width bars, U+2581 spaces)
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
    "<\uff5cAssistant\uff5c>", "<\uff5cUser\uff5c>", "<\uff5cEOT\uff5c>",
    # GLM / ChatGLM, Mistral v7+ control tokens, OLMo
    "<|user|>", "<|assistant|>", "<|system|>", "<|observation|>", "[/SYSTEM_PROMPT]",
)  # fmt: skip
"""End-of-turn, padding and role tokens of the common chat templates, removed before extraction.

OpenRLHF decodes ``prompt + response`` with ``skip_special_tokens=False``, so its queries end in the
end-of-turn token (and often padding): ``Answer: 3/4<|im_end|>`` must grade as ``3/4``. Besides this
list, any ``<|...|>`` token (word characters, dots, dashes only) and any DeepSeek ``<\uff5c...\uff5c>`` token is
removed too; ``extra_special_tokens`` of :func:`strip_special_tokens` adds model-specific ones.
"""
_SPECIAL_RE = re.compile(
    r"<(?:\|[A-Za-z0-9_.\-]{1,40}\||\uff5c[^\uff5c<>\n]{1,40}\uff5c|/s|s|unk|pad|eos|bos|end_of_turn|start_of_turn)>"
    r"|\[(?:PAD|/?INST|/SYSTEM_PROMPT)\]"
)  # every token of SPECIAL_TOKENS (a test checks it) plus the generic <|...|> and <\uff5c...\uff5c> shapes
_ANGLE_TOKENS = ("</s>", "<s>", "<unk>", "<pad>", "<eos>", "<bos>", "<end_of_turn>", "<start_of_turn>")
_BRACKET_TOKENS = ("[PAD]", "[INST]", "[/INST]", "[/SYSTEM_PROMPT]")
BARE_MAX_CHARS = 80
"""A prediction with no marker, one line and at most this many characters is taken as the answer."""

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b\s*")
_ANSWER_LINE_RE = re.compile(r"(?i)(?<![a-z])answer\s*\**\s*[:：]\s*\**[ \t]*([^\n]*)")
_GSM8K_RE = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS_RE = re.compile(
    r"(?i)(?:final answer|the answer|answer)\s*(?:to (?:this|the) (?:problem|question)\s*)?"
    r"(?:is|=|:)\s*:?\s*(.+?)(?=\.\s|\.$|\n|;\s|\s+I hope|$)",
    re.DOTALL,
)
_JOIN_SEP_RE = re.compile(
    r"^(?:\s|\$|\\\)|\\\(|\\\[|\\\]|,|;|\\quad|\\qquad|\band\b|\bor\b|\\text\{\s*(?:and|or)\s*\}"
    r"|(?<![A-Za-z])[a-z](?:_\{?\w+\}?)?\s*=)*$"
)  # "x = \boxed{2} or x = \boxed{3}": a one-letter "x =" between boxes keeps them one answer
# "the answer is" in other languages (no box): the phrase's value, up to the end of its sentence
_I18N_ANSWER_RE = re.compile(
    r"(?i)(?:最终答案|答案|答え|정답|réponse(?:\s+finale)?|antwort|respuesta(?:\s+final)?|risposta(?:\s+finale)?"
    r"|resposta(?:\s+final)?|ответ|odpowied[źz]|cevap|jawaban(?:nya)?)"
    r"\s*(?:est|ist|es|è|é|是|为|為|は|:|：|равен|—|-)?\s*(?:est|ist|es|è|é|:|：)?\s*"
    r"(\$[^$\n]+\$|\\\(.+?\\\)|[^\n。；;，！？!?]+?)(?=\s*(?:です|である|になります|となります|。|；|;|，|,\s|！|!|？|\?|\.(?!\d)|\n|$))"
)
_HOPE_RE = re.compile(r"(?i)\.?\s*I hope it is correct\.?\s*$")


def _answer_matches(regex: re.Pattern[str], text: str, back: tuple[int, ...] = (0,)) -> list[re.Match[str]]:
    """``list(regex.finditer(text))`` for a case-insensitive ``regex`` whose every match contains the
    word "answer" ``back[k]`` characters after its start, found without the regex scanning every position.

    Why: ``_ANSWER_LINE_RE`` starts with a look-behind, which defeats the regex engine's prefix scan;
    it tried a match at each of a 2,000-character response's positions (~4 us per response in
    the server process, on every item). Here ``str.lower`` + ``str.find`` list the places where
    "answer" can occur and the regex is tried only there, so the matches are exactly finditer's:
    each match of ``(?i)answer`` lowers to "answer" (an exhaustive check over every code point is in
    tests/service/test_extract_speed.py) except with the long s ``\u017f``, which IGNORECASE folds to
    "s" but ``lower`` keeps; a text with it, or whose length ``lower`` changes (positions would
    shift), takes ``finditer`` itself.
    """
    low = text.lower()
    if len(low) != len(text) or "\u017f" in text:
        return list(regex.finditer(text))
    out: list[re.Match[str]] = []
    pos = 0  # finditer's next search position (matches are never empty)
    q = low.find("answer")
    while q >= 0:
        # Candidate starts in increasing order (occurrences of "answer" are >= 6 apart and
        # ``back`` is decreasing): the leftmost match wins, as in finditer's search.
        for b in back:
            start = q - b
            if start >= pos:
                m = regex.match(text, start)
                if m is not None:
                    out.append(m)
                    pos = m.end()
        q = low.find("answer", max(q + 1, pos))
    return out


def strip_special_tokens(text: str, extra_special_tokens: tuple[str, ...] = ()) -> str:
    """``text`` with chat-template special tokens (``SPECIAL_TOKENS``, the generic ``<|...|>`` shape and
    ``extra_special_tokens``) replaced by a newline, so a marker's line ends where the turn ended.

    Removing rather than cutting at the first one: an OpenRLHF query may begin with padding or a
    system turn when the prompt prefix could not be stripped; the last marker still wins.
    """
    for tok in extra_special_tokens:
        if tok and tok in text:
            text = text.replace(tok, "\n")
    if not _may_have_special(text):
        return text
    return _SPECIAL_RE.sub("\n", text)


def _may_have_special(text: str) -> bool:
    """A cheap pre-check (the regex scan costs ~10 us per 2,000 characters, this ~1 us)."""
    if "|" in text or "\uff5c" in text:
        return True
    for lead, toks in (("<", _ANGLE_TOKENS), ("[", _BRACKET_TOKENS)):
        i = text.find(lead)
        while i >= 0:
            if text.startswith(toks, i):
                return True
            i = text.find(lead, i + 1)
    return False


def apply_think(text: str, think: str) -> str | None:
    """Cut the reasoning part of a response according to ``think`` (None when it is required but absent)."""
    if think not in THINK_MODES:
        raise ValueError(f"think: unknown mode {think!r}; valid: {', '.join(THINK_MODES)}")
    text = strip_special_tokens(text)
    if think == "ignore":
        return text
    idx = text.rfind("</think>")
    if idx < 0:
        return None if think == "required" else text
    return text[idx + len("</think>") :]


def _match_brace(text: str, open_idx: int) -> int:
    """Index of the ``}`` closing the ``{`` at ``open_idx`` (escaped ``\\{`` ignored), or -1."""
    depth = 0
    i = open_idx
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n and text[i + 1] in "{}":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def find_boxes(text: str) -> list[tuple[int, int, str]]:
    """All ``\\boxed``/``\\fbox`` contents as (start, end, content), in order; unclosed ones are skipped."""
    out: list[tuple[int, int, str]] = []
    if "boxed" not in text and "fbox" not in text:
        # Every match of _BOX_RE contains one of these words; ``in`` finds them in C, while the
        # regex stops at each backslash of a LaTeX-heavy response (~10 us per 500 characters).
        return out
    pos = 0
    while True:
        m = _BOX_RE.search(text, pos)
        if m is None:
            return out
        j = m.end()
        if j < len(text) and text[j] == "{":
            close = _match_brace(text, j)
            if close < 0:
                pos = m.end()
                continue
            out.append((m.start(), close + 1, text[j + 1 : close]))
            pos = close + 1
        else:
            # \boxed 5  -> the next token, up to whitespace or a math delimiter
            tok = re.match(r"[^\s$\\]+", text[j:]) if m.group(0).endswith((" ", "\t")) else None
            if tok:
                out.append((m.start(), j + tok.end(), tok.group(0).rstrip(".,")))
                pos = j + tok.end()
            else:
                pos = m.end()


def last_boxed(text: str) -> tuple[int, str] | None:
    """Start and content of the last non-empty box; adjacent boxes ("\\boxed{2}, \\boxed{3}") are joined."""
    boxes = [b for b in find_boxes(text) if b[2].strip()]
    if not boxes:
        return None
    group = [boxes[-1]]
    for prev in reversed(boxes[:-1]):
        between = text[prev[1] : group[0][0]]
        if _JOIN_SEP_RE.match(between):
            group.insert(0, prev)
        else:
            break
    return group[0][0], ", ".join(b[2].strip() for b in group)


# what may precede "answer" on its line for an ``Answer:`` marker: markdown and these words
_LINE_PREFIX_WORDS_RE = re.compile(r"(?i)\b(?:final|the|my|our|correct)\b")
_HEADING_RE = re.compile(r"^[A-Za-z]{2,}")
# a contrast after the answer: "5, not 4", "5 rather than 4", "5 (not 4)"
_CONTRAST_RE = re.compile(
    r"(?i)(?:,\s*|\s+|\s*\()(?:and\s+|but\s+)?(?:not|rather than|instead of)\s+.*$", re.S
)
_HAS_MATH_RE = re.compile(r"[0-9$\\]")


def _is_line_marker(body: str, m: re.Match[str]) -> bool:
    """An ``Answer:`` match that opens its line (markdown, "final", "the" and non-letters before it)."""
    prefix = body[body.rfind("\n", 0, m.start()) + 1 : m.start()]
    if prefix.rstrip(" *_").lower().endswith("final"):
        return True  # "... Final Answer: The final answer is 10455." commits wherever it stands
    return not re.search(r"[^\W\d_]", _LINE_PREFIX_WORDS_RE.sub("", prefix))


def _is_gsm8k_marker(m: re.Match[str]) -> bool:
    """A ``####`` line that carries a value, not a markdown heading ("#### Verification")."""
    return bool(m.group(1).strip()) and _HEADING_RE.match(m.group(1).strip()) is None


def _drop_contrast(s: str) -> str:
    """ "5, not 4" -> "5": the answer phrase's value without the alternative it rules out."""
    cut = _CONTRAST_RE.sub("", s)
    return cut if cut.strip() else s


def _pick_phrase(matches: list[re.Match[str]]) -> re.Match[str]:
    """The last phrase whose value holds math; else the last (a later "the answer is correct" checks it)."""
    for m in reversed(matches):
        if _HAS_MATH_RE.search(m.group(1)):
            return m
    return matches[-1]


def _clean_tail(s: str) -> str:
    """Strip decorations around a marker's answer text: markdown bold, a closing period, 'I hope...'."""
    s = _HOPE_RE.sub("", s.strip())
    s = s.strip().strip("*").strip()
    # a trailing full stop (not a decimal point: "3." alone is fine to strip too)
    while s.endswith((".", "。")) and not s.endswith("\\."):
        s = s[:-1].rstrip()
    return s


def _from_marker_text(s: str) -> str:
    """Answer text after a marker: unwrap a box inside it, else the last math span when words surround it."""
    s = _clean_tail(s)
    box = last_boxed(s)
    if box is not None:
        return box[1].strip()
    m = _ANSWER_IS_RE.search(s)
    if m is not None and m.start() == 0 or (m is not None and "answer" in s[: m.start() + 20].lower()):
        s = _clean_tail(_drop_contrast(m.group(1)))
    # words around math ("The volume of $V$ is 120") are left in: the grader then searches the
    # text for its rightmost LaTeX span or number, as math-verify does.
    return strip_delims(s)


def extract_answer(text: str, *, think: str = "optional") -> str | None:
    """The final answer text of a response, or None when it has none (rules in the module docstring)."""
    body = apply_think(text, think)
    if body is None:
        return None
    candidates: list[tuple[int, str]] = []
    box = last_boxed(body)
    if box is not None:
        candidates.append(box)
    line_matches = [
        m for m in _answer_matches(_ANSWER_LINE_RE, body) if m.group(1).strip() and _is_line_marker(body, m)
    ]
    if line_matches:
        m = line_matches[-1]
        candidates.append((m.start(), m.group(1)))
    gsm = [m for m in _GSM8K_RE.finditer(body) if _is_gsm8k_marker(m)] if "####" in body else []
    if gsm:
        candidates.append((gsm[-1].start(), gsm[-1].group(1)))
    if candidates:
        start, raw = max(candidates, key=lambda c: c[0])
        if box is not None and start == box[0]:
            ans = raw.strip()
        else:
            # a box that sits inside the chosen marker's text was handled by _from_marker_text
            ans = _from_marker_text(raw)
        return ans or None
    weak = _answer_matches(_ANSWER_IS_RE, body, (6, 4, 0))  # final answer | the answer | answer
    weak = [m for m in weak if re.match(r"(?i)final answer|the answer", m.group(0))]
    if weak:
        ans = _from_marker_text(_drop_contrast(_pick_phrase(weak).group(1)))
        if ans:
            return ans
    i18n = [m for m in _I18N_ANSWER_RE.finditer(body) if m.group(1).strip()]
    if i18n:
        ans = strip_delims(_clean_tail(_pick_phrase(i18n).group(1)))
        if ans:
            return ans
    stripped = body.strip()
    # ... unless the line stops inside a math span or a brace ("By the theorem, $c^2 = 6"): a
    # response cut at the length limit just after its reasoning, whose last number is no answer
    if stripped and "\n" not in stripped and len(stripped) <= BARE_MAX_CHARS:
        if _one_line_closed(stripped) or _closed_turn(text):
            return _clean_tail(stripped) or None
    return None


# what a finished statement may end with, after trailing markdown and quotes: a full stop (any
# script), a closing math delimiter, or a value (a digit, a closing bracket, a unit sign) -- not a
# word ("..., we get") nor an operator or separator that needs a continuation ("x = ", "a, ")
_UNFINISHED_END_RE = re.compile(r"(?:(?<![\\\w])[^\W\d_]{2,}|[,:;=+\-*/^_&\\({\[<])$")
_TRAILING_DECOR = " \t\r\n*_`\"'\u201d\u2019\u00bb"
_UNESCAPED_DOLLAR_RE = re.compile(r"(?<!\\)\$")


def _closed_turn(text: str) -> bool:
    """A chat-template special token follows some of the response's text: the model ended its turn
    itself (an end-of-turn token, or padding after it); a response cut at the length limit has none.
    Tokens before any text (left padding, a system turn's tokens) do not count."""
    if not _may_have_special(text):
        return False
    pos = 0
    for m in _SPECIAL_RE.finditer(text):
        if text[pos : m.start()].strip():
            return True
        pos = m.end()
    return False


# a dollar sign next to a digit is a currency sign ("$1,000.99", "2,74 $"), not a math delimiter
_CURRENCY_DOLLAR_RE = re.compile(r"(?<!\\)\$(?=\s?\d)|(?<=\d)\s?\$")


def _one_line_closed(line: str) -> bool:
    """A one-line answer's math spans and braces are closed, counting a ``$`` next to a digit as
    currency when that is what leaves one unpaired ("$1,000.99" is closed, "$c^2 = 6" is not)."""
    return _delimiters_closed(line) or _delimiters_closed(_CURRENCY_DOLLAR_RE.sub("", line))


def _delimiters_closed(body: str) -> bool:
    """Every ``$`` pair, ``\\(...\\)``, ``\\[...\\]`` and brace opened in ``body`` is closed."""
    if len(_UNESCAPED_DOLLAR_RE.findall(body)) % 2:
        return False
    if body.count("\\(") != body.count("\\)") or body.count("\\[") != body.count("\\]"):
        return False
    # braces as groups (escaped \\{ \\} are characters); counted in C, not walked in Python
    return body.count("{") - body.count("\\{") == body.count("}") - body.count("\\}")


def response_finished(text: str, *, think: str = "optional") -> bool:
    """Did the response finish, so that a value in it may be its answer without a marker?

    Yes when the model closed its turn (a special token after the text), or when the text (after
    the ``think`` rule) closes every math delimiter and brace it opens and its last character is
    not a word, an operator or a separator (``_UNFINISHED_END_RE``): "... is 120", "... $x=5$.",
    "x = 5". A response cut at the length limit stops anywhere: inside ``$\\frac{``, after "we
    get", after "the product of"; its last number is one it passed through, not one it committed
    to. Our choice; a cut that happens to fall right after a number ("Multiplying both sides by
    5") cannot be told from a statement ("The volume is 5") and counts as finished.
    """
    if _closed_turn(text):
        return True
    body = apply_think(text, think)
    if body is None:
        return False
    tail = body.rstrip(_TRAILING_DECOR)
    if not tail:
        return False
    return _delimiters_closed(body) and _UNFINISHED_END_RE.search(tail[-64:]) is None
