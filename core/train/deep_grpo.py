"""DEEP-GRPO (Guo et al. 2026, arXiv 2602.14169) in one place: pivot utility, the online logistic
recoverability model, pivot sampling, branch masks, local advantages, and the loop hook that
runs them with the local (branch) loss.

The paper picks *pivots* in failed rollouts, states deep enough to be worth branching from and still
recoverable, with the utility

    Q(t) ∝ P(success | r_t) · r_t^gamma,   r_t = t / T   (t: prefix length, T: the rollout's length)

where P is a 1-D logistic regression on r_t, refit online on a sliding window of branch outcomes
(r, success). K branches are resampled from each pivot's prefix and trained with a *local* loss
that is added to the global GRPO loss with weight lambda; the prefix the branches share is masked
out of the local term (its tokens already carry the global term's gradient).

Details from the authors' code (github.com/AgentCombo/DEEP-GRPO, ``recipe/deep_grpo/
branching_strategy.py``, ``UtilitySamplingStrategy``): the window holds the last 10000 outcomes; the
model is refit before each selection once the window holds more than 10 outcomes of both classes
(until then P = 1, i.e. depth alone decides); pivots are drawn *without replacement* with
probability Q / sum Q; gamma (``position_bias``) = 0.1; K (``branches_per_point``) = 8; one pivot
per failed chain (``n_branch_points``) and lambda (``branch_chain_loss_lambda``) = 1.0. The
authors' logistic model is scikit-learn's default (L2, C = 1, intercept not penalized); ours fits
the same objective by Newton's method, so scikit-learn is not a dependency.

A loop hook (``deep_grpo``, ``stapo.core.train.hooks.LoopHook``, registered here; nothing in ``stapo.core.train.loop`` knows
about DEEP-GRPO): ``on_batch`` runs :meth:`DeepGRPO.rollout_branches` on the step's rollouts,
``before_update`` returns :meth:`DeepGRPO.local_loss` as its contribution to the update (:class:`LocalLoss`),
``after_update`` logs the local term, ``state_dict`` carries the recoverability model across a resume.

``rollout_branches``: up to ``max_pivots`` failed rollouts (valid reward, not correct, >= 2 tokens)
are picked uniformly without replacement (seeded by step; the cap and the uniform pick among
failures are ours); for each, a pivot t is drawn with probability Q(t) ∝ P(success | t/T) (t/T)^gamma
(:func:`sample_pivot`), and K branches are generated from prompt + response[:t] through the
rollout engine's ``generate_from_prefix`` with the remaining token budget. Branches are graded on
prefix + continuation, shaped and given advantages within their pivot's group exactly as root
groups are (``shape_and_advantage``), then take their local advantage: by default the authors'
reward - mean of the pivot's K branch rewards (``deep_grpo.local_advantage: mean_baseline``; ``grpo``
keeps the run's own estimator, our earlier variant). The recoverability model gets one sample per
pivot, (t/T, any of its K branches succeeded), as the authors' ``BranchingFeedback`` does
(``deep_grpo.outcome: any_of_k``; ``per_branch``, one sample per branch, is our earlier variant).

``local_loss``: a contribution whose rows the update (``Actor.update``) runs right before each
optimizer step; they add lambda * L_local to the accumulated gradient, where L_local is the configured policy loss
with the configured token weighting and aggregation over the branch rows of that mini-batch, with the
shared prefix masked out (only continuation tokens count, in the loss and in its normalizer). So the
update is grad(L_global) + lambda grad(L_local), each stream under its own normalizer: the authors'
default ``teacher_loss_reduction: separate_stream_mean`` (``verl/trainer/config/actor/actor.yaml``;
``dp_actor.py``: ``pg_loss = pg_loss_main + branch_loss_coef * pg_loss_branch``, each a token mean
of its own stream; their ``mixed_token_mean`` alternative pools the streams under one normalizer).
With lambda = 0 there is no contribution and the update is plain GRPO's, bit for bit. Truncated branch rows
leave the local loss with DAPO's overlong filter on (:func:`loss_branches`), as the root rows leave
the policy loss. S2T's tau_h^(q) is each local mini-batch's own: the quantile over its continuation
tokens' candidates under the current policy (global over ranks), as the root rows' update takes it.

Micro-batching: the branch rows' no-grad pass and the local loss's forwards/backwards are split as
the policy update's (``stapo.core.train.micro.micro_batches``): with
``trainer.micro_batch_tokens`` rows are packed without padding into token-budget forwards (position
ids restart at each sequence), else ``trainer.micro_batch_size`` rows per forward. The local loss
runs through the actor's own mini-batch pass: p and H come from its gradient forwards (no
no-grad forward), and the weighting and the normalizer see the whole mini-batch, so the gradient is
the same either way (tests/unit/test_deep_grpo.py compares them).

Data parallel (DeepSpeed, ZeRO 0-3): each rank picks pivots among its own failed rollouts, so
counts differ, while ZeRO-3 gathers parameters in every generate step and forward. So every
decision is global: every rank makes max-over-ranks pivot generate calls (a rank with fewer makes
one-token throwaway calls; transformers' ``synced_gpus`` keeps the steps in step), the branch
rows' old log-probs run the same number of forwards (a zero-weight padding row fills in), the
local loss splits the GLOBAL branch rows into mini-batches with ``minibatch_rows`` as the root
update does (the busiest rank's number of micro-batches on every rank), its token weighting reads global statistics and its normalizer is all-reduced, and the
recoverability model is updated with every rank's outcomes in rank order (one model on every
rank). Tested on 2 CPU ranks under ZeRO-3 (tests/e2e/test_multirank_deep.py): it finishes in
lockstep; equality with one process is not tested (each rank samples its branches with its own seed).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from stapo.core.algos import overlong_filter_keep
from stapo.core.algos.advantages import get_advantage
from stapo.core.batch import Batch, Sequence_, collate_with_pad_row, derive_seed, group_sequences
from stapo.core.rollout import SamplingParams
from stapo.core.rollout.base import call_seed
from stapo.core.rollout.rollouts import shape_and_advantage
from stapo.core.train.hooks import Added, LoopHook, StepState, register_hook
from stapo.core.train.micro import Micro, micro_batches, micro_spec
from stapo.core.train.update import Actor, ExtraRows
from stapo.core.trainer.distributed import DataParallel, minibatch_rows

__all__ = ["DeepGRPO", "BranchRollouts", "branch_minibatches", "loss_branches", "set_local_advantages",
           "OnlineLogistic", "pivot_utility", "sample_pivot", "suffix_mask", "branch_ratio", "pivot_outcomes", "local_advantages", "LOCAL_ADVANTAGES"]


# ----------------------------------------------------------------------------- pure parts


def branch_minibatches(n_branch: int, roots: int | None, k: int) -> int:
    """Mini-batches that take branch rows: min(K, floor(N_branch / S)), S = roots // K the root
    mini-batch's rows (the authors' ``num_branch_mbs = min(num_main_mbs, N_branch // S)``); K when
    ``roots`` is None.

        branch_minibatches(10, 64, 4) == 0     # fewer branch rows than one mini-batch (S = 16)
        branch_minibatches(40, 64, 4) == 2     # two full-size branch mini-batches of 20
    """
    if roots is None:
        return min(k, n_branch)
    s = max(1, roots // k)
    return min(k, n_branch // s)

class OnlineLogistic:
    """P(success | r) = sigmoid(w r + b), refit on a sliding window of (r, success) outcomes.

    ``fit`` minimizes sum_i logloss_i + 0.5 w^2 (scikit-learn's default L2 with C = 1, intercept
    unpenalized) by Newton's method; ``predict`` returns 1 until a fit happened (the authors' rule).
    """

    def __init__(self, window: int = 10000, min_samples: int = 10) -> None:
        self.r: deque[float] = deque(maxlen=window)
        self.y: deque[int] = deque(maxlen=window)
        self.min_samples = min_samples
        self.w, self.b = 0.0, 0.0
        self.fitted = False

    def update(self, r: Sequence[float], success: Sequence[bool]) -> None:
        for ri, si in zip(r, success, strict=True):
            if not 0.0 < ri <= 1.0:
                raise ValueError(f"OnlineLogistic: r must be in (0, 1], got {ri}")
            self.r.append(float(ri))
            self.y.append(int(bool(si)))

    def ready(self) -> bool:
        return len(self.y) > self.min_samples and 0 < sum(self.y) < len(self.y)

    def fit(self, iters: int = 50, tol: float = 1e-10) -> bool:
        """Refit if the window allows it (see class doc); returns whether a fit is in place."""
        if not self.ready():
            return self.fitted
        x = np.asarray(self.r, dtype=np.float64)
        y = np.asarray(self.y, dtype=np.float64)
        w, b = self.w, self.b
        for _ in range(iters):
            p = 1.0 / (1.0 + np.exp(-(w * x + b)))
            s = p * (1.0 - p)
            gw = float(np.sum((p - y) * x)) + w  # + d(0.5 w^2)/dw
            gb = float(np.sum(p - y))
            hww = float(np.sum(s * x * x)) + 1.0
            hwb = float(np.sum(s * x))
            hbb = float(np.sum(s)) + 1e-12
            det = hww * hbb - hwb * hwb
            dw = (hbb * gw - hwb * gb) / det
            db = (hww * gb - hwb * gw) / det
            w, b = w - dw, b - db
            if abs(dw) + abs(db) < tol:
                break
        self.w, self.b, self.fitted = float(w), float(b), True
        return True

    def predict(self, r: np.ndarray) -> np.ndarray:
        if not self.fitted:
            return np.ones_like(r, dtype=np.float64)
        return 1.0 / (1.0 + np.exp(-(self.w * np.asarray(r, dtype=np.float64) + self.b)))

    def state_dict(self) -> dict[str, object]:
        return {"r": list(self.r), "y": list(self.y), "w": self.w, "b": self.b, "fitted": self.fitted}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if not state:
            return
        self.r.clear()
        self.y.clear()
        self.r.extend(float(v) for v in state["r"])  # type: ignore[union-attr]
        self.y.extend(int(v) for v in state["y"])  # type: ignore[union-attr]
        self.w, self.b, self.fitted = float(state["w"]), float(state["b"]), bool(state["fitted"])  # type: ignore[arg-type]


def pivot_utility(ratios: np.ndarray, p_success: np.ndarray, gamma: float) -> np.ndarray:
    """Normalized Q = P(success | r) r^gamma over candidate pivots (a distribution over them)."""
    q = np.asarray(p_success, dtype=np.float64) * np.power(np.asarray(ratios, dtype=np.float64), gamma)
    total = q.sum()
    if not total > 0:
        raise ValueError("pivot_utility: every candidate has zero utility")
    return q / total


def sample_pivot(length: int, model: OnlineLogistic, gamma: float, rng: np.random.Generator) -> int:
    """A pivot t in 1..length-1 (the prefix is response[:t]) drawn with probability Q(t).

    Candidates: every proper, non-empty prefix of the failed response (token granularity; the
    authors segment responses into steps first, ``partition_strategy.py``: ours is the finest split).
    """
    if length < 2:
        raise ValueError(f"sample_pivot: a response of {length} token(s) has no proper prefix to branch from")
    t = np.arange(1, length)
    q = pivot_utility(t / length, model.predict(t / length), gamma)
    return int(rng.choice(t, p=q))


def suffix_mask(response_mask: Tensor, prefix_len: Tensor) -> Tensor:
    """The response positions past each row's shared prefix: [N, L] bool.

    ``response_mask`` [N, L] marks a row's response tokens (prefix + continuation, contiguous);
    ``prefix_len`` [N] is how many of them the row shares with its pivot's rollout.
    """
    pos = torch.cumsum(response_mask.long(), dim=1)  # [N, L]: 1-based index within the response
    return response_mask & (pos > prefix_len.unsqueeze(1))


def branch_ratio(t: int, length: int) -> float:
    """r_t = t / T."""
    if not 0 < t <= length:
        raise ValueError(f"branch_ratio: need 0 < t <= T, got t={t}, T={length}")
    return t / length



def pivot_outcomes(
    ratios: Sequence[float], pivots: Sequence[int], valid: Sequence[bool], correct: Sequence[bool], mode: str
) -> tuple[list[float], list[bool]]:
    """The (t/T, success) samples one step's branches add to the recoverability model.

    Per branch i: its pivot's ratio, pivot id, whether its grade is valid and correct. ``any_of_k``
    (the authors' ``BranchingFeedback``): one sample per pivot, success = any of its branches
    succeeded (pivots whose branches all failed to grade add nothing). ``per_branch`` (ours): one
    sample per validly graded branch. Order: pivots (or branches) as they first appear."""
    if not len(ratios) == len(pivots) == len(valid) == len(correct):
        raise ValueError("pivot_outcomes: ratios, pivots, valid and correct must have the same length")
    if mode == "per_branch":
        keep = [i for i, v in enumerate(valid) if v]
        return [float(ratios[i]) for i in keep], [bool(correct[i]) for i in keep]
    if mode != "any_of_k":
        raise ValueError(f"deep_grpo.outcome: unknown {mode!r}; valid: any_of_k, per_branch")
    order: dict[int, tuple[float, bool]] = {}
    for r, p, v, c in zip(ratios, pivots, valid, correct, strict=True):
        if not v:
            continue
        prev = order.get(p)
        order[p] = (float(r), bool(c) or (prev[1] if prev else False))
    return [r for r, _ in order.values()], [y for _, y in order.values()]


#: ``deep_grpo.local_advantage`` -> the advantage estimator (``stapo.core.algos.ADVANTAGES``) over a
#: pivot's K branch rewards; ``None`` = the run's own ``algorithm.advantage``. ``mean_baseline`` is
#: the authors' ``reward - mean(rewards of all continuations)``, i.e. Dr. GRPO's estimator.
LOCAL_ADVANTAGES: dict[str, str | None] = {"mean_baseline": "dr_grpo", "grpo": None}


def local_advantages(rewards: Tensor, mode: str, run_advantage: str, eps: float = 1e-6) -> Tensor:
    """Branch advantages [P, K] from the branch rewards [P, K] (one row per pivot) for ``mode``."""
    if mode not in LOCAL_ADVANTAGES:
        raise ValueError(f"deep_grpo.local_advantage: unknown {mode!r}; valid: {', '.join(LOCAL_ADVANTAGES)}")
    return get_advantage(LOCAL_ADVANTAGES[mode] or run_advantage)(rewards, eps=eps)


# ----------------------------------------------------------------------------- in the loop


def loss_branches(cfg: Any, branches: list[Any]) -> list[Any]:
    """The branch rows the local loss trains on: every branch gets its local advantage within its
    pivot's K branches (:func:`set_local_advantages`, truncated ones included, as DAPO computes group
    statistics before its mask), then, with ``algorithm.overlong.filter``, truncated branches
    (finish reason ``length``) leave the loss, as the root rows do (``OverlongFilter``)."""
    kept = set_local_advantages(cfg, branches)
    if not cfg.algorithm.overlong.filter or not kept:
        return kept
    keep = overlong_filter_keep([s.finish_reason for s in kept]).tolist()  # [N]
    return [s for s, k in zip(kept, keep, strict=True) if k]


def set_local_advantages(cfg: Any, kept: list[Any]) -> list[Any]:
    """Give each kept branch its local advantage within its pivot's K branches
    (``algorithm.deep_grpo.local_advantage``; the shaped rewards, as the global advantages use)."""
    if not kept:
        return kept
    groups = list(group_sequences(kept).values())
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)  # [P, K]
    adv = local_advantages(rewards, cfg.algorithm.deep_grpo.local_advantage, cfg.algorithm.advantage,
                           eps=cfg.algorithm.adv_eps)  # [P, K]
    for g, row in zip(groups, adv.tolist(), strict=True):
        for s, a in zip(g, row, strict=True):
            s.advantage = a
    return [s for g in groups for s in g]


@dataclass
class BranchRollouts:
    """The step's branch rows (collated on the learner's device) and what the local loss needs."""

    seqs: list[Any]  # loop.Sequence_: prompt, prefix + continuation, advantage within the pivot's group
    batch: Any  # loop.Batch
    suffix: torch.Tensor  # [N, L] bool: continuation tokens only (shared prefix masked out)
    old_lp: torch.Tensor  # [N, L]
    old_ent: torch.Tensor  # [N, L]
    counts: list[int] | None = None  # kept branch rows of every rank (data parallel)
    pad_row: int | None = None  # this rank's zero-weight padding row (data parallel)


def collate_branches(run: Any, kept: list[Any], counts: list[int]) -> BranchRollouts:
    """The kept branch rows as the local loss needs them: collated (plus the zero-weight padding row
    under data parallelism), their continuation mask and the sampling policy's statistics from a
    no-grad pass micro-batched as the update's (``trainer.micro_batch_tokens``: packed), with the
    busiest rank's number of forwards on every rank. ``counts``: kept branch rows of every rank."""
    cfg, dp = run.cfg, DataParallel(run.backend)
    batch = collate_with_pad_row(kept, run.pad_id, pad=dp.multi).to(run.backend.device)
    pad_row = len(kept) if dp.multi else None
    prefix_len = torch.tensor([b.prefix_len for b in kept] + ([0] if dp.multi else []),
                              device=batch.response_mask.device)
    suffix = suffix_mask(batch.response_mask, prefix_len)  # [N, L]; the padding row has none
    old_lp, old_ent = Actor(cfg, run.backend).old_stats(batch, counts)
    return BranchRollouts(kept, batch, suffix, old_lp, old_ent, counts, pad_row)


