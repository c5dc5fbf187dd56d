"""Eval metrics and benchmark loading: pass@k against the closed form, avg@k / maj@k by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from stapo.evals.benchmarks import (
    benchmark_names,
    default_k,
    get_benchmark,
    load_benchmark,
    parse_benchmark_arg,
    register_benchmark,
    strip_dollars,
    strip_leading_zeros,
    strip_thousands,
)
from stapo.evals.metrics import (
    SampleScore,
    avg_at_k,
    macro_average,
    maj_at_k,
    majority_cluster,
    pass_at_k,
    summarize_benchmark,
)


def closed_form(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16, 32, 64])
def test_pass_at_k_matches_closed_form(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edges_and_large_n() -> None:
    assert pass_at_k(32, 0, 8) == 0.0
    assert pass_at_k(32, 32, 8) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the plain accuracy
    # n-c < k: every subset holds a correct sample.
    assert pass_at_k(5, 3, 3) == 1.0
    # Large n: math.comb would build 300-digit integers; the product form stays exact to fp precision.
    assert pass_at_k(1000, 7, 100) == pytest.approx(closed_form(1000, 7, 100), rel=1e-10)


@pytest.mark.parametrize(("n", "c", "k"), [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_bad_input(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def _eq(a: str, b: str) -> bool:
    """A stand-in equivalence: numbers compare by value, everything else by string."""
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def test_avg_and_maj_by_hand() -> None:
    s = [SampleScore(True, "0.5"), SampleScore(False, "2"), SampleScore(True, ".5"), SampleScore(False, "2")]
    assert avg_at_k(s) == 0.5
    # "0.5" and ".5" are equivalent but "2" also has 2 votes: tie -> the cluster seen first ("0.5").
    assert majority_cluster([x.extracted for x in s], _eq) == [0, 2]
    assert maj_at_k(s, _eq) == 1.0
    wrong_major = [SampleScore(False, "3"), SampleScore(True, "7"), SampleScore(False, "3.0"), SampleScore(False, None)]
    assert maj_at_k(wrong_major, _eq) == 0.0
    # No sample produced an answer: no vote, score 0.
    assert maj_at_k([SampleScore(False, None), SampleScore(False, "  ")], _eq) == 0.0
    # None answers do not vote even when they outnumber a single answer.
    assert maj_at_k([SampleScore(False, None)] * 3 + [SampleScore(True, "1")], _eq) == 1.0


def test_majority_uses_equivalence_not_strings() -> None:
    calls: list[tuple[str, str]] = []

    def eq(a: str, b: str) -> bool:
        calls.append((a, b))
        return _eq(a, b)

    # "1/2" x1, "0.5" + "0.50" (equivalent) x2: the equivalent pair wins.
    best = majority_cluster(["1/2", "0.5", "0.50"], eq)
    assert best == [1, 2]
    assert ("0.5", "0.50") in calls


def test_summarize_benchmark_and_macro() -> None:
    problems = {
        "p1": [SampleScore(True, "1"), SampleScore(True, "1"), SampleScore(False, "2"), SampleScore(False, "3")],
        "p2": [SampleScore(False, "5"), SampleScore(False, "5"), SampleScore(False, "5"), SampleScore(True, "4")],
    }
    m = summarize_benchmark(problems, k=4, equivalent=_eq)
    assert m["avg@4"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert m["pass@4"] == 1.0
    assert m["maj@4"] == pytest.approx(0.5)  # p1 majority "1" right, p2 majority "5" wrong
    assert m["n"] == 2 and m["samples"] == 8
    # pass@2 by hand: p1 1 - C(2,2)/C(4,2) = 5/6, p2 1 - C(3,2)/C(4,2) = 1/2.
    assert m["pass_curve"]["2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert m["pass_curve"]["1"] == pytest.approx(m["avg@4"])
    mac = macro_average({"a": m, "b": {"avg@32": 0.1, "pass@32": 0.2, "maj@32": 0.3}})
    assert mac["avg"] == pytest.approx((m["avg@4"] + 0.1) / 2)
    assert mac["maj"] == pytest.approx((0.5 + 0.3) / 2)
    with pytest.raises(ValueError, match="p1"):
        summarize_benchmark({"p1": problems["p1"][:3]}, k=4, equivalent=_eq)


def test_registry_names_defaults_and_errors() -> None:
    assert benchmark_names() == ["aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench", "gsm8k"]
    assert [default_k(n) for n in ("aime24", "aime25", "amc23", "math500", "gsm8k")] == [32, 32, 32, 4, 4]
    with pytest.raises(KeyError, match="valid names: aime24"):
        get_benchmark("aime2024")
    with pytest.raises(ValueError, match="already registered"):
        register_benchmark(get_benchmark("gsm8k"))


def test_answer_cleaning() -> None:
    assert strip_leading_zeros("025") == "25"
    assert strip_leading_zeros("000") == "0"
    assert strip_leading_zeros("\\frac{1}{2}") == "\\frac{1}{2}"
    assert strip_dollars("$\\frac{1}{2 n+2}$") == "\\frac{1}{2 n+2}"
    assert strip_dollars("$(1,8,19), (2,7,13)$") == "(1,8,19), (2,7,13)"
    assert strip_thousands("1,450,000") == "1450000"
    assert strip_thousands("1, 2") == "1, 2"


def test_load_shipped_benchmarks_with_caveats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STAPO_DATA_DIR", raising=False)  # no data dir: the copies shipped with stapo
    aime = load_benchmark("aime24")
    assert len(aime) == 30
    padded = [p for p in aime if p.raw_answer.startswith("0")]
    assert padded and all(not p.answer.startswith("0") for p in padded)
    gsm = load_benchmark("gsm8k", limit=5)
    assert len(gsm) == 5 and gsm[0].id == "0" and gsm[0].answer == "18"
    olymp = load_benchmark("olympiadbench", limit=3)
    assert olymp[1].raw_answer.startswith("$") and not olymp[1].answer.startswith("$")


def test_custom_benchmark_with_field_mapping(tmp_path: Path) -> None:
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join(json.dumps({"q": f"{i}+1?", "final": str(i + 1)}) for i in range(3)) + "\n")
    name, path, mapping = parse_benchmark_arg(f"custom:{f}#problem=q,answer=final")
    assert (name, path, mapping) == ("mine", f, {"problem": "q", "answer": "final"})
    probs = load_benchmark(f"custom:{f}#problem=q,answer=final")
    assert [(p.id, p.problem, p.answer) for p in probs] == [("0", "0+1?", "1"), ("1", "1+1?", "2"), ("2", "2+1?", "3")]
    with pytest.raises(ValueError, match="missing field 'problem'"):
        load_benchmark(f"custom:{f}")
    with pytest.raises(ValueError, match="bad field mapping"):
        parse_benchmark_arg(f"custom:{f}#question=q")


def test_maj_at_k_with_the_real_grader_equivalence() -> None:
    from stapo.verifier_service.grader import answers_equivalent

    s = [SampleScore(True, "\\frac{1}{2}"), SampleScore(False, "3"), SampleScore(True, "0.5"), SampleScore(False, "3")]
    # "\frac{1}{2}" and "0.5" are one cluster of 2, tied with "3" x2; the first-seen cluster wins.
    assert majority_cluster([x.extracted for x in s], answers_equivalent) == [0, 2]
    assert maj_at_k(s, answers_equivalent) == 1.0
