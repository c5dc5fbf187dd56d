"""A run: everything one training run holds, built from its config. The way to train from Python.

    from stapo.configs import preset_path
    from stapo.core.config import load_config
    from stapo.core.train.loop import train
    from stapo.core.train.run import Run

    cfg = load_config(preset_path("tiny"), ["trainer.max_steps=2"])
    result = train(Run.build(cfg, "runs/tiny"))          # what `stapo train --config tiny` runs

:meth:`Run.build` first prepares the run (``stapo.core.train.prepare``, as ``stapo train`` does): the
checks of the inputs and the launch, each refused in one line before anything loads, the memory plan
(on a GPU: ``trainer.update_memory: auto`` becomes the path the plan chooses, and a config that cannot
fit is refused) and the run dir's lock (a dir another live run holds is refused; released when the
run closes). ``stapo train`` prepares first and passes ``prepared=``. Then it makes the parts in this
order, each from the config: this rank's placement (its device
set before anything touches a GPU), the policy and its tokenizer (on the CPU; the backend places
it), the trainer backend, the rollout engine, the reward function, the train / val prompts, the
prompt sampler, the hooks (``stapo.core.train.extras``) and the actor (``stapo.core.train.update``). A part
given as a keyword replaces the one ``build`` would make, and the parts after it are made from
it: an engine or a reward function that stands in, prompts of one's own, a backend over a model
already loaded. :data:`PARTS` lists the names. ``train(run)`` (``stapo.core.train.loop``) trains it and
closes it; ``train(run, resume=True, allow_changes=True)`` resumes it, with the checks and the record of
``stapo train --resume --allow-changes``. Nothing but the lock is written into ``run_dir`` before
``train`` starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stapo.core.batch import seed_everything
from stapo.core.config import Config
from stapo.core.lazy import quiet_known_noise
from stapo.core.placement import Placement, rank_placement
from stapo.core.rollout import build_rollout_engine
from stapo.core.task.data import encode_prompt, load_prompts
from stapo.core.task.rewards import RewardFunction
from stapo.core.task.sampler import build_sampler
from stapo.core.train.extras import Hooks, build_hooks
from stapo.core.train.prepare import Prepared, prepare, vllm_tp_size
from stapo.core.train.update import Actor
from stapo.core.trainer import build_trainer_backend, load_context, models

__all__ = ["PARTS", "Run", "describe_method", "vllm_tp_size"]

#: What :meth:`Run.build` takes as keywords instead of making it (in the order it makes them); a part
#: given skips the pre-launch checks of the one it replaces (``stapo.core.train.prepare``).
#: ``plan``: the memory plan of this launch (``stapo.core.train.plan.Plan``; None: none, as on a CPU),
#: which resolves ``trainer.update_memory: auto``.
PARTS = ("plan", "placement", "model", "tokenizer", "backend", "engine", "rewards", "train_prompts",
         "val_prompts", "sampler", "hooks", "actor")


def describe_method(cfg: Config) -> str:
    """The run's first line: the recipe it follows (``algorithm.name``) and its token weighting with the
    weighting's options, e.g. ``method: stapo (token weighting s2t, tau_p 0.002, q 0.75)``. S2T's
    ``silence`` shows when it is an ablation's (not the paper's ``lowest_entropy``); a weighting
    registered outside stapo shows ``algorithm.weighting_options``."""
    a = cfg.algorithm
    section = getattr(a, a.token_weighting, None)  # s2t, top_entropy, stare; None: `none` or a plug-in
    options = section.arguments() if section is not None else dict(a.weighting_options)
    if a.token_weighting == "s2t" and options.get("silence") == "lowest_entropy":
        options.pop("silence")
    shown = [f"token weighting {a.token_weighting}", *(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in options.items())]
    return f"method: {a.name} ({', '.join(shown)})"


class Run:
    """Everything a run holds: model, trainer backend, rollout engine, rewards, data, hooks, actor.

    Made by :meth:`build`; the loop's phases read these attributes (``stapo.core.rollout.rollouts``, the
    hooks' factories, ``stapo.core.train.loop``).
    """

    cfg: Config  # the config as it runs (``update_memory: auto`` resolved on a GPU)
    run_dir: Path  # the run's folder (under a launcher ``train`` sets rank 0's on every rank)
    log: Callable[[str], None]
    started: float  # time.time() when the build began (the run's wall time counts from it)
    plan: Any  # stapo.core.train.plan.Plan of this launch, or None (CPU)
    prepared: Prepared  # its checks passed, its run dir's lock, how it starts (stapo.core.train.prepare)
    placement: Placement
    model: Any
    tokenizer: Any
    pad_id: int
    backend: Any  # stapo.core.trainer.base.TrainerBackend
    rank: int
    world_size: int
    engine: Any  # stapo.core.rollout.base.RolloutEngine
    rewards: Any  # (texts, golds) -> graded; stapo.core.task.rewards.RewardFunction
    train_prompts: list[Any]
    val_prompts: list[Any]
    sampler: Any  # stapo.core.task.sampler
    hooks: Hooks
    actor: Any  # stapo.core.train.update.Actor

    def __init__(self, cfg: Config, run_dir: Path | str, log: Callable[[str], None] = print) -> None:
        """An empty run; :meth:`build` makes one with its parts."""
        self.cfg, self.run_dir, self.log = cfg, Path(run_dir), log
        self.started = time.time()
        self._encoded: dict[str, list[int]] = {}
        self._own: Prepared | None = None  # the preparation build made (closed with the run)

    @classmethod
    def build(cls, cfg: Config, run_dir: Path | str, log: Callable[[str], None] = print, *,
              prepared: Prepared | None = None, **parts: Any) -> Run:
        """The run of ``cfg`` in ``run_dir``, every part made from the config unless given in ``parts``
        (names: :data:`PARTS`; the policy and its tokenizer load together unless both are given). ``log``
        gets the start-up lines (the policy's size, the data) and, through ``train``, the run's.
        ``prepared``: the run's preparation made by the caller (``stapo train``), who closes it; without
        it ``build`` prepares the run itself and the run releases it when it closes."""
        unknown = sorted(set(parts) - set(PARTS))
        if unknown:
            raise TypeError(f"Run.build() got unknown parts: {', '.join(unknown)}; parts are: {', '.join(PARTS)}")
        if prepared is not None and Path(run_dir) != prepared.run_dir:
            raise ValueError(f"Run.build({run_dir}): the preparation given holds {prepared.run_dir}")
        run = cls(cfg, run_dir, log)
        log(describe_method(cfg))
        quiet_known_noise(cfg.trainer.backend)  # as `stapo train` does: a Python-built run prints the same
        # every check before anything loads, the memory plan (update_memory: auto becomes its path on
        # every rank alike) and the run dir's lock: stapo.core.train.prepare
        if prepared is None:
            prepared = run._own = prepare(cfg, run_dir, given=parts, log=log)
        run.prepared, run.plan, run.cfg = prepared, prepared.plan, prepared.cfg
        try:
            run._build_parts(parts)
        except BaseException:
            run.close()
            raise
        return run

    def _build_parts(self, parts: dict[str, Any]) -> None:
        """The parts after the preparation, in the order of :data:`PARTS`."""
        cfg, log = self.cfg, self.log
        # this rank's device, set before anything touches a GPU (stapo.core.placement); the policy
        # loads on the CPU (ZeRO-3: partitioned as it is built) and the trainer backend places it there
        self.placement = _part(parts, "placement", lambda: rank_placement(cfg.trainer.device, tp_size=vllm_tp_size(cfg)))
        seed_everything(cfg.trainer.seed)
        device = self.placement.device
        if "model" in parts and "tokenizer" in parts:
            self.model, self.tokenizer = parts["model"], parts["tokenizer"]
        else:
            t0 = time.time()
            model, tokenizer = models.load_policy(cfg.model, device="cpu", compute_device=device,
                                                  init_context=load_context(cfg))
            self.model, self.tokenizer = parts.get("model", model), parts.get("tokenizer", tokenizer)
            log(f"policy {cfg.model.name_or_path}: {models.count_params(self.model) / 1e6:.1f}M params "
                f"for {device} ({time.time() - t0:.1f}s)")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        total_updates = cfg.trainer.max_steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches
        self.backend = _part(parts, "backend", lambda: build_trainer_backend(cfg, self.model,
                                                                            total_optimizer_steps=max(total_updates, 1)))
        # Data parallel (deepspeed launcher): each rank samples its share of the step's prompts (the
        # launch's ranks divide them: checked in the preparation); the token-mean normalizer and the
        # S2T thresholds are reduced across ranks; rank 0 writes files.
        self.rank, self.world_size = int(self.backend.rank), int(self.backend.world_size)
        self.engine = _part(parts, "engine", lambda: build_rollout_engine(cfg, model=self.backend.model,
                                                                          tokenizer=self.tokenizer))
        if self.world_size > 1 and hasattr(self.engine, "synced_gpus"):
            # ZeRO-3 gathers parameters in every generate step: a rank whose sequences finished early
            # keeps stepping (transformers' synced_gpus) until every rank is done.
            self.engine.synced_gpus = True
        self.rewards = _part(parts, "rewards", lambda: RewardFunction(cfg.reward))
        self._build_data_and_update(parts)

    def _build_data_and_update(self, parts: dict[str, Any]) -> None:
        """The prompts, the sampler, the hooks and the actor (after the rewards: :meth:`build`)."""
        cfg, log = self.cfg, self.log
        if "train_prompts" in parts and "val_prompts" in parts:
            self.train_prompts, self.val_prompts = list(parts["train_prompts"]), list(parts["val_prompts"])
        else:
            train, val = load_prompts(cfg.data, self.tokenizer)
            self.train_prompts, self.val_prompts = list(parts.get("train_prompts", train)), list(parts.get("val_prompts", val))
            log(f"data: {len(self.train_prompts)} train / {len(self.val_prompts)} val prompts from {cfg.data.source}")
        if not self.train_prompts:
            raise ValueError(f"no training prompts from data.source={cfg.data.source!r}")
        # which prompts (uniform | goldilocks: docs/stability.md); the loop's sampling asks it
        self.sampler = _part(parts, "sampler", lambda: build_sampler(cfg, self.train_prompts, encode=self.encode,
                                                                     model=self.backend.model))
        # every extra (async rollouts, the sampler's step, DEEP-GRPO, KL / Lp-Reg / STARE / overlong
        # filter) is a named hook with one interface: stapo.core.train.hooks (built by stapo.core.train.extras)
        self.hooks = _part(parts, "hooks", lambda: build_hooks(self))
        # the update; it asks the hooks for its in-update phases
        self.actor = _part(parts, "actor", lambda: Actor(cfg, self.backend, self.hooks))

    def encode(self, rec: Any) -> list[int]:
        """A prompt record's token ids (its chat template applied), encoded once per run."""
        if rec.id not in self._encoded:
            self._encoded[rec.id] = encode_prompt(self.tokenizer, rec.prompt, chat_template=self.cfg.data.chat_template)
        return self._encoded[rec.id]

    def close(self) -> None:
        """The hooks' end of run, then the reward function's (its worker pool), then the run dir's lock
        when :meth:`build` took it."""
        try:
            if getattr(self, "hooks", None) is not None:
                self.hooks.close()
        finally:
            try:
                close = getattr(getattr(self, "rewards", None), "close", None)  # (a stand-in may have none)
                if close is not None:
                    close()
            finally:
                if self._own is not None:
                    self._own.close()
                    self._own = None


def _part(parts: dict[str, Any], name: str, make: Callable[[], Any]) -> Any:
    """The part given as ``name``, else ``make()`` (made only when not given)."""
    return parts[name] if name in parts else make()