class DeepGRPO(LoopHook):
    """Holds the online recoverability model across steps (saved with checkpoints); the loop's
    ``deep_grpo`` hook when built with the ``run``."""

    name: ClassVar[str] = "deep_grpo"

    def __init__(self, cfg: Any, run: Any = None) -> None:
        self.cfg = cfg
        self.run = run
        self.branches: BranchRollouts | None = None
        o = cfg.algorithm.deep_grpo
        self.opts = o
        self.model = OnlineLogistic(window=o.window, min_samples=o.min_fit_samples)
        self._local: dict[str, float] = {}

    # ----------------------------------------------------------------------------- loop phases

    def on_batch(self, st: StepState) -> dict[str, float]:
        self.branches, m = self.rollout_branches(self.run, st.step, st.seqs)
        return m

    def before_update(self, st: StepState) -> Added:
        roots = sum(st.counts) if st.counts else len(st.kept)  # the step's global root rows
        local = self.local_loss(self.run.backend, self.branches, st.step, roots)
        return Added(contributions=(local,) if local is not None else ())

    def after_update(self, st: StepState) -> dict[str, float]:
        return self.local_metrics(self.run.backend)

    # ----------------------------------------------------------------------------- rollouts

    def rollout_branches(self, run: Any, step: int, seqs: list[Any]) -> tuple[BranchRollouts | None, dict[str, float]]:
        cfg, o = self.cfg, self.opts
        dp = DataParallel(run.backend)
        t0 = time.time()
        failed = [s for s in seqs if s.valid and not s.correct and len(s.response_ids) >= 2]
        rng = np.random.default_rng(derive_seed(cfg.trainer.seed, step, 0xDEE9, run.rank))
        chosen = [failed[i] for i in sorted(rng.choice(len(failed), size=min(o.max_pivots, len(failed)),
                                                       replace=False))] if failed else []
        self.model.fit()  # the authors refit before each selection (same window on every rank: same fit)
        n_pivots = dp.counts(len(chosen))  # a global decision: every rank makes the same generate calls
        if not sum(n_pivots):
            return None, {"deep/pivots": 0.0, "deep/branches": 0.0, "time/deep_rollout_s": time.time() - t0}
        pivots = [sample_pivot(len(s.response_ids), self.model, o.gamma, rng) for s in chosen]
        gen = getattr(run.engine, "generate_from_prefix", None)
        if gen is None:
            raise TypeError(f"algorithm.deep_grpo needs a rollout engine with generate_from_prefix; "
                            f"{type(run.engine).__name__} has none")
        branch_seqs: list[Any] = []
        for p in range(max(n_pivots)):  # data parallel: a rank with fewer pivots makes a throwaway call
            real = p < len(chosen)
            s, t = (chosen[p], pivots[p]) if real else (seqs[0], 1 if len(seqs[0].response_ids) > 1 else 0)
            sampling = SamplingParams(
                n=o.k_branches if real else 1, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                max_new_tokens=cfg.rollout.max_new_tokens - t if real else 1,
                seed=call_seed(cfg.trainer.seed, step, 0xB4A, p, run.rank),
            )
            prefix = list(s.response_ids[:t])
            (comps,) = gen([s.prompt_ids], [prefix], sampling)
            if not real:
                continue
            for c in comps:
                ids = prefix + list(c.token_ids)
                text = run.tokenizer.decode(ids, skip_special_tokens=True)
                b = Sequence_(list(s.prompt_ids), ids, c.finish_reason, text, s.gold, group=p)
                b.prefix_len = t  # type: ignore[attr-defined]
                b.ratio = branch_ratio(t, len(s.response_ids))  # type: ignore[attr-defined]
                branch_seqs.append(b)
        t_gen = time.time() - t0
        if branch_seqs:
            graded = run.rewards([b.text for b in branch_seqs], [b.gold for b in branch_seqs])
            for b, r, v, c in zip(branch_seqs, graded.rewards, graded.valid, graded.correct, strict=True):
                b.reward, b.valid, b.correct = r, v, c
        ok = [b for b in branch_seqs if b.valid]
        r, y = pivot_outcomes([b.ratio for b in branch_seqs], [b.group for b in branch_seqs],
                              [b.valid for b in branch_seqs], [b.correct for b in branch_seqs], o.outcome)
        every = dp.gather_objects((r, y))  # every rank's outcomes, in rank order: one model on every rank
        self.model.update([x for rr, _ in every for x in rr], [x for _, yy in every for x in yy])
        kept = loss_branches(cfg, shape_and_advantage(cfg, branch_seqs)) if branch_seqs else []
        main_tokens, new_tokens, n_ok, n_success, ratio_sum, n_y, n_br = dp.sum([
            sum(len(s.response_ids) for s in seqs), sum(len(b.response_ids) - b.prefix_len for b in branch_seqs),
            len(ok), sum(b.correct for b in ok), sum(b.ratio for b in branch_seqs), len(y), len(branch_seqs)])
        metrics = {  # global over ranks
            "deep/pivots": float(sum(n_pivots)),
            "deep/branches": n_br,
            "deep/branch_success": n_success / n_ok if n_ok else float("nan"),
            "deep/model_samples": n_y,  # outcomes the recoverability model got this step
            "deep/pivot_ratio_mean": ratio_sum / max(n_br, 1.0),
            "deep/extra_token_frac": new_tokens / max(main_tokens, 1.0),
            "deep/logit_w": self.model.w,
            "deep/logit_b": self.model.b,
            "time/deep_rollout_s": t_gen,
        }
        counts = dp.counts(len(kept))
        if not sum(counts):
            return None, metrics
        br = collate_branches(run, kept, counts)
        metrics["time/deep_total_s"] = time.time() - t0
        return br, metrics

    # ----------------------------------------------------------------------------- local loss

    def local_loss(self, backend: Any, br: BranchRollouts | None, step: int,
                   roots: int | None = None) -> LocalLoss | None:
        """The local term of this step as a contribution to the actor's update (``Actor.update``), or
        None (no branches / lambda = 0 / too few branch rows).

        Which mini-batches get branch rows: as the authors' ``dp_actor.update_policy``, the N_branch
        global branch rows fill min(K, floor(N_branch / S)) mini-batches (S = ``roots`` / K, the root
        mini-batch's rows; K = ``algorithm.mini_batches``), the first ones of each epoch, balanced; with
        fewer branch rows than S the step has no local term. ``roots`` None: S = 1 (every mini-batch)."""
        self._local = {}
        lam = float(self.opts.lambda_)
        if br is None or lam == 0.0:
            return None
        counts = br.counts or [br.batch.input_ids.shape[0]]
        k_branch = branch_minibatches(sum(counts), roots, self.cfg.algorithm.mini_batches)
        if k_branch == 0:
            return None
        return LocalLoss(self.cfg, backend, br, counts, step, k_branch, lam, self._local)

    def local_metrics(self, backend: Any = None) -> dict[str, float]:
        """The local term's loss and tokens, summed over ranks (every rank calls this, with the same keys)."""
        if backend is None or not self._local:
            return dict(self._local)
        keys = sorted(self._local)
        return dict(zip(keys, DataParallel(backend).sum([self._local[k] for k in keys]), strict=True))

    # ----------------------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        return {"logistic": self.model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.model.load_state_dict(state.get("logistic", {}))


