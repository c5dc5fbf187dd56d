"""The rollout phase of a step: sample G responses per prompt, grade them, shape rewards and take
group advantages; DAPO's dynamic sampling (more rounds until enough groups have mixed outcomes).

The one implementation of "sample and grade a step": the synchronous loop (``stapo.core.train.loop``) and
asynchronous rollouts (``stapo.core.rollout.async_rollout``) call :func:`rollout_and_grade`. What it reads
is a :class:`RolloutRun`: the loop passes its run (``stapo.core.train.run.Run``, which has every
field), asynchronous rollouts a :class:`RolloutInputs` with the engine at a version and a reward
function of their own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from stapo.core.algos import dynamic_sampling_filter, dynamic_sampling_values, get_advantage, overlong_penalty
from stapo.core.batch import Sequence_, group_sequences, mean_or_nan
from stapo.core.config import Config
from stapo.core.rollout import SamplingParams
from stapo.core.rollout.base import call_seed
from stapo.core.task.rewards import rule_shares
from stapo.core.task.sampler import PromptSampler, prompts_per_round, refill_until_full
from stapo.core.trainer.distributed import balanced_quota

__all__ = ["RolloutInputs", "RolloutRun", "dynamic_sampling_refill", "mixed_groups", "record_groups", "rollout_and_grade", "rollout_metrics",
           "shape_and_advantage", "trim_kept"]


class RolloutRun(Protocol):
    """What the rollout layer reads of a run, and only reads: the config, an engine, a reward
    function, the prompt sampler and prompts, the prompt encoder, and which share of the step's
    prompts is this rank's. The train layer's ``Run`` and :class:`RolloutInputs` both are one, so the
    rollout layer knows the run without importing the layer above it."""

    @property
    def cfg(self) -> Config: ...

    @property
    def engine(self) -> Any: ...  # generate(prompt_ids, SamplingParams) -> [prompt][sample] Completion

    @property
    def rewards(self) -> Any: ...  # (texts, golds) -> graded rewards (stapo.core.task.rewards.RewardFunction)

    @property
    def sampler(self) -> PromptSampler: ...

    @property
    def train_prompts(self) -> Sequence[Any]: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def encode(self, rec: Any) -> list[int]: ...  # a prompt record's token ids


@dataclass(frozen=True)
class RolloutInputs:
    """What :func:`rollout_and_grade` reads: the config, an engine, a reward function, the prompt
    sampler and prompts, the prompt encoder, and which share of the step's prompts is this rank's."""

    cfg: Config
    engine: Any  # generate(prompt_ids, SamplingParams) -> [prompt][sample] Completion
    rewards: Any  # (texts, golds) -> graded rewards (stapo.core.task.rewards.RewardFunction)
    sampler: Any  # select(step, round, k) -> prompt indices; record(...) learns from the groups
    train_prompts: Sequence[Any]
    encode: Callable[[Any], list[int]]
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of(cls, run: RolloutRun, **changes: Any) -> RolloutInputs:
        """The fields of the loop's ``run``, with ``changes`` (e.g. another ``engine``)."""
        fields = {k: getattr(run, k) for k in ("cfg", "engine", "rewards", "sampler", "train_prompts", "encode")}
        fields.update(rank=int(getattr(run, "rank", 0)), world_size=int(getattr(run, "world_size", 1)))
        return cls(**{**fields, **changes})


