"""S2T thresholds, populations and normalizers on batches with a real spread of entropies and probabilities.

A tiny random model's token entropies are nearly all equal (about ln(vocab)), so a threshold taken
over the wrong population, or re-taken per micro-batch, moves by float noise and silences the same
tokens: such bugs pass a unit test on a tiny model and fail only 1-minute 2-rank end-to-end tests.
Here every batch spans near-0 to ln(V) nats and probabilities from 1e-4 to 0.99:

* ``spread`` - hand-set logits ``[s, 0, 0, 0]`` per token (s from 0 to 9), sampled token the top
  one or a bottom one; expectations are recomputed independently in plain Python (``math``).
* ``test_update_*`` - the real update on a tiny model whose LM head is scaled 8x (peaked and flat
  next-token distributions side by side), checked against itself under invariances it must keep:
  micro-batch size does not change it, and a mirrored second rank halves each rank's share.

Every test states which bug it catches; each runs in well under a second or two.
"""

from __future__ import annotations

import copy
import importlib
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hook_driver import run_hooks

from stapo.core.algos import (
    AGGREGATIONS,
    TokenContext,
    get_aggregation,
    get_token_weighting,
    s2t_mask,
    s2t_tau_h,
)
from stapo.core.config import config_from_dict

B, T, V = 4, 6, 4
LENGTHS = [6, 4, 5, 3]  # valid response tokens per row; the rest is padding
ADV = [1.0, 0.5, -0.7, 0.8]
TAU_P = 0.05
PAD_ENTROPY = -5.0  # far outside the valid range: a threshold that counts padding moves visibly


def public(name: str):
    """A public name of the update path: the update's module or the step's data shapes."""
    for mod in ("stapo.core.train.update", "stapo.core.batch"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, name):
            return getattr(m, name)
    raise AssertionError(f"no public {name} in stapo.core.train.update or stapo.core.batch")


@dataclass
class Spread:
    logprobs: torch.Tensor  # [B, T] log-prob of the sampled token
    entropy: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] bool
    p: list[list[float]]  # plain-Python twins, for independent expectations
    h: list[list[float]]

    def rows(self, idx: list[int]) -> Spread:
        return Spread(self.logprobs[idx], self.entropy[idx], self.advantages[idx], self.mask[idx],
                      [self.p[i] for i in idx], [self.h[i] for i in idx])

    def ctx(self, **kw) -> TokenContext:
        return TokenContext(self.logprobs, self.entropy, self.advantages, self.mask, **kw)

    def valid_h(self) -> list[float]:
        return [self.h[b][t] for b in range(len(self.h)) for t in range(T) if self.mask[b, t]]

    def cand_h(self) -> list[float]:
        """The S2T candidates' entropies (valid, A > 0, p < tau_p): the quantile's population."""
        return [self.h[b][t] for b in range(len(self.h)) for t in range(T)
                if self.mask[b, t] and float(self.advantages[b]) > 0 and self.p[b][t] < TAU_P]


# Hand-set logit scales s: token (b, t) has logits s * [1, 0, 0, 0] (H falls from ln 4 at s = 0 to
# 0.004 at s = 9; the bottom token's p from 0.25 to 1e-4) and sampled the top token at even t, a
# bottom one at odd t. Rows 0-1 are mostly peaked, rows 2-3 mostly flat, so a rank (or micro-batch)
# holding rows 0-1 has a far lower entropy quantile than the whole batch. Tokens failing exactly one
# S2T condition: (0, 1) only H (s = 3.2: p 0.036, H 0.46), (0, 0) only p, (2, 1) only A.
SCALES = [
    [8.0, 3.2, 6.0, 5.0, 0.5, 9.0],
    [7.0, 4.0, 1.0, 3.6, 0.0, 0.0],
    [0.0, 8.0, 1.5, 2.0, 0.5, 0.0],
    [0.0, 2.5, 1.0, 0.0, 0.0, 0.0],
]


