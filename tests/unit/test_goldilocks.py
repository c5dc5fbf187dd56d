"""Goldilocks sampler on a synthetic pool with known success rates: the teacher's ranking converges,
zero-variance groups become rarer than under uniform sampling, epsilon = 1 is uniform, resume is exact."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stapo.core.task.sampler import (
    GoldilocksSampler,
    HashedNgramFeatures,
    UniformSampler,
    group_utility,
    prompts_for_step,
)

N, PER_STEP, G = 240, 8, 8
LEVELS = 12


def _pool() -> tuple[list[str], np.ndarray]:
    """Prompt q's success rate depends on its 'level' word only; the teacher must learn that from text."""
    rng = np.random.default_rng(0)
    texts, p = [], []
    for q in range(N):
        lvl = int(rng.integers(LEVELS))
        texts.append(f"a question about topic{q % 7} at level{lvl}")
        p.append(lvl / (LEVELS - 1))
    return texts, np.asarray(p)


def _sampler(texts: list[str], epsilon: float) -> GoldilocksSampler:
    feats = HashedNgramFeatures(512)
    return GoldilocksSampler(N, lambda i: feats(texts[i]), 512, data_seed=3, epsilon=epsilon, pool_factor=6,
                             buffer_size=400, train_steps=16, train_batch_size=64, lr=0.05, seed=1)


def _simulate(sampler, p: np.ndarray, steps: int) -> tuple[list[float], list[list[int]]]:
    zero_var, picks = [], []
    for step in range(1, steps + 1):
        idx = sampler.select(step, 0, PER_STEP)
        rng = np.random.default_rng(1000 + step)
        acc = [float(rng.binomial(G, p[i]) / G) for i in idx]
        sampler.record(idx, acc, [a in (0.0, 1.0) for a in acc])
        m = sampler.end_step(step)
        zero_var.append(m["sampler/zero_variance_share"])
        picks.append(idx)
    return zero_var, picks


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share their mean rank), 0-based."""
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
            j += 1
        r[order[i : j + 1]] = (i + j) / 2
        i = j + 1
    return r


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


def test_utility_hand_values() -> None:
    assert group_utility(0.5) == 0.5
    assert group_utility(0.0) == group_utility(1.0) == 0.0
    assert group_utility(0.2) == pytest.approx(math.sqrt(0.16))


def test_teacher_ranking_converges_and_zero_variance_falls_below_uniform() -> None:
    texts, p = _pool()
    gold = _sampler(texts, epsilon=0.1)
    zv_gold, _ = _simulate(gold, p, 60)
    zv_unif, _ = _simulate(UniformSampler(N, 3), p, 60)
    true_y = np.sqrt(p * (1 - p))
    pred = gold.predict(list(range(N))).numpy()
    rho = _spearman(pred, true_y)
    assert rho > 0.8, rho
    # after a warm-up, the teacher's picks carry a learning signal more often than uniform picks
    assert np.mean(zv_gold[20:]) < np.mean(zv_unif[20:]) - 0.1, (np.mean(zv_gold[20:]), np.mean(zv_unif[20:]))


def test_epsilon_one_reproduces_uniform() -> None:
    texts, p = _pool()
    _, picks = _simulate(_sampler(texts, epsilon=1.0), p, 10)
    assert picks == [prompts_for_step(N, s, PER_STEP, 3) for s in range(1, 11)]
    assert picks[0] == UniformSampler(N, 3).select(1, 0, PER_STEP)


def test_state_dict_resume_is_exact() -> None:
    texts, p = _pool()
    a = _sampler(texts, epsilon=0.1)
    _simulate(a, p, 12)
    b = _sampler(texts, epsilon=0.1)
    b.load_state_dict(a.state_dict())
    import json

    json.dumps(a.state_dict())  # stored in the checkpoint's meta.json
    for step in (13, 14):
        assert a.select(step, 0, PER_STEP) == b.select(step, 0, PER_STEP)
        for s in (a, b):
            s.record([0, 1], [0.5, 1.0], [False, True])
            s.end_step(step)
    assert a.predict(list(range(N))).tolist() == b.predict(list(range(N))).tolist()


def test_bad_epsilon() -> None:
    texts, _ = _pool()
    with pytest.raises(ValueError, match="epsilon"):
        _sampler(texts, epsilon=1.5)


def test_policy_embeddings_teacher_uses_a_frozen_copy_of_the_policy_table() -> None:
    import torch

    from stapo.core.config import load_config
    from stapo.core.task.data import PromptRecord, encode_prompt
    from stapo.core.task.sampler import build_sampler
    from stapo.core.trainer.models import load_policy

    cfg = load_config(None, ["model.name_or_path=tiny-random", "data.sampler=goldilocks",
                             "data.goldilocks.teacher=policy_embeddings", "data.goldilocks.epsilon=0"])
    model, tok = load_policy(cfg.model, device="cpu")
    recs = [PromptRecord(str(i), f"{i} + {i % 3} =", str(i + i % 3), "t") for i in range(12)]
    s = build_sampler(cfg, recs, encode=lambda r: encode_prompt(tok, r.prompt, chat_template=False), model=model)
    f0 = s.features([3])[0]
    assert f0.shape == (cfg.model.tiny.hidden_size,)
    ids = encode_prompt(tok, recs[3].prompt, chat_template=False)
    torch.testing.assert_close(f0, model.get_input_embeddings().weight[ids].mean(0).detach())
    with torch.no_grad():
        model.get_input_embeddings().weight.add_(1.0)  # training the policy does not move the teacher's input
    s._cache.clear()
    torch.testing.assert_close(s.features([3])[0], f0)
    idx = s.select(1, 0, 4)
    assert len(set(idx)) == 4 and all(0 <= i < 12 for i in idx)
    with pytest.raises(ValueError, match="policy model"):
        build_sampler(cfg, recs)


_TWO_RANK = r"""
import json, sys
import torch.distributed as dist
sys.path.insert(0, {test_dir!r})
import numpy as np
import test_goldilocks as T

