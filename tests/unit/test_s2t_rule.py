"""S2T as the paper defines it: the candidates' quantile, the ablations over the same candidates, ties,
two ranks against one process, the one float64 boundary comparison, the training-time rate watch and
the recipes' provenance tags. Hand-computed expectations."""

from __future__ import annotations

import math
import re
import threading
from pathlib import Path

import pytest
import torch

from stapo.core.algos import (
    TokenContext,
    below_thresholds,
    get_token_weighting,
    phase_cells,
    s2t_mask,
    token_counts,
)
from stapo.core.config import ConfigError, load_config
from stapo.core.train.s2t_watch import TAU_P_STEPS, RateWatch, candidate_counts, cannot_act
from stapo.core.train.update import needs_old_pass, weighting_params

ROOT = Path(__file__).resolve().parents[2]
S2T = get_token_weighting("s2t")


def _ctx(p, h, a, mask=None, **kw):
    lp = torch.tensor([p], dtype=torch.float64).log()
    ent = torch.tensor([h], dtype=torch.float64)
    adv = torch.tensor([a], dtype=torch.float64)
    m = torch.ones_like(lp, dtype=torch.bool) if mask is None else torch.tensor([mask])
    return TokenContext(lp, ent, adv, m, **kw)


# ----------------------------------------------------------------------------- the rule and its ablations

#            p     H    A      candidate (A > 0, p < 0.01)?
TOKENS = [(0.001, 0.5, 1.0),   # yes, H 0.5
          (0.002, 0.1, 1.0),   # yes, H 0.1
          (0.005, 0.3, 1.0),   # yes, H 0.3
          (0.5, 0.05, 1.0),    # no: p too high
          (0.001, 0.01, -1.0),  # no: A < 0
          (0.003, 0.2, 1.0),   # yes, H 0.2
          (0.9, 1.0, 0.0), (0.9, 1.0, 0.0), (0.9, 1.0, 0.0), (0.9, 1.0, 0.0)]  # 10 valid tokens
CANDIDATES = {0, 1, 2, 5}


def _silenced(tw) -> set[int]:
    return {int(i) for i in (tw.weights[0] == 0).nonzero().flatten()}


def test_lowest_entropy_silences_the_candidates_below_their_q_quantile():
    # candidate H sorted .1 .2 .3 .5; q .75 -> position 2.25 -> .3 + .25 * .2 = .35: tokens 1, 5, 2
    tw = S2T(_ctx(*zip(*TOKENS, strict=True)), tau_p=0.01, q=0.75)
    assert tw.info["tau_h"] == pytest.approx(0.35) and tw.info["candidates"] == 4
    assert _silenced(tw) == {1, 2, 5}
    assert tw.denom_mask[0].sum() == 7  # silenced tokens leave the denominator
    # q 0.5 -> .25: tokens 1, 5; the A < 0 token 4 (H .01) and the p = .5 token 3 (H .05) never
    assert _silenced(S2T(_ctx(*zip(*TOKENS, strict=True)), tau_p=0.01, q=0.5)) == {1, 5}


def test_the_ablations_pick_among_the_same_candidates():
    ctx = _ctx(*zip(*TOKENS, strict=True), seed=7)
    # highest_entropy: H above the (1 - q) quantile: .25 -> position .75 -> .1 + .75 * .1 = .175: 0, 2, 5
    assert _silenced(S2T(ctx, tau_p=0.01, q=0.75, silence="highest_entropy")) == {0, 2, 5}
    assert _silenced(S2T(ctx, tau_p=0.01, q=0.75, silence="all")) == CANDIDATES
    draws = {frozenset(_silenced(S2T(_ctx(*zip(*TOKENS, strict=True), seed=s), tau_p=0.01, q=0.75,
                                     silence="random"))) for s in range(12)}
    assert all(len(d) == 3 and d <= CANDIDATES for d in draws)  # as many as the rule silences, candidates only
    assert len(draws) > 1  # seeds differ
    again = S2T(_ctx(*zip(*TOKENS, strict=True), seed=7), tau_p=0.01, q=0.75, silence="random")
    assert _silenced(again) == _silenced(S2T(ctx, tau_p=0.01, q=0.75, silence="random"))  # reproducible
    with pytest.raises(ValueError, match="needs TokenContext.seed"):
        S2T(_ctx(*zip(*TOKENS, strict=True)), tau_p=0.01, q=0.75, silence="random")


