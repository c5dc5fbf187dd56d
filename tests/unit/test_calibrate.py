"""`stapo calibrate`'s numbers: the grid and the taxonomy against hand-computed small cases, the
gradient-norm column against a real backward on the tiny model, and the first-order entropy step
against a real SGD step (finite difference).

What can fail here: the rule's quantile taken over the wrong population (all tokens, or pooled over
mini-batches instead of per mini-batch), the A > 0 condition missing from a cell, a taxonomy token in
the wrong quadrant, the closed-form gradient norm disagreeing with autograd (wrong p, wrong sum pi^2,
wrong temperature), the random set not the same size as the silenced one, and the entropy step's sign
or scale."""

from __future__ import annotations

import math

import pytest
import torch

from stapo.core.batch import Batch
from stapo.core.train.calibrate import (
    CalibrationSample,
    MiniBatchStats,
    analyse,
    entropy_rates,
    grid,
    reference_sets,
    taxonomy,
    token_grad_norms,
)
from stapo.core.train.micro import MicroSpec


def _mb(p, h, a, q2=None, seed=7):
    n = len(p)
    return MiniBatchStats(torch.tensor(p, dtype=torch.float64).log().float(), torch.tensor(h, dtype=torch.float32),
                          torch.tensor(q2 if q2 is not None else [0.5] * n, dtype=torch.float32),
                          torch.tensor(a, dtype=torch.float32), seed=seed)


# Two mini-batches. mb1: four candidates (p 0.001, A > 0) with H 0.1..0.4, one high-p A > 0 token
# (p 0.5, H 0.05) and one low-p A < 0 token (H 0.01). mb2: four candidates with H 1..4, A = 2.
MB1 = _mb([0.001, 0.001, 0.001, 0.001, 0.5, 0.001], [0.1, 0.2, 0.3, 0.4, 0.05, 0.01], [1, 1, 1, 1, 1, -1])
MB2 = _mb([0.001] * 4, [1.0, 2.0, 3.0, 4.0], [2, 2, 2, 2], seed=8)
SAMPLE = CalibrationSample(minibatches=[MB1, MB2], responses=10, kept=10, correct=5, info={"model": "hand"})


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


def test_taxonomy_cells_counts_gradient_norms_and_shares():
    tax = taxonomy(SAMPLE, tau_p=0.002, q=0.25)
    cells = {(c["probability"], c["entropy"]): c for c in tax["cells"]}
    s = math.sqrt(1 - 2 * 0.001 + 0.5)  # |A| = 1 norm of a p 0.001 token with sum pi^2 0.5
    assert {k: c["count"] for k, c in cells.items()} == {("low", "low"): 2, ("low", "high"): 6,
                                                          ("high", "low"): 1, ("high", "high"): 0}
    assert cells["low", "low"]["mean_grad_norm"] == pytest.approx((s + 2 * s) / 2, rel=1e-6)
    assert cells["low", "high"]["mean_grad_norm"] == pytest.approx((3 * s + 3 * 2 * s) / 6, rel=1e-6)
    assert cells["high", "low"]["mean_grad_norm"] == pytest.approx(math.sqrt(1 - 1 + 0.5), rel=1e-6)
    assert math.isnan(cells["high", "high"]["mean_grad_norm"])
    total = 5 * s + math.sqrt(0.5) + 8 * s  # every valid token, the A < 0 one included
    sil = tax["sets"]["silenced"]
    assert sil["count"] == 2 and sil["share"] == pytest.approx(3 * s / total, rel=1e-6)
    assert sil["share_sq"] == pytest.approx(5 * s * s / (5 * s * s + 0.5 + 16 * s * s), rel=1e-6)
    assert tax["sets"]["random"]["count"] == 2  # the same size, drawn among the same candidates
    assert tax["candidates_per_minibatch"] == [4, 4]


