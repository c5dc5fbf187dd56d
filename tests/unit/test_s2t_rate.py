"""S2T's rate: the rate-targeted tau_h, the one float64 boundary comparison, the training-time
watch, the calibration grid's counts and the config's provenance tags. Hand-computed expectations."""

from __future__ import annotations

import math
import re
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
from stapo.core.algos.weights import tau_h_for_rate
from stapo.core.calibrate import CalibrationSample, calibration_grid
from stapo.core.config import ConfigError, load_config
from stapo.core.s2t_watch import RateWatch
from stapo.core.update import needs_old_pass, weighting_params

ROOT = Path(__file__).resolve().parents[2]


def _ctx(p, h, a, mask=None, **kw):
    lp = torch.tensor([p], dtype=torch.float64).log()
    ent = torch.tensor([h], dtype=torch.float64)
    adv = torch.tensor([a], dtype=torch.float64)
    m = torch.ones_like(lp, dtype=torch.bool) if mask is None else torch.tensor([mask])
    return TokenContext(lp, ent, adv, m, **kw)


# ----------------------------------------------------------------------------- rate-targeted tau_h

#            p     H    A      candidate (A > 0, p < 0.01)?
TOKENS = [(0.001, 0.5, 1.0),   # yes, H 0.5
          (0.002, 0.1, 1.0),   # yes, H 0.1
          (0.005, 0.3, 1.0),   # yes, H 0.3
          (0.5, 0.05, 1.0),    # no: p too high
          (0.001, 0.01, -1.0),  # no: A < 0
          (0.003, 0.2, 1.0),   # yes, H 0.2
          (0.9, 1.0, 0.0), (0.9, 1.0, 0.0), (0.9, 1.0, 0.0), (0.9, 1.0, 0.0)]  # 10 valid tokens


def test_tau_h_for_rate_silences_the_lowest_entropy_candidates():
    p, h, a = zip(*TOKENS, strict=True)
    ctx = _ctx(p, h, a)
    # rate 0.2 of 10 tokens -> k = 2: the two lowest-entropy candidates (H 0.1, 0.2); tau_h = the third (0.3)
    assert tau_h_for_rate(ctx, tau_p=0.01, rate=0.2) == pytest.approx(0.3)
    tw = get_token_weighting("s2t")(ctx, tau_p=0.01, target_rate=0.2)
    assert tw.info["tau_h"] == pytest.approx(0.3) and tw.info["silenced_count"] == 2
    assert (tw.weights[0] == 0).nonzero().flatten().tolist() == [1, 5]
    # k = 0: nothing; k >= candidates (rate 0.6 -> 6 > 4): every candidate, tau_h just above the largest
    assert get_token_weighting("s2t")(ctx, tau_p=0.01, target_rate=0.04).info["silenced_count"] == 0
    tw = get_token_weighting("s2t")(ctx, tau_p=0.01, target_rate=0.6)
    assert tw.info["silenced_count"] == 4 and 0.5 < tw.info["tau_h"] < 0.5 + 1e-12
    # no candidate at all: 0.0, silences nothing
    assert tau_h_for_rate(_ctx([0.5], [0.1], [1.0]), tau_p=0.01, rate=0.5) == 0.0


def test_tau_h_for_rate_is_global_across_ranks():
    """Two "ranks" holding halves of the batch: with gather / all-reduce over both, each rank gets the
    threshold of the whole batch (as the update's collectives give it)."""
    p, h, a = zip(*TOKENS, strict=True)
    whole = tau_h_for_rate(_ctx(p, h, a), tau_p=0.01, rate=0.2)
    halves = [(p[:5], h[:5], a[:5]), (p[5:], h[5:], a[5:])]
    ctxs = [_ctx(*x) for x in halves]

    def gather_for(rank):
        def gather(local):
            other = ctxs[1 - rank]
            cand = s2t_mask(other.logprobs, other.entropy, other.advantages, other.mask, tau_p=0.01, tau_h=math.inf)
            theirs = other.entropy[cand].double()
            return torch.cat([local, theirs] if rank == 0 else [theirs, local])
        return gather

    for rank in (0, 1):
        c = ctxs[rank]
        ctx = TokenContext(c.logprobs, c.entropy, c.advantages, c.mask, gather=gather_for(rank),
                           all_reduce_sum=lambda t: t * 2)  # both halves hold 5 valid tokens
        assert tau_h_for_rate(ctx, tau_p=0.01, rate=0.2) == whole
    assert tau_h_for_rate(ctxs[1], tau_p=0.01, rate=0.2) != whole  # one rank alone would differ