def build_spread() -> Spread:
    """The batch of SCALES: log-probs and entropies from torch, their plain-Python twins from math."""
    scales = torch.tensor(SCALES, dtype=torch.float64)  # [B, T]
    logits = torch.zeros(B, T, V, dtype=torch.float64)
    logits[..., 0] = scales
    sampled = torch.tensor([[0 if t % 2 == 0 else V - 1 for t in range(T)] for _ in range(B)])
    logp_all = torch.log_softmax(logits, -1)
    logprobs = logp_all.gather(-1, sampled[..., None])[..., 0].float()
    entropy = -(logp_all.exp() * logp_all).sum(-1).float()
    mask = torch.tensor([[t < n for t in range(T)] for n in LENGTHS])
    entropy = torch.where(mask, entropy, torch.full_like(entropy, PAD_ENTROPY))
    p, h = [], []
    for b in range(B):
        p.append([]), h.append([])
        for t in range(T):
            s = float(scales[b, t])
            z = math.exp(s) + (V - 1)
            probs = [math.exp(s) / z] + [1 / z] * (V - 1)
            p[b].append(probs[0] if t % 2 == 0 else probs[-1])
            h[b].append(-sum(q * math.log(q) for q in probs) if t < LENGTHS[b] else PAD_ENTROPY)
    return Spread(logprobs, entropy, torch.tensor(ADV), mask, p, h)


@pytest.fixture
def spread() -> Spread:
    return build_spread()


def np_quantile(values: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(values, dtype=np.float64), q))  # linear interpolation


def expected_silenced(sp: Spread, tau_h: float) -> list[tuple[int, int]]:
    return [(b, t) for b in range(len(sp.h)) for t in range(T)
            if sp.mask[b, t] and float(sp.advantages[b]) > 0 and sp.p[b][t] < TAU_P and sp.h[b][t] < tau_h]


# ----------------------------------------------------------------------------- the fixture itself


