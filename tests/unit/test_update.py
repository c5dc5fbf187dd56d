"""The one update path (stapo.core.train.update) against independent computations.

* Packed vs padded vs one-row-at-a-time micro-batches: the same per-token log-probs / entropies
  (1e-5) and the same parameter update (1e-5, with SGD so that an update is lr x the accumulated
  gradient) for every registered weighting x policy loss x aggregation, with mini_batches 1 and 4,
  ppo_epochs 1 and 2, on uneven lengths. The one-row-at-a-time run is the independent reference:
  no padding and no packing, one sequence per forward.
* On-policy (1 epoch, 1 mini-batch): the update without the no-grad pass (p, H and pi_old from the
  gradient forward) equals the update fed the no-grad pass's statistics.
* Forward counts: no no-grad policy forward runs inside the update (weighting `none` and `s2t`,
  4 mini-batches); the loop's only no-grad pass is the old-log-prob pass where needs_old_pass says.
* Prefix sharing vs full rows: values and gradients. Packing: first-fit decreasing.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hook_driver import run_hooks

from stapo.core.algos import AGGREGATIONS, POLICY_LOSSES, TOKEN_WEIGHTS
from stapo.core.batch import collate
from stapo.core.config import config_from_dict
from stapo.core.train import loop, update
from stapo.core.train.loop import train
from stapo.core.train.run import Run
from stapo.core.trainer import prefix
from stapo.core.trainer.base import compute_token_stats
from stapo.core.trainer.models import load_policy
from stapo.core.trainer.torch_backend import TorchBackend

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64, "seed": 0}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_cfg(weighting="s2t", micro=3, algorithm=None, rollout=None, **trainer):
    t = {"device": "cpu", "lr": 1e-2, "logits_chunk_size": 7, "micro_batch_size": micro, "max_grad_norm": 1e3}
    t.update(trainer)
    al = {"token_weighting": weighting, "s2t": {"tau_p": 0.5, "q": 0.5},
          "top_entropy": {"rho": 0.5}, "stare": {"target_entropy": 100.0, "top_ratio": 0.3}}
    al.update(algorithm or {})
    return config_from_dict({"model": {"name_or_path": "tiny-random", "tiny": TINY}, "trainer": t, "algorithm": al,
                             "rollout": rollout or {}})


def grouped_batch(vocab: int, seed: int = 0) -> loop.Batch:
    """2 groups x 4 responses; prompts of 5 and 3 tokens (left-padded), responses of 1-6 tokens."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for grp, p_len in enumerate((5, 3)):
        prompt = torch.randint(3, vocab, (p_len,), generator=g).tolist()
        for _ in range(4):
            r = int(torch.randint(1, 7, (1,), generator=g))
            seqs.append(loop.Sequence_(prompt, torch.randint(3, vocab, (r,), generator=g).tolist(), "stop", "",
                                       "0", group=grp))
    for s, a in zip(seqs, [1.1, -0.4, 0.7, -1.4, 0.9, 0.9, -0.9, -0.9], strict=True):
        s.advantage = a
    return collate(seqs, pad_id=0)


def update_once(cfg, backend, batch, old_lp, old_ent):
    """One step's update as the loop runs it: ``Actor.update`` with the config's hooks (STARE's
    controller, the KL term; built without a model: the KL's target is the sampling policy)."""
    return update.Actor(cfg, backend, run_hooks(cfg)).update(update.UpdateInputs(batch, old_lp, old_ent, step=1))


def sgd_backend(cfg, model):
    """A torch backend whose optimizer is plain SGD: the parameter update is lr x the accumulated
    gradient, so equal gradients give equal updates to rounding (AdamW's g / sqrt(v) would turn a
    1e-9 difference on a near-zero gradient into +-lr)."""
    b = TorchBackend(cfg, copy.deepcopy(model), total_optimizer_steps=8)
    b.optimizer = torch.optim.SGD(b.model.parameters(), lr=0.05)
    b.scheduler = torch.optim.lr_scheduler.LambdaLR(b.optimizer, lambda s: 1.0)
    return b


def count_nograd(b):
    calls = {"nograd": 0, "grad": 0}
    real_stats = b.token_stats

    def token_stats(*a, grad, **k):
        calls["grad" if grad else "nograd"] += 1
        return real_stats(*a, grad=grad, **k)

    b.token_stats = token_stats
    return calls


