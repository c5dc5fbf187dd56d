"""DAPO dynamic sampling with verl's generation-batch semantics (stapo.core.task.sampler), by hand.

verl's DAPO trainer samples ``gen_batch_size`` prompts per generation round, keeps the groups whose
accuracies differ, and stops once ``train_batch_size`` groups are kept (training on the first ones)
or raises after ``max_num_gen_batches`` rounds (0 = no limit). The refill driver takes the sampling
and the (global) counting as functions, so these tests feed it hand-made rounds.
"""

from __future__ import annotations

import math

import pytest

from stapo.core.config import config_from_dict
from stapo.core.task.sampler import DynamicSamplingExhausted, prompts_per_round, refill_until_full


def groups(tag: str, k: int) -> list[str]:
    """k kept groups of one round (one item per group: counting groups is what the driver does)."""
    return [f"{tag}{i}" for i in range(k)]


def test_prompts_per_round_is_verl_gen_batch_size():
    cfg = lambda **a: config_from_dict({"rollout": {"prompts_per_step": 5, "n": 2}, "algorithm": a})  # noqa: E731
    assert prompts_per_round(cfg(dynamic_sampling=True, gen_batch_multiplier=3)) == 15
    assert prompts_per_round(cfg(dynamic_sampling=True, gen_batch_multiplier=1.5)) == 8  # ceil(7.5)
    assert prompts_per_round(cfg(dynamic_sampling=False, gen_batch_multiplier=3)) == 5  # no filter: no extra prompts
    with pytest.raises(Exception, match="gen_batch_multiplier"):
        cfg(dynamic_sampling=True, gen_batch_multiplier=0.5)


def test_filled_after_three_rounds_keeps_every_kept_group_for_the_trim():
    # want 4 groups; rounds keep 1, 2, 3 -> 1 < 4, 3 < 4, 6 >= 4: filled after 3 rounds (rounds 1 and 2 sampled)
    rounds = {1: groups("b", 2), 2: groups("c", 3)}
    called: list[int] = []

    def sample(r: int) -> list[str]:
        called.append(r)
        return rounds[r]

    res = refill_until_full(groups("a", 1), sample, len, want_prompts=4, max_rounds=10, on_exhausted="error")
    assert called == [1, 2] and res.rounds == 3 and res.prompts == 6 and not res.underfilled
    assert res.kept == ["a0", "b0", "b1", "c0", "c1", "c2"]  # in generation order: the caller trims to the first 4


def test_underfilled_when_rounds_run_out_train_or_error_as_verl():
    # max 2 rounds keep 1 + 2 = 3 < 4
    sample = lambda r: groups("b", 2)  # noqa: E731
    res = refill_until_full(groups("a", 1), sample, len, want_prompts=4, max_rounds=2, on_exhausted="train")
    assert res.underfilled and res.rounds == 2 and res.prompts == 3 and res.kept == ["a0", "b0", "b1"]
    with pytest.raises(DynamicSamplingExhausted, match=r"2 generation rounds .* kept 3 groups .* fewer than the 4"):
        refill_until_full(groups("a", 1), sample, len, want_prompts=4, max_rounds=2, on_exhausted="error")
    # already full after round 0: no further round, even with max_rounds=1
    res = refill_until_full(groups("a", 4), sample, len, want_prompts=4, max_rounds=1, on_exhausted="error")
    assert res.rounds == 1 and not res.underfilled


def test_zero_max_rounds_means_no_limit():
    sample = lambda r: groups(f"r{r}-", 1)  # noqa: E731
    res = refill_until_full([], sample, len, want_prompts=5, max_rounds=0, on_exhausted="error")
    assert res.rounds == 6 and res.prompts == 5 and not res.underfilled


def test_a_larger_generation_batch_fills_where_one_batch_per_round_does_not():
    """256 prompts a step, a filter that keeps 1 group in 3 (floor). verl's 3x batch: 768 sampled,
    256 kept in round 1: full. One 256-prompt batch per round for 3 rounds: 85 + 85 + 85 = 255 < 256."""

    def run(gen: int, max_rounds: int):
        kept_per_round = lambda: groups("g", math.floor(gen / 3))  # noqa: E731
        return refill_until_full(kept_per_round(), lambda r: kept_per_round(), len, want_prompts=256,
                                 max_rounds=max_rounds, on_exhausted="train")

    verl = run(768, 10)
    assert (verl.rounds, verl.prompts, verl.underfilled) == (1, 256, False)
    old = run(256, 3)
    assert (old.rounds, old.prompts, old.underfilled) == (3, 255, True)


def test_decisions_are_global_so_ranks_stay_in_lockstep():
    """Two ranks with different local kept counts take the same decisions: the count is global.
    Rank 0 keeps 0, 1, 1 groups per round, rank 1 keeps 1, 0, 2 (global 1, 2, 5 cumulative; want 4)."""
    local = {0: [0, 1, 1], 1: [1, 0, 2]}
    seen: dict[int, list[str]] = {0: [], 1: []}

    def fake_total(rank: int):
        def total(kept: list[str]) -> int:  # stands for dp.total over ranks at the same round
            r = len([x for x in seen[rank] if x.startswith("round")])
            seen[rank].append(f"round{r}")
            return sum(sum(local[q][: r + 1]) for q in (0, 1))
        return total

    results = [
        refill_until_full(groups(f"r{rank}a", local[rank][0]), lambda r, rank=rank: groups(f"r{rank}x{r}", local[rank][r]),
                          fake_total(rank), want_prompts=4, max_rounds=10, on_exhausted="error")
        for rank in (0, 1)
    ]
    assert [x.rounds for x in results] == [3, 3] and [x.prompts for x in results] == [5, 5]
    assert [len(x.kept) for x in results] == [2, 3]  # different local shares, the same rounds
