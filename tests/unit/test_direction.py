"""benchmarks/direction.py's decision rules and metrics against hand-made per-seed results."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from direction import b_beats_a, entropy_drift, mechanism_check, verdict  # noqa: E402


def arm(finals: list[float], drifts: list[float], silenced: float = 1e-3) -> dict[int, dict]:
    return {s: {"final": f, "entropy_drift": d, "silenced_rate": silenced} for s, (f, d) in enumerate(zip(finals, drifts, strict=True))}


A = arm([0.40, 0.42, 0.44, 0.46], [0.9, 0.8, 0.7, 0.6], silenced=0.0)  # A's finals: sd 0.02582


def test_holds_needs_every_seed_and_calmer_entropy_in_three_of_four() -> None:
    b = arm([0.41, 0.45, 0.45, 0.50], [0.5, 0.5, 0.5, 0.9])  # above in 4/4, drift lower in 3/4
    assert verdict(A, b)[0] == "holds"
    assert verdict(A, b, no_harm_only=True)[0] == "no harm"
    b2 = arm([0.41, 0.45, 0.45, 0.50], [0.5, 0.5, 0.9, 0.9])  # drift lower in 2/4 only
    assert verdict(A, b2)[0] == "inconclusive"
    b3 = arm([0.41, 0.45, 0.43, 0.50], [0.1, 0.1, 0.1, 0.1])  # one seed below: not 4/4
    assert verdict(A, b3)[0] == "inconclusive" and b_beats_a(A, b3)  # 3/4 above: arm C still runs


def test_refuted_needs_three_of_four_below_by_more_than_a_sd() -> None:
    # differences A - B: 0.03, 0.03, 0.03, 0.00; A's sd is 0.02582: three seeds below by more than it
    b = arm([0.37, 0.39, 0.41, 0.46], [0.1] * 4)
    word, reasons = verdict(A, b)
    assert word == "refuted" and "in 3/4" in reasons[2] and "2.6 points" in reasons[2]
    b2 = arm([0.38, 0.40, 0.42, 0.46], [0.1] * 4)  # below by 0.02 < sd: not refuted
    assert verdict(A, b2)[0] == "inconclusive" and not b_beats_a(A, b2)


def test_void_when_b_silenced_nothing() -> None:
    assert verdict(A, arm([0.9] * 4, [0.0] * 4, silenced=0.0))[0] == "void"


def test_entropy_drift_is_the_largest_log_ratio_from_the_reference_step() -> None:
    h = {1: 1.0, 4: 9.0, 5: 1.0, 6: 2.0, 7: 0.25}  # steps before 5 do not count; |ln 0.25| = 1.386
    assert entropy_drift(h, 5) == pytest.approx(math.log(4))
    assert entropy_drift({1: 1.0}, 5) is None


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
    assert m["silenced_grad_share"] == pytest.approx(norms[0] / sum(norms))
    assert m["random_same_size_grad_share"] in [pytest.approx(n / sum(norms)) for n in norms[:3]]


DOC = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"


def test_documented_direction_lines_build_valid_matched_arms(capsys) -> None:
    """Every documented line, as --dry-run: the arms' configs load and differ only in method keys
    (the --smoke line itself runs in tests/e2e/test_direction_smoke.py)."""
    import shlex

    from direction import main

    lines = [ln for ln in DOC.read_text().splitlines() if ln.startswith("python benchmarks/direction.py")]
    assert len(lines) == 3 and any("--smoke" in ln for ln in lines)
    for line in lines:
        assert main([*shlex.split(line)[2:], "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "arms differ from A in: stapo: algorithm.name='stapo'; stapo: algorithm.token_weighting='s2t'" in out
        assert "stapo-random: algorithm.s2t.silence='random'" in out