SPECS = {"padded": {"micro_batch_size": 3}, "packed": {"micro_batch_size": 3, "micro_batch_tokens": 20},
         "one_row": {"micro_batch_size": 1}}


def run_update(weighting, loss, agg, mini_batches, epochs, spec, model, batch):
    algorithm = {"policy_loss": loss, "aggregation": agg, "mini_batches": mini_batches, "ppo_epochs": epochs}
    if loss == "gspo":
        algorithm.update(eps_low=3e-4, eps_high=4e-4)
    cfg = make_cfg(weighting, algorithm=algorithm, share_prompt_prefix=False, **SPECS[spec])
    b = sgd_backend(cfg, model)
    old_lp, old_ent = update.Actor(cfg, b).old_stats(batch)
    m = update_once(cfg, b, batch, old_lp, old_ent)
    return m, {n: p.detach().clone() for n, p in b.model.named_parameters()}, old_lp, old_ent


# every weighting x loss x aggregation once; the (mini_batches, epochs) settings cycle so that each
# weighting meets all four
COMBOS = [(w, lo, ag, *mbe) for (w, lo, ag), mbe in zip(
    itertools.product(sorted(TOKEN_WEIGHTS.names()), sorted(POLICY_LOSSES.names()), sorted(AGGREGATIONS.names())),
    itertools.cycle([(1, 1), (4, 2), (4, 1), (1, 2), (4, 2)]), strict=False)]


@pytest.fixture(scope="module")
def tiny():
    """The tiny random model with its (tied) embedding scaled by 10: a random init gives every position
    an entropy within 0.005 nats of ln V, so S2T's entropy quantile would be decided by float rounding
    and a packed forward's summation order could move a token across it; scaled, the entropies spread
    over 0.8-2.4 nats and every path must make the same split."""
    cfg = make_cfg()
    model, _ = load_policy(cfg.model, device="cpu")
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model, grouped_batch(model.config.vocab_size)


@pytest.mark.parametrize(("weighting", "loss", "agg", "mini_batches", "epochs"), COMBOS,
                         ids=["-".join(map(str, c)) for c in COMBOS])
def test_packed_padded_and_one_row_give_the_same_update(tiny, weighting, loss, agg, mini_batches, epochs):
    model, batch = tiny
    runs = {s: run_update(weighting, loss, agg, mini_batches, epochs, s, model, batch) for s in SPECS}
    m_ref, p_ref, lp_ref, ent_ref = runs["one_row"]
    start = {n: p.detach() for n, p in model.named_parameters()}
    assert max(float((p_ref[n] - start[n]).abs().max()) for n in p_ref) > 1e-3  # the update moved weights
    for s in ("padded", "packed"):
        m, p, lp, ent = runs[s]
        torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)
        for n in p_ref:
            torch.testing.assert_close(p[n], p_ref[n], atol=1e-5, rtol=0, msg=f"{s}: {n}")
        for k in ("stapo/silenced_count", "tokens/valid", "actor/clip_frac_low", "actor/clip_frac_high"):
            assert m[k] == pytest.approx(m_ref[k], abs=1e-6), (s, k)


def test_token_stats_packed_matches_padded_and_single_rows(tiny):
    model, batch = tiny
    cfg = make_cfg()
    b = TorchBackend(cfg, copy.deepcopy(model), total_optimizer_steps=1)
    ref = [compute_token_stats(model, batch.input_ids[i : i + 1, batch.attention_mask[i].bool()],
                               torch.ones_like(batch.input_ids[i : i + 1, batch.attention_mask[i].bool()]),
                               batch.response_mask[i : i + 1, batch.attention_mask[i].bool()], chunk_size=7)
           for i in range(batch.input_ids.shape[0])]  # each sequence alone, no padding at all
    for tokens in (None, 20, 1):  # rows of 3; packed into 20-token forwards; one row per forward
        lp, ent = update.Actor(make_cfg(micro_batch_tokens=tokens), b).old_stats(batch)
        for i, (lp_i, ent_i) in enumerate(ref):
            keep = batch.attention_mask[i].bool()
            torch.testing.assert_close(lp[i, keep], lp_i[0].detach(), atol=1e-5, rtol=0)
            torch.testing.assert_close(ent[i, keep], ent_i[0].detach(), atol=1e-5, rtol=0)


