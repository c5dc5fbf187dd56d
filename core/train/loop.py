"""The RL loop, read top to bottom: rollouts -> rewards -> advantages -> token weights -> update.

One step of :func:`train`::

    prompts  -> rollouts        (RolloutEngine: hf or vllm; G samples per prompt)
             -> rewards         (verifier: local worker pool or remote URL; failures never a silent 0)
             -> advantages      (grpo / dr_grpo / rloo over each group; DAPO overlong shaping)
             -> dynamic sampling(DAPO: keep groups with mixed rewards, resample to refill)
             -> dump forward    (when dumping: p, H, sum q^2, top-k of the sampled policy, one forward)
             -> old log-probs   (no-grad pass, only where stapo.core.train.update.needs_old_pass says: off-policy
                                 mini-batches, extras that read the sampling policy)
             -> K updates       (stapo.core.train.update: per mini-batch, p and H from the gradient forward ->
                                 token weights -> per-token loss -> aggregation with the GLOBAL
                                 normalizer, so micro-batching and packing never change the update; the
                                 weights' own counts are the logged diagnostics)
             -> weight sync     (trainer -> rollout engine; a no-op when hf shares the model)
             -> metrics, token dump (rank 0 writes), validation, checkpoint

Each phase lives in the module that owns it and none of them imports this one (a test checks):
``stapo.core.batch`` (sequences, the padded batch, seeds), ``stapo.core.rollout.rollouts`` (sample, grade,
shape, advantages, dynamic sampling), ``stapo.core.train.update`` (the update and its diagnostics); this
module strings them together.

Everything a recipe may add (asynchronous rollouts, the prompt sampler's step, DEEP-GRPO, the KL
reference, Lp-Reg, STARE's controller, DAPO's overlong filter) is a hook with one interface, registered
by name (``stapo.core.train.hooks``: ``LoopHook`` phases sample / on_batch / needs_old_stats /
before_update / after_update / after_sync / state_dict); :func:`train` calls the phases and never
branches on a particular extra.

Departures from plain GRPO are all config: the token weighting (``s2t`` is STAPO, arXiv
2602.15620: silence tokens with A > 0, p < tau_p, H < tau_h and drop them from the denominator),
DAPO's clip-higher / dynamic sampling / overlong shaping (arXiv 2503.14476), 20-Entropy's
top-entropy mask (arXiv 2506.01939). No KL by default (kl_coef=0), as in DAPO and JustRL.

Data parallelism (DeepSpeed on N ranks): each rank samples its share of the prompts; every decision
about the batch is global and every rank issues the same collectives whatever its rewards
(``stapo.core.trainer.distributed``: global refill decision and trim, one global mini-batch plan, zero-weight
padding rows); logged metrics are global sums; rank 0 writes files. The token diagnostics
(``stapo/*``, ``phase/*``, the dump's weights) are the update's own weightings, counted per mini-batch.

Determinism: every RNG is re-seeded from (trainer.seed, step) at the start of each step and
prompts come from a seeded permutation indexed by step, so a run resumed from a checkpoint
replays the remaining steps exactly (CPU).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from stapo.core.batch import (
    Batch,
    Sequence_,
    collate_with_pad_row,
    derive_seed,
    mean_or_nan,
    seed_everything,
)
from stapo.core.config import Config
from stapo.core.rollout import SamplingParams
from stapo.core.rollout.rollouts import (
    dynamic_sampling_refill,
    rollout_and_grade,
    rollout_metrics,
    shape_and_advantage,
)
from stapo.core.tracking import LiveView, Tracker, truncate_jsonl
from stapo.core.train.checkpoint import legacy_hook_state, load_checkpoint, save_checkpoint
from stapo.core.train.hooks import StepState
from stapo.core.train.run import Run
from stapo.core.train.rundir import (
    Stopped,
    agree_run_dir,
    open_run_dir,
    stop_at_once,
    stop_at_step_boundary,
    stop_requested,
)
from stapo.core.train.update import (
    UpdateInputs,
    UpdateRecord,
    needs_old_pass,
    stats_temperature,
)
from stapo.core.trainer.base import begin_rollout_step
from stapo.core.trainer.distributed import DataParallel, even_shard

__all__ = ["train", "TrainResult"]


# ----------------------------------------------------------------------------- what a run returns


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    val_before: float | None
    val_after: float | None
    wall_s: float
    notes: dict[str, Any] = field(default_factory=dict)  # the hooks' summary (e.g. S2T's whole-run rate)


# ----------------------------------------------------------------------------- phases of a step


def validate(run: Run) -> dict[str, float]:
    """Accuracy on held-out prompts (greedy by default), global over data-parallel ranks.

    Each rank generates a strided share of the prompts, padded to the same count (every rank makes
    the same generate calls; the HF engine runs them with ``synced_gpus`` under data parallelism),
    and the correct counts and lengths are summed over ranks.
    """
    cfg = run.cfg
    if not run.val_prompts:
        return {}
    dp = DataParallel(run.backend)
    recs, real = even_shard(run.val_prompts, dp.rank, dp.world_size)
    sampling = SamplingParams(
        n=1,
        temperature=cfg.eval.val_temperature,
        top_p=1.0,
        max_new_tokens=cfg.eval.val_max_new_tokens or cfg.rollout.max_new_tokens,
        seed=derive_seed(cfg.trainer.seed, 999_983),
    )
    outs = run.engine.generate([run.encode(r) for r in recs], sampling)[:real]
    texts = [o[0].text for o in outs]
    graded = run.rewards(texts, [r.answer for r in recs[:real]]) if outs else None
    correct = float(sum(graded.correct)) if graded is not None else 0.0
    length = float(sum(len(o[0].token_ids) for o in outs))
    n_correct, n_len, n = dp.sum([correct, length, float(len(outs))])
    return {
        "accuracy": n_correct / n if n else float("nan"),
        "mean_length": n_len / n if n else float("nan"),
        "n": int(n),
    }


def dump_candidates(cfg: Config, seqs: Sequence[Sequence_]) -> list[int]:
    """Local rows worth dumping, best first, at most ``logging.dump_max_sequences``: positive
    advantage (only those can be silenced), then negative, then zero (no gradient at all)."""
    order = sorted(range(len(seqs)), key=lambda i: (seqs[i].advantage <= 0, seqs[i].advantage == 0, i))
    return order[: cfg.logging.dump_max_sequences]


def dump_forward(run: Run, batch: Batch, rows: list[int]) -> dict[str, torch.Tensor]:
    """Theorem 3.1 data of the dump rows from one forward of the PRE-update (sampled) policy at the
    sampling temperature (``Actor.distribution``): p, H, sum q^2 and top-k describe the same
    distribution, on the CPU; every rank makes the same number of forwards (ZeRO-3)."""
    dist = run.actor.distribution(batch, rows, top_k=run.cfg.logging.dump_top_k, pad=True)
    return {k: v.cpu() for k, v in dist.items()}


def dump_tokens(run: Run, step: int, seqs: list[Sequence_], batch: Batch, rows: list[int],
                dist: dict[str, torch.Tensor], record: UpdateRecord, dp: Any) -> None:
    """Bounded token-level dump for `stapo inspect` (format in docs/architecture.md); rank 0 writes.

    ``weight`` is what the update applied (PPO epoch 0; ``weights_per_epoch`` when there are more),
    ``cell`` the phase cell the update counted each token in (index into ``PHASE_KEYS``), ``prob``
    and ``entropy`` the p and H its weighting compared with the thresholds (the same float64
    comparison, so a shown p >= tau_p is never a silenced token) and ``tau_h`` the threshold of the
    row's mini-batch (S2T's tau_h^(q), NaN when it had no candidate), ``minibatch`` that mini-batch's
    index in PPO epoch 0 (rows sharing it shared the quantile); ``sum_q2``, ``top``, ``dist_prob`` and ``dist_entropy`` come from :func:`dump_forward` (the sampled
    policy; later mini-batches see the updated policy), so gradient norms pair terms of one distribution. Records from every rank are gathered; sequences holding
    silenced tokens come first, then ones with a learning signal (A != 0), up to the bound.
    """
    cfg = run.cfg
    resp_all = batch.response_mask.cpu()
    local = []
    for j, i in enumerate(rows):
        s, resp = seqs[i], resp_all[i]
        w = record.weights[:, i][:, resp]  # [E, R]
        top_p, top_i = dist["top_prob"][j][resp], dist["top_ids"][j][resp]  # [R, k]
        rec = {
            "prompt": run.tokenizer.decode(s.prompt_ids, skip_special_tokens=True)[-500:],
            "gold": s.gold,
            "reward": s.reward,
            "advantage": s.advantage,
            "tokens": [run.tokenizer.decode([t]) for t in s.response_ids],
            "token_ids": s.response_ids,
            # p and H as the update's weighting compared them (p = exp in float64, as below_thresholds)
            "prob": record.logprobs[0, i][resp].double().exp().tolist(),
            "entropy": record.entropy[0, i][resp].double().tolist(),
            "sum_q2": dist["sum_q2"][j][resp].tolist(),
            # p and H of the forward that gave sum_q2: the gradient norm's terms from one distribution
            "dist_prob": dist["logprobs"][j][resp].double().exp().tolist(),
            "dist_entropy": dist["entropy"][j][resp].double().tolist(),
            "weight": w[0].tolist(),
            "cell": record.cells[0, i][resp].tolist(),
            "tau_h": float(record.tau_h[0, i]),
            "minibatch": int(record.minibatch[0, i]),
            "top": [
                [[run.tokenizer.decode([int(t)]), float(p)] for t, p in zip(ti, pi, strict=True)]
                for ti, pi in zip(top_i.tolist(), top_p.tolist(), strict=True)
            ],
        }
        if w.shape[0] > 1:
            rec["weights_per_epoch"] = w.tolist()
        silenced = bool(((w[0] == 0)).any())
        local.append(((not silenced, s.advantage == 0, dp.rank, i), rec))
    gathered = [x for part in dp.gather_objects(local) for x in part]
    if dp.rank != 0:
        return
    out = [rec for _, rec in sorted(gathered, key=lambda kv: kv[0])][: cfg.logging.dump_max_sequences]
    taus = [t for t in record.tau_h[0].tolist() if math.isfinite(t)]
    d = run.run_dir / "dumps"
    d.mkdir(exist_ok=True)
    payload = {"step": step, "tau_p": cfg.algorithm.s2t.tau_p, "tau_h": mean_or_nan(taus),
               "q": cfg.algorithm.s2t.q, "silence": cfg.algorithm.s2t.silence,
               "token_weighting": cfg.algorithm.token_weighting, "sequences": out}
    tmp = d / f".step_{step:06d}.json.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.rename(d / f"step_{step:06d}.json")


# ----------------------------------------------------------------------------- the loop


def train(run: Run, *, resume: bool = False, allow_changes: bool = False, fresh: bool = False) -> TrainResult:
    """Train (or resume) the built ``run`` (:meth:`stapo.core.train.run.Run.build`) and close it; returns
    where it went and validation before/after.

    First the run dir must agree with how the run starts, as for ``stapo train``
    (:meth:`stapo.core.train.prepare.Prepared.start`): a new run into a dir that holds one is refused;
    ``resume`` needs a checkpoint (``fresh``: start over without one); a resume that changes how the run
    trains is refused unless ``allow_changes`` (``--allow-changes``), which records the changes in
    ``RUN/config_changes.jsonl``. A resume of a run that has finished says so and returns.

    Each step, top to bottom: sample -> grade -> advantages (+ dynamic sampling) -> old pass (where
    needed) -> update -> weight sync -> metrics / validation / checkpoint. The extras are hooks
    (``stapo.core.train.hooks``: ``run.hooks``), called at their named phases with the step's
    :class:`~stapo.core.train.hooks.StepState`; nothing below branches on a particular extra.
    Nothing is written before the run is built and the ranks agree on rank 0's ``run_dir``; a
    SIGTERM stops the run at a step boundary, after a checkpoint (``stapo.core.train.rundir``).
    """
    cfg, run_dir, log = run.cfg, run.run_dir, run.log
    t_start = run.started  # (the build's time counts: the run started there)
    hooks = run.hooks
    dp = DataParallel(run.backend)
    main = run.rank == 0
    try:  # nothing is written before the run is built and every rank agrees on rank 0's run dir
        run.prepared.start(resume, allow_changes=allow_changes, fresh=fresh)  # (stapo train: done already)
        if run.prepared.finished:
            run.close()
            return TrainResult(run_dir, cfg.trainer.max_steps, None, None, time.time() - t_start)
        run_dir = run.run_dir = agree_run_dir(run_dir, dp)
        run.placement.record(run_dir / "ranks", run.backend.device)  # which host / GPU each rank took
        ckpt = open_run_dir(run_dir, cfg, resume=resume, main=main)  # rank 0: the dir and config.yaml
        tracker = Tracker(run_dir, cfg) if main else _NullTracker()
    except BaseException:
        run.close()
        raise
    if not main:
        log = _quiet
    start = 0
    val_before: float | None = None
    if ckpt is not None:
        state = load_checkpoint(ckpt, backend=run.backend)
        start = state.step
        val_before = state.extra.get("val_before")
        hooks.load_state_dict(legacy_hook_state(state.extra))  # STARE's schedule, sampler, DEEP-GRPO's model
        log(f"resumed from {ckpt} (step {start})")
    for name in ("metrics.jsonl", "val.jsonl") if main else ():
        truncate_jsonl(run_dir / name, max_step=start if ckpt is not None else -1)
    sync_weights(run)
    if start == 0 and run.val_prompts:
        v = validate(run)
        val_before = v["accuracy"]
        tracker.log_val(0, v)
        log(f"validation before training: accuracy {v['accuracy']:.3f} on {v['n']} prompts")

    def checkpoint(step: int) -> None:
        save_checkpoint(run_dir, step=step, backend=run.backend, cfg=cfg,
                        extra={"val_before": val_before, "hooks": hooks.state_dict()},
                        keep_last=cfg.checkpoint.keep_last)

    view = LiveView(cfg.trainer.max_steps, start, enabled=main and cfg.logging.live and sys.stderr.isatty(), log=log)
    last_val: float | None = val_before
    try:
        stop_at_step_boundary(cfg.checkpoint.on_signal)  # SIGTERM: checkpoint at the step's end (stapo.core.train.rundir)
        for step in range(start + 1, cfg.trainer.max_steps + 1):
            t_step = time.time()
            seed_everything(derive_seed(cfg.trainer.seed, step))
            begin_rollout_step(run.backend, step)  # LR of this step when the schedule counts rollout steps (verl)

            # --- sample + grade (a hook may supply round 0: async rollouts), advantages, DAPO's
            #     dynamic sampling (resample until the GLOBAL batch is full: stapo.core.task.sampler)
            seqs, metrics = hooks.sample(step) or rollout_and_grade(run, step, 0)
            all_seqs = list(seqs)
            kept = shape_and_advantage(cfg, seqs)
            if cfg.algorithm.dynamic_sampling:
                kept = dynamic_sampling_refill(run, step, kept, all_seqs, metrics, dp)
            st = StepState(step, all_seqs, kept, metrics, temperature=stats_temperature(cfg))
            st, added = hooks.on_batch(st)  # Goldilocks' teacher, DEEP-GRPO's branches, overlong filter
            metrics.update(added)
            st = replace(st, counts=dp.counts(len(st.kept)))
            metrics.update(rollout_metrics(dp, all_seqs, metrics))
            metrics["batch/sequences"] = float(sum(st.counts))

            # --- old log-probs (only where needed), update (every rank, in lockstep), token dump
            t0 = time.time()
            run.engine.sleep()  # once a step: the rollout engine's memory goes to the update (docs/gpu.md)
            if sum(st.counts):
                st = update_step(run, st, dp)
            else:
                metrics["actor/skipped_updates"] = 1.0
                log(f"step {step}: no group with a usable advantage signal; update skipped")
            metrics["time/train_s"] = time.time() - t0

            # --- weight sync (the hf engine shares the trained model: nothing to copy)
            sync_weights(run)
            hooks.after_sync(st)

            # --- validation, metrics, checkpoint
            if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.trainer.max_steps:
                v = validate(run)
                if v:
                    tracker.log_val(step, v)
                    metrics["val/accuracy"] = last_val = v["accuracy"]
            metrics["time/step_s"] = time.time() - t_step
            metrics["perf/tokens_per_s"] = metrics.pop("_tokens") / max(metrics["time/step_s"], 1e-9)
            tracker.log(step, metrics)
            view.update(metrics)
            saved = cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != cfg.trainer.max_steps
            if saved:
                checkpoint(step)
            # a stop asked during the last step lets the run finish (its checkpoint, export, summary)
            last = step == cfg.trainer.max_steps
            signum = stop_requested(dp) if cfg.checkpoint.on_signal and not last else None  # same on every rank
            if signum is not None:
                if not saved:
                    checkpoint(step)
                raise Stopped(signum, checkpointed=True)

        stop_at_once()
        view.close()
        end = cfg.trainer.max_steps
        if run.val_prompts and end > start:
            v = validate(run)
            tracker.log_val(end, v)
            last_val = v["accuracy"]
            log(f"validation after training: accuracy {v['accuracy']:.3f} (before: {val_before})")
        if end > start:
            checkpoint(end)
        if cfg.checkpoint.export_hf:
            run.backend.export_hf(run_dir / "final", run.tokenizer)
        notes = hooks.summary()
    finally:
        stop_at_once()
        view.close()
        tracker.close()
        run.close()
    result = TrainResult(run_dir, cfg.trainer.max_steps, val_before, last_val, time.time() - t_start, notes)
    if main:
        _write_summary(run_dir, result)
    return result


def sync_weights(run: Run) -> None:
    """Trainer -> rollout engine (a no-op when the hf engine shares the trained model)."""
    if run.cfg.rollout.engine != "hf" or getattr(run.engine, "model", None) is not run.backend.model:
        run.engine.load_weights(run.backend.named_parameters_for_sync())


def update_step(run: Run, st: StepState, dp: Any) -> StepState:
    """One step's update on ``st.kept`` (every rank, also one with no row): collate, the token dump's
    forward of the sampled policy, the old pass where the config or a hook needs it, the hooks'
    ``before_update``, the actor's update, the hooks' ``after_update``, the dump. Metrics go to
    ``st.metrics``; returns the step as the update saw it."""
    cfg, hooks, metrics, step = run.cfg, run.hooks, st.metrics, st.step
    t0 = time.time()
    batch = collate_with_pad_row(st.kept, run.pad_id, pad=dp.multi).to(run.backend.device)
    st = replace(st, batch=batch, pad_row=len(st.kept) if dp.multi else None)
    dumping = bool(cfg.logging.dump_tokens_every and step % cfg.logging.dump_tokens_every == 0)
    record = UpdateRecord.empty(cfg.algorithm.ppo_epochs, batch) if dumping else None
    if dumping:
        dump_rows = dump_candidates(cfg, st.kept)
        dump_dist = dump_forward(run, batch, dump_rows)  # the pre-update (sampled) policy
    if needs_old_pass(cfg, hooks.needs_old_stats(st)):
        micros = run.actor.forwards(batch, st.counts)  # also the extras' passes (reference, Lp-Reg's proxy)
        old_lp, old_ent = run.actor.old_stats(batch, micros=micros)
        st = replace(st, micros=micros, old_lp=old_lp, old_ent=old_ent)
    # async's off-policy weights, KL / Lp-Reg / STARE constants, DEEP-GRPO's local loss
    st, added = hooks.before_update(st)
    metrics.update(added)
    metrics["time/stats_s"] = time.time() - t0
    metrics.update(run.actor.update(UpdateInputs(batch, st.old_lp, st.old_ent, step, counts=st.counts, record=record,
                                                 contributions=st.contributions, off_policy=st.off_policy)))
    metrics.update(hooks.after_update(st))
    if dumping:
        dump_tokens(run, step, st.kept, batch, dump_rows, dump_dist, record, dp)
    return st


def _quiet(msg: str) -> None:
    """Log sink of ranks other than 0."""


class _NullTracker:
    """Ranks other than 0 write no metrics."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_val(self, step: int, result: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _write_summary(run_dir: Path, result: TrainResult) -> None:
    val_before, last_val = result.val_before, result.val_after
    (run_dir / "summary.json").write_text(json.dumps({
        "steps": result.steps,
        "val_accuracy_before": val_before,
        "val_accuracy_after": last_val,
        "wall_s": result.wall_s,
        "finite": all(math.isfinite(x) for x in (val_before or 0.0, last_val or 0.0)),
        **result.notes,
    }, indent=2))
