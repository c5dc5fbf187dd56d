"""Pairs (gold, response, expected) built from the shipped answer keys, labelled by construction.

Independent of the grader on purpose: this module reads only ``evals/data/*.jsonl`` (each row's
``answer`` and, to know a question's base or whether it asks for a percent, its ``problem``) and
its own templates. It never imports ``stapo.verifier_service`` nor reads the grader's tables, so a
grader that agrees with it agrees with an outside reading of the answers, not with itself.

Each family turns a gold into *equivalent rewrites* (the same answer written another way:
expected correct) and *near misses* (a different answer that looks alike: expected wrong). The label
follows from how the response was built, never from running a grader.

Splits: ``split="dev"`` uses seeds below ``HELDBACK_SEED`` and only golds whose key hashes outside
the held-back quarter; ``split="heldback"`` uses seeds >= ``HELDBACK_SEED`` over every gold.
Tests read only the dev split; the held-back split is read by ``benchmarks/differential.py``
alone, so tuning the grader on the tests cannot tune it to the held-back numbers.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "evals/data"
HELDBACK_SEED = 1000
"""Seeds >= this are the held-back split (the tests never generate them)."""


@dataclass(frozen=True)
class Pair:
    family: str
    gold: str
    response: str
    expected: bool
    how: str  # the template that built it (for reading errors)


@dataclass(frozen=True)
class Key:
    gold: str
    problem: str
    source: str


def load_keys() -> list[Key]:
    """Every shipped answer key (gold + problem), in file order."""
    out = []
    for path in sorted(DATA.glob("*.jsonl")):
        for line in path.read_text("utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                out.append(Key(str(row["answer"]).strip(), row.get("problem", ""), path.stem))
    return out


def heldback_gold(gold: str) -> bool:
    """A quarter of the golds (by hash) appear only in the held-back split."""
    return hashlib.sha256(gold.encode()).digest()[0] % 4 == 0


# ----------------------------------------------------------------------------------------------
# gold shapes (this module's own reading, deliberately simple)
# ----------------------------------------------------------------------------------------------
_INT = re.compile(r"^-?\d+$")
_THOUSANDS = re.compile(r"^\d{1,3}(?:,\d{3})+$")
_DEC = re.compile(r"^-?\d+\.\d+$")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}$")
_CHOICE = re.compile(r"^(?:\\text\{)?\(?([A-E])\)?\}?$")
_TEXT = re.compile(r"^(?:\\text\{\s*([A-Za-z][A-Za-z ]+?)\s*\}|([A-Za-z]{3,}))$")
_BASE = re.compile(r"^(\d+)_\{?(\d{1,2})\}?$")
_LIST = re.compile(r"^-?\d+(?:\s*,\s*-?\d+)+$")
_TUPLE = re.compile(r"^\((-?\d+(?:\s*,\s*-?\d+)+)\)$")
_INTERVAL = re.compile(r"^([(\[])\s*(-?\\infty|-?\d+)\s*,\s*(-?\d+|\\infty)\s*([)\]])$")
_MATRIX = re.compile(r"^\\begin\{pmatrix\}(.*)\\end\{pmatrix\}$", re.S)
_SYMBOLIC_OK = re.compile(r"^[0-9a-z+\-\\{}()^ ]+$")
_BASE_WORD = re.compile(r"base[ ~$]*\{?(\d{1,2})\}?\$?")


def int_value(key: Key) -> int | None:
    g = key.gold.replace("\\!", "").replace("{,}", ",")
    if _INT.match(g):
        return int(g)
    if _THOUSANDS.match(g) and key.source == "gsm8k_test":
        return int(g.replace(",", ""))
    return None


def symbolic(key: Key) -> bool:
    """A closed-form gold with sqrt / pi / a variable, no relation, list or subscript."""
    g = key.gold
    return (
        bool(_SYMBOLIC_OK.match(g))
        and ("\\sqrt" in g or "\\pi" in g or re.search(r"(?<![\\a-z])[a-z](?![a-z])", g) is not None)
        and "," not in g
        and "=" not in g
        and "_" not in g
        and "i" not in re.sub(r"\\[a-z]+", "", g)  # complex numbers are not rewritten here
        and len(g) <= 40
        and g.count("{") == g.count("}")
    )


def fmt_frac(v: Fraction) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    sign = "-" if v < 0 else ""
    return f"{sign}\\frac{{{abs(v.numerator)}}}{{{v.denominator}}}"


def exact_decimal(v: Fraction) -> str | None:
    """The finite decimal of ``v`` when one exists (denominator 2^a 5^b), else None."""
    d = v.denominator
    k = 0
    while d % 10 == 0 or d % 2 == 0 or d % 5 == 0:
        if d % 10 == 0:
            d //= 10
        elif d % 2 == 0:
            d //= 2
        else:
            d //= 5
        k += 1
    if d != 1:
        return None
    places = 0
    while (v * 10**places).denominator != 1:
        places += 1
    whole, rem = divmod(abs(v.numerator) * 10**places // v.denominator, 10**places)
    s = f"{whole}.{rem:0{places}d}" if places else str(whole)
    return ("-" if v < 0 else "") + s


def bump_digit(s: str, rng: random.Random) -> str | None:
    """``s`` with one digit changed (a near miss that keeps the shape); None when it has no digit."""
    spots = [m.start() for m in re.finditer(r"\d", s)]
    if not spots:
        return None
    i = rng.choice(spots)
    d = int(s[i])
    new = (d + rng.randint(1, 8)) % 10
    if new == 0 and (i == 0 or not s[i - 1].isdigit()) and i + 1 < len(s) and s[i + 1].isdigit():
        new = (d + 1) % 10 or 1  # no leading zero: "07" would read as 7
    return s[:i] + str(new) + s[i + 1 :]


def boxed(x: str) -> str:
    return f"Working through the problem carefully, we obtain the result.\n\nTherefore the answer is $\\boxed{{{x}}}$."


# ----------------------------------------------------------------------------------------------
# families: each maps (key, rng) to pairs; None/[] when the gold has no shape the family uses
# ----------------------------------------------------------------------------------------------
Builder = Callable[[Key, random.Random], list[tuple[str, bool, str]]]


def fam_numbers(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    v = int_value(key)
    if v is None:
        return []
    out = [
        (boxed(str(v)), True, "box"),
        (f"So the total comes to {v}.\nThe answer is ${v}$.", True, "answer-is"),
        (f"Adding everything up.\nAnswer: {v}", True, "answer-line"),
        (f"We compute step by step.\n#### {v}", True, "gsm8k"),
    ]
    if abs(v) >= 1000:
        out.append((boxed(f"{v:,}"), True, "thousands"))
    out += [
        (boxed(str(v + rng.choice([1, -1, 2]))), False, "off-by-small"),
        (boxed(str(v * 10)), v == 0, "times-ten"),
        (f"The answer is ${v + 1}$.", False, "answer-is-miss"),
    ]
    if str(abs(v))[::-1].lstrip("0") != str(abs(v)) and abs(v) >= 10:
        out.append((boxed(("-" if v < 0 else "") + str(abs(v))[::-1].lstrip("0")), False, "reversed"))
    return out


def fam_fracdec(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    """Fractions, decimals, percent and scientific notation."""
    out: list[tuple[str, bool, str]] = []
    m = _FRAC.match(key.gold)
    if m:
        v = Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
        a, b = abs(v.numerator), v.denominator
        sign = "-" if v < 0 else ""
        out += [
            (boxed(f"{sign}\\dfrac{{{a}}}{{{b}}}"), True, "dfrac"),
            (boxed(f"{sign}{a}/{b}"), True, "slash"),
            (boxed(f"{sign}\\frac{{{2 * a}}}{{{2 * b}}}"), True, "unreduced"),
            (boxed(f"{sign}\\frac{{{b}}}{{{a}}}"), a == b, "inverted"),
            (boxed(f"{sign}\\frac{{{a + 1}}}{{{b}}}"), False, "numerator+1"),
        ]
        dec = exact_decimal(v)
        if dec is not None:
            out.append((boxed(dec), True, "exact-decimal"))
        else:
            approx = f"{float(v):.2f}"
            out.append((boxed(approx), False, "two-decimals-of-repeating"))
        return out
    if _DEC.match(key.gold):
        v = Fraction(key.gold)
        places = len(key.gold.split(".")[1])
        out += [
            (boxed(key.gold + "0"), True, "trailing-zero"),
            (boxed(fmt_frac(v)), True, "as-fraction"),
            # one more digit that changes the value: the gold may be exact as written, and nothing in
            # the answer shows it was rounded (1.5 vs 1.54)
            (boxed(key.gold + str(rng.randint(1, 4))), False, "extra-digit"),
            (boxed(exact_decimal(v + Fraction(1, 10**places)) or ""), False, "last-digit+1"),
        ]
        return out
    v = int_value(key)
    if v is None:
        return []
    if "percent" in key.problem.lower() and 0 < v <= 100:
        out.append((boxed(f"{v}\\%"), True, "percent"))
    if abs(v) >= 1000 and str(abs(v)).rstrip("0") != str(abs(v)):
        digits = str(abs(v)).rstrip("0")
        k = len(str(abs(v))) - 1
        mant = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        out.append((boxed(f"{'-' if v < 0 else ''}{mant} \\times 10^{{{k}}}"), True, "scientific"))
    if abs(v) >= 10_000 and str(abs(v)).rstrip("0") == str(abs(v)):
        # a 2-significant-digit rounding of a number that is not round: a different integer
        k = len(str(abs(v))) - 1
        mant = round(abs(v) / 10 ** (k - 1)) / 10
        if Fraction(str(mant)) * 10**k != abs(v):
            out.append((boxed(f"{'-' if v < 0 else ''}{mant} \\times 10^{{{k}}}"), False, "scientific-rounded"))
    if 100 <= v < 10_000 and rng.random() < 0.3:
        big = int(f"{v}999999")  # a large integer gold derived from the key: 12 significant digits
        k = len(str(big))
        return [
            (boxed(f"{big:,}"), True, "big-thousands"),
            (boxed(f"{big / 10 ** (k - 1):.1f} \\times 10^{{{k - 1}}}"), False, "big-scientific-rounded"),
            (boxed(f"{(big + 1) // 10 ** (k - 1 - 3)}\\times 10^{{{k - 1 - 3}}}"), False, "big-rounded-up"),
        ], str(big)
    if abs(v) >= 100:
        out.append((boxed(f"{v}.5"), False, "half-more"))
        out.append((boxed(f"\\frac{{{2 * v + 1}}}{{2}}"), False, "fraction-near"))
    return out


def fam_symbolic(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    if not symbolic(key):
        return []
    g = key.gold
    out = [
        (boxed(g.replace("\\frac", "\\dfrac")), True, "dfrac"),
        (boxed(g.replace(" ", "")), True, "no-spaces"),
        (boxed(f"\\left({g}\\right)"), True, "parenthesised"),
        (f"Simplifying, we find the answer is ${g}$.", True, "answer-is"),
        (boxed(f"{g} + 1"), False, "plus-one"),
        (boxed(f"2\\left({g}\\right)"), False, "doubled"),
    ]
    bumped = bump_digit(g, rng)
    if bumped is not None and bumped != g:
        out.append((boxed(bumped), False, "digit-changed"))
    return out


def fam_equations(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    g = key.gold
    v = int_value(key)
    if v is not None:
        return [
            (boxed(f"x = {v}"), True, "x-equals"),
            (f"Solving the equation gives $x = {v}$.", True, "x-equals-prose"),
            (boxed(f"x = {v + 1}"), False, "x-equals-miss"),
            (boxed(f"2x = {v}"), v == 0, "coefficient-equation"),
        ]
    if g.count("=") != 1 or "\\frac{d" in g or "'" in g or "prime" in g or len(g) > 40:
        return []
    lhs, rhs = (s.strip() for s in g.split("="))
    out = [(boxed(f"{rhs} = {lhs}"), True, "sides-swapped"), (boxed(g.replace(" ", "")), True, "no-spaces")]
    bumped = bump_digit(rhs, rng)
    if bumped is not None and bumped != rhs:
        out.append((boxed(f"{lhs} = {bumped}"), False, "rhs-digit-changed"))
    else:
        out.append((boxed(f"{lhs} = {rhs} + 1"), False, "rhs-plus-one"))
    return out


def fam_structures(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    """Tuples, unordered lists, sets, intervals, matrices, and "and" inside a box."""
    g = key.gold.strip("$ ")
    out: list[tuple[str, bool, str]] = []
    if _LIST.match(g) and key.source != "gsm8k_test":
        items = [x.strip() for x in g.split(",")]
        if len(set(items)) == len(items):
            out += [
                (boxed(", ".join(reversed(items))), True, "list-reordered"),
                (boxed(" and ".join(items) if len(items) == 2 else ", ".join(items[:-1]) + ", and " + items[-1]),
                 True, "list-with-and"),
                (boxed(", ".join(items[:-1])), False, "list-missing-item"),
                (boxed(items[0]), False, "list-first-item-only"),
            ]
        return out
    m = _TUPLE.match(g)
    if m:
        items = [x.strip() for x in m.group(1).split(",")]
        out += [
            (boxed("\\left(" + ", ".join(items) + "\\right)"), True, "tuple-left-right"),
            (boxed("(" + ",\\ ".join(items) + ")"), True, "tuple-spaced"),
        ]
        if items[0] != items[1]:
            out.append((boxed("(" + ", ".join([items[1], items[0], *items[2:]]) + ")"), False, "tuple-swapped"))
        out.append((boxed("(" + ", ".join(items[:-1] + [str(int(items[-1]) + 1)]) + ")"), False, "tuple-last+1"))
        return out
    m = _MATRIX.match(g)
    if m:
        out.append((boxed(g.replace("pmatrix", "bmatrix")), True, "bmatrix"))
        bumped = bump_digit(g, rng)
        if bumped is not None and bumped != g:
            out.append((boxed(bumped), False, "entry-changed"))
        return out
    v = int_value(key)
    if v is not None and rng.random() < 0.25:
        w = v - rng.randint(1, 5)
        out.append((boxed(f"{w} and {v}"), False, "and-in-box"))
        out.append((boxed(f"{v} \\text{{ or }} {w}"), False, "or-in-box"))
    return out


def fam_intervals(key: Key, rng: random.Random):
    """Intervals and the inequalities that describe them (connective and variable matter)."""
    g = key.gold.strip("$ ")
    derived = None
    m = _INTERVAL.match(g)
    if m is None:
        v = int_value(key)
        if v is None or rng.random() > 0.1:
            return []
        # an interval gold derived from a shipped key (few interval keys ship)
        derived = rng.choice([f"({v},\\infty)", f"(-\\infty,{v})", f"({v},{v + 7})", "(-\\infty,\\infty)"])
        m = _INTERVAL.match(derived)
    lo, a, b, hi = m.groups()
    out = [(boxed(f"\\left{lo}{a}, {b}\\right{hi}"), True, "interval-left-right")]
    if "\\infty" not in a and "\\infty" not in b:
        flip = "[" if lo == "(" else "("
        out.append((boxed(f"{flip}{a}, {b}{hi}"), False, "interval-bracket-flipped"))
        if lo == "(" and hi == ")":
            out.append((f"The solution set is ${a} < x < {b}$.", True, "inequality-chain"))
            out.append((boxed(f"x > {a}, y < {b}"), False, "two-variables"))
            out.append((boxed(f"x < {a} \\text{{ or }} x > {b}"), False, "complement"))
    elif a.startswith("-") and "\\infty" in a and "\\infty" in b:
        out.append((boxed("x > 1 \\text{ and } x < 5"), False, "and-not-whole-line"))
        out.append((boxed("x \\in \\mathbb{R}"), True, "all-reals"))
    elif "\\infty" in b and lo == "(":
        out.append((boxed(f"x > {a}"), True, "inequality"))
        out.append((boxed(f"x > {a}, y > {int(a) + 1}"), False, "two-variables"))
        out.append((boxed(f"x > {a} \\text{{ and }} x < {int(a) + 10}"), False, "and-bounded"))
        out.append((boxed(f"x \\geq {a}"), False, "inequality-closed"))
    elif "\\infty" in a and hi == ")":
        out.append((boxed(f"x < {b}"), True, "inequality"))
        out.append((boxed(f"x > {b}"), False, "inequality-flipped"))
    return (out, derived) if derived else out


_LETTERS = "ABCDE"


def fam_choices(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    m = _CHOICE.match(key.gold)
    if m:
        letters = [m.group(1)]
    elif int_value(key) is not None and rng.random() < 0.04:
        letters = [_LETTERS[abs(int_value(key) or 0) % 5]]  # a letter gold derived from a shipped key
    else:
        return []
    c = letters[0]
    other = _LETTERS[(_LETTERS.index(c) + rng.randint(1, 4)) % 5]
    gold = key.gold if m else c
    return [
        (boxed(c), True, "letter-box"),
        (boxed(f"\\text{{({c})}}"), True, "text-paren-letter"),
        (f"Comparing the options, the answer is ({c}).", True, "answer-is-paren"),
        (boxed(f"\\textbf{{({c})}}"), True, "bold-letter"),
        (boxed(other), False, "other-letter"),
        (boxed(f"{c.lower()}^2"), False, "letter-squared"),
        (f"${c.lower()} = {rng.randint(2, 9)}$", False, "letter-assignment"),
        (boxed(f"{c.lower()} = {rng.randint(2, 9)}"), False, "letter-assignment-box"),
    ], gold


def fam_text(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    m = _TEXT.match(key.gold)
    if not m or _CHOICE.match(key.gold):
        return []
    word = (m.group(1) or m.group(2)).strip()
    return [
        (boxed(f"\\text{{{word}}}"), True, "text-box"),
        (boxed(word.lower()), True, "lower-case"),
        (boxed(word.upper()), True, "upper-case"),
        (f"The answer is {word}.", True, "answer-is"),
        (boxed(f"\\text{{not {word.lower()}}}"), False, "negated"),
        (boxed(word[:-1] + ("x" if word[-1] != "x" else "y")), False, "misspelled-other-word"),
    ]


_YES_NO = ("\\text{Yes}", "\\text{No}", "Yes", "No")


def fam_yes_no(gold: str, rng: random.Random) -> list[tuple[str, bool, str]]:
    word = gold.replace("\\text{", "").rstrip("}")
    other = "No" if word == "Yes" else "Yes"
    return [
        (boxed(word.lower()), True, "lower-case"),
        (boxed(f"\\text{{{word}}}"), True, "text-box"),
        (boxed(f"\\text{{{word.upper()}}}"), True, "upper-case"),
        (boxed(other.lower()), False, "opposite"),
        (boxed(f"\\text{{{other}}}"), False, "opposite-text"),
    ]


def fam_units(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    v = int_value(key)
    if v is not None:
        return [
            (boxed(f"{v} \\text{{ cm}}"), True, "text-unit"),
            (boxed(f"{v}\\text{{ square units}}"), True, "text-square-units"),
            (boxed(f"{v} square units"), True, "bare-square-units"),
            (boxed(f"{v} \\mathrm{{~m}}^2"), True, "mathrm-area"),
            (boxed(f"{v}\\pi \\text{{ square units}}"), v == 0, "pi-text-units"),
            (boxed(f"{v}\\pi square units"), v == 0, "pi-bare-units"),
            (boxed(f"{v}\\sqrt{{2}} \\text{{ cm}}"), v == 0, "sqrt-units"),
            (boxed(f"{v + 1} \\text{{ cm}}"), False, "off-by-one-units"),
        ]
    if symbolic(key) and "\\pi" in key.gold and not re.search(r"[a-z](?![a-z])", key.gold.replace("\\pi", "")):
        return [
            (boxed(f"{key.gold} square units"), True, "symbolic-bare-units"),
            (boxed(f"{key.gold} \\text{{ square units}}"), True, "symbolic-text-units"),
            (boxed(f"2{key.gold} \\text{{ cm}}^2"), False, "symbolic-doubled-units"),
        ]
    return []


def fam_clock_base(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    m = _BASE.match(key.gold)
    if m:
        digits, base = m.group(1), m.group(2)
        bumped = bump_digit(digits, rng) or digits
        return [
            (boxed(f"{digits}_{{{base}}}"), True, "braced-base"),
            (boxed(digits), True, "digits-only"),
            (boxed(f"{bumped}_{{{base}}}"), bumped == digits, "digit-changed"),
            (boxed(f"{digits}_{{{int(base) + 1}}}"), False, "other-base"),
        ]
    v = int_value(key)
    bm = _BASE_WORD.search(key.problem)
    if v is not None and v >= 0 and bm and int(bm.group(1)) not in (10,):
        base = bm.group(1)
        bumped = bump_digit(str(v), rng) or str(v)
        return [
            (boxed(f"{v}_{{{base}}}"), True, "digits-with-base"),
            (boxed(f"{v}_{base}"), True, "digits-with-base-plain"),
            (boxed(f"{bumped}_{{{base}}}"), bumped == str(v), "digit-changed"),
        ]
    if v is not None and rng.random() < 0.02:
        # a clock-time gold derived from a shipped key (there is none in the keys themselves)
        h, mi = abs(v) % 12 + 1, abs(v) * 7 % 60
        gold = f"{h}:{mi:02d}"
        return [
            (boxed(gold), True, "clock"),
            (f"They meet at {gold}.\nAnswer: {gold}", True, "clock-answer-line"),
            (boxed(f"{h}:{(mi + 1) % 60:02d}"), False, "clock-minute+1"),
            (boxed(f"{h % 12 + 1}:{mi:02d}"), False, "clock-hour+1"),
        ], gold
    return []


_I18N = (
    ("zh", "所以答案是 ${a}$。", "因此，最终答案是 ${a}$。我们可以验证这个答案是正确的。"),
    ("ja", "よって答えは ${a}$ です。", "したがって、答えは ${a}$ です。この答えは正しいです。"),
    ("fr", "Donc la réponse est ${a}$.", "La réponse est ${a}$. Vérifions que cette réponse est correcte."),
    ("de", "Die Antwort ist ${a}$.", "Also ist die Antwort ${a}$. Die Antwort ergibt sich aus der Rechnung."),
    ("es", "Por lo tanto, la respuesta es ${a}$.", "La respuesta es ${a}$. Comprobamos que la respuesta es válida."),
    ("ru", "Ответ: ${a}$.", "Итак, ответ: ${a}$. Проверим, что ответ верный."),
)


def fam_multilingual(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    v = int_value(key)
    ans = str(v) if v is not None else key.gold if _FRAC.match(key.gold) else None
    if ans is None:
        return []
    miss = str(v + 1) if v is not None else f"{ans}+1"
    lang, short, later = rng.choice(_I18N)
    return [
        (short.replace("{a}", ans), True, f"{lang}-short"),
        (later.replace("{a}", ans), True, f"{lang}-later-mention"),
        (short.replace("{a}", miss), False, f"{lang}-short-miss"),
        (later.replace("{a}", miss), False, f"{lang}-later-mention-miss"),
    ]


def fam_long_cot(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    v = int_value(key)
    if v is not None:
        ans, other = str(v), str(v + rng.choice([2, 3, -4]))
    elif _FRAC.match(key.gold) or symbolic(key):
        ans, other = key.gold, f"{key.gold}+1"
    else:
        return []
    cot = (
        "Let me set up the problem. We have several quantities to track, so I will go step by step.\n"
        f"First, an intermediate value is {rng.randint(2, 99)}, and then we combine the terms.\n"
    )
    out = []
    for right, wrong, label in ((ans, other, True), (other, ans, False)):
        out += [
            (cot + f"So the result is $\\boxed{{{right}}}$.\n\n#### Verification\nPlugging back in: "
             f"a value of {wrong} would not satisfy the equation.", label, "verification-heading"),
            (cot + f"Hence $\\boxed{{{right}}}$.\n\nDouble-check: the answer: {wrong} would break the "
             "second condition, so it is ruled out.", label, "later-answer-colon"),
            (cot + f"Therefore, the answer is ${right}$, not ${wrong}$.", label, "x-not-y"),
            (cot + f"**Final Answer**\n\\boxed{{{right}}}\n\nNote: a common mistake gives {wrong}.",
             label, "final-answer-note"),
        ]
    return out


def fam_cutoff(key: Key, rng: random.Random) -> list[tuple[str, bool, str]]:
    v = int_value(key)
    ans = str(v) if v is not None else key.gold if _FRAC.match(key.gold) else None
    if ans is None:
        return []
    lead = "We begin by expanding the expression and collecting like terms.\n"
    return [
        (lead + f"Thus $\\boxed{{{ans}}}$.\n\nLet me double-check: $\\frac{{", True, "cut-after-box"),
        (lead + f"So the answer is ${ans}$.\n\nWait, let me re-check the second step: $x = ", True, "cut-after-answer"),
        (lead + f"First we find that $y = {ans}$. Then we need to compute $\\frac{{", False, "cut-mid-work"),
        (lead + f"The partial sum is {ans}, and the next term gives $\\boxed{{", False, "cut-inside-box"),
        (lead + f"Substituting {ans} into the second equation, we get", False, "cut-mid-sentence"),
    ]


FAMILIES: dict[str, Builder] = {
    "numbers": fam_numbers,
    "fracdec": fam_fracdec,
    "symbolic": fam_symbolic,
    "equations": fam_equations,
    "structures": fam_structures,
    "intervals": fam_intervals,
    "choices": fam_choices,
    "text": fam_text,
    "units": fam_units,
    "clock_base": fam_clock_base,
    "multilingual": fam_multilingual,
    "long_cot": fam_long_cot,
    "cutoff": fam_cutoff,
}


def generate(seed: int = 0, per_family: int = 40, *, split: str = "dev", families: list[str] | None = None) -> Iterator[Pair]:
    """Up to ``per_family`` golds per family, each with its rewrites and near misses.

    ``split="dev"`` needs ``seed < HELDBACK_SEED`` and skips held-back golds; ``split="heldback"``
    needs ``seed >= HELDBACK_SEED``.
    """
    if split == "dev" and seed >= HELDBACK_SEED:
        raise ValueError(f"seed: the dev split uses seeds below {HELDBACK_SEED}")
    if split == "heldback" and seed < HELDBACK_SEED:
        raise ValueError(f"seed: the held-back split uses seeds >= {HELDBACK_SEED}")
    if split not in ("dev", "heldback"):
        raise ValueError(f"split: 'dev' or 'heldback', not {split!r}")
    keys = [k for k in load_keys() if split == "heldback" or not heldback_gold(k.gold)]
    for name in families or list(FAMILIES):
        rng = random.Random(f"{seed}:{name}")
        # rarer shapes first (up to half the budget), so 17k integer keys do not crowd out the 500 others
        ints = [i for i, k in enumerate(keys) if int_value(k) is not None]
        others = [i for i, k in enumerate(keys) if int_value(k) is None]
        rng.shuffle(ints)
        rng.shuffle(others)
        seen: set[str] = set()
        taken = 0
        for pool, cap in ((others, max(1, per_family // 2)), (ints, per_family), (others, per_family)):
            for i in pool:
                if taken >= cap or taken >= per_family:
                    break
                key = keys[i]
                if key.gold in seen:
                    continue
                got = FAMILIES[name](key, rng)
                gold = key.gold
                if isinstance(got, tuple):  # a family that derives its own gold from the key
                    got, gold = got
                if not got or gold in seen:
                    continue
                seen.add(key.gold)
                seen.add(gold)
                taken += 1
                for response, expected, how in got:
                    yield Pair(name, gold, response, expected, how)
        if name == "text":
            for gold in _YES_NO:
                for response, expected, how in fam_yes_no(gold, rng):
                    yield Pair(name, gold, response, expected, how)
