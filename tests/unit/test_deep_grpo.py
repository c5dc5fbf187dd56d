"""DEEP-GRPO pure parts: pivot utility and logistic fit hand-checked, pivot sampling, suffix mask,
and generation from a prefix on a real (tiny) transformers model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stapo.core.train.deep_grpo import (
    OnlineLogistic,
    local_advantages,
    pivot_outcomes,
    pivot_utility,
    sample_pivot,
    suffix_mask,
)


def test_pivot_utility_hand_values() -> None:
    r = np.array([0.25, 0.5, 1.0])
    p = np.array([1.0, 0.5, 0.2])
    assert pivot_utility(r, p, 1.0).tolist() == pytest.approx([0.25 / 0.7, 0.25 / 0.7, 0.2 / 0.7])
    q = [1.0 * 0.25**0.1, 0.5 * 0.5**0.1, 0.2 * 1.0]
    assert pivot_utility(r, p, 0.1).tolist() == pytest.approx([x / sum(q) for x in q])
    assert pivot_utility(r, p, 0.0).tolist() == pytest.approx([1 / 1.7, 0.5 / 1.7, 0.2 / 1.7])
    with pytest.raises(ValueError, match="zero utility"):
        pivot_utility(r, np.zeros(3), 1.0)


def test_logistic_waits_for_both_classes_and_enough_samples() -> None:
    m = OnlineLogistic(window=100, min_samples=10)
    assert m.predict(np.array([0.3, 0.9])).tolist() == [1.0, 1.0]  # the authors' prior: P = 1
    m.update([0.5] * 20, [False] * 20)
    assert not m.fit() and not m.fitted  # one class only
    m2 = OnlineLogistic(window=100, min_samples=10)
    m2.update([0.2, 0.8] * 5, [True, False] * 5)  # 10 samples: not more than min_samples
    assert not m2.fit()
    m2.update([0.5], [True])
    assert m2.fit()
    with pytest.raises(ValueError, match="r must be"):
        m2.update([0.0], [True])


def test_logistic_fit_hand_checked() -> None:
    # Two points r = 0.25 (3 of 4 succeed) and r = 0.75 (1 of 4), L2 0.5 w^2 on the slope only.
    # d/db: sum(p - y) = 0; the data are antisymmetric around r = 0.5, so b = -w/2 and, with
    # q = p(0.25) = sigmoid(-w/4), p(0.75) = 1 - q. d/dw: 4 (q - 0.75) 0.25 + 4 (0.25 - q) 0.75 + w = 0,
    # i.e. w + 2 (0.75 - q) = 0: a scalar equation solved below by bisection, independently of Newton.
    m = OnlineLogistic(window=100, min_samples=1)
    m.update([0.25] * 4 + [0.75] * 4, [True, True, True, False, True, False, False, False])
    assert m.fit()
    w, b = m.w, m.b
    q = 1 / (1 + math.exp(-(0.25 * w + b)))
    assert b == pytest.approx(-w / 2, abs=1e-9)
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        qm = 1 / (1 + math.exp(mid / 4))  # p(0.25) with b = -w/2
        f = mid + 2 * (0.75 - qm)
        lo, hi = (lo, mid) if f > 0 else (mid, hi)
    assert w == pytest.approx(lo, abs=1e-8)
    assert w < 0  # later pivots are less recoverable here
    assert m.predict(np.array([0.25, 0.75])).tolist() == pytest.approx([q, 1 - q], abs=1e-9)


def test_logistic_fit_is_the_penalized_optimum() -> None:
    rng = np.random.default_rng(0)
    r = rng.uniform(0.01, 1.0, size=300)
    y = rng.random(300) < 1 / (1 + np.exp(-(2.0 - 4.0 * r)))
    m = OnlineLogistic(window=1000, min_samples=10)
    m.update(r.tolist(), y.tolist())
    assert m.fit()
    wb = torch.tensor([m.w, m.b], dtype=torch.float64, requires_grad=True)
    x, t = torch.tensor(r), torch.tensor(y, dtype=torch.float64)
    z = wb[0] * x + wb[1]
    obj = torch.nn.functional.binary_cross_entropy_with_logits(z, t, reduction="sum") + 0.5 * wb[0] ** 2
    (g,) = torch.autograd.grad(obj, wb)
    assert g.abs().max().item() < 1e-6
    # the window slides: only the last `window` outcomes count
    small = OnlineLogistic(window=5, min_samples=1)
    small.update([0.1] * 10, [True] * 10)
    assert len(small.r) == 5


def test_sample_pivot_distribution_and_bounds() -> None:
    m = OnlineLogistic()
    rng = np.random.default_rng(0)
    assert {sample_pivot(2, m, 0.1, rng) for _ in range(20)} == {1}
    draws = np.array([sample_pivot(5, m, 0.0, rng) for _ in range(8000)])  # P = 1, gamma = 0: uniform on 1..4
    freq = np.bincount(draws, minlength=5)[1:] / len(draws)
    assert np.abs(freq - 0.25).max() < 0.02
    deep = np.array([sample_pivot(5, m, 3.0, rng) for _ in range(8000)])  # gamma = 3: (t/5)^3
    want = np.array([1, 8, 27, 64]) / 100
    assert np.abs(np.bincount(deep, minlength=5)[1:] / len(deep) - want).max() < 0.02
    with pytest.raises(ValueError, match="proper prefix"):
        sample_pivot(1, m, 0.1, rng)


def test_suffix_mask_hand_values() -> None:
    resp = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    got = suffix_mask(resp, torch.tensor([2, 1]))
    want = torch.tensor([[0, 0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(got, want)


def test_hf_generate_from_prefix_continues_the_greedy_rollout() -> None:
    """Greedy from prompt + first k tokens of a greedy rollout must give that rollout's remaining tokens."""
    from stapo.core.config import ModelConfig
    from stapo.core.rollout import SamplingParams
    from stapo.core.rollout.hf import HFRolloutEngine
    from stapo.core.trainer.models import load_policy

    model, tok = load_policy(ModelConfig(name_or_path="tiny-random"), device="cpu")
    eng = HFRolloutEngine(model, tok, batch_size=4)
    prompts = [tok.encode("1 + 2 =")[:6], tok.encode("seven")[:4]]
    full = eng.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
    k = 5
    prefixes = [c[0].token_ids[:k] for c in full]
    cont = eng.generate_from_prefix(prompts, prefixes, SamplingParams(n=2, temperature=0.0, max_new_tokens=12 - k))
    for f, c in zip(full, cont, strict=True):
        assert len(c) == 2
        assert c[0].token_ids == f[0].token_ids[k:]
    with pytest.raises(ValueError, match="prefixes"):
        eng.generate_from_prefix(prompts, prefixes[:1], SamplingParams(n=1))