def test_pack_rows_first_fit_decreasing():
    from stapo.core.train.micro import MicroSpec, micro_batches, pack_rows

    assert pack_rows([5, 9, 3, 7, 2], 10) == [[1], [3, 2], [0, 4]]
    assert pack_rows([12, 1], 10) == [[0], [1]]  # a longer row alone
    lengths = [5, 9, 3, 7, 2]
    attn = torch.tensor([[1] * n + [0] * (9 - n) for n in lengths])
    batch = loop.Batch(attn, attn, attn, attn.float())
    (micros,) = micro_batches(batch, [torch.arange(5)], MicroSpec(2, tokens=10))
    assert [m.rows.tolist() for m in micros] == [[1], [3, 2], [0, 4]]
    (micros,) = micro_batches(batch, [torch.arange(5)], MicroSpec(2))
    assert [m.rows.tolist() for m in micros] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_rows([1], 0)


@pytest.mark.parametrize(("weighting", "spec"), [("s2t", "padded"), ("none", "packed"), ("s2t", "packed"),
                                                 ("none", "padded")])
def test_onpolicy_update_without_the_nograd_pass(tiny, weighting, spec):
    """1 epoch, 1 mini-batch: p, H and pi_old from the gradient forward == fed the no-grad pass."""
    model, batch = tiny
    cfg = make_cfg(weighting, share_prompt_prefix=True, **SPECS[spec])
    ref_b = sgd_backend(cfg, model)
    old_lp, old_ent = update.Actor(cfg, ref_b).old_stats(batch)
    ref_m = update_once(cfg, ref_b, batch, old_lp, old_ent)
    b = sgd_backend(cfg, model)
    calls = count_nograd(b)
    m = update_once(cfg, b, batch, None, None)
    assert calls["nograd"] == 0
    if weighting == "s2t":  # the test must exercise silencing: some, not all, positive-A tokens
        assert 0 < m["stapo/silenced_count"] < batch.response_mask.sum()
    for k in ("stapo/silenced_count", "stapo/tau_h", "tokens/valid", "entropy/p05", "actor/loss",
              "actor/clip_frac_low", "actor/ratio_mean"):
        assert m[k] == pytest.approx(ref_m[k], abs=1e-6), k
    for (n, p), (_, q) in zip(b.model.named_parameters(), ref_b.model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=n)


@pytest.mark.parametrize("weighting", ["none", "s2t"])
def test_no_nograd_forward_inside_the_update(tiny, weighting):
    """4 mini-batches: the update's statistics come from its gradient forwards; the one no-grad
    pass is the step's old-log-prob pass (docs/performance.md)."""
    model, batch = tiny
    cfg = make_cfg(weighting, algorithm={"mini_batches": 4}, fused_loss=False)
    b = sgd_backend(cfg, model)
    old_lp, old_ent = update.Actor(cfg, b).old_stats(batch)
    calls = count_nograd(b)
    update_once(cfg, b, batch, old_lp, old_ent)
    assert calls["nograd"] == 0
    assert calls["grad"] == 4  # 8 rows in 4 mini-batches of 2: one micro-batch each
    assert update.needs_old_pass(cfg)  # pi_old for mini-batches 2-4
    assert not update.needs_old_pass(make_cfg(weighting))  # on-policy: none at all


@pytest.mark.parametrize(("weighting", "spec", "algorithm"), [
    ("s2t", "padded", {"mini_batches": 4, "ppo_epochs": 2}),
    ("top_entropy", "packed", {"mini_batches": 1}),
    ("stare", "padded", {"mini_batches": 4}),
    ("s2t", "packed", {"mini_batches": 2}),
])
def test_bounded_update_matches_kept_graphs(tiny, weighting, spec, algorithm):
    """trainer.update_memory=bounded (a no-grad statistics pass, then forward + backward per
    micro-batch) gives the kept-graphs update: same parameters, same diagnostics; it runs one no-grad
    forward per micro-batch more, and never more than one graph at a time."""
    model, batch = tiny
    runs = {}
    for mode in ("keep_graphs", "bounded"):
        cfg = make_cfg(weighting, algorithm=algorithm, share_prompt_prefix=False, update_memory=mode,
                       fused_loss=False, **SPECS[spec])
        b = sgd_backend(cfg, model)
        old_lp, old_ent = update.Actor(cfg, b).old_stats(batch)
        calls = count_nograd(b)
        m = update_once(cfg, b, batch, old_lp, old_ent)
        runs[mode] = (m, {n: p.detach().clone() for n, p in b.model.named_parameters()}, dict(calls))
    (m_k, p_k, c_k), (m_b, p_b, c_b) = runs["keep_graphs"], runs["bounded"]
    assert c_k["nograd"] == 0 and c_b["grad"] == c_k["grad"]
    assert c_b["nograd"] == c_b["grad"]  # one statistics forward per gradient forward
    for n in p_k:
        torch.testing.assert_close(p_b[n], p_k[n], atol=1e-5, rtol=0, msg=n)
    for k in ("stapo/silenced_count", "tokens/valid", "actor/loss", "actor/clip_frac_low"):
        if k in m_k:
            assert m_b[k] == pytest.approx(m_k[k], abs=1e-6), k


