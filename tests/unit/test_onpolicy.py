"""The on-policy fast path and prompt-prefix sharing (stapo.core.onpolicy) against today's path.

* ``onpolicy_update`` (one gradient forward per micro-batch, weights from its own detached stats)
  vs ``loop.token_stats_batched`` + ``loop.update_policy`` (separate no-grad pass, fused loss): the
  same accumulated gradient at the optimizer step, to 1e-6 (parameters after AdamW are not
  compared: its g / sqrt(v) turns a 1e-9 difference on a near-zero gradient into +-lr), for S2T with silencing
  across uneven micro-batches (mini-batch-wide tau_h and normalizer), for the stats-free ``none``
  weighting, with and without prefix sharing; the returned statistics equal the separate pass's.
* ``prefix_shared_token_stats`` vs ``compute_token_stats``: values and parameter gradients.
* ``loop.train`` with the fast path runs no no-grad statistics pass (fails on the old loop).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from stapo.core import loop, onpolicy
from stapo.core.config import config_from_dict
from stapo.core.models import load_policy
from stapo.core.trainer.base import compute_token_stats
from stapo.core.trainer.torch_backend import TorchBackend

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64, "seed": 0}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# configs/tiny.yaml as it was when these tests were calibrated (character vocabulary, 2 prompts x 4
# responses of up to 8 tokens); the preset now answers with one token from a digits-only vocabulary.
TINY_SHAPE = ["model.tiny.vocab=chars", "data.arithmetic.answer_range=null", "rollout.prompts_per_step=2",
              "rollout.n=4", "rollout.max_new_tokens=8", "trainer.micro_batch_size=4"]

def make_cfg(weighting="s2t", micro=3, **trainer):
    t = {"device": "cpu", "lr": 1e-2, "logits_chunk_size": 7, "micro_batch_size": micro, "max_grad_norm": 1e3}
    t.update(trainer)
    return config_from_dict({
        "model": {"name_or_path": "tiny-random", "tiny": TINY},
        "trainer": t,
        "algorithm": {"token_weighting": weighting, "s2t": {"tau_p": 0.5, "tau_h_quantile": 0.5}},
    })


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
    return loop.collate(seqs, pad_id=0)


def backend_and_run(cfg, model):
    b = TorchBackend(cfg, copy.deepcopy(model), total_optimizer_steps=4)
    grads = {}
    real_step = b.step

    def step():
        grads.update({n: p.grad.detach().clone() for n, p in b.model.named_parameters() if p.grad is not None})
        return real_step()

    b.step = step
    return b, SimpleNamespace(cfg=cfg, backend=b), grads


@pytest.mark.parametrize(
    ("weighting", "micro", "share"),
    [("s2t", 3, False), ("s2t", 3, True), ("s2t", 8, True), ("none", 3, True), ("none", 3, False)],
)
def test_fast_path_is_the_two_pass_update(weighting, micro, share):
    cfg = make_cfg(weighting, micro, share_prompt_prefix=share)
    model, _ = load_policy(cfg.model, device="cpu")
    batch = grouped_batch(model.config.vocab_size)

    ref_b, ref_run, ref_grads = backend_and_run(cfg, model)
    old_lp, old_ent = loop.token_stats_batched(ref_b, batch, micro, 1.0)
    ref_metrics = loop.update_policy(ref_run, batch, old_lp, old_ent, step=1)

    b, run, grads = backend_and_run(cfg, model)
    assert onpolicy.onpolicy_applies(cfg, b, batch.input_ids.shape[0])
    calls = {"nograd": 0}
    real_stats = b.token_stats

    def token_stats(*a, grad, **k):
        calls["nograd"] += not grad
        return real_stats(*a, grad=grad, **k)

    b.token_stats = token_stats
    metrics, lp, ent = onpolicy.onpolicy_update(run, batch, step=1)
    assert calls["nograd"] == 0
    if weighting == "s2t":  # the test must exercise silencing: some, not all, positive-A tokens
        assert 0 < metrics["stapo/silenced_count"] < batch.response_mask.sum()
    # the diagnostics are the update's own on both paths: same silenced count, threshold, cells
    for k in ("stapo/silenced_count", "stapo/tau_h", "tokens/valid", "entropy/p05"):
        assert metrics[k] == pytest.approx(ref_metrics[k], abs=1e-6), k
    for k in (k for k in ref_metrics if k.startswith("phase/")):
        assert metrics[k] == pytest.approx(ref_metrics[k], abs=1e-9), k
    torch.testing.assert_close(lp, old_lp, atol=1e-6, rtol=1e-6)  # |lp| ~ 5: fp32 rounding is ~6e-7
    torch.testing.assert_close(ent, old_ent, atol=1e-6, rtol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=1e-5, msg=n)
    for k in ("actor/loss", "actor/clip_frac_low", "actor/clip_frac_high", "actor/ratio_mean"):
        assert metrics[k] == pytest.approx(ref_metrics[k], abs=1e-6), k


def test_prefix_sharing_matches_full_rows_values_and_gradients():
    cfg = make_cfg()
    model, _ = load_policy(cfg.model, device="cpu")
    batch = grouped_batch(model.config.vocab_size, seed=3)
    first, group = onpolicy.prompt_groups(batch.input_ids, batch.attention_mask, 5)
    assert first.tolist() == [0, 4] and group.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    shuffled = torch.tensor([5, 0, 6, 1, 2, 7, 3, 4])  # groups need not be adjacent
    first, group = onpolicy.prompt_groups(batch.input_ids[shuffled], batch.attention_mask[shuffled], 5)
    assert first.tolist() == [0, 1] and group.tolist() == [0, 1, 0, 1, 1, 0, 1, 0]
    probe = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(0))

    def run(fn):
        model.zero_grad()
        lp, ent = fn(model, batch.input_ids, batch.attention_mask, batch.response_mask, chunk_size=7)
        (lp * probe).sum().backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lp_a, ent_a, g_a = run(compute_token_stats)
    lp_b, ent_b, g_b = run(onpolicy.prefix_shared_token_stats)
    assert (lp_a != 0).sum() == batch.response_mask.sum()  # every response token has a log-prob
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=0)
    for n in g_a:
        torch.testing.assert_close(g_b[n], g_a[n], atol=1e-5, rtol=1e-4, msg=n)


def test_fast_path_off_on_and_auto():
    model, _ = load_policy(make_cfg().model, device="cpu")
    b = TorchBackend(make_cfg(), model, total_optimizer_steps=1)
    assert onpolicy.onpolicy_applies(make_cfg(), b, 8)  # CPU: graphs kept
    assert not onpolicy.onpolicy_applies(make_cfg(onpolicy_fast_path="never"), b, 8)
    off_policy = config_from_dict({**make_cfg().model_dump(), "algorithm": {"ppo_epochs": 2}})
    assert not onpolicy.onpolicy_applies(off_policy, b, 8)
    b.device = torch.device("cuda")  # only read by the rule: several micro-batches on a GPU keep two passes
    assert not onpolicy.onpolicy_applies(make_cfg(), b, 8)
    assert onpolicy.onpolicy_applies(make_cfg(micro=8), b, 8)
    assert onpolicy.onpolicy_applies(make_cfg("none"), b, 8)
    assert onpolicy.onpolicy_applies(make_cfg(onpolicy_fast_path="always"), b, 8)


def test_loop_runs_no_separate_statistics_pass(tmp_path, monkeypatch):
    from stapo.configs import preset_path
    from stapo.core.config import load_config

    cfg = load_config(preset_path("tiny"), [*TINY_SHAPE, "trainer.max_steps=1", "checkpoint.every=0", "data.val_size=0",
                                            "logging.dump_tokens_every=1", "logging.live=false"])
    passes, stats = [], []
    real_batched, real_shared = loop.token_stats_batched, onpolicy.prefix_shared_token_stats
    monkeypatch.setattr(loop, "token_stats_batched", lambda *a, **k: passes.append(1) or real_batched(*a, **k))

    def shared(*a, **k):
        stats.append(torch.is_grad_enabled())
        return real_shared(*a, **k)

    monkeypatch.setattr(onpolicy, "prefix_shared_token_stats", shared)
    loop.train(cfg, tmp_path, log=lambda m: None)
    assert not passes  # fails on the two-pass loop: it runs token_stats_batched (no grad) every step
    assert stats and all(stats)  # the statistics came from gradient forwards (prompt prefix shared)
    assert (tmp_path / "dumps" / "step_000001.json").is_file()  # token dumps still get p and H


def test_waves_are_graded_while_the_next_wave_generates(tmp_path, monkeypatch):
    """rollout.batch_size < prompts x n: wave 0 is graded in a thread while wave 1 generates."""
    import threading
    import time

    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.rewards import RewardFunction
    from stapo.core.rollout.hf import HFRolloutEngine

    cfg = load_config(preset_path("tiny"), [*TINY_SHAPE, "trainer.max_steps=1", "checkpoint.every=0", "data.val_size=0",
                                            "logging.dump_tokens_every=0", "logging.live=false",
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
    loop.train(cfg, tmp_path, log=lambda m: None)
    kinds = [e[0] for e in events]
    assert kinds.count("gen_start") == 2 and [e[1] for e in events if e[0] == "gen_start"] == [1, 1]
    assert events[0][2] != events[kinds.index("gen_start", 1)][2]  # each wave its own seed
    assert kinds.index("grade_start") < kinds.index("gen_start", 1) < kinds.index("grade_end")
    assert all(e[1] for e in events if e[0] == "grade_start")  # graded off the main thread
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert '"time/reward_total_s"' in rows[0]