dist.init_process_group("gloo")
rank = dist.get_rank()
texts, p = T._pool()
s = T._sampler(texts, epsilon=0.1)
for step in range(1, 9):
    idx = s.select(step, 0, T.PER_STEP)  # every rank picks the same prompts ...
    mine = idx[rank::2]                  # ... and grades its share, as the loop does
    rng = np.random.default_rng(1000 + step * 7 + rank)
    acc = [float(rng.binomial(T.G, p[i]) / T.G) for i in mine]
    s.record(mine, acc, [a in (0.0, 1.0) for a in acc])
    m = s.end_step(step)
print(json.dumps({{"pred": s.predict(list(range(T.N))).tolist(), "buffer": len(s.buffer),
                  "next": s.select(9, 0, T.PER_STEP)}}))
dist.destroy_process_group()
"""


def test_two_ranks_train_identical_teachers_on_everyones_groups(tmp_path) -> None:
    """Real gloo collectives: each rank records its share; both teachers see all groups and agree."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = _TWO_RANK.format(test_dir=os.path.dirname(__file__))
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    a, b = (json.loads(o.strip().splitlines()[-1]) for o, _ in outs)
    assert a["buffer"] == b["buffer"] == 8 * PER_STEP  # every group of both ranks, on both ranks
    assert a["pred"] == b["pred"] and a["next"] == b["next"]


def test_candidate_pool_scales_with_the_round():
    """A generation round of 768 prompts (dynamic sampling's 3 x 256) scores 4 x 768 candidates, as a
    round of 8 scores 32: the teacher rejects three in four at any round size (a fixed pool of 1,024
    for ~691 greedy slots rejected a third)."""
    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.task.sampler import build_sampler, prompts_per_round

    cfg = load_config(preset_path("stapo-goldilocks"), ["data.goldilocks.num_features=64",
                                                        "algorithm.dynamic_sampling=true", "algorithm.gen_batch_multiplier=3"])
    per_round = prompts_per_round(cfg)
    assert per_round == 768
    prompts = [type("P", (), {"prompt": f"question {i}"})() for i in range(5000)]
    sampler = build_sampler(cfg, prompts)
    scored: list[int] = []
    real = sampler.predict
    sampler.predict = lambda idx: scored.append(len(idx)) or real(idx)
    out = sampler.select(1, 0, per_round)
    assert len(out) == per_round and scored[0] == 4 * 768
    sampler.select(2, 0, 8)
    assert scored[2] == 32  # (scored[1]: the chosen prompts' predictions, logged)
