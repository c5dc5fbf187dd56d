"""Which prompts a step trains on: the uniform seeded-epoch sampler, or Goldilocks (arXiv 2602.14868).

Goldilocks: a *teacher* predicts, from the prompt alone, the prompt's utility for the current policy
y_q = sqrt(p_q (1 - p_q)), the standard deviation of its Bernoulli reward, i.e. the size of the GRPO
signal the group will carry (0 for a prompt always or never solved). Each step:

1. ``select``: a seeded candidate pool of ceil(``pool_factor`` x the round's prompt count) prompts
   (with DAPO's dynamic sampling a round samples ``gen_batch_multiplier`` x ``prompts_per_step``) is
   scored by the teacher, so the share it rejects does not depend on the round's size; each of the
   round's slots keeps the uniform sampler's prompt with probability epsilon, otherwise it takes the
   best-scored candidate not yet chosen (epsilon-greedy). With epsilon = 1 the choice is the uniform
   sampler's, index for index.
2. ``record``: the loop reports each graded group's observed accuracy p_hat (share of correct samples).
3. ``end_step``: observations of every rank are gathered, pushed into a sliding-window replay buffer,
   and the teacher takes ``train_steps`` Adam steps of MSE(pred, sqrt(p_hat (1 - p_hat))) on seeded
   mini-batches from the buffer. Metrics: predicted-vs-observed utility correlation, share of
   zero-variance groups (what the sampler should reduce), teacher loss, its wall time.

The teacher (our choice; the paper's teacher is a language model of its own, too heavy for CPU
runs): hashed word 1-2-gram + character 3-gram features (``hashed_ngrams``, no model) or the mean of
the policy's frozen input embeddings over the prompt tokens (``policy_embeddings``), under a small
head (linear, or one hidden layer) with output 0.5 * sigmoid(z), the range of y.

Determinism and resume: the pool, the greedy slots and the replay mini-batches are drawn from
generators seeded by (seed, step, round); the teacher's weights, optimizer state and buffer are in
``state_dict()`` (JSON-safe, stored in the checkpoint's ``extra``), so a resumed run selects the same
prompts as an uninterrupted one.

DAPO's dynamic sampling (``algorithm.dynamic_sampling``) lives here too, with verl's generation-batch
semantics (``recipe/dapo``'s trainer): each generation round samples ``prompts_per_round(cfg)`` =
ceil(``gen_batch_multiplier`` x ``prompts_per_step``) prompts (verl's ``gen_batch_size``; the DAPO
scripts use 3x), keeps the groups whose accuracies differ, and rounds go on until the kept groups of
every rank together reach ``prompts_per_step`` (then the first ``prompts_per_step`` train) or
``max_gen_rounds`` rounds have run (verl's ``max_num_gen_batches``, 0 = no limit). Out of rounds,
verl raises; ``gen_rounds_exhausted: train`` trains on the under-filled batch instead. Every
decision is taken on global counts, so all ranks run the same rounds (lockstep).
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from stapo.core.batch import derive_seed

__all__ = [
    "prompts_for_step",
    "PromptSampler",
    "UniformSampler",
    "GoldilocksSampler",
    "HashedNgramFeatures",
    "build_sampler",
    "group_utility",
    "prompts_per_round",
    "refill_until_full",
    "RefillResult",
    "DynamicSamplingExhausted",
]


def group_utility(p: float) -> float:
    """sqrt(p (1 - p)): the Bernoulli reward's standard deviation at success rate p."""
    p = min(max(float(p), 0.0), 1.0)
    return math.sqrt(p * (1.0 - p))


def _gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (rank order); ``[obj]`` in a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def _pearson(x: Sequence[float], y: Sequence[float]) -> float:
    if len(x) < 2:
        return float("nan")
    xa, ya = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xa.std() == 0 or ya.std() == 0:
        return float("nan")
    return float(np.corrcoef(xa, ya)[0, 1])