class LocalLoss:
    """DEEP-GRPO's local loss as a :class:`~stapo.core.train.update.Contribution` to the policy update.

    Before each optimizer step the actor asks for that step's branch rows and runs them through its
    own mini-batch pass, the way it runs the root rows (``stapo.core.train.micro``: packed into token-budget
    forwards without padding with ``trainer.micro_batch_tokens``, every rank making the busiest rank's
    number of forwards; the configured weighting and loss with p and H from the gradient forwards,
    no no-grad forward; the weighting and the global normalizer see the whole mini-batch, so the
    gradient does not depend on the micro-batching), scaled by lambda. The branch rows' response mask
    is their continuation (the shared prefix carries the global term's gradient). At each epoch's
    first step the GLOBAL branch rows are split into ``k_branch`` mini-batches as the root rows are
    (``minibatch_rows``, its own seed); later optimizer steps of the epoch get none."""

    def __init__(self, cfg: Any, backend: Any, br: BranchRollouts, counts: list[int], step: int, k_branch: int,
                 lam: float, sums: dict[str, float]) -> None:
        self.cfg, self.br, self.counts, self.step, self.k_branch = cfg, br, counts, step, k_branch
        self.lam, self.sums = lam, sums
        self.dp = DataParallel(backend)
        # the forwards' rows: the local term's tokens (the continuation) are their response positions
        self.batch = Batch(br.batch.input_ids, br.batch.attention_mask, br.suffix, br.batch.advantages)
        self.plan: list[list[Micro]] = []  # this epoch's forwards, per branch mini-batch

    def rows(self, update: int) -> ExtraRows | None:
        cfg = self.cfg
        epoch, mb = divmod(update, cfg.algorithm.mini_batches)
        if mb == 0:  # a new pass over the GLOBAL branch rows, split like the root rows
            g = torch.Generator().manual_seed(derive_seed(cfg.trainer.seed, self.step, epoch, 0xB7))
            groups = minibatch_rows(self.counts, self.dp.rank, self.k_branch, g)
            self.plan = micro_batches(self.batch, groups, micro_spec(cfg), dp=self.dp, pad_row=self.br.pad_row,
                                      min_forwards=0)
        if mb >= len(self.plan) or not self.plan[mb]:  # no branch row in this mini-batch on any rank
            return None
        return ExtraRows(self.batch, self.plan[mb], self.br.old_lp, self.lam,
                         seed=derive_seed(cfg.trainer.seed, self.step, epoch, mb, 0xB8))

    def done(self, update: int, loss: float, tokens: float) -> None:
        self.sums["deep/local_loss"] = self.sums.get("deep/local_loss", 0.0) + loss
        self.sums["deep/local_tokens"] = self.sums.get("deep/local_tokens", 0.0) + tokens


@register_hook("deep_grpo")
def _deep_grpo_hook(run: Any) -> LoopHook | None:
    return DeepGRPO(run.cfg, run) if run.cfg.algorithm.deep_grpo.enabled else None
