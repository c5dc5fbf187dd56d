"""The RL-shaped load generator: stream shapes and the statistics the benchmark reports.

Run: ``pytest tests/service/test_loadgen.py`` (<1 s; no server).
"""

from __future__ import annotations

import pytest

from stapo.verifier_service.clients.loadgen import build_stream, load_golds, stream_stats
from stapo.verifier_service.grader.extraction import extract_answer

GOLDS = ["18", "\\frac{1}{2}", "(1,2)", "70", "x^2+1", "12", "5", "-1"]


def test_groups_share_a_gold_and_repeat_answers():
    items = build_stream(64, golds=GOLDS, seed=1, cutoff_frac=0.0)
    for k in range(0, 64, 8):
        assert len({g for _, g, _ in items[k : k + 8]}) == 1
    st = stream_stats(items)
    assert st["items"] == 64 and st["no_marker"] == 0.0
    assert 1.0 <= st["distinct_per_group"] <= 4.0  # four answers per prompt at most
    assert st["response_repeat"] == 0.0  # reasoning text differs per response
    assert st["answer_repeat"] > 0.3


def test_stats_on_a_hand_made_stream():
    items = [
        ("so \\boxed{18}", "18", "math"),
        ("so \\boxed{18}", "18", "math"),  # the whole response again
        ("thus \\boxed{17}", "18", "math"),
        ("cut off", "\\frac{1}{2}", "math"),  # short bare text: extracted as itself
    ]
    st = stream_stats(items, group=2)
    assert st["distinct_per_group"] == (1 + 2) / 2
    assert st["answer_repeat"] == 1 / 4 and st["response_repeat"] == 1 / 4
    assert st["integer_golds"] == 3 / 4 and st["latex_golds"] == 1 / 4
    assert st["distinct_golds"] == 2


def test_answer_line_style_ends_like_the_dapo_template():
    items = build_stream(40, golds=["34", "7"], seed=2, style="answer_line", cutoff_frac=0.0)
    for pred, _gold, _ in items:
        last = pred.rstrip().splitlines()[-1]
        assert last.startswith("Answer: ")
        assert extract_answer(pred) is not None


def test_revisit_false_gives_every_group_a_new_prompt():
    golds = [str(n) for n in range(100, 200)]
    items = build_stream(80, golds=golds, seed=3, revisit=False)
    group_golds = [items[k][1] for k in range(0, 80, 8)]
    assert len(set(group_golds)) == len(group_golds)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="style"):
        build_stream(8, golds=GOLDS, style="markdown")
    with pytest.raises(ValueError, match="source"):
        load_golds(source="nope")


def test_dapo_golds_are_integers_when_the_data_is_there():
    golds = load_golds(source="dapo17k")
    if len(golds) < 1000:
        pytest.skip("DAPO-Math-17k not in the data dir; the built-in list was used")
    assert all(g.lstrip("-").isdigit() for g in golds)