def test_prefix_sharing_matches_full_rows_values_and_gradients():
    cfg = make_cfg()
    model, _ = load_policy(cfg.model, device="cpu")
    batch = grouped_batch(model.config.vocab_size, seed=3)
    first, group = prefix.prompt_groups(batch.input_ids, batch.attention_mask, 5)
    assert first.tolist() == [0, 4] and group.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    shuffled = torch.tensor([5, 0, 6, 1, 2, 7, 3, 4])  # groups need not be adjacent
    first, group = prefix.prompt_groups(batch.input_ids[shuffled], batch.attention_mask[shuffled], 5)
    assert first.tolist() == [0, 1] and group.tolist() == [0, 1, 0, 1, 1, 0, 1, 0]
    probe = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(0))

    def run(fn):
        model.zero_grad()
        lp, ent = fn(model, batch.input_ids, batch.attention_mask, batch.response_mask, chunk_size=7)
        (lp * probe).sum().backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lp_a, ent_a, g_a = run(compute_token_stats)
    lp_b, ent_b, g_b = run(prefix.prefix_shared_token_stats)
    assert (lp_a != 0).sum() == batch.response_mask.sum()  # every response token has a log-prob
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=0)
    for n in g_a:
        torch.testing.assert_close(g_b[n], g_a[n], atol=1e-5, rtol=1e-4, msg=n)