def test_complement_silences_what_the_rule_keeps_on_a_2x6_batch():
    """[2, 6] by hand, tau_p 0.01, q 0.75. Row 0 is a correct response (A = 1), row 1 a wrong one (A = -1).
    Row 0's candidates (p < 0.01): columns 0, 1, 2, 4, 5 with H .4, .1, .4, .2, .3 (column 3 has p .5);
    sorted .1 .2 .3 .4 .4, position .75 x 4 = 3 -> tau_h^(q) = .4 exactly. The rule silences H < .4:
    columns 1, 4, 5; the complement silences H >= .4: columns 0 and 2 (the tie at .4 is the complement's).
    Row 1 has p < 0.01 everywhere but A < 0: no candidate, never silenced."""
    lp = torch.tensor([[0.001, 0.002, 0.005, 0.5, 0.003, 0.004],
                       [0.001, 0.001, 0.001, 0.001, 0.001, 0.001]], dtype=torch.float64).log()  # [2, 6]
    ent = torch.tensor([[0.4, 0.1, 0.4, 0.05, 0.2, 0.3], [0.01] * 6], dtype=torch.float64)  # [2, 6]
    ctx = TokenContext(lp, ent, torch.tensor([1.0, -1.0]), torch.ones(2, 6, dtype=torch.bool))
    rule = S2T(ctx, tau_p=0.01, q=0.75)
    comp = S2T(ctx, tau_p=0.01, q=0.75, silence="complement")
    assert rule.info["tau_h"] == pytest.approx(0.4) == comp.info["tau_h"]
    assert rule.weights.tolist() == [[1, 0, 1, 1, 0, 0], [1] * 6]
    assert comp.weights.tolist() == [[0, 1, 0, 1, 1, 1], [1] * 6]
    assert comp.denom_mask.sum() == 10 and comp.info["silenced_count"] == 2  # out of the denominator too
    cand = (rule.weights == 0) | (comp.weights == 0)  # the two partition row 0's five candidates
    assert cand.sum() == 5 and not ((rule.weights == 0) & (comp.weights == 0)).any()


@pytest.mark.parametrize(("n", "silenced"), [(1, 0), (2, 1), (3, 2), (4, 3), (5, 3), (8, 6)])
def test_few_distinct_candidates_silence_the_values_below_the_quantile_position(n, silenced):
    """q 0.75 over n distinct entropies: tau_h^(q) sits at position 0.75 (n - 1); the strict H < tau_h
    silences the values below it: 1, 2, 3, 3 for n = 2..5 (at n = 5 the position 3 lands on a value,
    which stays), 6 of 8 (position 5.25). docs/algorithms.md states these counts."""
    h = [0.1 * (i + 1) for i in range(n)]
    tw = S2T(_ctx([0.001] * n, h, [1.0] * n), tau_p=0.01, q=0.75)
    assert int((tw.weights == 0).sum()) == silenced


def test_ties_and_no_candidate():
    # every candidate at H .3: tau_h^(q) = .3 and the strict H < tau_h silences none (Algorithm 1)
    tw = S2T(_ctx([0.001] * 4, [0.3] * 4, [1.0] * 4), tau_p=0.01, q=0.75)
    assert tw.info["tau_h"] == pytest.approx(0.3) and _silenced(tw) == set()
    # two of four tied at the bottom: quantile(.1, .1, .5, .5; .25) = .1 -> none; q .75 -> .5 -> both .1
    tw = S2T(_ctx([0.001] * 4, [0.1, 0.1, 0.5, 0.5], [1.0] * 4), tau_p=0.01, q=0.75)
    assert _silenced(tw) == {0, 1}
    tw = S2T(_ctx([0.5] * 4, [0.1] * 4, [1.0] * 4), tau_p=0.01, q=0.75)
    assert math.isnan(tw.info["tau_h"]) and tw.info["candidates"] == 0 and _silenced(tw) == set()