def test_config_takes_exactly_one_tau_h_form_and_keeps_watch_keys_out_of_the_weighting():
    cfg = load_config(None, ["algorithm.s2t.tau_h_quantile=null", "algorithm.s2t.target_rate=1e-4"])
    assert weighting_params(cfg) == {"tau_p": 0.01, "tau_h": None, "tau_h_quantile": None, "target_rate": 1e-4}
    assert not needs_old_pass(cfg)  # the rate target is taken per mini-batch: no step threshold, no old pass
    with pytest.raises(ConfigError, match="exactly one of tau_h"):
        load_config(None, ["algorithm.s2t.target_rate=1e-4"])  # the default quantile is still set


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
    tw = get_token_weighting("s2t")(ctx, tau_p=0.01, tau_h=0.5)
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


def test_watch_warns_once_per_kind_and_never_on_a_small_window():
    w = RateWatch(steps=2, min_rate=0.5, max_rate=0.1, thresholds="tau_p=1e-09, tau_h=quantile 0.05")
    assert w.add(0, 64, 2.6) == []  # one step is never judged alone
    (msg,) = w.add(0, 64, 2.7)  # 128 tokens x 0.5 = 64 predicted, none silenced
    assert "silenced no token over the last 2 steps" in msg and "predicts 64" in msg
    assert "tau_p=1e-09" in msg and "`stapo calibrate`" in msg and "2.65 nats" in msg
    assert w.add(0, 64, 2.6) == [] and w.add(0, 64, 2.6) == []  # warned once: never again
    small = RateWatch(steps=1, min_rate=0.5, max_rate=1.0, thresholds="t")
    assert small.add(0, 4, 1.0) == [] and small.add(0, 4, 1.0) == []  # 2, then 4 predicted: window grows
    assert len(small.add(0, 4, 1.0)) == 1  # 12 tokens x 0.5 = 6 >= 5
    high = RateWatch(steps=1, min_rate=0.0, max_rate=0.01, thresholds="t")
    assert high.add(1, 200, 1.0) == []  # 0.005: fine
    (msg,) = high.add(5, 200, 1.0)
    assert "2.50e-02 of the tokens" in msg and "watch_max_rate=0.01" in msg
    assert high.add(50, 200, 1.0) == []
    state = high.state_dict()
    again = RateWatch(steps=1, min_rate=0.0, max_rate=0.01, thresholds="t")
    again.load_state_dict(state)
    assert again.add(50, 200, 1.0) == []  # a resumed run does not warn twice


# ----------------------------------------------------------------------------- calibration grid