def test_fixture_spans_entropies_and_probabilities(spread):
    """The point of the fixture: without a spread, the tests below could not fail."""
    h = spread.valid_h()
    assert min(h) < 0.01 and max(h) > math.log(V) - 0.01
    p = [spread.p[b][t] for b in range(B) for t in range(T) if spread.mask[b, t]]
    assert min(p) < 1e-3 and max(p) > 0.99
    torch.testing.assert_close(spread.entropy[spread.mask], torch.tensor(h), atol=1e-5, rtol=0)
    torch.testing.assert_close(spread.logprobs.exp()[spread.mask], torch.tensor(p), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- thresholds


@pytest.mark.parametrize("q", [0.05, 0.3, 0.5, 0.75, 0.9])
def test_tau_h_is_the_quantile_of_the_candidates_only(spread, q):
    """Catches: the quantile over every valid token (or padding, or A <= 0 tokens, or p >= tau_p
    tokens) instead of the paper's population, and the wrong interpolation."""
    got = s2t_tau_h(spread.logprobs, spread.entropy, spread.advantages, spread.mask, tau_p=TAU_P, q=q)
    assert got == pytest.approx(np_quantile(spread.cand_h(), q), abs=1e-5)
    tw = get_token_weighting("s2t")(spread.ctx(), tau_p=TAU_P, q=q)
    assert tw.info["tau_h"] == pytest.approx(got, abs=1e-12) and tw.info["candidates"] == len(spread.cand_h())


def test_candidate_and_all_token_quantiles_differ(spread):
    """The fixture can tell the paper's population from every token's (the all-token rule would pass
    the test above otherwise)."""
    assert abs(np_quantile(spread.cand_h(), 0.75) - np_quantile(spread.valid_h(), 0.75)) > 0.1
    assert 3 <= len(spread.cand_h()) < len(spread.valid_h())


def mirror_gather(other: Spread, what: str = "valid"):
    """What all_gather_1d returns on rank 0 of 2 when rank 1 holds ``other``: its valid tokens'
    entropies (20-Entropy's, the step's p05) or its S2T candidates' (the s2t quantile's)."""
    theirs = other.entropy[other.mask] if what == "valid" else torch.tensor(other.cand_h(), dtype=torch.float64)

    def gather(local: torch.Tensor) -> torch.Tensor:
        return torch.cat([local, theirs.to(local.dtype)])
    return gather


def test_tau_h_is_taken_over_every_rank(spread):
    """Catches: the gather dropped (each rank's own quantile) in the weighting's threshold."""
    r0, r1 = spread.rows([0, 2]), spread.rows([1, 3])  # each rank holds candidates of one row
    want = np_quantile(spread.cand_h(), 0.75)
    assert abs(np_quantile(r0.cand_h(), 0.75) - want) > 0.05  # rank-local would differ a lot
    got = s2t_tau_h(r0.logprobs, r0.entropy, r0.advantages, r0.mask, tau_p=TAU_P, q=0.75,
                    gather=mirror_gather(r1, "cand"))
    assert got == pytest.approx(want, abs=1e-5)
    tw = get_token_weighting("s2t")(r0.ctx(gather=mirror_gather(r1, "cand")), tau_p=TAU_P, q=0.75)
    assert tw.info["tau_h"] == pytest.approx(want, abs=1e-5)


def test_top_entropy_ranks_tokens_over_every_rank(spread):
    """20-Entropy's top-rho threshold is taken over the gathered batch (catches the gather dropped)."""
    r0, r1 = spread.rows([0, 1]), spread.rows([2, 3])
    h = sorted(spread.valid_h(), reverse=True)
    thr = h[math.ceil(0.2 * len(h)) - 1]  # the ceil(rho * n)-th largest entropy of the whole batch
    tw = get_token_weighting("top_entropy")(r0.ctx(gather=mirror_gather(r1)), rho=0.2)
    assert tw.info["entropy_threshold"] == pytest.approx(thr, abs=1e-5)
    want = [(b, t) for b in range(2) for t in range(T) if r0.mask[b, t] and r0.h[b][t] >= thr - 1e-6]
    assert sorted(map(tuple, tw.weights.nonzero().tolist())) == want
    local = get_token_weighting("top_entropy")(r0.ctx(), rho=0.2)
    assert not torch.equal(local.weights, tw.weights)  # a rank-local ranking keeps other tokens


def test_step_p05_is_global(spread):
    """``step_p05`` (the logged ``entropy/p05``): catches the gather dropped and the wrong quantile."""
    step_p05 = public("step_p05")
    r0, r1 = spread.rows([0, 1]), spread.rows([2, 3])
    assert step_p05(r0.entropy, r0.mask, mirror_gather(r1)) == pytest.approx(
        np_quantile(spread.valid_h(), 0.05), abs=1e-5)


# ----------------------------------------------------------------------------- the mask


@pytest.mark.parametrize("q", [0.3, 0.6, 0.75, 0.9])
def test_s2t_silences_exactly_positive_lowp_lowh_tokens(spread, q):
    """Catches a flipped or dropped condition (A > 0, p < tau_p, H < tau_h; strictness), the
    mask ignored, and silenced tokens left in the denominator."""
    tau = np_quantile(spread.cand_h(), q)
    want = expected_silenced(spread, tau)
    got = s2t_mask(spread.logprobs, spread.entropy, spread.advantages, spread.mask, tau_p=TAU_P, tau_h=tau)
    assert sorted(map(tuple, got.nonzero().tolist())) == want
    tw = get_token_weighting("s2t")(spread.ctx(), tau_p=TAU_P, q=q)
    keep = spread.mask & ~got
    assert torch.equal(tw.denom_mask, keep) and torch.equal(tw.weights, keep.float())
    assert tw.info["silenced_count"] == len(want)


def test_every_condition_of_the_mask_is_decisive(spread):
    """The fixture has tokens that fail exactly one condition each, so no flip goes unnoticed."""
    tau = np_quantile(spread.cand_h(), 0.75)
    fails = {"adv": 0, "p": 0, "h": 0, "none": 0}
    for b in range(B):
        for t in range(LENGTHS[b]):
            ok = {"adv": float(spread.advantages[b]) > 0, "p": spread.p[b][t] < TAU_P, "h": spread.h[b][t] < tau}
            bad = [k for k, v in ok.items() if not v]
            if len(bad) <= 1:
                fails[bad[0] if bad else "none"] += 1
    assert all(v > 0 for v in fails.values()), fails


# ----------------------------------------------------------------------------- normalizers


def per_token_loss(sp: Spread) -> torch.Tensor:
    return (-(sp.logprobs.double()) * sp.advantages.double()[:, None] + 0.1 * torch.arange(T))  # [B, T]


@pytest.mark.parametrize("name", sorted(AGGREGATIONS.names()))
def test_global_normalizer_makes_shares_add_up(spread, name):
    """Micro-batches (or ranks) with the GLOBAL normalizer sum to the whole batch's loss; with their
    own local normalizers they do not (catches a local normalizer in the accumulation)."""
    agg = get_aggregation(name)
    tw = get_token_weighting("s2t")(spread.ctx(), tau_p=TAU_P, q=0.6)
    loss = per_token_loss(spread)
    whole = agg.aggregate(loss, tw, normalizer=agg.normalizer(tw, spread.mask))
    parts = [[0], [1, 2], [3]]
    norm = sum(agg.normalizer(tw.select(r), spread.mask[r]) for r in parts)
    shares = sum(agg.aggregate(loss[r], tw.select(r), normalizer=norm) for r in parts)
    assert float(shares) == pytest.approx(float(whole), rel=1e-9)
    local = sum(agg.aggregate(loss[r], tw.select(r), normalizer=agg.normalizer(tw.select(r), spread.mask[r]))
                for r in parts)
    assert abs(float(local) - float(whole)) > 0.1 * abs(float(whole))


def test_token_mean_normalizer_counts_kept_tokens(spread):
    """Hand count: valid tokens minus silenced ones (silenced tokens leave the denominator)."""
    tau = np_quantile(spread.cand_h(), 0.6)
    tw = get_token_weighting("s2t")(spread.ctx(), tau_p=TAU_P, q=0.6)
    kept = sum(LENGTHS) - len(expected_silenced(spread, tau))
    assert float(get_aggregation("token-mean").normalizer(tw, spread.mask)) == kept
    assert kept < sum(LENGTHS)


def test_threshold_per_micro_batch_would_silence_other_tokens(spread):
    """Why the update must weigh whole mini-batches: on this batch, a threshold re-resolved on each
    micro-batch of 2 rows silences a different set than the mini-batch's one (so the update test
    below can see that bug)."""
    tw = get_token_weighting("s2t")(spread.ctx(), tau_p=TAU_P, q=0.5)
    per_micro = torch.zeros_like(spread.mask)
    for r in ([0, 2], [1, 3]):
        per_micro[r] = get_token_weighting("s2t")(spread.rows(r).ctx(), tau_p=TAU_P, q=0.5).denom_mask
    assert not torch.equal(per_micro, tw.denom_mask)


# ----------------------------------------------------------------------------- the real update

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64, "seed": 0}
HEAD_SCALE = 8.0  # the random head gives H = ln(101) +- 0.003; x8 spreads it over 1.0 - 4.0 nats