# ----------------------------------------------------------------------------- the authors' outcome and local advantage


def test_pivot_outcomes_any_of_k_vs_per_branch() -> None:
    """Two pivots, K = 3. Pivot 0 (t/T = 0.5): wrong, right, wrong -> one sample (0.5, success).
    Pivot 1 (t/T = 0.25): wrong, wrong, grading failed -> (0.25, failure). Per branch: 5 valid samples."""
    ratios = [0.5, 0.5, 0.5, 0.25, 0.25, 0.25]
    pivots = [0, 0, 0, 1, 1, 1]
    valid = [True, True, True, True, True, False]
    correct = [False, True, False, False, False, False]
    assert pivot_outcomes(ratios, pivots, valid, correct, "any_of_k") == ([0.5, 0.25], [True, False])
    assert pivot_outcomes(ratios, pivots, valid, correct, "per_branch") == (
        [0.5, 0.5, 0.5, 0.25, 0.25], [False, True, False, False, False])
    # a pivot whose branches all failed to grade says nothing about recoverability
    assert pivot_outcomes([0.5, 0.5], [3, 3], [False, False], [False, False], "any_of_k") == ([], [])
    with pytest.raises(ValueError, match="outcome"):
        pivot_outcomes([0.5], [0], [True], [True], "majority")


