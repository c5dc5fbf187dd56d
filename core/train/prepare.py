"""Preparing a run: every check between a config and the first model load, the run dir's lock and a
resume's change check and record, each written once, for ``stapo train`` and for Python alike.

    from stapo.core.train.loop import train
    from stapo.core.train.run import Run

    train(Run.build(cfg, "runs/tiny"))                                   # prepares itself
    train(Run.build(cfg, "runs/tiny"), resume=True, allow_changes=True)  # = stapo train --resume --allow-changes

    with prepare(cfg, "runs/tiny", resume=True) as prepared:             # what `stapo train` does
        train(Run.build(prepared.cfg, prepared.run_dir, prepared=prepared), resume=True)

:func:`prepare` runs, in this order, before anything loads (a mistake costs a second, not a model load):

1. the inputs (:func:`check_inputs`): the model and tokenizer paths (a hub id not in the cache needs a
   hub that answers) and the data source;
2. the launch (:func:`check_launch`): a backend that spans the ranks, the prompts split evenly over
   them, asynchronous rollouts on an engine that has them, the optional packages the config names,
   this rank's GPU, every rollout server and verifier URL answering;
3. the memory plan (on a GPU: a config that cannot fit is refused naming the setting that fits it;
   ``trainer.update_memory: auto`` becomes the plan's path; ``stapo.core.train.plan``);
4. the run dir's lock (rank 0; a dir another live run holds is refused naming its holder:
   ``stapo.core.train.rundir``);
5. the start (:meth:`Prepared.start`, when ``resume`` is given; else ``train`` calls it): a new run
   into a dir that holds one is refused; a resume needs a checkpoint (``fresh``: start over without
   one); a resume that changes how the run trains is refused without ``allow_changes`` and, with it,
   recorded in ``RUN/config_changes.jsonl`` (rank 0); a change a checkpoint fixes is refused always.

``Run.build`` without ``prepared`` runs steps 1-4 itself (a part given to it skips the checks of the
part it replaces: a given engine is not probed), and ``train(run, resume=...)`` runs step 5, so a run
built from Python gets the command's protections. Every refusal is a :class:`PrepareError` (a
``ValueError``) in one line that names the fix; ``stapo train`` prints it and exits 2.

:func:`run_config` is the config ``stapo train`` asks for: a preset or file with ``--set`` overrides,
a recipe's method keys, a resumed run's own config (``config.yaml`` with its recorded changes), and
the check that ``algorithm.name`` names the method that runs (:func:`name_mismatch`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from stapo.configs import preset_names, preset_path
from stapo.core.config import Config, apply_overrides, config_from_dict, load_config
from stapo.core.fairness import classify, flatten
from stapo.core.placement import launch_world_size, place
from stapo.core.rollout.async_rollout import check_supported
from stapo.core.task.data import DataError, check_source
from stapo.core.train import plan as memory
from stapo.core.train.checkpoint import checkpoint_step, latest_checkpoint
from stapo.core.train.plan import Plan, PlanError, plan_at_start, plan_run, resolve_update_memory
from stapo.core.train.rundir import (
    BOOKKEEPING_KEYS,
    CHANGES_NAME,
    ConfigChange,
    RunDirBusy,
    RunDirOwner,
    check_not_busy,
    config_changes,
    holds_run,
    owned,
    record_config_changes,
    resume_config_data,
    unappliable_changes,
)

__all__ = [
    "PrepareError", "InputError", "LaunchError", "PlanRefused", "RunDirError", "ResumeError", "NameMismatch",
    "Prepared", "prepare", "check_free", "run_config", "check_inputs", "check_launch", "check_engine_and_device",
    "check_resume", "plan_launch", "memory_plan", "name_mismatch", "method_overrides", "vllm_tp_size",
]


# ----------------------------------------------------------------------------- the errors


class PrepareError(ValueError):
    """A run that cannot start as asked; the message is one line naming the fix.

    ``job_wide``: every rank of a launch meets it alike (the config, its inputs, the launch's size),
    so under a launcher ``stapo train`` prints it once per node instead of once per rank."""

    job_wide: ClassVar[bool] = True


class InputError(PrepareError):
    """The model, the tokenizer or the data source cannot be read (the field is named)."""


class LaunchError(PrepareError):
    """What the launch fixes does not fit the config: ranks, packages, device, servers (the key is named)."""


class PlanRefused(PrepareError):
    """The memory plan cannot be made, or the config does not fit the card (the setting that fits is named)."""


class NameMismatch(PrepareError):
    """``algorithm.name`` does not name the method that runs."""


class RunDirError(PrepareError):
    """The run dir cannot take this run: another live run holds it, it holds a run, no checkpoint."""

    job_wide = False


class ResumeError(PrepareError):
    """A resume would change how the run trains (refused without ``allow_changes``), or a change a
    checkpoint fixes (refused always)."""

    job_wide = False


# ----------------------------------------------------------------------------- 1. the inputs

# A Hugging Face hub id: "name" or "org/name" (letters, digits, ".", "_", "-").
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_MODEL_FIX = "give a model folder (with config.json, e.g. RUN/final), a Hugging Face id, or tiny-random"

HUB_PROBE_S = 5.0
"""Seconds the hub gets to answer before a hub id that is not cached is refused (the loader itself
retries for about 30 s, printing each retry)."""


def check_model_path(field: str, name: str, *, gguf_file: str | None = None, tokenizer: bool = False) -> None:
    """A local model (or tokenizer) path must exist and look like one; a hub id is left to the loader.

    Special names (``tiny-random``, ``demo:...``) are the loader's business too. Without a hub the
    loader's own error for an id is caught at the command line boundary like any other.
    """
    if name == "tiny-random" or name.startswith("demo:"):
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                raise InputError(f"model.gguf_file: {path / gguf_file} does not exist")
            return
        wanted = ("tokenizer_config.json", "tokenizer.json") if tokenizer else ("config.json",)
        if not any((path / f).is_file() for f in wanted):
            what = "tokenizer (no tokenizer_config.json)" if tokenizer else "model (no config.json)"
            raise InputError(f"{field}: {path} is a folder but not a {what}; {_MODEL_FIX}")
        return
    if path.exists():
        raise InputError(
            f"{field}: {path} is a file; give the model's folder (a GGUF file: model.name_or_path=FOLDER "
            "model.gguf_file=NAME)"
        )
    if not _HUB_ID.match(name):  # an absolute/relative path, ~, or a/b/c: not a hub id, so a missing path
        raise InputError(f"{field}: {path} does not exist; {_MODEL_FIX}")
    check_hub_id(field, name, tokenizer=tokenizer)


def hub_answers(endpoint: str, timeout_s: float = HUB_PROBE_S) -> str | None:
    """None when ``endpoint`` (the Hugging Face hub) answers an HTTP request within ``timeout_s``, else
    why not (the error's type). Proxies from the environment are used, as the hub client uses them."""
    import httpx

    try:
        httpx.head(endpoint, timeout=timeout_s)
    except httpx.HTTPError as err:
        return type(err).__name__
    return None


def check_hub_id(field: str, name: str, *, tokenizer: bool = False) -> None:
    """A Hugging Face id that is not in the local cache needs the hub: with ``HF_HUB_OFFLINE`` set, or
    a hub that does not answer in :data:`HUB_PROBE_S` seconds, it is refused now in one line instead
    of after the loader's retries. A cached id (its config.json, or tokenizer_config.json for a
    tokenizer) loads offline and is not probed."""
    from huggingface_hub import constants, try_to_load_from_cache

    wanted = "tokenizer_config.json" if tokenizer else "config.json"
    if isinstance(try_to_load_from_cache(name, wanted), str):
        return
    where = f"{name} is not a local folder and not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    fix = f"download it where the hub is reachable (`hf download {name}`), give a model folder, or use tiny-random"
    if constants.HF_HUB_OFFLINE:
        raise InputError(f"{field}: {where}, and HF_HUB_OFFLINE is set; {fix}")
    why = hub_answers(constants.ENDPOINT)
    if why is not None:
        raise InputError(f"{field}: {where}, and the hub ({constants.ENDPOINT}) cannot be reached ({why}, "
                         f"{HUB_PROBE_S:g} s limit); {fix}")


def check_inputs(cfg: Config, *, given: Collection[str] = ()) -> None:
    """The model, tokenizer and data source of ``cfg`` exist and are readable (nothing is loaded).
    ``given``: the parts ``Run.build`` was given (a given model and tokenizer, or given prompts, are not
    read from the config, so their paths are not checked)."""
    if not {"model", "tokenizer"} <= set(given):
        check_model_path("model.name_or_path", cfg.model.name_or_path, gguf_file=cfg.model.gguf_file)
        if cfg.model.tokenizer and cfg.model.tokenizer != cfg.model.name_or_path:
            check_model_path("model.tokenizer", cfg.model.tokenizer, tokenizer=True)
    if not {"train_prompts", "val_prompts"} <= set(given):
        try:
            check_source(cfg.data)
        except DataError as err:
            raise InputError(str(err)) from None


# ----------------------------------------------------------------------------- 2. the launch


def vllm_tp_size(cfg: Config) -> int:
    """vLLM's tensor-parallel size (1 unless the colocated vllm engine is used)."""
    return cfg.rollout.vllm.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1


def nearest_multiples(count: int, world: int) -> tuple[int, int]:
    """The multiples of ``world`` just below (0 when none) and just above ``count``."""
    below = count // world * world
    return below, below + world


def check_launch(cfg: Config, environ: Mapping[str, str] = os.environ, *, given: Collection[str] = ()) -> None:
    """What the launch already knows, checked before the model loads (minutes at 8B): a backend that
    spans the ranks, the prompts split evenly over them, an engine that supports the run's
    asynchronous rollouts, the optional packages and this rank's device
    (:func:`check_engine_and_device`), every ``rollout.server.urls`` entry answers as a ``stapo
    rollout serve`` server and every ``reward.urls`` entry resolves and answers ``/readyz``. Each
    failure is one :class:`LaunchError` naming the key. ``given``: the parts ``Run.build`` was given,
    whose own checks are skipped (a given backend, engine, placement or reward function)."""
    world = launch_world_size(environ)
    if world > 1 and cfg.trainer.backend == "torch" and "backend" not in given:
        raise LaunchError(
            f"trainer.backend=torch trains in one process, but this launch has {world} ranks: "
            "--set trainer.backend=deepspeed (ZeRO over the ranks), or start one process"
        )
    prompts = cfg.rollout.prompts_per_step
    if prompts % world:
        below, above = nearest_multiples(prompts, world)
        near = f"{below} or {above}" if below else str(above)
        raise LaunchError(
            f"rollout.prompts_per_step ({prompts}) must be divisible by the number of ranks ({world}): each rank "
            f"samples an equal share of a step's prompts; the nearest valid counts are {near} "
            f"(--set rollout.prompts_per_step=N), or launch a number of ranks that divides {prompts}"
        )
    try:
        check_supported(cfg)
    except ValueError as err:
        raise LaunchError(str(err)) from None
    check_engine_and_device(cfg, environ, given=given)
    if cfg.rollout.engine == "vllm_server" and "engine" not in given:
        for url in cfg.rollout.server.urls:
            _check_rollout_server(url)
    if "rewards" not in given:
        for url in cfg.reward.urls:
            _check_verifier(url)


def check_engine_and_device(cfg: Config, environ: Mapping[str, str] = os.environ, *,
                            given: Collection[str] = ()) -> None:
    """The optional packages the config names are installed (vLLM, DeepSpeed, wandb) and
    ``trainer.device`` exists on this machine: what `stapo train` and `stapo eval` need before a
    model loads or a memory plan is printed; one :class:`LaunchError` naming the fix."""
    import torch

    for wanted, module, fix in (
        (cfg.trainer.backend == "deepspeed" and "backend" not in given, "deepspeed",
         "install stapo[train] or --set trainer.backend=torch"),
        (cfg.logging.wandb, "wandb", "`pip install wandb` (and `wandb login`) or --set logging.wandb=false"),
    ):
        if wanted and importlib.util.find_spec(module) is None:
            what = f"trainer.backend={cfg.trainer.backend}" if module == "deepspeed" else "logging.wandb=true"
            raise LaunchError(f"{what} needs {module}, which is not installed: {fix}")
    if cfg.trainer.backend == "deepspeed" and cfg.trainer.offload_optimizer:
        from stapo.core.trainer.deepspeed_backend import cpu_adam_build_missing

        if missing := cpu_adam_build_missing(environ):
            raise LaunchError(
                f"trainer.offload_optimizer=true: DeepSpeed compiles its CPU Adam at the first step (its PyPI "
                f"release ships no compiled op), which needs a C++ compiler ($CXX, default c++) and ninja on PATH; "
                f"missing: {', '.join(missing)}. Install them (apt-get install g++ ninja-build), or DeepSpeed "
                "with the op prebuilt (DS_BUILD_CPU_ADAM=1 pip install deepspeed), or --set "
                "trainer.offload_optimizer=false"
            )
    if cfg.rollout.engine == "vllm" and "engine" not in given:
        try:
            import vllm  # noqa: F401
        except Exception as err:  # missing, or installed beside a torch it was not built for
            raise LaunchError(
                f"rollout.engine=vllm, but vllm does not import ({type(err).__name__}: {err}); install "
                "stapo[vllm] or --set rollout.engine=hf"
            ) from None
    if not cfg.trainer.device.startswith("cuda") or "placement" in given:
        return  # auto and cpu always place
    try:  # the GPU each rank takes at start, decided now (stapo.core.placement)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        place(environ, cuda_devices=gpus, requested=cfg.trainer.device, tp_size=vllm_tp_size(cfg))
    except ValueError as err:
        raise LaunchError(str(err)) from None


def _check_rollout_server(url: str, timeout_s: float = 5.0) -> None:
    """``url`` answers vLLM's ``GET /health`` and, started as ``stapo rollout serve`` starts it
    (``VLLM_SERVER_DEV_MODE=1``), the ``GET /weight_info`` the weight pushes need."""
    import httpx

    serve = "start it with `stapo rollout serve MODEL --port PORT` (docs/rollout.md, \"Starting a server\")"
    try:
        status = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).status_code
        if status != 200:
            raise LaunchError(f"rollout.server.urls: {url}/health answered {status}: the server is not ready; {serve}")
        info = httpx.get(f"{url.rstrip('/')}/weight_info", timeout=timeout_s).status_code
    except httpx.HTTPError as err:
        raise LaunchError(f"rollout.server.urls: {url} did not answer ({type(err).__name__}); {serve}") from None
    if info == 404:
        raise LaunchError(f"rollout.server.urls: {url} runs without VLLM_SERVER_DEV_MODE=1, so it cannot take weight "
                          f"pushes; {serve}")


def _check_verifier(url: str) -> None:
    """``url`` resolves and its ``/readyz`` answers 200 (readiness: its grading pool is up)."""
    import socket
    from urllib.parse import urlsplit

    import httpx

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LaunchError(f"reward.urls: {url!r} is not an http(s)://host:port URL")
    try:
        socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    except OSError:
        raise LaunchError(
            f"reward.urls: cannot resolve {parts.hostname!r} ({url}); give a reachable verifier, or "
            "--set reward.urls=[] to grade in-process"
        ) from None
    try:
        status = httpx.get(f"{url.rstrip('/')}/readyz", timeout=10.0).status_code
    except httpx.HTTPError as err:
        raise LaunchError(f"reward.urls: {url}/readyz did not answer ({type(err).__name__}); is the verifier up?") from None
    if status != 200:
        raise LaunchError(f"reward.urls: {url}/readyz answered {status}: the verifier is not ready to grade")


# ----------------------------------------------------------------------------- 3. the memory plan


def memory_plan(cfg: Config, world_size: int | None = None, card: float | None = None) -> Plan:
    """``stapo train --plan``: the memory plan of ``cfg`` at ``world_size`` ranks (default: the
    launch's) on a card of ``card`` GiB (default: ``trainer.gpu_memory_gib``, the GPU's own, or 80)."""
    try:
        return plan_run(cfg, world_size or launch_world_size(), memory.card_gib(cfg, card))
    except PlanError as err:
        raise PlanRefused(str(err)) from None


def plan_launch(cfg: Config, card: float | None = None, log: Callable[[str], None] | None = None,
                environ: Mapping[str, str] = os.environ) -> tuple[Config, Plan | None]:
    """The plan of this launch at start: on a GPU a config that cannot fit is refused and
    ``update_memory: auto`` resolved; on a CPU (cfg, None). ``log`` gets the plan's one line."""
    try:
        cfg, plan = plan_at_start(cfg, launch_world_size(environ), card)
    except PlanError as err:
        raise PlanRefused(str(err)) from None
    if log is not None:
        log(plan.line() if plan else "memory plan: skipped (CPU run; `stapo train --plan` plans a GPU run)")
    return cfg, plan


# ----------------------------------------------------------------------------- 5. the start


@dataclass(frozen=True)
class Resume:
    """A run dir's checkpoint that a resume continues from: its step and the config it goes on with."""

    step: int
    data: dict[str, Any]  # config.yaml with the recorded changes up to the checkpoint (nested)

    @classmethod
    def of(cls, run_dir: Path) -> Resume | None:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None or not (Path(run_dir) / "config.yaml").is_file():
            return None
        step = checkpoint_step(ckpt)
        return cls(step, resume_config_data(run_dir, step))


def check_resume(run_dir: Path, cfg: Config, *, allow_changes: bool = False) -> list[ConfigChange]:
    """The changes a resume of ``run_dir`` with ``cfg`` makes to how the run trains (not bookkeeping).
    Refused in one line naming every such key without ``allow_changes``; a change the resumed run
    could not use (``FIXED_AT_START``) is refused with why, with it too. No checkpoint: none."""
    resume = Resume.of(run_dir)
    if resume is None:
        return []
    new = cfg.model_dump(mode="json", by_alias=True)
    changed = [c for c in config_changes(resume.data, new) if not c.bookkeeping]
    if fixed := unappliable_changes(changed, new):
        raise ResumeError(f"--resume cannot change {run_dir} from step {resume.step + 1}: {'; '.join(fixed)}")
    if changed and not allow_changes:
        free = ", ".join(k.rstrip(".") for k in BOOKKEEPING_KEYS[:4])
        raise ResumeError(
            f"--resume would change how {run_dir} trains from step {resume.step + 1}: "
            f"{'; '.join(map(str, changed))}. Add --allow-changes to go on with them (config.yaml keeps the "
            f"run's first config; config_changes.jsonl records them), or drop them ({free}... need no flag)"
        )
    return changed


def _check_resumable(run_dir: Path, fresh: bool, max_steps: int, log: Callable[[str], None]) -> bool:
    """A resume needs a checkpoint; ``fresh`` starts a run dir without one over, and says so. True:
    the run has finished (its last checkpoint is ``trainer.max_steps``), said so, nothing to do."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        if checkpoint_step(ckpt) < max_steps:
            return False
        log(
            f"{run_dir} has finished: its last checkpoint is step {checkpoint_step(ckpt)} of trainer.max_steps="
            f"{max_steps}; nothing to do (to train further: --resume --set trainer.max_steps=N)"
        )
        return True
    if not fresh:
        raise RunDirError(
            f"{run_dir} has no checkpoint to resume from (one is written every checkpoint.every steps and "
            "at the end); add --fresh to start it over from step 0"
        )
    log(f"{run_dir} has no checkpoint: starting over from step 0 (--fresh)")
    return False


@dataclass
class Prepared:
    """A run that passed its checks and holds its run dir: the config as it runs (``update_memory``
    resolved by the plan), the plan (None: a CPU run, or none given), the run dir's owner (its lock;
    what a failed start removes) and, once :meth:`start` ran, how the run starts."""

    cfg: Config
    run_dir: Path
    plan: Plan | None
    owner: RunDirOwner
    log: Callable[[str], None] = print
    resume: bool | None = None  # None: the start is not checked yet (train checks it)
    finished: bool = False  # a resume of a run already at trainer.max_steps: nothing to do
    changes: list[ConfigChange] = field(default_factory=list)  # the resume's recorded changes
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    def start(self, resume: bool, *, allow_changes: bool = False, fresh: bool = False) -> None:
        """Step 5: the run dir agrees with how the run starts (see the module's docstring); a resume's
        changes are recorded by rank 0 and said. Once per preparation; again with the same ``resume``
        it does nothing."""
        if self.resume is not None:
            if resume != self.resume:
                raise ValueError(f"{self.run_dir} was prepared with resume={self.resume}, not resume={resume}")
            return
        if (fresh or allow_changes) and not resume:
            raise ValueError("fresh and allow_changes go with resume=True")
        if not resume and holds_run(self.run_dir):
            raise RunDirError(f"{self.run_dir} already holds a run; pass --resume to continue it or pick another "
                              "--run-dir")
        if resume:
            self.changes = check_resume(self.run_dir, self.cfg, allow_changes=allow_changes)
            self.finished = _check_resumable(self.run_dir, fresh, self.cfg.trainer.max_steps, self.log)
            if self.owner.rank0 and not self.finished:
                self._record()
        self.resume = resume

    def _record(self) -> None:
        """Rank 0, under the lock: write the resume's changes to the run's record and say them. A
        resume that starts over (no checkpoint, fresh) drops the record with the old run."""
        resume = Resume.of(self.run_dir)
        if resume is None:
            (self.run_dir / CHANGES_NAME).unlink(missing_ok=True)
            return
        changes = record_config_changes(self.run_dir, resume.step, self.cfg.model_dump(mode="json", by_alias=True))
        if changes:
            self.log(f"resuming with changes from step {resume.step + 1} (recorded in {self.run_dir / CHANGES_NAME}): "
                     + "; ".join(map(str, changes)))

    def close(self) -> None:
        """Release the run dir's lock (a dir this preparation made and left empty is removed)."""
        self._stack.close()

    def __enter__(self) -> Prepared:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_free(run_dir: Path, environ: Mapping[str, str] = os.environ) -> None:
    """A resume into a dir a live run still holds is refused first, naming the holder (before its
    config, which that run may not have written yet, is looked for). Raises :class:`RunDirError`.

    Rank 0 checks (it alone takes the lock): under a launcher the other ranks would otherwise meet
    their own job's lock, taken by rank 0 while they start."""
    if int(environ.get("RANK", "0")) != 0:
        return
    try:
        check_not_busy(Path(run_dir))
    except RunDirBusy as err:
        raise RunDirError(str(err)) from None


def prepare(cfg: Config, run_dir: Path | str, *, resume: bool | None = None, allow_changes: bool = False,
            fresh: bool = False, card: float | None = None, given: Mapping[str, Any] | None = None,
            log: Callable[[str], None] = print, note: Callable[[str], None] | None = None,
            environ: Mapping[str, str] = os.environ) -> Prepared:
    """Steps 1-4 of the module's docstring, and step 5 when ``resume`` is given; a :class:`Prepared`
    holding the run dir's lock until it is closed (a context manager). Raises :class:`PrepareError`.

    ``card``: the GPU's memory in GiB for the plan (default: the config's or the GPU's); ``given``: the
    parts ``Run.build`` was given (``stapo.core.train.run.PARTS``): their checks are skipped, and a
    given ``plan`` (None: none) is used instead of planning; ``log``: the start-up lines (the plan's, a
    resume's changes); ``note``: a taken-over lock of a dead run (default ``log``)."""
    run_dir, given = Path(run_dir), dict(given or {})
    if resume:
        check_free(run_dir, environ)
    check_inputs(cfg, given=given)
    check_launch(cfg, environ, given=given)
    if "plan" in given:
        plan, said = given["plan"], None
        cfg = resolve_update_memory(cfg, plan)
    else:
        lines: list[str] = []
        cfg, plan = plan_launch(cfg, card, lines.append, environ)
        said = lines[0]
    stack = contextlib.ExitStack()
    try:
        owner = stack.enter_context(owned(run_dir))
    except RunDirBusy as err:
        raise RunDirError(str(err)) from None
    prepared = Prepared(cfg, run_dir, plan, owner, log, _stack=stack)
    try:
        if owner.previous:
            (note or log)(f"note: {run_dir}: taking over the lock of a run that is no longer running "
                          f"({owner.previous})")
        if resume is not None:
            prepared.start(resume, allow_changes=allow_changes, fresh=fresh)
        if said is not None and not prepared.finished:
            log(said)  # the plan's line once the run goes on (a refused or finished start says only why)
    except BaseException:
        prepared.close()
        raise
    return prepared


# ----------------------------------------------------------------------------- the config `stapo train` asks for


def run_config(path: Path | None, overrides: list[str], *, resume_dir: Path | None = None,
               recipe: Path | None = None, asked_name: str | None = None) -> Config:
    """The config ``stapo train`` runs: ``path`` (a file; on a resume None means the run's own) with
    ``overrides``, after ``recipe``'s method keys (:func:`method_overrides`; ``--set`` still wins). A
    resume of ``resume_dir`` with a checkpoint goes on from ``config.yaml`` with its recorded changes
    (unless ``path`` names another file); whether the result may change the run is
    :meth:`Prepared.start`'s to say. ``asked_name``: the ``algorithm.name`` given with ``--set``, for
    :func:`name_mismatch` (refused as :class:`NameMismatch`). Raises ``ConfigError`` for a bad config."""
    saved = resume_dir / "config.yaml" if resume_dir is not None else None
    base_path = path if path is not None else saved
    if recipe is not None:
        overrides = method_overrides(recipe, load_config(base_path).rollout.max_new_tokens) + overrides
    resume = Resume.of(resume_dir) if resume_dir is not None else None
    if resume is not None and path is None:
        cfg = config_from_dict(apply_overrides(resume.data, overrides))
    else:
        cfg = load_config(base_path, overrides)
    if (wrong := name_mismatch(cfg, asked_name)) is not None:
        raise NameMismatch(wrong)
    return cfg


# The keys that decide which objective runs: token weighting, per-token loss, advantage, and the
# layers (our choice); with them every string or boolean option of the chosen weighting's section
# (S2T's mode, 20-Entropy's side...), so a recipe that differs from another by a mode needs no entry
# here. A config labelled with a recipe's name must agree with that recipe on them. Recipes that
# differ only in numbers (grpo and justrl: the clip range) are not told apart by this check:
# `stapo recipes diff` shows those.
_TW = "algorithm.token_weighting"
SIGNATURE_KEYS = (
    _TW, "algorithm.policy_loss", "algorithm.advantage", "algorithm.lp_reg.enabled",
    "algorithm.deep_grpo.enabled", "data.sampler", "rollout.async.enabled",
)


def method_overrides(recipe: Path, max_new_tokens: int | None = None) -> list[str]:
    """``--set`` overrides that give a config the recipe's values of every method key.

    Method keys are those :func:`stapo.core.fairness.classify` puts in the ``method`` group (the
    objective and its layers), so the recipe's batch, lengths, reward scale, schedule, model and
    backend are left out: ``--config tiny --recipe grpo`` is GRPO at the tiny config's scale.
    One method key is a length: DAPO's overlong buffer (in tokens) keeps its share of the response
    budget on a config whose ``rollout.max_new_tokens`` is ``max_new_tokens`` (at least 1 token).
    """
    cfg = load_config(recipe)
    data = flatten(cfg.model_dump(mode="json", by_alias=True))
    if max_new_tokens is not None:
        share = cfg.algorithm.overlong.buffer / cfg.rollout.max_new_tokens
        data["algorithm.overlong.buffer"] = min(max_new_tokens, max(1, round(share * max_new_tokens)))
    return [f"{key}={_flow(value)}" for key, value in data.items() if classify(key) == "method"]


def _flow(value: object) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _signature(flat: dict[str, object]) -> dict[str, object]:
    """The values of a flattened config that say which method runs (:data:`SIGNATURE_KEYS` + modes)."""
    weighting = flat.get("algorithm.token_weighting")
    section = f"algorithm.{weighting}."
    if not any(k.startswith(section) for k in flat):
        section = "algorithm.weighting_options."  # a weighting registered outside stapo
    modes = {k: v for k, v in flat.items() if k.startswith(section) and isinstance(v, str | bool)}
    return {**{k: flat.get(k) for k in SIGNATURE_KEYS}, **modes}


def _recipes() -> dict[str, Config]:
    """The shipped recipes by name: presets whose algorithm.name is their own name (not demo, tiny)."""
    found = {name: load_config(preset_path(name)) for name in preset_names()}
    return {name: cfg for name, cfg in found.items() if cfg.algorithm.name == name}


def name_mismatch(cfg: Config, asked: str | None = None) -> str | None:
    """One line when ``algorithm.name`` does not name the method that runs (None: it does).

    ``algorithm.name`` says which recipe a run follows; reports and `stapo compare` go by it. A shipped
    recipe's name must agree with that recipe on the method's signature (:func:`_signature`). A name
    no recipe has is a new method's: set with ``--set`` (``asked``) on a config whose method is a
    shipped recipe's, it is a relabel (``stapoo``) and refused too. The fix named is ``--recipe``,
    which takes a recipe's method keys and its name together.
    """

    def signature(c: Config) -> dict[str, object]:
        return _signature(flatten(c.model_dump(mode="json", by_alias=True)))

    name, recipes, ours = cfg.algorithm.name, _recipes(), signature(cfg)
    same = [r for r, rc in recipes.items() if signature(rc) == ours]
    also = f" (recipes with this config's method: {', '.join(same)})" if same else ""
    if name not in recipes:
        if asked is None or not same:
            return None  # a config file's own name, or a method no recipe has
        return (f"--set algorithm.name={name}: no recipe is called {name}, and this config runs a shipped recipe's "
                f"method{also}; the name says which recipe ran: `--recipe NAME` runs a recipe's method under its name")
    theirs = signature(recipes[name])
    keys = sorted(set(ours) | set(theirs)) if ours == theirs or ours.get(_TW) == theirs.get(_TW) else SIGNATURE_KEYS
    diffs = [f"{k}={ours.get(k)!r} (the {name} recipe: {theirs.get(k)!r})" for k in keys if ours.get(k) != theirs.get(k)]
    if not diffs:
        return None
    named = f"; this config's method is {' / '.join(same)}'s: --set algorithm.name={same[0]} names it so" if same else ""
    return (f"algorithm.name={name}, but {'; '.join(diffs)}: the run would be reported as {name}. "
            f"`--recipe {name}` runs the {name} recipe's method{named}")