class TwoRanks:
    """Two data-parallel ranks as threads: all_gather (concatenate in rank order) and all-reduce (sum)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.slots: list[torch.Tensor | None] = [None, None]

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def ctx(self, rank: int, p, h, a, **kw) -> TokenContext:
        return _ctx(p, h, a, gather=lambda x: torch.cat(self._exchange(rank, x)),
                    all_reduce_sum=lambda x: sum(self._exchange(rank, x)), rank=rank, **kw)


@pytest.mark.parametrize("silence", ["lowest_entropy", "highest_entropy", "all", "random"])
def test_two_ranks_silence_what_one_process_does(silence):
    cols = list(zip(*TOKENS, strict=True))
    halves = [[c[:5] for c in cols], [c[5:] for c in cols]]
    one = S2T(_ctx(*cols, seed=3), tau_p=0.01, q=0.75, silence=silence)
    ranks, out = TwoRanks(), [None, None]

    def run(r: int) -> None:
        out[r] = S2T(ranks.ctx(r, *halves[r], seed=3), tau_p=0.01, q=0.75, silence=silence)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    two = torch.cat([out[0].weights, out[1].weights], dim=1)
    assert out[0].info["tau_h"] == pytest.approx(one.info["tau_h"]) == out[1].info["tau_h"]
    if silence == "random":  # each rank draws its own stream: the same count, over all ranks' candidates
        assert int((two == 0).sum()) == int((one.weights == 0).sum()) == 3
        assert {int(i) for i in (two[0] == 0).nonzero().flatten()} <= CANDIDATES
    else:
        assert torch.equal(two, one.weights)


def test_config_has_the_papers_options_and_refuses_the_old_ones():
    cfg = load_config(None)
    assert weighting_params(cfg) == {"tau_p": 0.002, "q": 0.75, "silence": "lowest_entropy"}
    assert not needs_old_pass(cfg)  # tau_h^(q) is each mini-batch's: no step statistics needed
    for key in ("tau_h_quantile=0.05", "tau_h=0.4", "target_rate=1e-4", "tau_h_scope=step"):
        with pytest.raises(ConfigError, match=f"algorithm.s2t.{key.split('=')[0]} is not an option"):
            load_config(None, [f"algorithm.s2t.{key}"])
    with pytest.raises(ConfigError, match="silence"):
        load_config(None, ["algorithm.s2t.silence=lowest"])


# ----------------------------------------------------------------------------- the boundary


def _boundary_logprob() -> torch.Tensor:
    """A float32 log-prob whose float32 exp is NOT below 0.01 while its float64 exp is."""
    x = torch.tensor(math.log(0.01), dtype=torch.float32)
    for _ in range(200):
        if not bool(x.exp() < 0.01) and bool(x.double().exp() < 0.01):
            return x
        x = torch.nextafter(x, torch.tensor(0.0))
    pytest.fail("no float32 log-prob on the boundary found near log(0.01)")


def test_mask_phase_cells_counts_and_dump_agree_on_the_boundary():
    lp = _boundary_logprob().reshape(1, 1)  # float32, as the update's log-probs are
    ent, adv, mask = torch.tensor([[0.1]]), torch.tensor([[1.0]]), torch.tensor([[True]])
    ctx = TokenContext(lp, ent, adv, mask)
    tw = get_token_weighting("s2t")(ctx, tau_p=0.01, silence="all")  # the p condition alone decides
    silenced = bool(s2t_mask(lp, ent, adv, mask, tau_p=0.01, tau_h=0.5)[0, 0])
    assert silenced and tw.weights[0, 0] == 0  # float64: p = 0.0099999... < 0.01
    assert int(phase_cells(ctx, tau_p=0.01, tau_h=0.5)[0, 0]) == 0  # lowp_lowh_pos: the silenced cell
    assert token_counts(ctx, tw, tau_p=0.01, tau_h=0.5)["phase/lowp_lowh_pos"] == 1.0
    # the dump's p (float64 exp of the same float32 log-prob) is below tau_p, and inspect prints it so
    from stapo.evals.inspect import fmt_p

    p_dump = float(lp.double().exp())
    assert p_dump < 0.01 and float(fmt_p(p_dump, 0.01)) < 0.01 and f"{p_dump:.4f}" == "0.0100"
    assert fmt_p(0.010098, 0.01) == "0.0101" and fmt_p(0.0099996, 0.01) == "0.0099996"
    lowp, lowh = below_thresholds(lp, ent, tau_p=0.01, tau_h=0.1)
    assert bool(lowp) and not bool(lowh)  # strict: H == tau_h is not below


# ----------------------------------------------------------------------------- the watch


def test_watch_warns_on_a_silent_window_and_notes_a_rate_far_above_the_papers():
    w = RateWatch(steps=2, thresholds="tau_p=0.002, q=0.75")
    assert w.add(0, 30_000, 0, 2.6) == []  # one step is never judged alone
    (msg,) = w.add(0, 30_000, 0, float("nan"))
    assert msg.startswith("warning: S2T silenced no token over the last 2 steps (60,000 response tokens;")
    assert "no token was a candidate" in msg and "tau_p=0.002, q=0.75" in msg and "2.6 nats" in msg
    assert w.add(0, 30_000, 5, 1.0) == [] and w.add(0, 30_000, 5, 1.0) == []  # warned once: never again
    ties = RateWatch(steps=1, thresholds="t")
    (msg,) = ties.add(0, 200, 3, 1.0)
    assert "3 candidates, none below tau_h^(q)" in msg
    high = RateWatch(steps=1, thresholds="t")
    assert high.add(5, 100_000, 9, 1.0) == []  # 5e-5: near the paper's
    (msg,) = high.add(400, 100_000, 500, 1.0)  # whole run 405 / 200,000 = 2.0e-3 > 10 x 1e-4
    assert msg.startswith("note: S2T silenced 2.02e-03 of the response tokens, far above the paper's ~1e-4")
    assert high.add(400, 100_000, 500, 1.0) == []
    summary = high.summary()
    assert summary["s2t_silenced"] == 805 and summary["s2t_tokens"] == 300_000
    assert summary["s2t_silenced_rate"] == pytest.approx(805 / 300_000) and "far above" in summary["s2t_note"]
    again = RateWatch(steps=1, thresholds="t")
    again.load_state_dict(high.state_dict())
    assert again.add(400, 100_000, 500, 1.0) == [] and again.summary()["s2t_silenced"] == 1205  # resumed


def test_a_run_shorter_than_a_window_that_silenced_nothing_gets_the_note():
    short = RateWatch(steps=20, thresholds="tau_p=0.002, q=0.75")
    for _ in range(3):
        assert short.add(0, 64, 0, float("nan")) == []  # 3 steps: no window closes
    assert short.summary()["s2t_note"] == (
        "S2T silenced no token in this run's 3 steps (192 response tokens; tau_p=0.002, q=0.75): no token was a "
        "candidate (A > 0 and p < tau_p), so the run trained like its baseline.")
    ties = RateWatch(steps=20, thresholds="t")
    ties.add(0, 64, 4, 1.0)
    assert "4 candidates, none silenced" in ties.summary()["s2t_note"]
    fired = RateWatch(steps=20, thresholds="t")
    fired.add(0, 1_000_000, 4, 1.0)
    fired.add(1, 1_000_000, 4, 1.0)  # one token in 2e6: near the paper's rate, no note
    assert fired.summary()["s2t_note"] is None


def test_candidate_counts_and_the_warning_when_s2t_cannot_act():
    """Two correct responses (A > 0) and one wrong, 3 tokens each, the last row's last token padding;
    p by hand: the correct tokens' p are 0.3, 0.07, 0.015 | 0.25, 0.06, 0.6 (none on a boundary)."""
    p = torch.tensor([[0.3, 0.07, 0.015], [0.25, 0.06, 0.6], [0.001, 0.001, 0.001]])
    mask = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    adv = torch.tensor([[1.0] * 3, [0.5] * 3, [-1.0] * 3])
    counts = candidate_counts(p.log(), adv, mask, tau_p=0.002)
    # correct tokens 6; at 0.002: 0; then TAU_P_STEPS 0.005 0.01 0.02 0.05 0.1 0.2 0.5 -> 0 0 1 1 3 3 5
    assert TAU_P_STEPS == (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
    assert counts == [6, 0, 0, 0, 1, 1, 3, 3, 5]
    msg = cannot_act(counts, 1, "tau_p=0.002, q=0.75")
    assert msg == (
        "warning: S2T cannot act at this scale: at step 1 no token was a candidate (A > 0 and p < tau_p) among the 6 "
        "tokens of correct responses (tau_p=0.002, q=0.75), so nothing is silenced and the run trains like its "
        "baseline; --set algorithm.s2t.tau_p=0.02 makes 17% of them candidates on this model (`stapo calibrate` "
        "measures the rule on your model and prompts).")
    assert cannot_act(candidate_counts(p.log(), adv, mask, tau_p=0.1), 1, "t") is None  # 3 candidates: it acts
    assert cannot_act(candidate_counts(p.log(), -adv.abs(), mask, tau_p=0.002), 1, "t") is None  # nothing correct
    high = torch.full((1, 200), 0.9)  # 200 correct tokens, all p 0.9: no step of the grid reaches them
    assert "even tau_p 0.5 leaves too few of them" in cannot_act(
        candidate_counts(high.log(), torch.ones(1, 200), torch.ones(1, 200, dtype=torch.bool), tau_p=0.002), 2, "t")


def test_the_start_up_line_names_the_method():
    from stapo.configs import preset_path
    from stapo.core.train.run import describe_method

    def line(name: str, *sets: str) -> str:
        return describe_method(load_config(preset_path(name), list(sets)))

    assert line("stapo") == "method: stapo (token weighting s2t, tau_p 0.002, q 0.75)"
    assert line("stapo-random") == "method: stapo-random (token weighting s2t, tau_p 0.002, q 0.75, silence random)"
    assert line("tiny") == "method: stapo (token weighting s2t, tau_p 0.1, q 0.75)"
    assert line("grpo") == "method: grpo (token weighting none)"
    assert line("20-entropy") == "method: 20-entropy (token weighting top_entropy, rho 0.2, denominator kept)"


# ----------------------------------------------------------------------------- provenance tags


S2T_LINE = re.compile(r"^\s*s2t:\s*\{(?P<vals>[^}]*)\}\s*#\s*(?P<tag>.*)$")


def test_the_recipes_use_the_papers_values_tagged_paper_v1():
    """stapo.yaml and the demo set the paper's pair with the [paper v1] tag; no recipe keeps the
    earlier all-token quantile keys."""
    tags = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        text = path.read_text()
        assert "tau_h_quantile" not in text and "target_rate" not in text, path.name
        for line in text.splitlines():
            m = S2T_LINE.match(line)
            if m:
                tags[path.name] = (m["vals"].strip(), m["tag"].strip())
    for name in ("stapo.yaml", "demo.yaml"):
        vals, tag = tags[name]
        assert vals == "tau_p: 0.002, q: 0.75" and tag.startswith("[paper v1]"), (name, tags[name])
    from stapo.core.config import S2TOptions

    for name in ("tau_p", "q"):
        assert "[paper v1" in S2TOptions.model_fields[name].description


# ----------------------------------------------------------------------------- compare


def _run(tmp_path, name, rows, weighting="s2t", epochs=1):
    import json

    import yaml

    from stapo.evals.compare import load_run

    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"algorithm": {"name": name, "token_weighting": weighting,
                                                                 "ppo_epochs": epochs}}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, **r}) + "\n" for i, r in enumerate(rows)))
    return load_run(d)