def rollout_and_grade(run: RolloutRun, step: int, round_: int, *,
                      record: bool = True) -> tuple[list[Sequence_], dict[str, float]]:
    """Sample G responses for this step's prompts and grade them (``run``: a :class:`RolloutRun`, the
    loop's run or a :class:`RolloutInputs`). ``record``: the prompt sampler learns from the groups
    (asynchronous rollouts record when the learner takes the batch, not when it is generated)."""
    cfg = run.cfg
    idx = run.sampler.select(step, round_, prompts_per_round(cfg))  # uniform: prompts_for_step
    recs = [run.train_prompts[i] for i in idx[run.rank :: run.world_size]]  # this rank's share
    sampling = SamplingParams(
        n=cfg.rollout.n,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=call_seed(cfg.trainer.seed, step, round_, run.rank),
        ignore_eos=cfg.rollout.ignore_eos,
        logprobs=cfg.rollout.async_.enabled,  # only asynchronous rollouts read behaviour log-probs
    )
    # With the hf engine, a step larger than one generate call (rollout.batch_size
    #    sequences) is sampled in waves, and each wave is graded (in a thread; the grader's work runs
    #    in its own processes or service) while the next one generates. Wave 0 keeps the step's seed,
    #    so a single-wave step samples exactly what it did before.
    per_wave = max(1, cfg.rollout.batch_size // cfg.rollout.n) if cfg.rollout.engine == "hf" else len(recs)
    waves = [recs[i : i + per_wave] for i in range(0, len(recs), per_wave)] or [recs]
    seqs: list[Sequence_] = []
    futures = []
    t_grade: list[float] = []

    def grade(wave_seqs: list[Sequence_]) -> Any:
        t = time.time()
        out = run.rewards([s.text for s in wave_seqs], [s.gold for s in wave_seqs])
        t_grade.append(time.time() - t)
        return out

    from concurrent.futures import ThreadPoolExecutor

    t_roll = 0.0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="grade") as pool:
        for w, wave in enumerate(waves):
            params = sampling if w == 0 else replace(sampling, seed=call_seed(sampling.seed or 0, w))
            t1 = time.time()
            groups = run.engine.generate([run.encode(r) for r in wave], params)
            t_roll += time.time() - t1
            base = len(seqs) // cfg.rollout.n
            wave_seqs = [
                Sequence_(run.encode(rec), list(c.token_ids), c.finish_reason, c.text, rec.answer, group=base + g)
                for g, (rec, comps) in enumerate(zip(wave, groups, strict=True))
                for c in comps
            ]
            seqs += wave_seqs
            futures.append((wave_seqs, pool.submit(grade, wave_seqs)))
        t_wait = time.time()
        failed = retried = no_answer = 0
        for wave_seqs, fut in futures:
            graded = fut.result()
            for s, r, v, c in zip(wave_seqs, graded.rewards, graded.valid, graded.correct, strict=True):
                s.reward, s.valid, s.correct = r, v, c
            failed += graded.valid.count(False)  # no reward computed: timeout, error, undecided
            retried += graded.retried
            no_answer += graded.statuses.get("no_answer", 0)
    if record:
        record_groups(run, idx[run.rank :: run.world_size], seqs)  # the sampler learns from observed accuracies
    times = {"time/rollout_s": t_roll, "time/reward_s": time.time() - t_wait, "time/reward_total_s": sum(t_grade),
             "reward/failed": failed, "reward/retried": retried, "reward/no_answer_frac": no_answer / max(len(seqs), 1),
             **rule_shares([fut.result() for _, fut in futures])}
    return seqs, times


def sample_and_grade(engine: Any, prompt_ids: list[list[int]], recs: Sequence[Any], sampling: SamplingParams,
                     rewards: Callable[[list[str], list[str]], Any]) -> list[Sequence_]:
    """One generate call over ``prompt_ids`` (the engine woken for it, put to sleep after), its responses
    graded: ``sampling.n`` sequences per prompt, grouped by prompt, with reward, valid and correct set
    (``recs``: each prompt's record, for its gold answer). What ``stapo calibrate`` and ``stapo probe``
    sample outside the loop; :func:`rollout_and_grade` adds the loop's waves, overlapped grading,
    data-parallel shares and metrics."""
    engine.wake()
    groups = engine.generate(prompt_ids, sampling)
    engine.sleep()
    seqs = [Sequence_(ids, list(c.token_ids), c.finish_reason, c.text, rec.answer, group=g)
            for g, (rec, ids, comps) in enumerate(zip(recs, prompt_ids, groups, strict=True)) for c in comps]
    graded = rewards([s.text for s in seqs], [s.gold for s in seqs])
    for s, r, v, c in zip(seqs, graded.rewards, graded.valid, graded.correct, strict=True):
        s.reward, s.valid, s.correct = r, v, c
    return seqs


def record_groups(run: RolloutRun, idx: Sequence[int], seqs: list[Sequence_]) -> None:
    """Tell the prompt sampler each valid group's accuracy and whether its rewards were all equal."""
    groups = group_sequences(seqs)
    ok = [(i, g) for i, g in zip(idx, (groups.get(k, []) for k in range(len(idx))), strict=True)
          if g and all(s.valid for s in g)]
    run.sampler.record([i for i, _ in ok], [mean_or_nan([float(s.correct) for s in g]) for _, g in ok],
                       [len({s.reward for s in g}) == 1 for _, g in ok])


def shape_and_advantage(cfg: Config, seqs: list[Sequence_]) -> list[Sequence_]:
    """Overlong shaping, drop groups with a failed reward, group advantages; returns kept sequences."""
    if cfg.algorithm.overlong.enabled:
        lengths = torch.tensor([len(s.response_ids) for s in seqs], dtype=torch.float32)
        pen = overlong_penalty(
            lengths,
            max_len=cfg.rollout.max_new_tokens,
            buffer=cfg.algorithm.overlong.buffer,
            penalty=cfg.algorithm.overlong.penalty,
        )
        for s, p in zip(seqs, pen.tolist(), strict=True):
            s.reward += p
    groups = [g for g in group_sequences(seqs).values() if all(s.valid for s in g)]
    if not groups:
        return []
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)  # [P, G]
    adv = get_advantage(cfg.algorithm.advantage)(rewards, eps=cfg.algorithm.adv_eps)  # [P, G]
    for g, row in zip(groups, adv.tolist(), strict=True):
        for s, a in zip(g, row, strict=True):
            s.advantage = a
    return [s for g in groups for s in g]


