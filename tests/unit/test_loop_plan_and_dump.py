"""The loop's batch plan, token dumps and logged counts, on the real loop with a tiny random model
(1 process).

The multi-rank halves of 1, 2 and 5 (lockstep, collective-safe dumps and validation, global
metrics) need 2 ranks: tests/e2e/test_multirank_loop.py. Here:

1. the batch decision and the update plan are global (pure functions of every rank's counts);
2. the token dump runs no forward of its own outside the trainer backend (under ZeRO-3 a bare
   ``model(...)`` on rank 0 issues all-gathers the other ranks never join);
3. the dumped weights and logged silenced counts are the update's own: a dumped token has weight 0
   exactly when it got zero gradient in that step's update (2 mini-batches, thresholds per update);
4. the dump's p, H, sum q^2 and top-k describe ONE distribution: the sampled (pre-update) policy at
   the sampling temperature, checked against an independent full-logits computation;
5. logged counts are sums (``stapo/silenced_count`` = frac x tokens), ``batch/sequences`` is logged.
(fp32 accumulation of the LM-head gradient: tests/unit/test_tokenstats_accum.py.)
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from stapo.configs import preset_path
from stapo.core.batch import Batch
from stapo.core.config import load_config
from stapo.core.tracking import read_jsonl
from stapo.core.train.loop import train
from stapo.core.train.micro import MicroSpec, micro_batches
from stapo.core.train.run import Run
from stapo.core.trainer.distributed import balanced_quota, even_shard, minibatch_rows
from stapo.core.trainer.torch_backend import TorchBackend

# The shape these tests are calibrated on: a character vocabulary, 2 prompts x 4 responses (the
# tiny preset itself answers with one token from a digits-only vocabulary).
TINY_SHAPE = ["model.tiny.vocab=chars", "data.arithmetic.answer_range=null", "rollout.prompts_per_step=2",
              "rollout.n=4", "trainer.micro_batch_size=4"]
BASE = [*TINY_SHAPE, "logging.live=false", "logging.tensorboard=false", "algorithm.overlong.enabled=true",
        "rollout.max_new_tokens=32", "algorithm.overlong.buffer=31", "trainer.max_steps=1",
        "data.val_size=0", "checkpoint.export_hf=false", "algorithm.s2t.tau_p=0.5",
        "algorithm.s2t.q=0.9", "logging.dump_max_sequences=8", "trainer.lr=1e-4"]


def tiny(*overrides: str):
    return load_config(preset_path("tiny"), [*BASE, *overrides])


# ----------------------------------------------------------------------------- 1: global decisions


def test_balanced_quota_trims_the_global_surplus_evenly():
    assert balanced_quota([3, 1], 2) == [1, 1]
    assert balanced_quota([3, 0], 2) == [2, 0]  # a rank with nothing keeps nothing
    assert balanced_quota([2, 2], 8) == [2, 2]  # short of the target: keep everything
    assert balanced_quota([5, 5, 1], 6) == [3, 2, 1]
    assert sum(balanced_quota([4, 7, 0, 2], 9)) == 9


@pytest.mark.parametrize("counts", [[5, 0], [1, 4], [3, 3], [7, 2, 0]])
@pytest.mark.parametrize("spec", [MicroSpec(2), MicroSpec(2, tokens=9)], ids=["rows", "packed"])
def test_update_plan_same_micro_batches_on_every_rank_and_one_process_split(counts, spec):
    n, mbs = sum(counts), 2
    lengths = torch.tensor([3, 8, 5, 2, 6, 4, 7, 1, 9])[:n]  # uneven real-token counts, global row order
    one = minibatch_rows([n], 0, mbs, torch.Generator().manual_seed(1))
    plans = [minibatch_rows(counts, r, mbs, torch.Generator().manual_seed(1)) for r in range(len(counts))]
    def rank_batch(r: int) -> Batch:  # rank r's rows (their real tokens, left-aligned) + its padding row
        lens = [*lengths[sum(counts[:r]) : sum(counts[: r + 1])].tolist(), 1]
        attn = torch.tensor([[1] * k + [0] * (9 - k) for k in lens])
        return Batch(attn, attn, attn, attn.float())

    for m, global_rows in enumerate(one):  # the same sequences in each mini-batch as one process
        got = []
        for r, p in enumerate(plans):
            off = sum(counts[:r])
            (micros,) = micro_batches(rank_batch(r), [p[m]], spec, min_forwards=0)
            rows = [x.rows for x in micros]
            assert sorted(torch.cat(rows).tolist() if rows else []) == sorted(p[m].tolist())  # each row once
            if spec.tokens:  # within budget, except a longer row alone
                assert all(int(lengths[off + x].sum()) <= spec.tokens or len(x) == 1 for x in rows)
            got += (p[m] + off).tolist()
        assert sorted(got) == sorted(global_rows.tolist())
    batch = rank_batch(0)
    with pytest.raises(ValueError, match="padding row"):  # a rank short of forwards needs its padding row
        micro_batches(batch, [torch.tensor([], dtype=torch.long)], spec, min_forwards=2)
    (micros,) = micro_batches(batch, [torch.tensor([0])], spec, pad_row=counts[0], min_forwards=3)
    assert [(x.rows.tolist(), x.padding) for x in micros] == [([0], False), ([counts[0]], True), ([counts[0]], True)]


def test_even_shard_pads_every_rank_to_the_same_count():
    assert even_shard(list("abcde"), 0, 2) == (["a", "c", "e"], 3)
    assert even_shard(list("abcde"), 1, 2) == (["b", "d", "b"], 2)
    assert even_shard(list("a"), 1, 2) == (["a"], 0)


# ----------------------------------------------------------------------------- 2: no bare forward


def test_dump_runs_no_forward_outside_the_backend(tmp_path):
    """A bare ``model(...)`` outside the backend (and outside generate) is what hangs ZeRO-3."""
    calls = {"bare": 0, "generating": False}
    run = Run.build(tiny(), tmp_path / "run", log=lambda m: None)
    model, engine = run.backend.model, run.engine
    fwd, gen = model.forward, engine.generate

    def counting_forward(*args, **kw):
        if not calls["generating"]:
            calls["bare"] += 1
        return fwd(*args, **kw)

    def generate(*args, **kw):
        calls["generating"] = True
        try:
            return gen(*args, **kw)
        finally:
            calls["generating"] = False

    model.forward, engine.generate = counting_forward, generate  # this run's model and engine only
    train(run)
    assert list((tmp_path / "run" / "dumps").glob("step_*.json"))
    assert calls["bare"] == 0


# ----------------------------------------------------------------------------- 3 + 5: the update's own


def test_dumped_silenced_tokens_are_exactly_the_zero_gradient_tokens(tmp_path, monkeypatch):
    seen = []  # (full row token ids, response mask, d loss / d logp) per micro-batch row
    orig = TorchBackend.token_stats

    def spy(self, ids, attn, resp, *, grad, **kw):
        """S2T reads p and H, so its gradient forwards are ``token_stats(grad=True)``; the hook on
        their log-probs catches d loss / d logp when the mini-batch's backward reaches them."""
        lp, ent = orig(self, ids, attn, resp, grad=grad, **kw)
        if grad:
            grads = torch.zeros(ids.shape, dtype=torch.float64)  # [b, L], filled in backward
            def keep_grad(g: torch.Tensor, out: torch.Tensor = grads) -> None:
                out.copy_(g.detach().double().cpu())

            lp.register_hook(keep_grad)
            for b in range(ids.shape[0]):
                keep = attn[b].bool().cpu()
                seen.append((ids[b].cpu()[keep].tolist(), resp[b].cpu()[keep], grads[b], keep))
        return lp, ent

    monkeypatch.setattr(TorchBackend, "token_stats", spy)
    cfg = tiny("algorithm.mini_batches=2", "trainer.micro_batch_size=2")
    run_dir = tmp_path / "run"
    train(Run.build(cfg, run_dir, log=lambda m: None))
    dump = json.loads((run_dir / "dumps" / "step_000001.json").read_text())
    by_response: dict[tuple, list[list[bool]]] = {}
    for ids, resp, g, keep in seen:
        r = tuple(t for t, m in zip(ids, resp.tolist(), strict=True) if m)
        by_response.setdefault(r, []).append((g[keep][resp] == 0).tolist())
    checked = silenced = 0
    for s in dump["sequences"]:
        if s["advantage"] == 0:
            continue  # no gradient at all: nothing to compare
        zero_grad = by_response[tuple(s["token_ids"])]
        w_zero = [w == 0 for w in s["weight"]]
        assert w_zero in zero_grad, (s["token_ids"], s["weight"], zero_grad)
        assert [c == 0 for c in s["cell"]] == w_zero  # S2T: silenced = the update's lowp_lowh_pos cell
        checked += 1
        silenced += sum(w_zero)
    assert checked and silenced, "the test needs dumped sequences with silenced tokens"
    (row,) = read_jsonl(run_dir / "metrics.jsonl")
    assert row["batch/sequences"] == 8.0
    assert row["stapo/silenced_count"] == pytest.approx(row["stapo/silenced_frac"] * row["tokens/valid"])
    assert row["stapo/silenced_count"] >= silenced  # the dump holds a subset of the batch
    taus = {s["tau_h"] for s in dump["sequences"] if math.isfinite(s["tau_h"])}  # each mini-batch's own (NaN: no
    # candidate); the metric is the mean of the finite ones
    assert min(taus) - 1e-9 <= row["stapo/tau_h"] <= max(taus) + 1e-9
    # independent of the update's code: every row is dumped (8 of 8), so each mini-batch's candidates
    # (A > 0, p < tau_p) are all here; the silenced ones are those below their q-quantile of entropy
    assert len(dump["sequences"]) == 8 and {s["minibatch"] for s in dump["sequences"]} == {0, 1}
    for mb in (0, 1):
        seqs = [s for s in dump["sequences"] if s["minibatch"] == mb]
        cand = [(s, i) for s in seqs for i, p in enumerate(s["prob"]) if s["advantage"] > 0 and p < dump["tau_p"]]
        tau = float(np.quantile([s["entropy"][i] for s, i in cand], dump["q"])) if cand else float("nan")
        assert all(s["tau_h"] == pytest.approx(tau, abs=1e-9, nan_ok=True) for s in seqs)
        want = {(id(s), i) for s, i in cand if s["entropy"][i] < tau}
        got = {(id(s), i) for s in seqs for i, w in enumerate(s["weight"]) if w == 0}
        assert got == want, mb