def test_random_set_is_seeded_and_among_the_candidates():
    a = reference_sets(MB2, tau_p=0.002, q=0.5)
    b = reference_sets(MB2, tau_p=0.002, q=0.5)
    assert torch.equal(a["random"], b["random"]) and int(a["random"].sum()) == int(a["silenced"].sum()) == 2
    assert not (a["random"] & ~a["candidates"]).any()
    assert a["silenced"].tolist() == [True, True, False, False]


def test_analyse_marks_the_rule_and_reads_it():
    res = analyse(SAMPLE, tau_ps=[0.01], qs=[0.5], tau_p=0.002, q=0.25)
    assert {(r["tau_p"], r["q"]) for r in res["grid"]} == {(0.002, 0.25), (0.002, 0.5), (0.01, 0.25), (0.01, 0.5)}
    (ref,) = [r for r in res["grid"] if r["configured"]]
    assert (ref["tau_p"], ref["q"]) == (0.002, 0.25)
    assert "silences 2 of 8 candidates: 2.00e-01 of the response tokens" in res["reading"]
    assert "times a random same-size set" in res["reading"]
    empty = analyse(CalibrationSample(minibatches=[_mb([0.5], [1.0], [1])], info={"model": "hand"}), tau_p=0.002, q=0.75)
    assert "Nothing is silenced here: no A > 0 token has p < tau_p." in empty["reading"]
    lone = analyse(CalibrationSample(minibatches=[_mb([0.001, 0.5], [0.1, 1.0], [1, 1])], info={"model": "hand"}),
                   tau_p=0.002, q=0.75)
    assert "no mini-batch has more than one candidate" in lone["reading"]


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
    mb = MiniBatchStats(dist["logprobs"][m], dist["entropy"][m], dist["sum_q2"][m], batch.advantages[m], seed=0)
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


def test_entropy_step_is_the_first_order_change_of_a_real_sgd_step(one_thread):
    cfg, backend = _tiny()
    model = backend.model.double()
    batch = _batch(model.config.vocab_size)
    rows = torch.arange(3)
    m = batch.response_mask
    subset = m.clone()
    subset[0] = False  # the objective restricted to rows 1 and 2's tokens
    rates = entropy_rates(model, batch, rows, {"sub": subset}, temperature=1.0, chunk_size=64,
                          spec=MicroSpec(2))

    params = [p for p in model.parameters() if p.requires_grad]

    def stats():
        logp = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1], -1)
        lp = logp.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [3, 8] predicts ids[:, 1:]
        ent = -(logp.exp() * logp).sum(-1)  # [3, 8]
        return lp, ent

    n = int(m.sum())
    mm = m[:, 1:].double()
    lp, ent = stats()
    loss = -(batch.advantages[:, 1:].double() * lp * subset[:, 1:].double()).sum() / n
    grads = torch.autograd.grad(loss, params)
    h0 = float((ent.detach() * mm).sum() / n)
    eta = 1e-3
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            p -= eta * g
        _, ent1 = stats()
    h1 = float((ent1 * mm).sum() / n)
    assert rates["sub"] != 0
    assert (h1 - h0) / eta == pytest.approx(rates["sub"], rel=2e-2)
    # linear in the set: the rows' parts add up to the whole step
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            p += eta * g
    row0 = m & ~subset
    parts = entropy_rates(model, batch, rows, {"sub": subset, "row0": row0}, temperature=1.0, chunk_size=64,
                          spec=MicroSpec(3))
    assert parts["sub"] + parts["row0"] == pytest.approx(parts["all"], rel=1e-6)


@pytest.mark.parametrize(("args", "line"), [
    (["--q", "1.5"], "--q must be in [0, 1], got 1.5"),
    (["--tau-p", "0"], "--tau-p must be a probability in (0, 1], got 0.0"),
    (["--limit", "0"], "--limit must be >= 1 prompt, got 0"),
])
def test_bad_options_are_one_line_before_the_model_loads(stapo_main, tmp_path, args, line):
    code, _out, err = stapo_main("calibrate", "--config", "tiny", *args, "--out", str(tmp_path / "c"))
    assert code == 2 and line in err and not (tmp_path / "c").exists()