def mixed_groups(seqs: list[Sequence_], metric: str = "acc") -> list[Sequence_]:
    """DAPO dynamic sampling: keep only groups whose accuracies (``metric="acc"``, DAPO) or shaped
    rewards (``"reward"``) are not all equal."""
    groups = list(group_sequences(seqs).values())
    if not groups:
        return []
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)  # [P, G]
    correct = torch.tensor([[float(s.correct) for s in g] for g in groups], dtype=torch.float32)  # [P, G]
    keep = dynamic_sampling_filter(dynamic_sampling_values(rewards, correct, metric=metric))  # [P]
    return [s for g, k in zip(groups, keep.tolist(), strict=True) if k for s in g]


def trim_kept(kept: list[Sequence_], want: int, n: int, dp: Any) -> list[Sequence_]:
    """Cut the GLOBAL kept batch to ``want`` sequences (whole groups of ``n``).

    One process: the first ``want``, as DAPO fills its batch. Data parallel: the ranks' kept group
    counts are all-gathered and :func:`stapo.core.trainer.distributed.balanced_quota` says how many groups
    each keeps, so the global batch has ``min(want, total)`` sequences spread as evenly as possible.
    """
    if not dp.multi:
        return kept[:want]
    quota = balanced_quota(dp.counts(len(kept) // n), want // n)
    return kept[: quota[dp.rank] * n]


def rollout_metrics(dp: Any, all_seqs: Sequence[Sequence_], metrics: dict[str, float]) -> dict[str, float]:
    """Reward, accuracy and length metrics over EVERY rank's sampled sequences (one all_gather).

    Also sums the per-rank reward failure / retry counts; ``_tokens`` (global response tokens) is
    for the throughput metric.
    """
    lengths = [len(s.response_ids) for s in all_seqs]
    rewards = [s.reward for s in all_seqs]
    local = [
        float(len(all_seqs)), math.fsum(rewards), math.fsum(r * r for r in rewards),
        float(sum(s.correct for s in all_seqs)), float(sum(lengths)),
        float(sum(s.finish_reason == "length" for s in all_seqs)),
        float(metrics.get("reward/failed", 0.0)), float(metrics.get("reward/retried", 0.0)),
        float(metrics.get("reward/no_answer_frac", 0.0)), float(max(lengths, default=0)),
    ]
    rows = dp.gather_rows(local)
    tot = [math.fsum(col) for col in zip(*rows, strict=True)]
    n = tot[0]
    mean = tot[1] / n if n else float("nan")
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(tot[2] / n - mean * mean, 0.0)) if n else float("nan"),
        "reward/accuracy": tot[3] / n if n else float("nan"),
        "response_length/mean": tot[4] / n if n else float("nan"),
        "response_length/max": max(r[9] for r in rows),
        "response_length/clip_ratio": tot[5] / n if n else float("nan"),
        "reward/failed": tot[6],
        "reward/retried": tot[7],
        "reward/no_answer_frac": tot[8] / len(rows),  # equal shares of the step's prompts per rank
        "_tokens": tot[4],
    }


def dynamic_sampling_refill(run: RolloutRun, step: int, kept: list[Any], all_seqs: list[Any], metrics: dict[str, float],
                            dp: Any) -> list[Any]:
    """The loop's dynamic-sampling step: filter round 0 (``kept``), refill, trim to the step's batch.

    Appends every sampled sequence to ``all_seqs`` (for rollout metrics and DEEP-GRPO) and adds the
    rounds' timings and counts to ``metrics``; returns this rank's share of the trimmed batch."""
    cfg = run.cfg
    a, n = cfg.algorithm, cfg.rollout.n

    def sample_round(round_: int) -> list[Any]:
        more, m2 = rollout_and_grade(run, step, round_)
        for key in ("time/rollout_s", "time/reward_s", "reward/failed", "reward/retried"):
            metrics[key] = metrics.get(key, 0.0) + m2.get(key, 0.0)
        for s in more:
            s.group += 10_000 * round_  # group ids stay unique across rounds
        all_seqs.extend(more)
        return mixed_groups(shape_and_advantage(cfg, more), a.dynamic_sampling_metric)

    res = refill_until_full(
        mixed_groups(kept, a.dynamic_sampling_metric), sample_round, lambda k: dp.total(len(k)) // n,
        want_prompts=cfg.rollout.prompts_per_step, max_rounds=a.max_gen_rounds, on_exhausted=a.gen_rounds_exhausted,
    )
    out = trim_kept(res.kept, cfg.rollout.prompts_per_step * n, n, dp)
    metrics["dapo/kept_groups"] = dp.total(len(out)) / n
    metrics["dapo/gen_rounds"] = float(res.rounds)
    metrics["dapo/underfilled"] = float(res.underfilled)
    return out