def test_local_advantage_mean_baseline_vs_grpo_by_hand() -> None:
    """Pivot rewards [1, 0, 0] (one of three branches right): the authors' reward - mean gives
    [2/3, -1/3, -1/3]; GRPO divides by the std (torch's unbiased std of [1, 0, 0] = 1/sqrt(3)):
    [2/3 * sqrt(3), -1/3 * sqrt(3), ...] = [1.1547, -0.5774, -0.5774]. All-equal rewards: 0 either way."""
    r = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mb = local_advantages(r, "mean_baseline", "grpo")
    torch.testing.assert_close(mb, torch.tensor([[2 / 3, -1 / 3, -1 / 3], [0.0, 0.0, 0.0]]))
    g = local_advantages(r, "grpo", "grpo")  # eps 1e-6 next to std 0.577: inside the tolerance
    s3 = math.sqrt(3)
    torch.testing.assert_close(g, torch.tensor([[2 / 3 * s3, -1 / 3 * s3, -1 / 3 * s3], [0.0, 0.0, 0.0]]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="local_advantage"):
        local_advantages(r, "median", "grpo")


def test_set_local_advantages_on_branch_sequences() -> None:
    """The loop-side assignment: per pivot group, over the shaped rewards, in group order."""
    from types import SimpleNamespace

    from stapo.core.config import config_from_dict
    from stapo.core.train.deep_grpo import set_local_advantages

    seqs = [SimpleNamespace(group=g, reward=r, advantage=None) for g, r in
            [(0, 1.0), (1, -1.0), (0, -1.0), (1, -1.0), (0, -1.0), (1, 1.0)]]
    cfg = config_from_dict({"algorithm": {"deep_grpo": {"enabled": True}}})  # default: the authors' mean baseline
    out = set_local_advantages(cfg, seqs)
    # pivot 0: [1, -1, -1] - (-1/3) = [4/3, -2/3, -2/3]; pivot 1: [-1, -1, 1] -> [-2/3, -2/3, 4/3]
    assert [s.group for s in out] == [0, 0, 0, 1, 1, 1]
    assert [s.advantage for s in out] == pytest.approx([4 / 3, -2 / 3, -2 / 3, -2 / 3, -2 / 3, 4 / 3])
    assert cfg.algorithm.deep_grpo.outcome == "any_of_k"


# ----------------------------------------------------------------------------- the local loss's micro-batching

LOCAL_TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64, "seed": 0}


