"""`stapo calibrate`'s numbers: the counts at the configured batch size, the grid, the taxonomy and
the exact random controls against hand-computed small cases, the gradient-norm column against a real
backward on the tiny model, and the terminal tables at 80 columns.

What can fail here: the rule's quantile taken over the wrong population (all tokens, or pooled over
mini-batches instead of per mini-batch), the A > 0 condition missing from a cell, the taxonomy's
entropy split taken from the candidates instead of the A > 0 tokens, a control that is one draw or
the wrong population's expectation, the counts carried to the wrong batch size, the closed-form
gradient norm disagreeing with autograd (wrong p, wrong sum pi^2, wrong temperature), a non-paper
tau_p called the paper's rule, and a table header cut at 80 columns."""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch

from stapo.core.batch import Batch
from stapo.core.train.calibrate import (
    CalibrationSample,
    MiniBatchStats,
    analyse,
    expected_counts,
    expected_subset_sum,
    grid,
    reference_sets,
    rule_name,
    taxonomy,
    token_grad_norms,
)


def _mb(p, h, a, q2=None, responses=2):
    n = len(p)
    return MiniBatchStats(torch.tensor(p, dtype=torch.float64).log().float(), torch.tensor(h, dtype=torch.float32),
                          torch.tensor(q2 if q2 is not None else [0.5] * n, dtype=torch.float32),
                          torch.tensor(a, dtype=torch.float32), responses=responses)


# Two mini-batches. mb1: four candidates (p 0.001, A > 0) with H 0.1..0.4 (the first with sum pi^2 0.9,
# the others 0.1), one high-p A > 0 token (p 0.5, H 0.05) and one low-p A < 0 token (H 0.01).
# mb2: four candidates with H 1..4, A = 2, sum pi^2 0.5.
MB1 = _mb([0.001, 0.001, 0.001, 0.001, 0.5, 0.001], [0.1, 0.2, 0.3, 0.4, 0.05, 0.01], [1, 1, 1, 1, 1, -1],
          q2=[0.9, 0.1, 0.1, 0.1, 0.5, 0.5])
MB2 = _mb([0.001] * 4, [1.0, 2.0, 3.0, 4.0], [2, 2, 2, 2])
INFO = {"model": "hand", "dtype": "float32", "prompts_per_batch": 4, "n": 8, "mini_batches_per_batch": 2, "max_steps": 10}
SAMPLE = CalibrationSample(minibatches=[MB1, MB2], responses=4, kept=4, correct=2, info=INFO)
A = math.sqrt(1 - 2 * 0.001 + 0.9)  # mb1's silenced candidate (|A| 1, sum pi^2 0.9)
B = math.sqrt(1 - 2 * 0.001 + 0.1)  # mb1's other candidates
S = math.sqrt(1 - 2 * 0.001 + 0.5)  # mb1's A < 0 token; mb2's candidates are 2 S (|A| 2)
H = math.sqrt(1 - 2 * 0.5 + 0.5)  # mb1's high-p A > 0 token


def test_grid_applies_the_rule_per_minibatch_with_and_before_the_advantage_condition():
    (cell, none) = grid(SAMPLE, [0.002, 0.0005], [0.25])
    # q 0.25 of mb1's candidates [.1 .2 .3 .4]: position 0.75 -> 0.175 (silences H 0.1); of mb2's [1 2 3 4]:
    # 1.75 (silences H 1). Pooled over both the quantile would be 0.275, one threshold for both.
    assert cell["candidates"] == 8 and cell["silenced"] == 2 and cell["rate"] == pytest.approx(2 / 10)
    assert cell["tau_h_mean"] == pytest.approx((0.175 + 1.75) / 2)
    # before A > 0, mb1's candidates add the A < 0 token (H 0.01): [.01 .1 .2 .3 .4] -> q 0.25 = 0.1, which
    # silences only H 0.01 (strict); mb2 is unchanged
    assert cell["candidates_before_adv"] == 9 and cell["silenced_before_adv"] == 2
    assert none["candidates"] == 0 and none["silenced"] == 0 and math.isnan(none["tau_h_mean"])


