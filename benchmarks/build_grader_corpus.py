"""Build the large grading corpus: labelled (gold, prediction, expected) pairs by family, dev + held-back.

Rows ``{"gold", "prediction", "expected", "family", "source"}`` go to

- ``verifier_service/data/corpus_dev.jsonl``: the development part (tests read it, the grader was
  tuned on it);
- ``verifier_service/data/corpus_heldback.jsonl``: the held-back part, read ONLY by
  ``benchmarks/grader_accuracy.py`` (no test reads it). It is built from other sources than the dev
  part: other benchmark answer keys (OlympiadBench, Minerva, GSM8K, AIME 2025 vs MATH-500, AMC 2023,
  AIME 2024), other response templates, other languages, other values. The builder is one file so
  the labelling conventions are visibly the same; the split is by source, decided before measuring.

Every family's labelling convention is written next to its generator with the graders that hold
it (Qwen2.5-Math ``evaluation/grader.py``, PRM800K ``grading/grader.py``, OlympiadBench's
evaluator, OpenCompass math evaluators, verl ``prime_math`` / ``math_dapo``, DeepScaleR /
Open-Reasoner-Zero reward code); where they disagree, the row follows stapo's documented policy for
mode ``math`` (docs/verifier.md, "Policies"). We wrote these cases ourselves from those graders'
documented behaviour and test themes; no code or rows were copied.

Labels of generated near-misses are checked, not assumed: a perturbed numeric answer is kept only
when ``numeric.evaluate`` (mpmath, 50 digits) shows its value differs from the gold's.

    python benchmarks/build_grader_corpus.py      # rewrite both files (deterministic)
"""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "evals" / "data"  # the shipped copies (byte-identical to the originals, see its README)
OUT = ROOT / "verifier_service/data"

# --------------------------------------------------------------------------- response templates
DEV_WRAP = (
    lambda a: f"\\boxed{{{a}}}",
    lambda a: f"We simplify and get the result.\nThe answer is ${a}$.",
    lambda a: f"Solving step by step.\nAnswer: {a}",
    lambda a: f"<think>Let me compute carefully.</think>\nSo the final answer is $\\boxed{{{a}}}$.<|im_end|>",
    lambda a: f"Step 1: set up.\nStep 2: solve.\nTherefore the answer is $\\boxed{{{a}}}$.",
)
HELD_WRAP = (
    lambda a: f"**Final Answer**\n\\[\n\\boxed{{{a}}}\n\\]",
    lambda a: f"Putting it all together, we obtain $\\boxed{{{a}}}$.<|eot_id|>",
    lambda a: f"Thus the required value is $\\boxed{{{a}}}$ .</s>",
    lambda a: f"<think>\nok\n</think>\n\nFinal Answer: The final answer is ${a}$. I hope it is correct.",
    lambda a: f"Combining the cases above yields \\(\\boxed{{{a}}}\\).<end_of_turn>",
)


def row(gold: str, pred: str, expected: bool, family: str, source: str) -> dict:
    return {"gold": gold, "prediction": pred, "expected": expected, "family": family, "source": source}


def _ev(s: str):
    from stapo.verifier_service.grader.numeric import evaluate

    v = evaluate(s)
    return None if v is None else v[0]


def _differs(a: str, b: str) -> bool:
    va, vb = _ev(a), _ev(b)
    return va is not None and vb is not None and abs(va - vb) > 1e-6 * max(1, abs(va))


def _same(a: str, b: str) -> bool:
    va, vb = _ev(a), _ev(b)
    return va is not None and vb is not None and abs(va - vb) <= 1e-12 * max(1, abs(va))


# --------------------------------------------------------------------------- answer keys
_LAST_INT_RE = re.compile(r"\d+(?!.*\d)", re.S)


def _bump_last_int(s: str, by: int) -> str | None:
    m = _LAST_INT_RE.search(s)
    if m is None:
        return None
    v = int(m.group(0)) + by
    if v < 0:
        return None
    return s[: m.start()] + str(v) + s[m.end() :]


def _strip_dollars(s: str) -> str:
    s = s.strip()
    while s.startswith("$") and s.endswith("$") and len(s) > 1:
        s = s[1:-1].strip()
    return s


def key_variants(gold: str, rng: random.Random) -> tuple[list[str], list[str]]:
    """(equivalent forms, near-miss wrong forms) of an answer-key gold, each with its label sure by construction."""
    g = _strip_dollars(gold)
    eq: list[str] = [g]
    wrong: list[str] = []
    if re.fullmatch(r"-?\d+", g):  # integer golds (AIME, AMC, GSM8K, many MATH)
        n = int(g)
        if abs(n) >= 1000:
            eq.append(f"{n:,}")
            eq.append(f"{n:,}".replace(",", "{,}"))
        eq.append(f"{n}.0")
        eq.append(f"{n} \\text{{ units}}" if rng.random() < 0.5 else f"\\text{{{n}}}")
        wrong += [str(n + 1), str(n - 1), str(n * 10)]
        if n != 0:
            wrong.append(str(-n))
        if abs(n) >= 10:
            wrong.append(g[:-1] + str((int(g[-1]) + 3) % 10))
    elif m := re.fullmatch(r"(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}", g):
        sign, a, b = m.group(1), int(m.group(2)), int(m.group(3))
        eq += [f"{sign}{a}/{b}", f"{sign}\\dfrac{{{a}}}{{{b}}}", f"{sign}\\frac{{{2 * a}}}{{{2 * b}}}"]
        val = Fraction(a, b)
        if 10**6 % val.denominator == 0 or all(p in (2, 5) for p in _factors(val.denominator)):
            eq.append(sign + _decimal(val))
        wrong += [f"{sign}\\frac{{{a + 1}}}{{{b}}}", f"{sign}\\frac{{{a}}}{{{b + 1}}}"]
        if a != b:
            wrong.append(f"{sign}\\frac{{{b}}}{{{a}}}")
        wrong.append(("" if sign else "-") + f"\\frac{{{a}}}{{{b}}}")
        if val.denominator > 1 and not all(p in (2, 5) for p in _factors(val.denominator)):
            wrong.append(sign + f"{float(val):.2f}")  # a 2-decimal approximation of an exact gold
    elif re.fullmatch(r"-?\d+\.\d+", g):
        eq += [
            g + "0",
            ("-" if g.startswith("-") else "") + g.lstrip("-").lstrip("0")
            if g.lstrip("-").startswith("0.")
            else g,
        ]
        wrong += [_bump_last_int(g, 1) or "", _bump_last_int(g, 2) or ""]
    else:
        # structured or symbolic golds: spacing / markup paraphrases, and perturbations we can verify
        eq.append(g.replace("\\frac", "\\dfrac"))
        eq.append(re.sub(r"\s+", "", g) if "\\" not in g else g.replace(" ", "  "))
        if g.startswith("(") or g.startswith("\\left("):
            eq.append(g.replace("\\left(", "(").replace("\\right)", ")"))
        b = _bump_last_int(g, 1)
        if b is not None and b != g:
            parts_g, parts_b = _top_parts(g), _top_parts(b)
            if len(parts_g) == len(parts_b) and any(
                _differs(x, y) for x, y in zip(parts_g, parts_b, strict=True)
            ):
                wrong.append(b)
        parts = _top_parts(g)
        if g.startswith("(") and len(parts) == 2 and _differs(parts[0], parts[1]):
            wrong.append(f"({parts[1]}, {parts[0]})")  # an ordered pair swapped
    eq = list(dict.fromkeys(x for x in eq if x))
    wrong = list(dict.fromkeys(x for x in wrong if x and x not in eq))
    return eq, wrong