def test_loop_runs_no_separate_statistics_pass_on_policy(tmp_path, monkeypatch):
    from stapo.configs import preset_path
    from stapo.core.config import load_config

    cfg = load_config(preset_path("tiny"), ["trainer.max_steps=2", "checkpoint.every=0", "data.val_size=0",
                                            "logging.dump_tokens_every=1", "logging.live=false"])
    passes, stats = [], []  # passes: "nograd" / "grad" forwards in call order
    real_shared = prefix.prefix_shared_token_stats

    def shared(*a, **k):
        stats.append(torch.is_grad_enabled())
        return real_shared(*a, **k)

    monkeypatch.setattr("stapo.core.trainer.torch_backend.prefix_shared_token_stats", shared)
    run = Run.build(cfg, tmp_path, log=lambda m: None)
    real_stats = run.backend.token_stats

    def token_stats(*a, grad, **k):  # the no-grad statistics pass is token_stats(grad=False)
        passes.append("grad" if grad else "nograd")
        return real_stats(*a, grad=grad, **k)

    real_loss = run.backend.token_loss

    def token_loss(*a, **k):  # the fused gradient forward
        passes.append("grad")
        return real_loss(*a, **k)

    run.backend.token_stats, run.backend.token_loss = token_stats, token_loss  # (this run's backend only)
    train(run)
    # on-policy the update reads p and H from its gradient forwards: the only no-grad forward is the S2T
    # watch's one-time candidate count before the first update (stapo.core.train.extras.S2TWatch)
    first_grad = passes.index("grad")
    assert "nograd" not in passes[first_grad:]
    one_pass = -(-cfg.rollout.prompts_per_step * cfg.rollout.n // cfg.trainer.micro_batch_size)  # its micro-batches
    assert passes[:first_grad] == ["nograd"] * one_pass
    assert stats[one_pass:] and all(stats[one_pass:])  # the update's statistics came from gradient forwards (prompt prefix shared)
    assert (tmp_path / "dumps" / "step_000001.json").is_file()  # token dumps still get p and H


def test_waves_are_graded_while_the_next_wave_generates(tmp_path, monkeypatch):
    """rollout.batch_size < prompts x n: wave 0 is graded in a thread while wave 1 generates."""
    import threading
    import time

    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.rollout.hf import HFRolloutEngine
    from stapo.core.task.rewards import RewardFunction

    cfg = load_config(preset_path("tiny"), ["trainer.max_steps=1", "checkpoint.every=0", "data.val_size=0",
                                            "logging.dump_tokens_every=0", "logging.live=false",
                                            "rollout.prompts_per_step=2", "rollout.n=4",
                                            "rollout.batch_size=4"])  # 2 prompts x 4 samples: 2 waves
    events = []
    real_gen, real_grade = HFRolloutEngine.generate, RewardFunction.__call__

    def generate(self, prompts, sampling):
        events.append(("gen_start", len(prompts), sampling.seed))
        out = real_gen(self, prompts, sampling)
        events.append(("gen_end",))
        return out

    def grade(self, responses, golds):
        events.append(("grade_start", threading.current_thread().name.startswith("grade")))
        time.sleep(0.3)  # a slow grader: the second wave must start generating meanwhile
        out = real_grade(self, responses, golds)
        events.append(("grade_end", len(responses)))
        return out

    monkeypatch.setattr(HFRolloutEngine, "generate", generate)
    monkeypatch.setattr(RewardFunction, "__call__", grade)
    train(Run.build(cfg, tmp_path, log=lambda m: None))
    kinds = [e[0] for e in events]
    assert kinds.count("gen_start") == 2 and [e[1] for e in events if e[0] == "gen_start"] == [1, 1]
    assert events[0][2] != events[kinds.index("gen_start", 1)][2]  # each wave its own seed
    assert kinds.index("grade_start") < kinds.index("gen_start", 1) < kinds.index("grade_end")
    assert all(e[1] for e in events if e[0] == "grade_start")  # graded off the main thread
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert '"time/reward_total_s"' in rows[0]


def test_minibatch_split_gives_exactly_k_optimizer_steps():
    """randperm(N).chunk(K) makes ceil(N/K)-row chunks, so fewer than K of them when N < K^2
    (100 rows, K = 16: 14 chunks of 7 and one of 2). The split is K parts whose sizes differ by at
    most one."""
    from stapo.core.trainer.distributed import global_minibatches

    for n, k in ((100, 16), (8, 5), (8, 8), (9, 2)):
        parts = global_minibatches([n], k, torch.Generator().manual_seed(0))
        sizes = [len(p) for p in parts]
        assert len(parts) == k and max(sizes) - min(sizes) <= 1, (n, k, sizes)
        assert sorted(torch.cat(parts).tolist()) == list(range(n))  # each row once
    assert len(torch.randperm(100).chunk(16)) == 15  # what chunk gives


def test_unequal_minibatches_each_normalized_by_their_own_tokens(tiny):
    """8 rows in 5 optimizer steps (2, 2, 2, 1, 1 rows): the update equals five one-mini-batch
    updates, each on its own rows alone, run one after the other: each optimizer step's STAPO
    denominator is its own mini-batch's unsilenced tokens. Fewer rows than mini-batches is refused
    naming the key."""
    from stapo.core.trainer.distributed import global_minibatches

    model, batch = tiny
    s2t = {"tau_p": 0.5, "silence": "all"}  # the silenced set does not depend on the mini-batch split
    frame = {"prompts_per_step": 5, "n": 2}  # 10 rows asked for; 8 left (filters drop rows)
    cfg = make_cfg("s2t", algorithm={"mini_batches": 5, "s2t": s2t}, rollout=frame, share_prompt_prefix=False)
    b = sgd_backend(cfg, model)
    old_lp, old_ent = update.Actor(cfg, b).old_stats(batch)
    steps = []
    real_step = b.step
    b.step = lambda **kw: steps.append(1) or real_step(**kw)
    update_once(cfg, b, batch, old_lp, old_ent)
    assert len(steps) == 5  # chunk(5) of 8 rows: 4 steps

    one = make_cfg("s2t", algorithm={"mini_batches": 1, "s2t": s2t}, share_prompt_prefix=False)
    ref = sgd_backend(one, model)
    parts = global_minibatches([8], 5, torch.Generator().manual_seed(loop.derive_seed(cfg.trainer.seed, 1, 0)))
    assert sorted(len(p) for p in parts) == [1, 1, 2, 2, 2]
    for rows in parts:
        update_once(one, ref, batch.rows(rows), old_lp[rows], old_ent[rows])
    for (n, p), (_, q) in zip(b.model.named_parameters(), ref.model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=n)

    nine = make_cfg("s2t", algorithm={"mini_batches": 9, "s2t": s2t}, rollout={"prompts_per_step": 9, "n": 2})
    with pytest.raises(ValueError, match=r"8 rows for algorithm.mini_batches=9"):
        update_once(nine, sgd_backend(nine, model), batch, old_lp, old_ent)