def test_taxonomy_splits_entropy_at_the_positive_tokens_own_quantile():
    tax = taxonomy(SAMPLE, tau_p=0.002, q=0.25)
    cells = {(c["probability"], c["entropy"]): c for c in tax["cells"]}
    # mb1's A > 0 entropies [.05 .1 .2 .3 .4]: q 0.25 at position 1 -> 0.1, so only H 0.05 (the p 0.5
    # token) is low; the candidates' own tau_h (0.175) would have put the H 0.1 candidate in low/low too.
    # mb2's A > 0 tokens are its candidates: q 0.25 -> 1.75, H 1 is low.
    assert {k: c["count"] for k, c in cells.items()} == {("low", "low"): 1, ("low", "high"): 7,
                                                          ("high", "low"): 1, ("high", "high"): 0}
    assert tax["entropy_split_mean"] == pytest.approx((0.1 + 1.75) / 2)
    pos_mean = (A + 3 * B + H + 4 * 2 * S) / 9
    assert tax["sets"]["positive"]["mean_grad_norm"] == pytest.approx(pos_mean, rel=1e-6)
    assert cells["low", "low"]["mean_grad_norm"] == pytest.approx(2 * S, rel=1e-6)
    assert cells["low", "low"]["vs_positive_mean"] == pytest.approx(2 * S / pos_mean, rel=1e-6)
    assert cells["high", "low"]["mean_grad_norm"] == pytest.approx(H, rel=1e-6)
    assert math.isnan(cells["high", "high"]["mean_grad_norm"])
    assert tax["candidates_per_minibatch"] == [4, 4] and tax["silenced_per_minibatch"] == [1, 1]


def test_random_controls_are_the_exact_expectations_of_each_population():
    tax = taxonomy(SAMPLE, tau_p=0.002, q=0.25)
    sets = tax["sets"]
    total_sq = A**2 + 3 * B**2 + H**2 + S**2 + 4 * (2 * S) ** 2  # every valid token, the A < 0 one included
    sil = sets["silenced"]  # mb1's H 0.1 candidate (norm A) and mb2's H 1 (2 S)
    assert sil["count"] == 2 and sil["grad_norm_sum"] == pytest.approx(A + 2 * S, rel=1e-6)
    assert sil["share_sq"] == pytest.approx((A**2 + 4 * S**2) / total_sq, rel=1e-6)
    # one of mb1's 4 candidates at random: (A + 3B) / 4 on average; mb2's are all 2 S
    rc = sets["random_candidates"]
    assert rc["count"] == 2 and rc["grad_norm_sum"] == pytest.approx((A + 3 * B) / 4 + 2 * S, rel=1e-6)
    assert rc["share_sq"] == pytest.approx(((A**2 + 3 * B**2) / 4 + 4 * S**2) / total_sq, rel=1e-6)
    # one of mb1's 5 A > 0 tokens (the p 0.5 one too), one of mb2's 4
    rp = sets["random_positive"]
    assert rp["grad_norm_sum"] == pytest.approx((A + 3 * B + H) / 5 + 2 * S, rel=1e-6)
    assert rp["share_sq"] == pytest.approx(((A**2 + 3 * B**2 + H**2) / 5 + 4 * S**2) / total_sq, rel=1e-6)
    assert tax["silenced_vs_random_positive"] == pytest.approx(sil["share_sq"] / rp["share_sq"], rel=1e-9)
    # the capped contrast: every candidate's norm / |A| is sqrt(1 - 2p + sum pi^2)
    assert tax["candidate_factor"] == pytest.approx([B, A], rel=1e-6)


def test_expected_subset_sum_equals_the_mean_over_every_subset():
    values = torch.tensor([0.3, 1.7, 2.0, 5.5, 0.25])
    for k in range(6):
        subsets = list(itertools.combinations(values.tolist(), k))
        brute = sum(sum(c) for c in subsets) / len(subsets)
        assert expected_subset_sum(values, k) == pytest.approx(brute, rel=1e-12)
    assert expected_subset_sum(values, 2) == pytest.approx(2 / 5 * 9.75)
    with pytest.raises(ValueError, match="random 6-subset of 5"):
        expected_subset_sum(values, 6)