def update_cfg(micro: int, **s2t):
    return config_from_dict({
        "model": {"name_or_path": "tiny-random", "tiny": TINY},
        "trainer": {"device": "cpu", "lr": 1e-3, "micro_batch_size": micro, "max_grad_norm": 1e6,
                    "logits_chunk_size": 7},
        "algorithm": {"token_weighting": "s2t", "mini_batches": 1,
                      "s2t": {"tau_p": TAU_P, "q": 0.5, **s2t}},
    })


@pytest.fixture(scope="module")
def spread_model():
    from stapo.core.trainer.models import load_policy

    model, _ = load_policy(update_cfg(2).model, device="cpu")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    return model


def spread_sequences(vocab: int):
    """6 responses of 3-7 tokens in 2 groups, advantages of both signs."""
    seq_cls = public("Sequence_")
    g = torch.Generator().manual_seed(5)
    seqs = []
    for i in range(6):
        prompt = torch.randint(3, vocab, (4,), generator=g).tolist()
        resp = torch.randint(3, vocab, (3 + i % 5,), generator=g).tolist()
        s = seq_cls(prompt, resp, "stop", "", "0", group=i // 3)
        s.advantage = [1.2, 0.6, -1.8, 0.9, -0.3, -0.6][i]
        seqs.append(s)
    return seqs


class MirrorRank:
    """Data-parallel collectives as seen from rank 0 of 2 when rank 1 holds the same batch: sums
    double, gathers repeat. The rank's loss share, and so its gradient, is then half the one-process
    update's (rank 1 contributes the other half)."""

    @staticmethod
    def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    @staticmethod
    def all_gather_1d(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t])