# ----------------------------------------------------------------------------- 4: one distribution


def test_dump_theorem_data_is_the_sampled_policy_at_the_sampling_temperature(tmp_path):
    temp, k = 0.7, 3
    cfg = tiny(f"rollout.temperature={temp}", f"logging.dump_top_k={k}")
    run = Run.build(cfg, tmp_path / "run", log=lambda m: None)
    before = copy.deepcopy(run.backend.model).eval()
    sampled = []  # (prompt ids, response ids) of every rollout: the engine's own outputs
    gen = run.engine.generate

    def generate(prompts, sampling):
        out = gen(prompts, sampling)
        sampled.extend((list(p), list(c.token_ids)) for p, comps in zip(prompts, out, strict=True) for c in comps)
        return out

    run.engine.generate = generate  # (this run's engine only)
    train(run)
    dump = json.loads((tmp_path / "run" / "dumps" / "step_000001.json").read_text())

    ref = {}
    with torch.no_grad():  # independent: full logits of the pre-update model, softmax at T
        for prompt_ids, response_ids in sampled:
            ids = torch.tensor([prompt_ids + response_ids])
            q = torch.softmax(before(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].double() / temp,
                              dim=-1)  # [R, V]
            p = q.gather(1, torch.tensor(response_ids).unsqueeze(1)).squeeze(1)
            # a dumped sequence names its prompt by its decoded text (the last 500 characters)
            prompt = run.tokenizer.decode(prompt_ids, skip_special_tokens=True)[-500:]
            ref[(prompt, tuple(response_ids))] = (p, -(q * q.log()).sum(-1), (q * q).sum(-1), q.topk(k).values)
    assert dump["sequences"]
    for s in dump["sequences"]:
        p, h, q2, top = ref[(s["prompt"], tuple(s["token_ids"]))]
        torch.testing.assert_close(torch.tensor(s["prob"], dtype=torch.float64), p, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(s["entropy"], dtype=torch.float64), h, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(s["sum_q2"], dtype=torch.float64), q2, atol=1e-5, rtol=1e-4)
        # the gradient norm's p and H: the same (pre-update) forward as sum_q2
        torch.testing.assert_close(torch.tensor(s["dist_prob"], dtype=torch.float64), p, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(s["dist_entropy"], dtype=torch.float64), h, atol=1e-4, rtol=1e-4)
        got_top = torch.tensor([[pr for _, pr in tok] for tok in s["top"]], dtype=torch.float64)
        torch.testing.assert_close(got_top, top, atol=1e-5, rtol=1e-4)