def test_expected_counts_carry_the_rate_to_the_configured_batch():
    c = expected_counts(silenced=2, tokens=10, responses=5, silenced_per_minibatch=[0, 2], prompts_per_step=4, n=8,
                        mini_batches=2, steps=10)
    # 2 tokens a response x 32 responses = 64 tokens a step; rate 0.2 -> 12.8 a step, 6.4 a mini-batch
    assert c["tokens_per_step"] == pytest.approx(64) and c["per_step"] == pytest.approx(12.8)
    assert c["per_minibatch"] == pytest.approx(6.4) and c["per_run"] == pytest.approx(128)
    assert c["tokens_per_run"] == pytest.approx(640) and c["idle_minibatches"] == 1 and c["rate_upper_95"] is None
    none = expected_counts(silenced=0, tokens=600, responses=100, silenced_per_minibatch=[0, 0, 0],
                           prompts_per_step=4, n=8, mini_batches=2, steps=10)
    assert none["per_run"] == 0 and none["rate_upper_95"] == pytest.approx(3 / 600) and none["idle_minibatches"] == 3


def test_rule_is_named_for_what_it_is():
    assert rule_name(0.002, 0.75) == "the paper's rule (tau_p 0.002, q 0.75)"
    assert rule_name(0.1, 0.75) == "S2T at tau_p 0.1, q 0.75 (the paper uses tau_p 0.002)"
    assert rule_name(0.002, 0.5) == "S2T at tau_p 0.002, q 0.5 (the paper uses q 0.75)"
    assert rule_name(0.01, 0.9) == "S2T at tau_p 0.01, q 0.9 (the paper uses tau_p 0.002 and q 0.75)"


def test_analyse_leads_the_reading_with_the_counts():
    res = analyse(SAMPLE, tau_ps=[0.01], qs=[0.5], tau_p=0.002, q=0.25)
    assert {(r["tau_p"], r["q"]) for r in res["grid"]} == {(0.002, 0.25), (0.002, 0.5), (0.01, 0.25), (0.01, 0.5)}
    (ref,) = [r for r in res["grid"] if r["configured"]]
    assert (ref["tau_p"], ref["q"]) == (0.002, 0.25)
    # 10 tokens of 4 responses: 2.5 a response x 32 = 80 a step; rate 0.2 -> 16 a step, 8 a mini-batch, 160 a run
    assert res["reading"].startswith(res["answer"])
    assert res["answer"].startswith("On hand, S2T at tau_p 0.002, q 0.25 (the paper uses q 0.75) silences 2 of 10 "
                                    "response tokens (2.0e-01). At the configured batch (4 prompts x 8 responses of "
                                    "~2 tokens, 2 mini-batch(es) a step) that is ~8 silenced tokens per mini-batch "
                                    "and ~16 per step: a 10-step run silences ~160 of the ~800 tokens")
    assert "for as many random candidates" in res["reading"] and "`stapo probe`" in res["reading"]
    one = dict(INFO, mini_batches_per_batch=1)
    empty = analyse(CalibrationSample(minibatches=[_mb([0.5], [1.0], [1], responses=1)], info=one),
                    tau_p=0.002, q=0.75)
    assert empty["answer"].startswith("On hand, the paper's rule (tau_p 0.002, q 0.75) silences nothing in 1 "
                                      "response tokens (no A > 0 token has p < tau_p). At this rate a 10-step run")
    assert "below ~3.0e+00 (3/1, the rule of three)" in empty["answer"]
    lone = analyse(CalibrationSample(minibatches=[_mb([0.001, 0.5], [0.1, 1.0], [1, 1])], info=one),
                   tau_p=0.002, q=0.75)
    assert "no mini-batch has more than one candidate" in lone["answer"]


