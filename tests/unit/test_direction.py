"""benchmarks/direction.py's decision rules and metrics against hand-made per-seed results.

The rule is one paired test read both ways: mirrored inputs (every per-seed difference's sign
flipped) must give the mirrored verdict, so "refuted" is as reachable as "holds"."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from direction import (  # noqa: E402
    endpoint,
    entropy_rise,
    last_third,
    log_entropy_ratio,
    low_populations,
    mechanism_check,
    seeds_needed,
    verdict,
)


def arms(acc_diffs: list[float], ent_logratios: list[float], *, silenced: float = 1e-3,
         cands: float = 12.0) -> dict[str, dict[int, dict]]:
    """Arms A and C at endpoint 50% and entropy 1 nat on steps 1-3; arm B at 50% + acc_diffs[s] and
    entropy exp(ent_logratios[s]): B - C = acc_diffs, ln(H_B / H_A) = ent_logratios, per seed."""

    def run(end: float, h: float, sil: float) -> dict:
        return {"endpoint": end, "entropy": {str(t): h for t in (1, 2, 3)}, "silenced_rate": sil,
                "candidates_per_minibatch": cands}

    pairs = list(enumerate(zip(acc_diffs, ent_logratios, strict=True)))
    return {"A": {s: run(0.5, 1.0, 0.0) for s, _ in pairs},
            "B": {s: run(0.5 + d, math.exp(e), silenced) for s, (d, e) in pairs},
            "C": {s: run(0.5, 1.0, silenced) for s, _ in pairs}}


D = [0.04, 0.06, 0.05, 0.05]  # B - C: mean 0.05, sd 0.008165, half 3.182 x 0.008165 / 2 = 0.01299
E = [-0.3, -0.5, -0.4, -0.4]  # ln(H_B / H_A): mean -0.4, sd 0.08165, half 0.1299


def test_the_deciding_intervals_by_hand() -> None:
    word, reasons, cs = verdict(arms(D, E), 1, entropy_applies=True)
    bc, ba_ent = cs[0].record(), cs[1].record()
    assert (bc["name"], bc["deciding"]) == ("B - C", True)
    assert bc["mean"] == pytest.approx(0.05) and bc["ci95"] == pytest.approx([0.05 - 0.012990, 0.05 + 0.012990], abs=1e-5)
    assert ba_ent["mean"] == pytest.approx(-0.4) and ba_ent["ci95"] == pytest.approx([-0.52990, -0.27010], abs=1e-4)
    assert (bc["side"], ba_ent["side"], word) == ("for", "for", "holds")
    assert reasons[0].startswith("B - C endpoint accuracy: +5 points [+3.7, +6.3] n=4, for (deciding)")


@pytest.mark.parametrize(("d", "e", "word"), [
    (D, E, "holds"),                               # both intervals on STAPO's side
    ([-x for x in D], [-x for x in E], "refuted"),  # the mirror: both on the other side
    (D, [-x for x in E], "inconclusive"),          # accuracy for, entropy against
    ([0.10, -0.08, 0.02, 0.0], E, "inconclusive"),  # accuracy interval contains 0
])
def test_mirrored_inputs_give_the_mirrored_verdict(d: list[float], e: list[float], word: str) -> None:
    mirror = {"holds": "refuted", "refuted": "holds", "inconclusive": "inconclusive"}
    assert verdict(arms(d, e), 1, entropy_applies=True)[0] == word
    assert verdict(arms([-x for x in d], [-x for x in e]), 1, entropy_applies=True)[0] == mirror[word]


def test_entropy_not_applicable_where_the_baseline_does_not_rise() -> None:
    """Accuracy decides alone; the entropy contrast is named 'not applicable', whatever its side."""
    for e in (E, [-x for x in E]):
        word, reasons, cs = verdict(arms(D, e), 1, entropy_applies=False)
        assert word == "holds" and not cs[1].deciding and "not applicable" in reasons[1]
        assert verdict(arms([-x for x in D], e), 1, entropy_applies=False)[0] == "refuted"


def test_b_minus_a_decides_nothing() -> None:
    """B far above A but equal to C: the STAPO-specific contrast B - C is open, so no verdict."""
    per = arms([0.0, 0.0, 0.0, 0.0], E)
    for s in per["A"]:
        per["A"][s]["endpoint"] = 0.2 + 0.01 * s  # B - A = 0.3 - 0.01 s: an interval far above 0
        per["C"][s]["endpoint"] = 0.5 + 0.01 * (s % 2)  # B - C = 0, -0.01, 0, -0.01
    word, _, cs = verdict(per, 1, entropy_applies=True)
    assert cs[2].name == "B - A" and cs[2].side == "for" and not cs[2].deciding
    assert cs[0].side == "open" and word == "inconclusive"


def test_void_when_b_silenced_nothing() -> None:
    assert verdict(arms(D, E, silenced=0.0), 1, entropy_applies=True)[0] == "void"


def test_endpoint_is_the_mean_over_the_last_third() -> None:
    assert (last_third(50), last_third(60), last_third(12), last_third(2), last_third(3)) == (34, 40, 8, 2, 2)
    acc = {0: 0.2, 25: 0.9, 30: 0.4, 35: 0.5, 40: 0.6, 45: 0.7, 50: 0.6}  # steps >= 34: 0.5, 0.6, 0.7, 0.6
    assert endpoint(acc, 50) == pytest.approx(0.6)
    assert endpoint({0: 0.2}, 50) is None


def test_entropy_rise_and_log_ratio_are_signed() -> None:
    # reference step 1: H 1.0; last third of 6 steps (>= 4): mean of 2.0, 4.0, 3.0 = 3.0 -> ln 3
    h = {1: 1.0, 2: 9.0, 4: 2.0, 5: 4.0, 6: 3.0}
    assert entropy_rise(h, 1, 6) == pytest.approx(math.log(3))
    assert entropy_rise({1: 1.0, 4: 0.25, 5: 0.25, 6: 0.25}, 1, 6) == pytest.approx(math.log(0.25))  # a fall is < 0
    assert entropy_rise({2: 1.0}, 1, 6) is None
    # per step ln(num / den) from step 2 on: ln 2, ln 0.5 -> mean 0; step 1 does not count
    assert log_entropy_ratio({1: 5.0, 2: 2.0, 3: 0.5}, {1: 1.0, 2: 1.0, 3: 1.0}, 2) == pytest.approx(0.0)
    assert log_entropy_ratio({1: 0.5, 2: 0.5}, {1: 1.0, 2: 1.0}, 1) == pytest.approx(-math.log(2))


def test_seeds_needed_for_a_five_point_effect() -> None:
    # n = ((1.95996 + 0.84162) x sd / 0.05)^2: sd 0.18 -> 101.7 -> 102; sd 0.23 -> 166.1 -> 167; sd 0.05 -> 7.85 -> 8
    assert seeds_needed(0.18, 0.05) == 102
    assert seeds_needed(0.23, 0.05) == 167
    assert seeds_needed(0.05, 0.05) == 8


def test_low_populations_names_the_runs_under_ten_candidates() -> None:
    per = arms(D, E)
    per["B"][2]["candidates_per_minibatch"] = 1.5
    assert low_populations(per) == ["B seed 2 (1.5)"]


def test_mechanism_check_on_a_hand_made_dump(tmp_path: Path) -> None:
    # One step, A = 1; mini-batch 0: candidates are p < 0.1 (three tokens, H 0.1, 0.2, 0.3); the 0.5 quantile of their
    # entropies is 0.2, so only H = 0.1 is silenced. Gradient norm |A| sqrt(1 - 2p + sum_q2) per token.
    seq = {"advantage": 1.0, "prob": [0.05, 0.05, 0.05, 0.9], "entropy": [0.1, 0.2, 0.3, 0.5],
           "sum_q2": [0.5, 0.3, 0.2, 0.82]}
    # A second mini-batch with one candidate: the quantile of one value is that value, nothing is below it.
    other = {"advantage": 1.0, "prob": [0.01], "entropy": [0.05], "sum_q2": [0.0], "minibatch": 1}
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "step_000001.json").write_text(json.dumps({"step": 1, "sequences": [seq | {"minibatch": 0}, other]}))
    norms = [math.sqrt(1 - 2 * p + s) for p, s in zip(seq["prob"], seq["sum_q2"], strict=True)] + [math.sqrt(0.98)]
    m = mechanism_check(tmp_path, tau_p=0.1, q=0.5)
    assert m["silenced_tokens"] == 1 and m["steps"] == 1
    assert m["candidates_per_minibatch"] == [3, 1]
    assert m["silenced_grad_share"] == pytest.approx(norms[0] / sum(norms))
    assert m["random_same_size_grad_share"] in [pytest.approx(n / sum(norms)) for n in norms[:3]]


DOC = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"


def test_documented_direction_lines_build_valid_matched_arms(capsys) -> None:
    """Every documented line, as --dry-run: the arms' configs load and differ only in method keys, all
    three arms run, and the rules and the power line come first (the --smoke line itself runs in
    tests/e2e/test_direction_smoke.py)."""
    import shlex

    from direction import main

    lines = [ln for ln in DOC.read_text().splitlines() if ln.startswith("python benchmarks/direction.py")]
    assert len(lines) == 3 and any("--smoke" in ln for ln in lines)
    for line in lines:
        assert main([*shlex.split(line)[2:], "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "arms differ from A in: stapo: algorithm.name='stapo'; stapo: algorithm.token_weighting='s2t'" in out
        assert "stapo-random: algorithm.s2t.silence='random'" in out
        assert "C=stapo-random;" in out and "needs 102-167 seeds" in out
        assert out.index("power:") < out.index("verdict rules, fixed before running") < out.index("arms differ")
    assert main(["--dry-run"]) == 0
    assert "endpoint = mean of the evaluations at steps [35, 40, 45, 50]" in capsys.readouterr().out