class PromptSampler(Protocol):
    """What the loop calls: ``select`` prompts, ``record`` graded groups, ``end_step`` once per step."""

    def select(self, step: int, round_: int, per_step: int) -> list[int]: ...

    def record(self, indices: Sequence[int], accuracies: Sequence[float], zero_variance: Sequence[bool]) -> None: ...

    def end_step(self, step: int) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _Recorder:
    """Pending observations of the current step (this rank's groups)."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, float, bool]] = []

    def record(self, indices: Sequence[int], accuracies: Sequence[float], zero_variance: Sequence[bool]) -> None:
        if not len(indices) == len(accuracies) == len(zero_variance):
            raise ValueError("record: indices, accuracies and zero_variance must have the same length")
        self.pending.extend((int(i), float(a), bool(z)) for i, a, z in zip(indices, accuracies, zero_variance, strict=True))

    def take_all_ranks(self) -> list[tuple[int, float, bool]]:
        mine, self.pending = self.pending, []
        return [obs for part in _gather_objects(mine) for obs in part]


class UniformSampler(_Recorder):
    """Seeded epochs (:func:`prompts_for_step`); logs the zero-variance share for comparison."""

    def __init__(self, n_prompts: int, seed: int) -> None:
        super().__init__()
        self.n_prompts, self.seed = n_prompts, seed

    def select(self, step: int, round_: int, per_step: int) -> list[int]:

        return prompts_for_step(self.n_prompts, step, per_step, self.seed, round_)

    def end_step(self, step: int) -> dict[str, float]:
        obs = self.take_all_ranks()
        if not obs:
            return {}
        return {"sampler/zero_variance_share": float(np.mean([z for _, _, z in obs]))}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class HashedNgramFeatures:
    """L2-normalized counts of hashed word 1-2-grams and character 3-grams (stable across processes)."""

    def __init__(self, num_features: int) -> None:
        self.dim = num_features

    def _index(self, gram: str) -> int:
        return int.from_bytes(hashlib.blake2b(gram.encode(), digest_size=8).digest(), "little") % self.dim

    def __call__(self, text: str) -> torch.Tensor:
        x = torch.zeros(self.dim, dtype=torch.float32)
        words = re.findall(r"\w+|[^\w\s]", text.lower())
        grams = [f"w:{w}" for w in words] + [f"b:{a} {b}" for a, b in zip(words, words[1:], strict=False)]
        flat = " ".join(words)
        grams += [f"c:{flat[i:i + 3]}" for i in range(max(len(flat) - 2, 0))]
        for g in grams:
            x[self._index(g)] += 1.0
        n = x.norm()
        return x / n if n > 0 else x


class _Head(torch.nn.Module):
    """Linear (or one-hidden-layer) head with output in [0, 0.5], the range of sqrt(p (1 - p))."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        if hidden:
            self.net: torch.nn.Module = torch.nn.Sequential(
                torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
            )
        else:
            self.net = torch.nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N]
        return 0.5 * torch.sigmoid(self.net(x).squeeze(-1))