def _top_parts(s: str) -> list[str]:
    from stapo.verifier_service.grader.normalize import split_top_level

    inner = s.replace("\\left", "").replace("\\right", "").strip()
    if inner[:1] in "([" and inner[-1:] in ")]":
        inner = inner[1:-1]
    return [p.strip() for p in split_top_level(inner)]


def _factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


def _decimal(v: Fraction) -> str:
    s = f"{float(v):.10f}".rstrip("0").rstrip(".")
    return s


def answer_keys(bench: str, wraps, rng: random.Random, limit: int) -> list[dict]:
    rows = [
        json.loads(line) for line in (DATA / f"{bench}.jsonl").read_text("utf-8").splitlines() if line.strip()
    ]
    rng.shuffle(rows)
    out = []
    for r in rows[:limit]:
        gold = r["answer"]
        if bench == "olympiadbench" and r.get("is_multiple_answer"):
            continue  # multi-answer golds are covered by the list families
        eq, wrong = key_variants(gold, rng)
        src = f"answer key: evals/data/{bench}.jsonl id={r['id']}"
        for form in eq[:3]:
            out.append(row(gold, rng.choice(wraps)(form), True, f"keys-{bench}", src + " (equivalent form)"))
        for form in wrong[:2]:
            out.append(row(gold, rng.choice(wraps)(form), False, f"keys-{bench}", src + " (near miss)"))
    return out