def _local_loss_grads(micro: dict, algorithm: dict, roots: int | None = None) -> tuple[list[dict[str, torch.Tensor]], object]:
    """The gradient the local (branch) loss adds at optimizer steps 0 and 1 (``Actor.contribute``), on 6 branch rows of uneven lengths and prefixes; and the sequences
    per forward of every forward (from the position ids; rows: minus the padded rows; no grad: 0)."""
    from types import SimpleNamespace

    from stapo.core.config import config_from_dict
    from stapo.core.train import loop
    from stapo.core.train.deep_grpo import DeepGRPO, collate_branches
    from stapo.core.train.update import Actor
    from stapo.core.trainer.models import load_policy
    from stapo.core.trainer.torch_backend import TorchBackend

    alg = {"token_weighting": "none", "policy_loss": "ppo_clip", "aggregation": "token-mean",
           "deep_grpo": {"enabled": True, "lambda": 0.5}, **algorithm}
    cfg = config_from_dict({"model": {"name_or_path": "tiny-random", "dtype": "float32", "tiny": LOCAL_TINY},
                            "rollout": {"temperature": 1.0},
                            "trainer": {"device": "cpu", "logits_chunk_size": 7, **micro}, "algorithm": alg})
    model, _ = load_policy(cfg.model, device="cpu")
    backend = TorchBackend(cfg, model, total_optimizer_steps=4)
    g = torch.Generator().manual_seed(0)
    kept = []
    for i, (p, r) in enumerate([(3, 9), (6, 2), (4, 7), (5, 3), (3, 19), (6, 5)]):  # prompt, response lengths
        ids = torch.randint(3, model.config.vocab_size, (p + r,), generator=g).tolist()
        s = loop.Sequence_(ids[:p], ids[p:], "stop", "", "0", group=i // 3)
        s.prefix_len = [1, 0, 3, 1, 6, 2][i]
        s.advantage = [1.2, -0.4, -0.8, 0.9, 0.3, -0.9][i]
        kept.append(s)
    run = SimpleNamespace(cfg=cfg, backend=backend, pad_id=0)
    br = collate_branches(run, kept, [len(kept)])
    local = DeepGRPO(cfg, run).local_loss(backend, br, step=1, roots=roots)
    actor = Actor(cfg, backend)
    forwards, token_stats = [], backend.token_stats

    def spy(ids, attn, resp, *, grad, temperature, position_ids=None):
        n = int((position_ids == 0).sum()) if position_ids is not None else -ids.shape[0]
        forwards.append(n if grad else 0)
        return token_stats(ids, attn, resp, grad=grad, temperature=temperature, position_ids=position_ids)

    backend.token_stats = spy
    grads = []
    for update in (0, 1):  # the first two optimizer steps' local terms, from the same weights
        backend.zero_grad()
        actor.contribute(local, update)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    return grads, (model, kept, forwards, br)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("algorithm", [{"mini_batches": 1}, {"mini_batches": 2, "token_weighting": "s2t",
                                                               "s2t": {"tau_p": 0.5, "q": 0.5}}])
def test_local_loss_gradient_packed_equals_row_micro_batches(algorithm):
    """Packed token-budget micro-batches (``trainer.micro_batch_tokens``: 20 tokens, so rows share
    forwards and the 22-token row gets one of its own) vs 2 padded rows per forward: the same
    gradient (1e-5). With weighting ``none`` and one mini-batch the gradient is also checked against
    an independent computation: each row alone through the model's own logits, lambda * sum over
    continuation tokens of -A d(log p) / (continuation tokens), the PPO ratio being 1 at the sampler.
    The local loss runs no no-grad forward (p and H of s2t come from its gradient forwards)."""
    packed, (_, _, fw_packed, _) = _local_loss_grads({"micro_batch_tokens": 20}, algorithm)
    rows, (model, kept, fw_rows, _) = _local_loss_grads({"micro_batch_size": 2}, algorithm)
    if algorithm["mini_batches"] == 1:  # first-fit decreasing of lengths 22, 12, 11, 11, 8, 8 into 20 tokens
        assert sorted(fw_packed) == [1, 1, 1, 1, 2, 2, 2, 2] and fw_rows == [-2, -2, -2] * 2  # per update
    else:
        assert max(fw_packed) == 2 and min(fw_rows) == -2
    assert 0 not in fw_packed + fw_rows
    for gp, gr in zip(packed, rows, strict=True):
        assert gp.keys() == gr.keys() and gp
        for n in gr:
            torch.testing.assert_close(gp[n], gr[n], atol=1e-5, rtol=0, msg=n)
    if algorithm["mini_batches"] != 1:
        return
    model.zero_grad(set_to_none=True)
    n_tok = sum(len(s.response_ids) - s.prefix_len for s in kept)
    for s in kept:  # one sequence at a time, no padding, no packing
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        cont = lp[len(s.prompt_ids) - 1 + s.prefix_len:]  # log p of the continuation tokens
        (0.5 * (-s.advantage * torch.exp(cont - cont.detach())).sum() / n_tok).backward()
    for g in rows:  # both updates: the parameters did not move (no optimizer step here)
        for n, p in model.named_parameters():
            torch.testing.assert_close(g[n], p.grad, atol=1e-5, rtol=0, msg=n)


@pytest.mark.usefixtures("one_thread")
def test_local_loss_s2t_takes_each_mini_batchs_quantile():
    """The local loss silences with each local mini-batch's own tau_h^(q) (the paper's rule, as the
    root rows' update): one row per forward gives the gradient of two rows per forward (a threshold
    re-taken per micro-batch would not), and the rule is active (silencing every candidate differs)."""
    algo = {"mini_batches": 2, "token_weighting": "s2t"}
    s2t = {"tau_p": 0.5, "q": 0.5}
    two, _ = _local_loss_grads({"micro_batch_size": 2}, {**algo, "s2t": s2t})
    one, _ = _local_loss_grads({"micro_batch_size": 1}, {**algo, "s2t": s2t})
    every, _ = _local_loss_grads({"micro_batch_size": 2}, {**algo, "s2t": {**s2t, "silence": "all"}})
    for g2, g1 in zip(two, one, strict=True):
        for n in g2:
            torch.testing.assert_close(g1[n], g2[n], atol=1e-6, rtol=0, msg=n)
    assert any(not torch.allclose(g2[n], ge[n], atol=1e-6) for g2, ge in zip(two, every, strict=True) for n in g2)


def test_truncated_branches_leave_the_local_loss_with_the_overlong_filter():
    """Local advantages over all K branches of a pivot (mean baseline: 1/0 rewards, mean 0.5), then
    the truncated branch (finish reason ``length``) leaves the loss when ``overlong.filter`` is on."""
    from stapo.core.config import config_from_dict
    from stapo.core.train import loop
    from stapo.core.train.deep_grpo import loss_branches

    def branches():
        out = []
        for i, (reason, r) in enumerate([("stop", 1.0), ("length", 0.0), ("stop", 0.0), ("stop", 1.0)]):
            s = loop.Sequence_([1, 2], [3, 4, 5 + i], reason, "", "0", group=0)
            s.reward = r
            out.append(s)
        return out

    for filt, reasons in ((True, ["stop"] * 3), (False, ["stop", "length", "stop", "stop"])):
        cfg = config_from_dict({"algorithm": {"deep_grpo": {"enabled": True}, "overlong": {"filter": filt}}})
        kept = loss_branches(cfg, branches())
        assert [s.finish_reason for s in kept] == reasons
        assert [s.advantage for s in kept] == ([0.5, -0.5, 0.5] if filt else [0.5, -0.5, -0.5, 0.5])


def test_branch_rows_fill_full_size_mini_batches_as_the_authors_code():
    """min(K, floor(N_branch / S)), S = root rows / K (dp_actor.update_policy's num_branch_mbs)."""
    from stapo.core.train.deep_grpo import branch_minibatches

    assert branch_minibatches(10, 64, 4) == 0  # S = 16: not one full mini-batch of branches -> no local term
    assert branch_minibatches(16, 64, 4) == 1
    assert branch_minibatches(40, 64, 4) == 2  # two mini-batches of 20 (balanced), the other two without
    assert branch_minibatches(500, 64, 4) == 4  # capped at K
    assert branch_minibatches(3, None, 4) == 3  # no root count: one row at least per mini-batch


@pytest.mark.usefixtures("one_thread")
def test_local_loss_runs_only_in_the_branch_mini_batches():
    """6 branch rows, K = 2: with 12 root rows (S = 6) all six fill mini-batch 0 and mini-batch 1 gets
    no local gradient; with 4 root rows (S = 2) both mini-batches take three."""
    algo = {"mini_batches": 2}
    one, _ = _local_loss_grads({"micro_batch_size": 2}, algo, roots=12)
    assert one[0] and not one[1]
    both, _ = _local_loss_grads({"micro_batch_size": 2}, algo, roots=4)
    assert both[0] and both[1]