class GoldilocksSampler(_Recorder):
    """Epsilon-greedy over a teacher-scored candidate pool; the teacher learns online (see module doc).

    ``featurize(i) -> [D]`` gives prompt i's (frozen) features; they are cached per prompt (sparse
    when mostly zero). ``policy_embeddings`` clones the policy's input embedding table to CPU once:
    meant for small policies (a 151k x 4096 table is 2.5 GB); ``hashed_ngrams`` has no such cost.
    """

    def __init__(
        self,
        n_prompts: int,
        featurize: Callable[[int], torch.Tensor],
        dim: int,
        *,
        data_seed: int,
        epsilon: float = 0.1,
        pool_factor: float = 4.0,
        buffer_size: int = 512,
        train_steps: int = 8,
        train_batch_size: int = 64,
        lr: float = 0.05,
        hidden_size: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"goldilocks.epsilon must be in [0, 1], got {epsilon}")
        self.uniform = UniformSampler(n_prompts, data_seed)
        self.n_prompts, self.featurize, self.dim = n_prompts, featurize, dim
        if pool_factor < 1:
            raise ValueError(f"goldilocks.pool_factor must be >= 1 (candidates per slot), got {pool_factor}")
        self.epsilon, self.pool_factor = epsilon, pool_factor
        self.train_steps, self.train_batch_size = train_steps, train_batch_size
        self.seed = seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, 0x601D))
            self.head = _Head(dim, hidden_size)
        self.lr = lr
        self.opt = torch.optim.Adam(self.head.parameters(), lr=lr)
        self.buffer: deque[tuple[int, float]] = deque(maxlen=buffer_size)
        self._cache: dict[int, torch.Tensor] = {}
        self._pred_at_select: dict[int, float] = {}
        self._time_s = 0.0
        self._greedy_slots = 0
        self._slots = 0

    # ----------------------------------------------------------------------------- teacher

    def features(self, idx: Sequence[int]) -> torch.Tensor:
        rows = []
        for i in idx:
            if i not in self._cache:
                x = self.featurize(i).detach().float().reshape(-1)
                # hashed n-grams are ~1-5% non-zero: keep them sparse (17k prompts x 4096 dense = 280 MB)
                self._cache[i] = x.to_sparse() if int((x != 0).sum()) * 4 < x.numel() else x
            x = self._cache[i]
            rows.append(x.to_dense() if x.is_sparse else x)
        return torch.stack(rows) if rows else torch.zeros((0, self.dim))  # [N, D]

    def predict(self, idx: Sequence[int]) -> torch.Tensor:
        """Predicted utility [N] of prompts ``idx``."""
        with torch.no_grad():
            return self.head(self.features(idx))

    # ----------------------------------------------------------------------------- the sampler

    def pool_size(self, per_round: int) -> int:
        """Candidates scored for a round of ``per_round`` prompts: ceil(pool_factor x per_round)."""
        return math.ceil(self.pool_factor * per_round)

    def select(self, step: int, round_: int, per_step: int) -> list[int]:
        t0 = time.perf_counter()
        base = self.uniform.select(step, round_, per_step)
        rng = np.random.default_rng(derive_seed(self.seed, step, round_, 0x5E1))
        greedy = rng.random(per_step) >= self.epsilon  # [per_step]
        out = list(base)
        if greedy.any():
            size = min(self.pool_size(per_step), self.n_prompts)
            pool = rng.choice(self.n_prompts, size=size, replace=False)  # [size] candidates
            pred = self.predict([int(i) for i in pool]).numpy()
            order = sorted(range(len(pool)), key=lambda k: (-float(pred[k]), int(pool[k])))
            taken = {b for b, g in zip(base, greedy, strict=True) if not g}
            ranked = iter(int(pool[k]) for k in order if int(pool[k]) not in taken)
            for s in np.flatnonzero(greedy):
                nxt = next(ranked, None)
                if nxt is None:
                    break
                out[int(s)] = nxt
        for i, p in zip(out, self.predict(out).tolist(), strict=True):
            self._pred_at_select[i] = p
        self._greedy_slots += int(greedy.sum())
        self._slots += per_step
        self._time_s += time.perf_counter() - t0
        return out

    def end_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        obs = self.take_all_ranks()
        metrics: dict[str, float] = {}
        if obs:
            y_obs = [group_utility(a) for _, a, _ in obs]
            idx = [i for i, _, _ in obs]
            y_pred = [self._pred_at_select.get(i, float("nan")) for i in idx]
            metrics["sampler/zero_variance_share"] = float(np.mean([z for _, _, z in obs]))
            pairs = [(p, o) for p, o in zip(y_pred, y_obs, strict=True) if math.isfinite(p)]
            metrics["goldilocks/pred_obs_corr"] = _pearson([p for p, _ in pairs], [o for _, o in pairs])
            metrics["goldilocks/pred_utility_mean"] = float(np.mean([p for p, _ in pairs])) if pairs else float("nan")
            metrics["goldilocks/obs_utility_mean"] = float(np.mean(y_obs))
            self.buffer.extend(zip(idx, y_obs, strict=True))
        metrics["goldilocks/teacher_loss"] = self._train(step)
        metrics["goldilocks/greedy_share"] = self._greedy_slots / max(self._slots, 1)
        metrics["goldilocks/buffer"] = float(len(self.buffer))
        self._pred_at_select.clear()
        self._greedy_slots = self._slots = 0
        self._time_s += time.perf_counter() - t0
        metrics["time/sampler_s"], self._time_s = self._time_s, 0.0
        return metrics

    def _train(self, step: int) -> float:
        """``train_steps`` Adam steps of MSE on seeded replay mini-batches; mean loss (nan if none)."""
        if not self.buffer or not self.train_steps:
            return float("nan")
        items = list(self.buffer)
        g = torch.Generator().manual_seed(derive_seed(self.seed, step, 0x7EA))
        losses = []
        self.head.train()
        for _ in range(self.train_steps):
            pick = torch.randint(len(items), (min(self.train_batch_size, len(items)),), generator=g).tolist()
            x = self.features([items[k][0] for k in pick])  # [b, D]
            y = torch.tensor([items[k][1] for k in pick], dtype=torch.float32)  # [b]
            loss = torch.mean((self.head(x) - y) ** 2)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            losses.append(float(loss.detach()))
        self.head.eval()
        return float(np.mean(losses))

    # ----------------------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save({"head": self.head.state_dict(), "opt": self.opt.state_dict()}, buf)
        return {
            "teacher": base64.b64encode(buf.getvalue()).decode("ascii"),
            "buffer": [[i, y] for i, y in self.buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        blob = torch.load(io.BytesIO(base64.b64decode(state["teacher"])), weights_only=True)
        self.head.load_state_dict(blob["head"])
        self.opt.load_state_dict(blob["opt"])
        for group in self.opt.param_groups:  # the configured rate, not the checkpoint's (a resume may change it)
            group["lr"] = self.lr
        self.buffer.clear()
        self.buffer.extend((int(i), float(y)) for i, y in state["buffer"])


def build_sampler(cfg: Any, prompts: Sequence[Any], *, encode: Callable[[Any], list[int]] | None = None,
                  model: Any = None) -> UniformSampler | GoldilocksSampler:
    """The sampler ``cfg.data.sampler`` names, over ``prompts`` (records with ``.prompt``)."""
    d = cfg.data
    if d.sampler == "uniform":
        return UniformSampler(len(prompts), d.seed)
    g = d.goldilocks
    if g.teacher == "hashed_ngrams":
        feats = HashedNgramFeatures(g.num_features)
        featurize: Callable[[int], torch.Tensor] = lambda i: feats(prompts[i].prompt)  # noqa: E731
        dim = g.num_features
    else:  # policy_embeddings: frozen copy of the input embedding table, on CPU
        if model is None or encode is None:
            raise ValueError("data.goldilocks.teacher=policy_embeddings needs the policy model and its tokenizer")
        table = model.get_input_embeddings().weight.detach().float().cpu().clone()  # [V, H]
        featurize = lambda i: table[torch.tensor(encode(prompts[i]), dtype=torch.long)].mean(0)  # noqa: E731
        dim = table.shape[1]
    return GoldilocksSampler(
        len(prompts), featurize, dim, data_seed=d.seed, epsilon=g.epsilon, pool_factor=g.pool_factor,
        buffer_size=g.buffer_size, train_steps=g.train_steps, train_batch_size=g.train_batch_size, lr=g.lr,
        hidden_size=g.hidden_size, seed=g.seed,
    )


# ----------------------------------------------------------------------------- DAPO dynamic sampling


class DynamicSamplingExhausted(RuntimeError):
    """``max_gen_rounds`` generation rounds kept fewer groups than a step trains on (verl raises too)."""


@dataclass
class RefillResult:
    """What a step's generation rounds produced: the kept sequences (this rank's), rounds run, fill."""

    kept: list[Any]
    rounds: int
    prompts: int  # kept groups over every rank, before trimming
    underfilled: bool


def prompts_per_round(cfg: Any) -> int:
    """Prompts one generation round samples: ``rollout.prompts_per_step``, or with dynamic sampling
    ceil(``algorithm.gen_batch_multiplier`` x it) (verl's ``data.gen_batch_size``)."""
    per_step = cfg.rollout.prompts_per_step
    if not cfg.algorithm.dynamic_sampling:
        return per_step
    return math.ceil(cfg.algorithm.gen_batch_multiplier * per_step)


def refill_until_full(
    first: list[Any],
    sample_round: Callable[[int], list[Any]],
    global_prompts: Callable[[list[Any]], int],
    *,
    want_prompts: int,
    max_rounds: int,
    on_exhausted: str = "train",
) -> RefillResult:
    """verl's DAPO refill loop over kept groups, with the sampling and counting passed in.

    ``first``: round 0's kept sequences; ``sample_round(r)`` runs generation round r >= 1 and returns
    its kept sequences; ``global_prompts(kept)``: kept groups over every rank (the same number on
    each rank, so each takes the same branch). Stops as soon as ``want_prompts`` groups are kept;
    after ``max_rounds`` rounds (0: never) it raises :class:`DynamicSamplingExhausted` (``on_exhausted
    = "error"``, verl) or returns the under-filled batch (``"train"``). Trimming to ``want_prompts`` is
    the caller's (it must split whole groups across ranks)."""
    kept, rounds = list(first), 1
    while True:
        have = global_prompts(kept)
        if have >= want_prompts:
            return RefillResult(kept, rounds, have, underfilled=False)
        if max_rounds > 0 and rounds >= max_rounds:
            if on_exhausted == "error":
                raise DynamicSamplingExhausted(
                    f"dynamic sampling: {rounds} generation rounds (algorithm.max_gen_rounds={max_rounds}) kept "
                    f"{have} groups with mixed outcomes, fewer than the {want_prompts} a step trains on; the data "
                    "may be too hard or too easy for the policy. Raise algorithm.max_gen_rounds (0 = no limit) or "
                    "algorithm.gen_batch_multiplier, or set algorithm.gen_rounds_exhausted=train."
                )
            return RefillResult(kept, rounds, have, underfilled=True)
        kept += sample_round(rounds)
        rounds += 1


def prompts_for_step(n_prompts: int, step: int, per_step: int, seed: int, round_: int = 0) -> list[int]:
    """Indices of a step's prompts: consecutive slices of per-epoch seeded permutations.

    Extra dynamic-sampling rounds (``round_ > 0``) draw from their own seeded stream so that the
    main cursor, and thus every later step, is the same with or without resampling.
    """
    if round_:
        rng = np.random.default_rng(derive_seed(seed, step, round_))
        return [int(i) for i in rng.choice(n_prompts, size=per_step, replace=per_step > n_prompts)]
    out = []
    for i in range((step - 1) * per_step, step * per_step):
        epoch, pos = divmod(i, n_prompts)
        perm = np.random.default_rng(derive_seed(seed, epoch)).permutation(n_prompts)
        out.append(int(perm[pos]))
    return out