# --------------------------------------------------------------------------- families
def fam_tolerance(ns, wraps, rng) -> list[dict]:
    """Tiny and huge values: relative, not absolute, tolerance.

    Convention: OlympiadBench's evaluator and Qwen2.5-Math ``math_equal`` compare numbers with a
    tolerance (absolute 1e-8 / relative 1e-4); with absolute tolerance 1/3^60 "equals" 1/3^59.
    Exact answers are compared exactly (PRM800K sympy ``simplify(a - b) == 0``).
    """
    src = "family: tolerance (OlympiadBench evaluator precision; Qwen2.5-Math math_equal rel_tol; PRM800K exact)"
    out = []
    for n in ns:
        w = rng.choice(wraps)
        out += [
            row(f"\\frac{{1}}{{3^{{{n}}}}}", w(f"\\frac{{1}}{{3^{{{n + 1}}}}}"), False, "tolerance", src),
            row(f"\\frac{{1}}{{3^{{{n}}}}}", w(f"3^{{-{n}}}"), True, "tolerance", src),
            row(f"\\frac{{1}}{{2^{{{n}}}}}", w(f"\\frac{{2}}{{2^{{{n + 1}}}}}"), True, "tolerance", src),
            row(f"10^{{-{n}}}", w(f"10^{{-{n + 1}}}"), False, "tolerance", src),
            row(f"2^{{{n}}}", w(f"2^{{{n}}}+1"), False, "tolerance", src),
            row(f"2^{{{n}}}", w(str(2**n)), True, "tolerance", src),
            row(str(2**n), w(str(2**n + 1)), False, "tolerance", src),
        ]
    for k in range(8, 8 + len(ns) // 2):
        w = rng.choice(wraps)
        out += [
            row(f"\\frac{{1}}{{{k}!}}", w(f"\\frac{{1}}{{{k + 2}!}}"), False, "tolerance", src),
            row(
                f"\\frac{{1}}{{{k}!}}",
                w(f"\\frac{{1}}{{{__import__('math').factorial(k)}}}"),
                True,
                "tolerance",
                src,
            ),
        ]
    for m in (1.5, 2.5, 3.7, 6.02, 9.1):
        e = rng.choice([-12, -15, -19, -27, 23, 30, 33])
        w = rng.choice(wraps)
        out += [
            row(f"{m} \\times 10^{{{e}}}", w(f"{m}e{e}"), True, "tolerance", src),
            row(
                f"{m} \\times 10^{{{e}}}",
                w(f"{round(m + 0.1, 2)} \\times 10^{{{e}}}"),
                False,
                "tolerance",
                src,
            ),
            row(f"{m} \\times 10^{{{e}}}", w(f"{m} \\times 10^{{{e + 1}}}"), False, "tolerance", src),
        ]
    return out


_EXACT = [  # (gold LaTeX, value)
    ("\\frac{2}{3}", 2 / 3),
    ("\\sqrt{5}", 5**0.5),
    ("20\\pi", 62.83185307179586),
    ("3\\sqrt{2}", 3 * 2**0.5),
    ("\\frac{\\pi}{4}", 0.7853981633974483),
    ("\\frac{1}{7}", 1 / 7),
    ("2\\sqrt{3}", 2 * 3**0.5),
    ("\\frac{5}{6}", 5 / 6),
    ("\\sqrt{10}", 10**0.5),
    ("4\\pi", 12.566370614359172),
    ("\\frac{\\sqrt{2}}{2}", 2**0.5 / 2),
    ("\\frac{11}{3}", 11 / 3),
    ("1+\\sqrt{2}", 1 + 2**0.5),
    ("\\frac{9}{7}", 9 / 7),
]


def fam_decimal(items, wraps, rng) -> list[dict]:
    """Decimal approximations, mode ``math`` policy (docs/verifier.md):

    - an exact gold (fraction, radical, pi) is NOT matched by a rounded decimal shown to fewer than 6
      decimals (PRM800K, lm-eval Minerva and math-verify's 6-decimal rounding agree; Qwen2.5-Math's
      rel_tol 1e-4 would accept 4+ significant digits: we side with the exact-answer graders because
      MATH-style questions ask for exact forms and RL should not reward giving up on them);
    - the same gold IS matched by a decimal correct to 6 decimals (math-verify's rule);
    - a gold that is itself a rounded decimal (Minerva, OlympiadBench physics) IS matched by an exact
      or more precise answer that rounds to it at the gold's shown precision (OlympiadBench's
      tolerance, Qwen's isclose), and not by a different value at that precision.
    """
    src = "family: decimal approximations (PRM800K exact; math-verify 6-decimal rounding; Qwen2.5-Math rel_tol; OlympiadBench precision)"
    out = []
    for gold, v in items:
        w = rng.choice(wraps)
        d = rng.choice([2, 3, 4])
        out.append(row(gold, w(f"{v:.{d}f}"), False, "decimal-approx", src + " exact gold, short decimal"))
        out.append(row(gold, w(f"{v:.8f}"), True, "decimal-approx", src + " exact gold, 8 decimals"))
        out.append(
            row(gold, w(f"{v + 0.01:.6f}"), False, "decimal-approx", src + " exact gold, wrong decimal")
        )
        # the gold is the rounded decimal
        gd = f"{v:.{d}f}"
        out.append(row(gd, w(gold), True, "decimal-approx", src + " rounded gold, exact answer"))
        out.append(row(gd, w(f"{v:.{d + 3}f}"), True, "decimal-approx", src + " rounded gold, more digits"))
        out.append(row(gd, w(f"{v + 3 * 10**-d:.{d}f}"), False, "decimal-approx", src + " rounded gold, off"))
    return out


_LANG_DEV = [
    ("答案是 {a}。我们再验算一次：共有 {x} 种情况，每种 {y} 个。", "zh"),
    ("所以最终答案为 {a}。检验：{x} + {y} 次计算均一致。", "zh"),
    ("Donc la réponse est {a}. Vérification : on a utilisé {x} étapes et {y} cas.", "fr"),
    ("La réponse finale est {a}, obtenue après {x} essais sur {y}.", "fr"),
    ("Die Antwort ist {a}. Probe: {x} mal {y} Schritte stimmen.", "de"),
]
_LANG_HELD = [
    ("La respuesta es {a}. Comprobación: {x} casos y {y} pasos.", "es"),
    ("Ответ: {a}. Проверка: {x} случаев по {y}.", "ru"),
    ("答えは {a} です。確認：{x} 通り、{y} 回。", "ja"),
    ("Quindi la risposta è {a}, verificato con {x} prove su {y}.", "it"),
    ("A resposta é {a}. Conferindo: {x} casos e {y} etapas.", "pt"),
    ("因此，答案为 {a}。验证：{x} 个数中有 {y} 个满足。", "zh"),
    ("Finalement, la réponse est {a} ; on a vérifié {x} cas en {y} lignes.", "fr"),
]


def fam_language(templates, golds, rng) -> list[dict]:
    """Answers in non-English prose without a box: the answer phrase's value is the answer.

    Convention: Qwen2.5-Math's and OpenCompass's extractors read "答案是" / "answer is" phrases; a
    grader that takes the last number of the text grades the verification sentence instead.
    """
    out = []
    for gold, right_form, wrong_form in golds:
        tpl, lang = rng.choice(templates)
        x, y = rng.randint(2, 40), rng.randint(2, 40)
        src = (
            f"family: non-English answer phrase ({lang}; Qwen2.5-Math / OpenCompass answer-phrase extraction)"
        )
        out.append(row(gold, tpl.format(a=right_form, x=x, y=y), True, "non-english", src))
        out.append(row(gold, tpl.format(a=wrong_form, x=x, y=y), False, "non-english", src))
        # the gold value appears only in the verification text: still wrong
        tpl2, _ = rng.choice(templates)
        out.append(row(gold, tpl2.format(a=wrong_form, x=right_form, y=y), False, "non-english", src))
    return out


def _lang_golds(rng, n, lo, hi) -> list[tuple[str, str, str]]:
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.4:
            v = rng.randint(lo, hi)
            out.append((str(v), str(v), str(v + rng.choice([1, 2, -1, 5]))))
        elif kind < 0.7:
            a, b = rng.randint(1, 12), rng.randint(13, 30)
            out.append((f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}", f"{a + 1}/{b}"))
        else:
            k = rng.choice([2, 3, 5, 6, 7])
            c = rng.randint(2, 9)
            out.append((f"{c}\\sqrt{{{k}}}", f"${c}\\sqrt{{{k}}}$", f"${c + 1}\\sqrt{{{k}}}$"))
    return out


_UNITS_DEV = ["m", "days", "km^2", "cm", "meters", "hours", "dollars", "degrees", "units"]
_UNITS_HELD = ["kg", "minutes", "m^2", "inches", "seconds", "mph", "feet", "liters", "cm^3"]


def fam_units(units, wraps, rng, n) -> list[dict]:
    """Units and unit-like suffixes (m, days, km^2, degrees, %, $), clock times, mixed numbers.

    Conventions: PRM800K strips ``\\text{}`` units and reads ``7 3/4`` as the mixed number 7 + 3/4;
    Qwen2.5-Math strips unit words and ``^\\circ``; the DAPO/Minerva normalizer drops a fixed list
    of unit words. A different number with the right unit stays wrong.
    """
    src = "family: units/suffixes/clock/mixed numbers (PRM800K mixed numbers + unit stripping; Qwen2.5-Math strip units; Minerva normalizer)"
    out = []
    for _ in range(n):
        v = rng.randint(2, 500)
        u = rng.choice(units)
        w = rng.choice(wraps)
        form = rng.choice([f"{v} \\text{{ {u}}}", f"{v}\\text{{{u}}}", f"{v} {u}", f"{v}\\,\\mathrm{{{u}}}"])
        out.append(row(str(v), w(form), True, "units", src))
        out.append(row(str(v), w(form.replace(str(v), str(v + 1), 1)), False, "units", src))
    for _ in range(n // 3):
        v = rng.randint(2, 89)
        w = rng.choice(wraps)
        out += [
            row(f"{v}^\\circ", w(f"{v}"), True, "units", src),
            row(f"{v}", w(f"{v}^{{\\circ}}"), True, "units", src),
            row(f"{v}", w(f"{v}°"), True, "units", src),
            row(f"{v}^\\circ", w(f"{v + 1}^\\circ"), False, "units", src),
            row(f"{v}\\%", w(f"{v}%"), True, "units", src),
            row(f"{v}\\%", w(f"{v} percent"), True, "units", src),
            row(f"{v}\\%", w(f"{v + 1}\\%"), False, "units", src),
            row(f"\\${v}.50", w(f"{v}.5"), True, "units", src),
            row(f"\\${v}.50", w(f"\\${v}.05"), False, "units", src),
        ]
    for _ in range(n // 3):  # clock times
        h, mi = rng.randint(1, 12), rng.choice([0, 5, 15, 20, 30, 45, 50])
        t = f"{h}:{mi:02d}"
        w = rng.choice(wraps)
        ampm = rng.choice(["AM", "PM", "a.m.", "p.m."])
        out += [
            row(t, w(t), True, "clock-time", src),
            row(f"{t}\\text{{ {ampm}}}", w(f"{t} {ampm}"), True, "clock-time", src),
            row(t, w(f"{h}:{(mi + 10) % 60:02d}"), False, "clock-time", src),
            row(t, w(f"{h % 12 + 1}:{mi:02d}"), False, "clock-time", src),
        ]
    for _ in range(n // 3):  # mixed numbers
        whole, a = rng.randint(1, 9), rng.randint(1, 6)
        b = rng.randint(a + 1, 9)
        val = Fraction(whole * b + a, b)
        w = rng.choice(wraps)
        out += [
            row(
                f"{whole}\\frac{{{a}}}{{{b}}}",
                w(f"\\frac{{{val.numerator}}}{{{val.denominator}}}"),
                True,
                "mixed-number",
                src,
            ),
            row(
                f"\\frac{{{val.numerator}}}{{{val.denominator}}}",
                w(f"{whole} {a}/{b}"),
                True,
                "mixed-number",
                src,
            ),
            row(
                f"\\frac{{{val.numerator}}}{{{val.denominator}}}",
                w(f"{whole}\\frac{{{a}}}{{{b}}}"),
                True,
                "mixed-number",
                src,
            ),
            row(
                f"{whole}\\frac{{{a}}}{{{b}}}", w(f"\\frac{{{whole * a}}}{{{b}}}"), False, "mixed-number", src
            ),
            row(
                f"{whole}\\frac{{{a}}}{{{b}}}",
                w(f"{whole + 1}\\frac{{{a}}}{{{b}}}"),
                False,
                "mixed-number",
                src,
            ),
        ]
    return out


def fam_symbolic(wraps, rng, held: bool) -> list[dict]:
    """Symbolic identities (trig with degrees), f(x)= vs y=, inequalities vs intervals.

    Conventions: PRM800K / Qwen2.5-Math decide identities with sympy ``simplify``; OlympiadBench's
    evaluator strips a ``f(x)=`` / ``y=`` left side before comparing expressions and compares
    intervals; math-verify compares an inequality with an interval as sets.
    """
    src = "family: symbolic identities / function names / inequalities vs intervals (PRM800K + Qwen sympy; OlympiadBench evaluator; math-verify sets)"
    out = []
    angles = [10, 20, 25, 35, 40, 55, 70, 80] if held else [15, 30, 45, 50, 60, 65, 75]
    for a in angles:
        w = rng.choice(wraps)
        out += [
            row("\\sin x", w(f"\\cos({90}^\\circ - x)"), True, "symbolic", src),
            row(f"\\sin {a}^\\circ", w(f"\\cos {90 - a}^\\circ"), True, "symbolic", src),
            row(f"\\sin {a}^\\circ", w(f"\\cos {a}^\\circ"), a == 45, "symbolic", src),
            row(f"\\cos {a}^\\circ", w(f"\\sin {90 - a}^\\circ"), True, "symbolic", src),
            row(f"\\tan {a}^\\circ", w(f"\\frac{{1}}{{\\tan {90 - a}^\\circ}}"), True, "symbolic", src),
        ]
    for c in range(2, 9) if not held else range(9, 16):
        w = rng.choice(wraps)
        k = c + 1
        out += [
            row(f"f(x) = {c}x - {k}", w(f"y = {c}x - {k}"), True, "function-name", src),
            row(f"f(x) = {c}x - {k}", w(f"{c}x - {k}"), True, "function-name", src),
            row(f"y = {c}x + {k}", w(f"f(x) = {c}x + {k}"), True, "function-name", src),
            row(f"f(x) = {c}x - {k}", w(f"y = {c}x + {k}"), False, "function-name", src),
            row(f"f(x) = x^2 + {c}", w(f"g(x) = x^2 + {c + 1}"), False, "function-name", src),
            row(f"-{c} < x < {k}", w(f"(-{c}, {k})"), True, "inequality-interval", src),
            row(f"(-{c}, {k})", w(f"-{c} < x < {k}"), True, "inequality-interval", src),
            row(f"(-{c}, {k})", w(f"-{c} \\le x \\le {k}"), False, "inequality-interval", src),
            row(f"[{c}, \\infty)", w(f"x \\ge {c}"), True, "inequality-interval", src),
            row(f"[{c}, \\infty)", w(f"x > {c}"), False, "inequality-interval", src),
            row(
                f"(-\\infty, -{c}) \\cup ({k}, \\infty)",
                w(f"x < -{c} \\text{{ or }} x > {k}"),
                True,
                "inequality-interval",
                src,
            ),
            row(
                f"(-\\infty, -{c}) \\cup ({k}, \\infty)", w(f"(-{c}, {k})"), False, "inequality-interval", src
            ),
            row("\\cos 2x", w("\\cos^2 x - \\sin^2 x"), True, "symbolic", src) if c == 2 else None,
            row(f"x^2 - {c * c}", w(f"(x-{c})(x+{c})"), True, "symbolic", src),
            row(f"x^2 - {c * c}", w(f"(x-{c})^2"), False, "symbolic", src),
        ]
    return [r for r in out if r is not None]


def fam_lists(wraps, rng, n) -> list[dict]:
    """Ordered vs unordered lists, several boxed answers.

    Conventions: OlympiadBench multi-answer questions and Qwen2.5-Math treat "all solutions" as an
    unordered list; ordered pairs/tuples and intervals keep their order (PRM800K compares tuple
    elements in order); several boxes that together form the answer are one list.
    """
    src = "family: ordered vs unordered lists, several boxes (OlympiadBench multi-answer; PRM800K tuples; Qwen2.5-Math)"
    out = []
    for _ in range(n):
        a, b = rng.sample(range(-9, 20), 2)
        c = rng.choice([x for x in range(-9, 20) if x not in (a, b)])
        w = rng.choice(wraps)
        out += [
            row(f"{a}, {b}", w(f"{b}, {a}"), True, "lists", src),
            row(f"{a}, {b}", w(f"x = {b} \\text{{ or }} x = {a}"), True, "lists", src),
            row(f"({a}, {b})", w(f"({b}, {a})"), False, "lists", src),
            row(f"({a}, {b})", w(f"({a}, {b})"), True, "lists", src),
            row(f"\\{{{a}, {b}\\}}", w(f"\\{{{b}, {a}\\}}"), True, "lists", src),
            row(f"{a}, {b}", w(f"{a}"), False, "lists", src),
            row(f"{a}, {b}", w(f"{a}, {b}, {c}"), False, "lists", src),
            row(f"{a}, {b}", w(f"{a}, {c}"), False, "lists", src),
            row(
                f"{a}, {b}",
                f"The solutions are $\\boxed{{{a}}}$ and $\\boxed{{{b}}}$.",
                True,
                "several-boxes",
                src,
            ),
            row(f"{a}, {b}", f"So $x=\\boxed{{{b}}}$ or $x=\\boxed{{{a}}}$.", True, "several-boxes", src),
            row(f"{a}, {b}", f"$\\boxed{{{a}}}$, $\\boxed{{{c}}}$", False, "several-boxes", src),
            row(
                f"{b}",
                f"First guess $\\boxed{{{a}}}$. Checking again, the final answer is $\\boxed{{{b}}}$.",
                True,
                "several-boxes",
                src,
            ),
            row(
                f"{a}",
                f"First guess $\\boxed{{{a}}}$. Checking again, the final answer is $\\boxed{{{b}}}$.",
                False,
                "several-boxes",
                src,
            ),
        ]
    return out


# --------------------------------------------------------------------------- hand-written held-back rows
# Written by hand in one sitting after the dev part was at 100% and BEFORE the grader was run on
# them: realistic phrasings the generators above do not produce. (gold, prediction, expected,
# family, what the row checks). Labels follow the family conventions documented above.
HANDWRITTEN_HELD = [
# ---- tolerance / huge / tiny
("\\frac{1}{2^{100}}", "\\boxed{\\frac{1}{2^{101}}}", False, "tolerance", "relative"),
("\\frac{1}{2^{100}}", "\\boxed{2^{-100}}", True, "tolerance", "exact"),
("\\frac{1}{2^{100}}", "\\boxed{\\left(\\frac{1}{2}\\right)^{100}}", True, "tolerance", "exact"),
("\\frac{1}{2020!}", "\\boxed{\\frac{1}{2021!}}", False, "tolerance", "relative"),
("\\frac{1}{2020!}", "\\boxed{\\frac{2021}{2021!}}", True, "tolerance", "exact"),
("3^{100}", "\\boxed{3^{100}+3}", False, "tolerance", "relative"),
("3^{100}", "\\boxed{9^{50}}", True, "tolerance", "exact"),
("10^{100}", "\\boxed{100^{50}}", True, "tolerance", "exact"),
("10^{100}", "\\boxed{10^{99}}", False, "tolerance", "relative"),
("2^{-30}", "\\boxed{2^{-31}}", False, "tolerance", "relative"),
("5^{-20}", "\\boxed{\\frac{1}{5^{20}}}", True, "tolerance", "exact"),
("\\frac{1}{7^{40}}", "The answer is $\\frac{1}{7^{41}}$.", False, "tolerance", "relative"),
("\\frac{\\pi}{10^{9}}", "\\boxed{\\frac{\\pi}{10^{10}}}", False, "tolerance", "relative"),
("\\sqrt{2} \\cdot 10^{-12}", "\\boxed{\\sqrt{2} \\times 10^{-12}}", True, "tolerance", "exact"),
("\\sqrt{2} \\cdot 10^{-12}", "\\boxed{\\sqrt{3} \\times 10^{-12}}", False, "tolerance", "relative"),
("1.2 \\times 10^{-9}", "\\boxed{1.3 \\times 10^{-9}}", False, "tolerance", "relative"),
("1.2 \\times 10^{-9}", "\\boxed{1.2\\text{e-}9}", True, "tolerance", "same number"),
("6.02 \\times 10^{23}", "\\boxed{6.02 \\cdot 10^{23}}", True, "tolerance", "same number"),
("6.02 \\times 10^{23}", "\\boxed{6.2 \\times 10^{23}}", False, "tolerance", "relative"),
("999999999999999999", "\\boxed{1000000000000000000}", False, "tolerance", "exact integers"),
("123456789123456789", "\\boxed{123,456,789,123,456,789}", True, "tolerance", "exact integers"),
("\\binom{100}{50}", "\\boxed{\\binom{100}{49}}", False, "tolerance", "relative"),
("\\frac{1}{3^{59}}", "\\boxed{\\frac{3}{3^{60}}}", True, "tolerance", "exact"),
# ---- decimal approximations
("\\frac{1}{3}", "\\boxed{0.33}", False, "decimal-approx", "exact gold short decimal"),
("\\frac{1}{3}", "\\boxed{0.333}", False, "decimal-approx", "exact gold short decimal"),
("\\frac{1}{3}", "\\boxed{0.3333333}", True, "decimal-approx", "6 decimals"),
("\\pi", "\\boxed{3.14}", False, "decimal-approx", "exact gold short decimal"),
("\\pi", "\\boxed{3.1415927}", True, "decimal-approx", "6 decimals"),
("\\sqrt{2}", "\\boxed{1.414}", False, "decimal-approx", "exact gold short decimal"),
("\\sqrt{2}", "\\boxed{1.41421356}", True, "decimal-approx", "6 decimals"),
("\\frac{22}{7}", "\\boxed{3.142857142857}", True, "decimal-approx", "6 decimals"),
("\\frac{22}{7}", "\\boxed{\\pi}", False, "decimal-approx", "different constant"),
("3.14", "\\boxed{\\pi}", True, "decimal-approx", "rounded gold, exact answer"),
("1.41", "\\boxed{\\sqrt{2}}", True, "decimal-approx", "rounded gold, exact answer"),
("1.73", "\\boxed{\\sqrt{3}}", True, "decimal-approx", "rounded gold, exact answer"),
("1.73", "\\boxed{\\sqrt{2}}", False, "decimal-approx", "rounded gold, wrong"),
("2.72", "\\boxed{2.7183}", True, "decimal-approx", "rounded gold, more digits"),
("2.72", "\\boxed{2.75}", False, "decimal-approx", "rounded gold, same precision, off"),
("0.083", "\\boxed{\\frac{1}{12}}", True, "decimal-approx", "rounded gold, exact answer"),
("0.083", "\\boxed{\\frac{1}{11}}", False, "decimal-approx", "rounded gold, wrong"),
("12.57", "\\boxed{4\\pi}", True, "decimal-approx", "rounded gold, exact answer"),
("12.57", "\\boxed{12.6}", False, "decimal-approx", "less precise than gold"),
("0.5", "\\boxed{0.49}", False, "decimal-approx", "one significant digit gold is exact"),
("0.25", "\\boxed{\\frac{1}{4}}", True, "decimal-approx", "exact"),
("0.25", "\\boxed{0.2500}", True, "decimal-approx", "trailing zeros"),
("0.25", "\\boxed{0.26}", False, "decimal-approx", "different"),
# ---- non-English
("\\frac{3}{5}", "设所求概率为 $p$，计算可得答案是 $\\frac{3}{5}$。另外还有 2 种特殊情况已排除。", True, "non-english", "zh"),
("\\frac{3}{5}", "设所求概率为 $p$，计算可得答案是 $\\frac{2}{5}$。另外还有 3 种情况，共 5 种。", False, "non-english", "zh"),
("18", "因此，最终答案为 18。（共检查了 4 遍）", True, "non-english", "zh"),
("18", "因此，最终答案为 16。（共检查了 18 遍）", False, "non-english", "zh"),
("45", "Alors, la réponse est 45 degrés. Il y a 3 angles.", True, "non-english", "fr"),
("45", "Alors, la réponse est 40. Il y a 45 angles au total.", False, "non-english", "fr"),
("7", "Also ist die Antwort 7. Wir haben 12 Fälle geprüft.", True, "non-english", "de word order"),
("120", "La respuesta es 120, ya que 5! = 120 y hay 3 formas.", True, "non-english", "es"),
("120", "La respuesta es 60, pero si contamos 120 permutaciones hay 2 ciclos.", False, "non-english", "es"),
("2\\sqrt{6}", "Ответ: $2\\sqrt{6}$. Проверка: при $x = 3$ получаем 24.", True, "non-english", "ru"),
("2\\sqrt{6}", "Ответ: $3\\sqrt{6}$. Проверка: $2\\sqrt{6}$ не подходит, 5 случаев.", False, "non-english", "ru"),
("9", "よって答えは 9 です。確認のため 3 回計算しました。", True, "non-english", "ja"),
("\\frac{1}{4}", "Quindi la risposta è 1/4, con 8 casi favorevoli su 32.", True, "non-english", "it"),
("\\frac{1}{4}", "Quindi la risposta è 1/8, con 4 casi favorevoli su 32.", False, "non-english", "it"),
("36", "Portanto, a resposta é 36. Verificamos 6 vezes 6.", True, "non-english", "pt"),
("36", "Portanto, a resposta é 30. Verificamos 6 vezes 6 = 36.", False, "non-english", "pt"),
# ---- units / suffixes
("48", "\\boxed{48 \\text{ square feet}}", True, "units", "unit words"),
("48", "\\boxed{48\\ \\text{ft}^2}", True, "units", "unit with exponent"),
("48", "\\boxed{84 \\text{ ft}^2}", False, "units", "wrong value"),
("12", "\\boxed{12\\text{ cm}^3}", True, "units", "unit"),
("15", "\\boxed{15 \\text{ km/h}}", True, "units", "unit"),
("15", "\\boxed{\\$15}", True, "units", "currency"),
("15", "\\boxed{\\$15.00}", True, "units", "currency"),
("15", "\\boxed{\\$16}", False, "units", "currency wrong"),
("4.5", "\\boxed{4.5\\,\\text{m}}", True, "units", "unit"),
("60^\\circ", "\\boxed{60 \\text{ degrees}}", True, "units", "degree words"),
("60^\\circ", "\\boxed{60°}", True, "units", "degree sign"),
("60^\\circ", "\\boxed{\\frac{\\pi}{3}}", False, "units", "no radian conversion (policy)"),
("25\\%", "\\boxed{25\\%}", True, "units", "percent"),
("25\\%", "\\boxed{0.25}", True, "units", "percent as fraction"),
("25\\%", "\\boxed{2.5\\%}", False, "units", "percent wrong"),
("7", "\\boxed{7 \\text{ days}}", True, "units", "unit"),
("7", "\\boxed{7\\text{th}}", True, "units", "ordinal suffix"),
("3", "\\boxed{3 \\text{ hours}}", True, "units", "unit"),
("3", "\\boxed{3 \\text{ hours and } 20 \\text{ minutes}}", False, "units", "extra part"),
# ---- clock times
("3:15", "\\boxed{3:15}", True, "clock-time", ""),
("3:15\\text{ PM}", "\\boxed{15:15}", True, "clock-time", "24h"),
("3:15\\text{ PM}", "\\boxed{3:15\\text{ AM}}", False, "clock-time", "am vs pm"),
("3:15", "\\boxed{3:50}", False, "clock-time", ""),
("11:59\\text{ p.m.}", "The clock shows $11:59$ p.m., so the answer is \\boxed{11:59 \\text{ p.m.}}", True, "clock-time", ""),
("12:00", "\\boxed{12:00 \\text{ noon}}", True, "clock-time", "noon word"),
("6:00\\text{ a.m.}", "\\boxed{6:00 AM}", True, "clock-time", ""),
("6:00\\text{ a.m.}", "\\boxed{18:00}", False, "clock-time", "24h wrong"),
# ---- mixed numbers
("3\\frac{1}{2}", "\\boxed{3.5}", True, "mixed-number", "mixed = decimal"),
("3\\frac{1}{2}", "\\boxed{\\frac{7}{2}}", True, "mixed-number", ""),
("3\\frac{1}{2}", "\\boxed{3 1/2}", True, "mixed-number", ""),
("3\\frac{1}{2}", "\\boxed{\\frac{3}{2}}", False, "mixed-number", "product reading"),
("\\frac{7}{2}", "\\boxed{3\\tfrac{1}{2}}", True, "mixed-number", ""),
("\\frac{9}{4}", "\\boxed{2\\dfrac{1}{4}}", True, "mixed-number", ""),
("\\frac{9}{4}", "\\boxed{2\\frac{3}{4}}", False, "mixed-number", ""),
("1\\frac{2}{3}", "\\boxed{\\frac{5}{3}}", True, "mixed-number", ""),
("1\\frac{2}{3}", "\\boxed{1.67}", False, "mixed-number", "short decimal of exact gold"),
# ---- symbolic identities
("\\sin 2x", "\\boxed{2\\sin x \\cos x}", True, "symbolic", "double angle"),
("\\cos^2 x", "\\boxed{\\frac{1 + \\cos 2x}{2}}", True, "symbolic", "half angle"),
("\\cos^2 x", "\\boxed{\\frac{1 - \\cos 2x}{2}}", False, "symbolic", "half angle wrong"),
("\\tan x", "\\boxed{\\frac{\\sin x}{\\cos x}}", True, "symbolic", ""),
("\\frac{\\sqrt{3}}{2}", "\\boxed{\\sin 60^\\circ}", True, "symbolic", "degrees"),
("\\frac{\\sqrt{3}}{2}", "\\boxed{\\sin 30^\\circ}", False, "symbolic", "degrees"),
("\\frac{1}{2}", "\\boxed{\\cos 60^{\\circ}}", True, "symbolic", "degrees braces"),
("\\sqrt{2}", "\\boxed{2\\sin 45^\\circ}", True, "symbolic", "degrees"),
("\\cos x", "\\boxed{\\sin(90^\\circ + x)}", True, "symbolic", "degrees with variable"),
("-\\cos x", "\\boxed{\\cos(180^\\circ - x)}", True, "symbolic", "degrees with variable"),
("\\cos x", "\\boxed{\\cos(180^\\circ - x)}", False, "symbolic", "sign"),
("(x+1)^2", "\\boxed{x^2+2x+1}", True, "symbolic", "expansion"),
("(x+1)^2", "\\boxed{x^2+x+1}", False, "symbolic", "expansion wrong"),
("\\frac{x^2-1}{x-1}", "\\boxed{x+1}", True, "symbolic", "simplify"),
("\\log_2 8", "\\boxed{3}", True, "symbolic", "log"),
("\\ln(e^2)", "\\boxed{2}", True, "symbolic", "log"),
("e^{i\\pi}", "\\boxed{-1}", True, "symbolic", "euler"),
("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", True, "symbolic", "radicals"),
("2\\sqrt{2}", "\\boxed{\\sqrt{6}}", False, "symbolic", "radicals"),
("\\frac{\\sqrt{6}}{3}", "\\boxed{\\sqrt{\\frac{2}{3}}}", True, "symbolic", "radicals"),
("\\frac{\\sqrt{6}}{3}", "\\boxed{\\frac{\\sqrt{2}}{\\sqrt{3}}}", True, "symbolic", "radicals"),
# ---- function names / equations
("f(x) = x^2 - 4x + 3", "\\boxed{f(x) = (x-1)(x-3)}", True, "function-name", "same name"),
("f(x) = x^2 - 4x + 3", "\\boxed{y = (x-1)(x-3)}", True, "function-name", "y"),
("f(x) = x^2 - 4x + 3", "\\boxed{y = (x+1)(x+3)}", False, "function-name", "y wrong"),
("g(t) = 3t + 1", "\\boxed{h(t) = 3t + 1}", True, "function-name", "renamed"),
("g(t) = 3t + 1", "\\boxed{3t+1}", True, "function-name", "rhs only"),
("y = -2x + 5", "\\boxed{f(x) = 5 - 2x}", True, "function-name", "y vs f(x)"),
("y = -2x + 5", "\\boxed{2x + y = 5}", True, "function-name", "implicit form (equation equivalence)"),
("y = -2x + 5", "\\boxed{f(x) = 2x + 5}", False, "function-name", ""),
("f(x) = 2x", "The function is $f(x)=2x$ for all real $x$. \\boxed{f(x) = 2x}", True, "function-name", ""),
("f(x)=x+1", "\\boxed{f(x) = x - 1}", False, "function-name", ""),
# ---- inequalities vs intervals
("(2, 5]", "\\boxed{2 < x \\le 5}", True, "inequality-interval", ""),
("(2, 5]", "\\boxed{2 \\le x < 5}", False, "inequality-interval", ""),
("(-\\infty, 0)", "\\boxed{x < 0}", True, "inequality-interval", ""),
("(-\\infty, 0]", "\\boxed{x < 0}", False, "inequality-interval", ""),
("(-\\infty, 1) \\cup (2, \\infty)", "\\boxed{x < 1 \\text{ or } x > 2}", True, "inequality-interval", ""),
("(-\\infty, 1) \\cup (2, \\infty)", "\\boxed{x<1 \\lor x>2}", True, "inequality-interval", ""),
("(-\\infty, 1) \\cup (2, \\infty)", "\\boxed{1 < x < 2}", False, "inequality-interval", ""),
("(-\\infty, 1] \\cup [2, \\infty)", "\\boxed{x \\leq 1 \\text{ or } x \\geq 2}", True, "inequality-interval", ""),
("(-\\infty, 1] \\cup [2, \\infty)", "\\boxed{x < 1 \\text{ or } x > 2}", False, "inequality-interval", ""),
("[-3, 3]", "\\boxed{-3 \\le x \\le 3}", True, "inequality-interval", ""),
("[-3, 3]", "\\boxed{|x| \\le 3}", True, "inequality-interval", "absolute value form"),
("x > 4", "\\boxed{(4, \\infty)}", True, "inequality-interval", "gold inequality"),
("x > 4", "\\boxed{[4, \\infty)}", False, "inequality-interval", "gold inequality"),
# ---- lists
("1, 2, 3", "\\boxed{3, 1, 2}", True, "lists", "unordered roots"),
("1, 2, 3", "\\boxed{1, 2}", False, "lists", ""),
("1, 2, 3", "\\boxed{\\{1, 2, 3\\}}", True, "lists", "set"),
("(1, 2, 3)", "\\boxed{(3, 2, 1)}", False, "lists", "ordered triple"),
("(1, 2, 3)", "\\boxed{(1, 2, 3)}", True, "lists", ""),
("(0, 1), (1, 0)", "\\boxed{(1, 0), (0, 1)}", True, "lists", "unordered list of points"),
("(0, 1), (1, 0)", "\\boxed{(0, 1), (0, 1)}", False, "lists", ""),
("x = 1, y = 2", "\\boxed{x=1, y=2}", True, "lists", "named values"),
("-1, 4", "The roots are $x = -1$ and $x = 4$, so \\boxed{-1, 4}", True, "lists", ""),
("-1, 4", "\\boxed{x=4} \\text{ or } \\boxed{x=-1}", True, "several-boxes", ""),
("-1, 4", "So $x_1 = \\boxed{-1}$ and $x_2 = \\boxed{4}$.", True, "several-boxes", "subscripted names"),
("-1, 4", "So $x_1 = \\boxed{-1}$ and $x_2 = \\boxed{5}$.", False, "several-boxes", ""),
("4", "Initially \\boxed{3} seemed right, but recomputing gives \\boxed{4}.", True, "several-boxes", "last box"),
("3", "Initially \\boxed{3} seemed right, but recomputing gives \\boxed{4}.", False, "several-boxes", "last box"),
("5, 7", "$\\boxed{5}$, $\\boxed{7}$", True, "several-boxes", ""),
("5, 7", "$\\boxed{5}$", False, "several-boxes", ""),
# ---- special tokens
("\\frac{5}{8}", "Answer: 5/8<|im_end|>", True, "special-tokens", "ChatML"),
("\\frac{5}{8}", "Answer: 5/8<|eot_id|><|end_of_text|>", True, "special-tokens", "Llama 3"),
("\\frac{5}{8}", "The answer is $\\frac{5}{8}$.</s>", True, "special-tokens", "Llama 2"),
("\\frac{5}{8}", "\\boxed{\\frac{5}{8}}<end_of_turn>\n<eos>", True, "special-tokens", "Gemma"),
("\\frac{5}{8}", "\\boxed{\\frac{5}{8}}<\uff5cend\u2581of\u2581sentence\uff5c>", True, "special-tokens", "DeepSeek"),
("\\frac{5}{8}", "Answer: 3/8<|im_end|>", False, "special-tokens", "wrong"),
("(1, -2)", "Answer: (1, -2)<|endoftext|><|endoftext|>", True, "special-tokens", "padding"),
("2\\sqrt{3}", "Answer: 2\\sqrt{3}<|end|>", True, "special-tokens", "Phi"),
]


def handwritten_held() -> list[dict]:
    src = "hand-written held-back (stapo, written before measuring): "
    return [row(g, p, e, f, src + (note or f)) for g, p, e, f, note in HANDWRITTEN_HELD]


def build() -> tuple[list[dict], list[dict]]:
    rng = random.Random(11)
    dev: list[dict] = []
    dev += answer_keys("math500", DEV_WRAP, rng, 330)
    dev += answer_keys("amc23", DEV_WRAP, rng, 40)
    dev += answer_keys("aime24", DEV_WRAP, rng, 30)
    dev += fam_tolerance(range(20, 62, 3), DEV_WRAP, rng)
    dev += fam_decimal(_EXACT[:8], DEV_WRAP, rng)
    dev += fam_language(_LANG_DEV, _lang_golds(rng, 50, 10, 999), rng)
    dev += fam_units(_UNITS_DEV, DEV_WRAP, rng, 45)
    dev += fam_symbolic(DEV_WRAP, rng, held=False)
    dev += fam_lists(DEV_WRAP, rng, 14)

    rng = random.Random(2011)
    held: list[dict] = []
    held += answer_keys("olympiadbench", HELD_WRAP, rng, 260)
    held += answer_keys("minerva_math", HELD_WRAP, rng, 150)
    held += answer_keys("gsm8k_test", HELD_WRAP, rng, 120)
    held += answer_keys("aime25", HELD_WRAP, rng, 30)
    held += fam_tolerance(range(63, 100, 4), HELD_WRAP, rng)
    held += fam_decimal(_EXACT[8:], HELD_WRAP, rng)
    held += fam_language(_LANG_HELD, _lang_golds(rng, 40, 1000, 99999), rng)
    held += fam_units(_UNITS_HELD, HELD_WRAP, rng, 30)
    held += fam_symbolic(HELD_WRAP, rng, held=True)
    held += fam_lists(HELD_WRAP, rng, 10)
    held += handwritten_held()
    return _dedup(dev), _dedup(held)


def _dedup(rows: list[dict]) -> list[dict]:
    seen, out = set(), []
    for r in rows:
        key = (r["gold"], r["prediction"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    global DATA
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data", type=Path, default=DATA, help="folder with the benchmark jsonl files (answer keys)"
    )
    DATA = ap.parse_args(argv).data
    dev, held = build()
    keys = {(r["gold"], r["prediction"]) for r in dev}
    held = [r for r in held if (r["gold"], r["prediction"]) not in keys]  # disjoint by construction
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in (("dev", dev), ("heldback", held)):
        with (OUT / f"corpus_{name}.jsonl").open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        neg = sum(not r["expected"] for r in rows)
        print(f"{name}: {len(rows)} rows ({neg} expected=False)")


if __name__ == "__main__":
    main()
