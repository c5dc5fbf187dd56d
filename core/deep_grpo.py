"""DEEP-GRPO in the loop: branch rollouts from pivots of failed rollouts, and the local branch loss.

Two calls from ``stapo.core.loop`` (and nothing else there knows about DEEP-GRPO):

    branches, m = run.deep.rollout_branches(run, step, all_seqs)       # after the step's rollouts
    ...update_policy(..., before_step=run.deep.local_loss_hook(run, branches, step))

``rollout_branches``: up to ``max_pivots`` failed rollouts (valid reward, not correct, >= 2 tokens)
are picked uniformly without replacement (seeded by step; the cap and the uniform pick among
failures are ours); for each, a pivot t is drawn with probability Q(t) ∝ P(success | t/T) (t/T)^gamma
(``stapo.core.algos.deep_grpo``), and K branches are generated from prompt + response[:t] through the
rollout engine's ``generate_from_prefix`` with the remaining token budget. Branches are graded on
prefix + continuation, shaped and given advantages within their pivot's group exactly as root
groups are (``shape_and_advantage``), then take their local advantage: by default the authors'
reward - mean of the pivot's K branch rewards (``deep_grpo.local_advantage: mean_baseline``; ``grpo``
keeps the run's own estimator, our earlier variant). The recoverability model gets one sample per
pivot, (t/T, any of its K branches succeeded), as the authors' ``BranchingFeedback`` does
(``deep_grpo.outcome: any_of_k``; ``per_branch``, one sample per branch, is our earlier variant).

``local_loss_hook``: returns a callable that ``update_policy`` runs right before each optimizer step;
it adds lambda * L_local to the accumulated gradient, where L_local is the configured policy loss
with the configured token weighting and aggregation over the branch rows of that mini-batch, with the
shared prefix masked out (only continuation tokens count, in the loss and in its normalizer). So the
update is grad(L_global) + lambda grad(L_local) (the issue's "added with weight lambda"; the
authors' released code instead pools both streams under one token-mean normalizer,
(sum_main + lambda sum_branch) / (N_main + lambda N_branch) — see docs/algorithms.md). With
lambda = 0 the hook is None and the update is plain GRPO's, bit for bit.

Single data-parallel rank only for now: branch counts differ across ranks, and the local term's
collectives would then not run in lockstep; the loop refuses deep_grpo with more than one rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stapo.core.algos.deep_grpo import (
    OnlineLogistic,
    branch_ratio,
    local_advantages,
    pivot_outcomes,
    sample_pivot,
    suffix_mask,
)

__all__ = ["DeepGRPO", "BranchRollouts", "set_local_advantages"]


def set_local_advantages(cfg: Any, kept: list[Any]) -> list[Any]:
    """Give each kept branch its local advantage within its pivot's K branches
    (``algorithm.deep_grpo.local_advantage``; the shaped rewards, as the global advantages use)."""
    if not kept:
        return kept
    from stapo.core.loop import group_sequences

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


class DeepGRPO:
    """Holds the online recoverability model across steps (saved with checkpoints)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        o = cfg.algorithm.deep_grpo
        self.opts = o
        self.model = OnlineLogistic(window=o.window, min_samples=o.min_fit_samples)
        self._local: dict[str, float] = {}

    # ----------------------------------------------------------------------------- rollouts

    def rollout_branches(self, run: Any, step: int, seqs: list[Any]) -> tuple[BranchRollouts | None, dict[str, float]]:
        from stapo.core.loop import (
            Sequence_,
            collate,
            derive_seed,
            shape_and_advantage,
            stats_temperature,
            token_stats_batched,
        )
        from stapo.core.rollout import SamplingParams

        cfg, o = self.cfg, self.opts
        t0 = time.time()
        failed = [s for s in seqs if s.valid and not s.correct and len(s.response_ids) >= 2]
        rng = np.random.default_rng(derive_seed(cfg.trainer.seed, step, 0xDEE9, run.rank))
        chosen = [failed[i] for i in sorted(rng.choice(len(failed), size=min(o.max_pivots, len(failed)),
                                                       replace=False))] if failed else []
        self.model.fit()  # the authors refit before each selection
        if not chosen:
            return None, {"deep/pivots": 0.0, "deep/branches": 0.0, "time/deep_rollout_s": time.time() - t0}
        pivots = [sample_pivot(len(s.response_ids), self.model, o.gamma, rng) for s in chosen]
        gen = getattr(run.engine, "generate_from_prefix", None)
        if gen is None:
            raise TypeError(f"algorithm.deep_grpo needs a rollout engine with generate_from_prefix; "
                            f"{type(run.engine).__name__} has none")
        branch_seqs: list[Any] = []
        run.engine.wake()
        for p, (s, t) in enumerate(zip(chosen, pivots, strict=True)):
            sampling = SamplingParams(
                n=o.k_branches, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                max_new_tokens=cfg.rollout.max_new_tokens - t,
                seed=derive_seed(cfg.trainer.seed, step, 0xB4A, p, run.rank),
            )
            prefix = list(s.response_ids[:t])
            (comps,) = gen([s.prompt_ids], [prefix], sampling)
            for c in comps:
                ids = prefix + list(c.token_ids)
                text = run.tokenizer.decode(ids, skip_special_tokens=True)
                b = Sequence_(list(s.prompt_ids), ids, c.finish_reason, text, s.gold, group=p)
                b.prefix_len = t  # type: ignore[attr-defined]
                b.ratio = branch_ratio(t, len(s.response_ids))  # type: ignore[attr-defined]
                branch_seqs.append(b)
        run.engine.sleep()
        t_gen = time.time() - t0
        graded = run.rewards([b.text for b in branch_seqs], [b.gold for b in branch_seqs])
        for b, r, v, c in zip(branch_seqs, graded.rewards, graded.valid, graded.correct, strict=True):
            b.reward, b.valid, b.correct = r, v, c
        ok = [b for b in branch_seqs if b.valid]
        r, y = pivot_outcomes([b.ratio for b in branch_seqs], [b.group for b in branch_seqs],
                              [b.valid for b in branch_seqs], [b.correct for b in branch_seqs], o.outcome)
        self.model.update(r, y)
        kept = set_local_advantages(cfg, shape_and_advantage(cfg, branch_seqs))
        main_tokens = sum(len(s.response_ids) for s in seqs)
        new_tokens = sum(len(b.response_ids) - b.prefix_len for b in branch_seqs)
        metrics = {
            "deep/pivots": float(len(chosen)),
            "deep/branches": float(len(branch_seqs)),
            "deep/branch_success": float(np.mean([b.correct for b in ok])) if ok else float("nan"),
            "deep/model_samples": float(len(y)),  # outcomes the recoverability model got this step
            "deep/pivot_ratio_mean": float(np.mean([b.ratio for b in branch_seqs])),
            "deep/extra_token_frac": new_tokens / max(main_tokens, 1),
            "deep/logit_w": self.model.w,
            "deep/logit_b": self.model.b,
            "time/deep_rollout_s": t_gen,
        }
        if not kept:
            return None, metrics
        batch = collate(kept, run.pad_id).to(run.backend.device)
        prefix_len = torch.tensor([b.prefix_len for b in kept], device=batch.response_mask.device)
        suffix = suffix_mask(batch.response_mask, prefix_len)  # [N, L]
        old_lp, old_ent = token_stats_batched(run.backend, batch, cfg.trainer.micro_batch_size,
                                              stats_temperature(cfg))
        metrics["time/deep_total_s"] = time.time() - t0
        return BranchRollouts(kept, batch, suffix, old_lp, old_ent), metrics

    # ----------------------------------------------------------------------------- local loss

    def local_loss_hook(self, run: Any, br: BranchRollouts | None, step: int) -> Callable[[int, bool], None] | None:
        """``before_step(update_index, fresh)`` for ``update_policy``, or None (no branches / lambda = 0)."""
        lam = float(self.opts.lambda_)
        self._local = {}
        if br is None or lam == 0.0:
            return None
        from stapo.core.algos import TokenContext, get_aggregation, get_policy_loss, get_token_weighting
        from stapo.core.loop import (
            derive_seed,
            policy_loss_params,
            stats_temperature,
            token_stats_batched,
            weighting_params,
        )

        cfg, backend = self.cfg, run.backend
        a = cfg.algorithm
        weigh, loss_fn, agg = get_token_weighting(a.token_weighting), get_policy_loss(a.policy_loss), get_aggregation(
            a.aggregation)
        loss_kw = {"eps_low": a.eps_low, "eps_high": a.eps_high, "dual_clip_c": a.dual_clip_c,
                   **policy_loss_params(cfg)}
        micro, temp = cfg.trainer.micro_batch_size, stats_temperature(cfg)
        n = br.batch.input_ids.shape[0]
        chunks: list[torch.Tensor] = []

        def before_step(update: int, fresh: bool) -> None:
            epoch, mb = divmod(update, a.mini_batches)
            if mb == 0:  # a new pass over the branch rows, split like the root rows
                g = torch.Generator().manual_seed(derive_seed(cfg.trainer.seed, step, epoch, 0xB7))
                chunks[:] = list(torch.randperm(n, generator=g).to(br.suffix.device).chunk(a.mini_batches))
            if mb >= len(chunks):
                return
            idx = chunks[mb]
            rows = br.batch.rows(idx)
            mask = br.suffix[idx]  # [b, L]: the shared prefix is out of the local term
            if fresh:
                cur_lp, cur_ent = br.old_lp[idx], br.old_ent[idx]
            else:
                cur_lp, cur_ent = token_stats_batched(backend, rows, micro, temp)
            ctx = TokenContext(logprobs=cur_lp, entropy=cur_ent, advantages=rows.advantages, mask=mask)
            tw = weigh(ctx, **weighting_params(cfg))
            norm = agg.normalizer(tw, mask)
            total = 0.0
            for s in range(0, idx.shape[0], micro):
                r = slice(s, s + micro)
                lp, _ = backend.token_stats(rows.input_ids[r], rows.attention_mask[r], mask[r], grad=True,
                                            temperature=temp)
                per_tok, _ = loss_fn(lp, br.old_lp[idx][r], rows.advantages[r], mask[r], **loss_kw)
                loss = lam * agg.aggregate(per_tok, tw.select(r), normalizer=norm)
                backend.backward(loss)
                total += float(loss.detach())
            self._local["deep/local_loss"] = self._local.get("deep/local_loss", 0.0) + total
            self._local["deep/local_tokens"] = self._local.get("deep/local_tokens", 0.0) + float(mask.sum())

        return before_step

    def local_metrics(self) -> dict[str, float]:
        return dict(self._local)

    # ----------------------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        return {"logistic": self.model.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.model.load_state_dict(state.get("logistic", {}))