def test_tables_fit_80_columns_with_whole_headers():
    from rich.console import Console

    from stapo.cli.calibrate import terminal_tables

    res = analyse(SAMPLE, tau_ps=[0.0005, 0.001, 0.002, 0.005, 0.01], qs=[0.5, 0.75, 0.9], tau_p=0.1, q=0.75)
    console = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    for item in terminal_tables(res):
        console.print(item)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80 and "\u2026" not in text
    for header in ("tau_p \\ q", "q 0.75", "mean norm", "x A>0", "norm^2", "E[random candidates]",
                   "E[random A > 0 tokens]", "silenced (the rule)", "all A > 0 tokens"):
        assert header in text, header
    assert "The rule: S2T at tau_p 0.1, q 0.75" in " ".join(text.split())
    assert "the paper's rule" not in text


def test_reference_sets_are_the_rule_and_its_populations():
    ref = reference_sets(MB1, tau_p=0.002, q=0.25)
    assert ref["silenced"].tolist() == [True, False, False, False, False, False]
    assert ref["candidates"].tolist() == [True, True, True, True, False, False]
    assert ref["positive"].tolist() == [True, True, True, True, True, False]


# ----------------------------------------------------------------------------- on the tiny model


def _tiny(temperature: float = 1.0):
    from stapo.core.config import load_config
    from stapo.core.trainer import build_trainer_backend
    from stapo.core.trainer.models import load_policy

    cfg = load_config(None, ["model.name_or_path=tiny-random", "trainer.device=cpu",
                             f"rollout.temperature={temperature}"])
    model, _ = load_policy(cfg.model, device="cpu")
    return cfg, build_trainer_backend(cfg, model, total_optimizer_steps=1)


def _batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (3, 9), generator=g)  # [3, 9]: 5 prompt tokens, 4 response tokens
    resp = torch.zeros(3, 9, dtype=torch.bool)
    resp[:, 5:] = True
    resp[2, 8] = False  # one shorter response
    attn = torch.ones(3, 9, dtype=torch.long)
    attn[2, 8] = 0
    adv = torch.tensor([1.5, -0.5, 2.0]).unsqueeze(1) * resp  # [3, 9]
    return Batch(ids, attn, resp, adv)


def test_gradient_norm_column_equals_a_real_backward_on_the_logits(one_thread):
    cfg, backend = _tiny(temperature=0.7)
    model = backend.model
    batch = _batch(model.config.vocab_size)
    from stapo.core.train.update import Actor

    dist = Actor(cfg, backend).distribution(batch, range(3))  # at the sampling temperature, 0.7
    m = batch.response_mask
    mb = MiniBatchStats(dist["logprobs"][m], dist["entropy"][m], dist["sum_q2"][m], batch.advantages[m])
    column = token_grad_norms(mb)  # [n]
    # independently: the loss A * log softmax(z / T)[y] of each token, differentiated by autograd w.r.t. z / T
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double()  # [3, 9, V]
    expected = []
    for r, t in m.nonzero().tolist():
        z = (logits[r, t - 1] / 0.7).clone().requires_grad_(True)
        loss = batch.advantages[r, t].double() * torch.log_softmax(z, -1)[batch.input_ids[r, t]]
        (g,) = torch.autograd.grad(loss, z)
        expected.append(float(g.norm()))
    assert column.numel() == 11
    torch.testing.assert_close(column, torch.tensor(expected, dtype=torch.float64), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("args", "line"), [
    (["--q", "1.5"], "--q must be in [0, 1], got 1.5"),
    (["--tau-p", "0"], "--tau-p must be a probability in (0, 1], got 0.0"),
    (["--limit", "0"], "--limit must be >= 1 prompt, got 0"),
])
def test_bad_options_are_one_line_before_the_model_loads(stapo_main, tmp_path, args, line):
    code, _out, err = stapo_main("calibrate", "--config", "tiny", *args, "--out", str(tmp_path / "c"))
    assert code == 2 and line in err and not (tmp_path / "c").exists()