def test_compare_rate_and_notes(tmp_path):
    from stapo.evals.compare import identical_metrics, s2t_notes, silenced_rate

    base = {"reward/mean": 0.5, "actor/loss": 0.1, "tokens/valid": 100.0}
    a = _run(tmp_path, "a", [{**base, "stapo/silenced_count": 0.0, "time/step_s": 1.0, "phase/lowp_lowh_pos": 0.0}] * 3)
    b = _run(tmp_path, "b", [{**base, "stapo/silenced_count": 0.0, "time/step_s": 9.0, "phase/lowp_lowh_pos": 0.2}] * 3,
             weighting="none")
    c = _run(tmp_path, "c", [{**base, "stapo/silenced_count": 3.0}, {**base, "stapo/silenced_count": 1.0}], epochs=2)
    assert silenced_rate(a) == 0 and silenced_rate(c) == pytest.approx(4 / (200 * 2))  # (token, epoch) pairs
    assert identical_metrics(a, b)  # timings and threshold-drawn diagnostics aside
    assert not identical_metrics(a, c)
    d = _run(tmp_path, "d", [{**base, "stapo/silenced_count": 0.0, "actor/loss": 0.1 + 1e-9}] * 3)
    assert identical_metrics(a, d)  # float rounding (summation order) is no difference
    e = _run(tmp_path, "e", [{**base, "stapo/silenced_count": 0.0, "actor/loss": 0.1002}] * 3)
    assert not identical_metrics(a, e)  # a difference in the 4th significant digit is
    notes = s2t_notes([a, b, c])
    assert notes[0].startswith("S2T never fired in a: 0 tokens silenced over 3 steps (300 response tokens)")
    assert notes[1].startswith("a and b logged identical metrics") and len(notes) == 2  # b is no S2T run