def test_calibration_grid_counts_by_hand():
    p, h, a = zip(*TOKENS, strict=True)
    lp = torch.tensor(p).log()
    sample = CalibrationSample(logprobs=[lp[:5], lp[5:]], entropy=[torch.tensor(h[:5]), torch.tensor(h[5:])],
                               advantages=[torch.tensor(a[:5]), torch.tensor(a[5:])], responses=4, kept=4)
    res = calibration_grid(sample, tau_ps=[0.01], tau_hs=[("absolute", 0.25), ("quantile", 0.5)], target=0.1,
                           configured=(0.01, "absolute", 0.25))
    rows = {r["label"]: r for r in res["grid"]}
    # absolute 0.25: p < 0.01 & H < 0.25 -> tokens 1 (H 0.1), 4 (H 0.01, A < 0), 5 (H 0.2); with A > 0: 1 and 5
    assert rows["H<0.25"]["silenced_before_adv"] == 3 and rows["H<0.25"]["silenced"] == 2
    assert rows["H<0.25"]["rate"] == pytest.approx(0.2) and rows["H<0.25"]["configured"]
    # quantile 0.5 per batch: batch 1 H (0.5, 0.1, 0.3, 0.05, 0.01) -> median 0.1: token 4 only (p 0.001, A < 0);
    # batch 2 H (0.2, 1, 1, 1, 1) -> median 1.0: token 5 (p 0.003, H 0.2, A > 0)
    assert rows["q0.5"]["silenced_before_adv"] == 2 and rows["q0.5"]["silenced"] == 1
    assert rows["q0.5"]["tau_h_mean"] == pytest.approx((0.1 + 1.0) / 2)
    assert rows["q0.5"]["nearest_target"] and not rows["H<0.25"]["nearest_target"]  # 0.1 vs 0.2 from 0.1
    assert not any(r["in_band"] for r in res["grid"]) and res["resolution"] == pytest.approx(0.1)
    assert res["stats"]["tokens"] == 10 and res["stats"]["share_positive_advantage"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- provenance tags


S2T_LINE = re.compile(r"^\s*s2t:\s*\{(?P<vals>[^}]*)\}\s*#\s*(?P<tag>.*)$")


def test_every_recipe_tags_its_s2t_values_the_same_way():
    """Each recipe that sets the S2T pair carries the one tag; none calls a threshold [paper]."""
    tags = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        text = path.read_text()
        for line in text.splitlines():
            if "tau_p" in line or "tau_h" in line:
                assert "[paper]" not in line, (path.name, line)
            m = S2T_LINE.match(line)
            if m:
                tags[path.name] = (m["vals"].strip(), m["tag"].strip())
    shipped = {"stapo.yaml", "stapo-async.yaml", "stapo-deep.yaml", "stapo-goldilocks.yaml", "stapo-maspo.yaml",
               "stapo-stack.yaml", "demo.yaml"}
    assert shipped <= set(tags)
    assert len({tags[n] for n in shipped}) == 1, {n: tags[n] for n in shipped}
    vals, tag = tags["stapo.yaml"]
    assert vals == "tau_p: 0.01, tau_h_quantile: 0.05"
    assert re.match(r"\[ours: measured rate [0-9.e-]+ on SmolLM2-135M-Instruct\]", tag), tag
    assert "[paper-reading]" in tag
    from stapo.core.config import S2TOptions

    for name in ("tau_p", "tau_h_quantile"):
        desc = S2TOptions.model_fields[name].description
        assert "[ours: measured rate" in desc and "[paper-reading]" in desc and "[paper]" not in desc


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


def test_calibration_grid_judges_before_the_advantage_when_no_token_has_a_positive_one():
    """Every group all wrong: the update silences nothing, so the marks fall on the rates before A > 0."""
    p, h, _a = zip(*TOKENS, strict=True)
    sample = CalibrationSample(logprobs=[torch.tensor(p).log()], entropy=[torch.tensor(h)],
                               advantages=[torch.zeros(10)], responses=2, kept=2)
    res = calibration_grid(sample, tau_ps=[0.01], tau_hs=[("absolute", 0.25), ("absolute", 0.15)], target=0.1)
    rows = {r["label"]: r for r in res["grid"]}
    assert res["judged_on"] == "rate_before_adv" and all(r["rate"] == 0 for r in res["grid"])
    assert rows["H<0.15"]["rate_before_adv"] == pytest.approx(0.2)  # tokens 1 (H 0.1) and 4 (H 0.01)
    assert rows["H<0.15"]["nearest_target"] and not rows["H<0.25"]["nearest_target"]  # 0.2 vs 0.3