def run_update(cfg, model, *, mirror: bool = False):
    """One update on the spread batch; (metrics, gradients at the optimizer step)."""
    from stapo.core.trainer.torch_backend import TorchBackend

    b = TorchBackend(cfg, copy.deepcopy(model), total_optimizer_steps=2)
    grads: dict[str, torch.Tensor] = {}
    real_step = b.step

    def step(**kw):
        grads.update({n: p.grad.detach().clone() for n, p in b.model.named_parameters() if p.grad is not None})
        return real_step(**kw)

    b.step = step
    if mirror:
        b.all_reduce_sum, b.all_gather_1d = MirrorRank.all_reduce_sum, MirrorRank.all_gather_1d
    batch = public("collate")(spread_sequences(model.config.vocab_size), 0)
    actor = public("Actor")(cfg, b, run_hooks(cfg))
    old_lp, old_ent = actor.old_stats(batch)
    metrics = actor.update(public("UpdateInputs")(batch, old_lp, old_ent, step=1))
    return metrics, grads, old_lp, old_ent, batch


@pytest.mark.usefixtures("one_thread")
def test_update_does_not_depend_on_the_micro_batch_size(spread_model):
    """Catches the S2T threshold (or the normalizer) re-resolved per micro-batch: micro-batches of 1
    and 2 rows must give the gradient of the whole mini-batch in one micro-batch."""
    ref, g_ref, _, ent, batch = run_update(update_cfg(8), spread_model)
    valid = ent[batch.response_mask.bool()]
    assert float(valid.max() - valid.min()) > 1.0  # a real spread, unlike the unscaled tiny model
    assert 0 < ref["stapo/silenced_count"] < float(batch.response_mask.sum())
    for micro in (1, 2):
        m, g, *_ = run_update(update_cfg(micro), spread_model)
        for k in ("stapo/tau_h", "stapo/silenced_count", "actor/loss"):
            assert m[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), (micro, k)
        for n in g_ref:
            torch.testing.assert_close(g[n], g_ref[n], atol=1e-6, rtol=1e-4, msg=f"micro {micro}: {n}")


@pytest.mark.usefixtures("one_thread")
def test_each_rank_contributes_its_share_of_the_global_objective(spread_model):
    """Catches the normalizer not summed over ranks: with a mirrored second rank (same rows), the
    global normalizer doubles and this rank's gradient is exactly half the one-process gradient.
    (Every candidate silenced: the quantile of a doubled population is not the same number.)"""
    cfg = update_cfg(2, silence="all")
    _, g1, *_ = run_update(cfg, spread_model)
    _, g2, *_ = run_update(cfg, spread_model, mirror=True)
    for n in g1:
        torch.testing.assert_close(g2[n], 0.5 * g1[n], atol=1e-7, rtol=1e-4, msg=n)
