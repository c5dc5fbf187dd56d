"""Shared pieces of the command line: the one user-facing error type, typed option aliases, and
the checks that run before a command writes anything.

Every command module raises :class:`CLIError` for mistakes a user can fix (a bad path, a bad
``--set``); :func:`stapo.cli.main.main` prints it in one line and exits with status 2, without a
traceback. Library errors that are user mistakes (``stapo.core.config.ConfigError``) are turned
into a ``CLIError`` by the command that called the library; ``main`` turns the rest into a short
message too (the traceback is behind ``--debug``).

:func:`check_inputs` looks at the model path and the data source of a config without loading
either, and :func:`check_launch` at what the launch fixes (ranks, vLLM, the verifier URLs), so that
``stapo train`` fails on a typo before it makes a run dir, loads a model or starts a grader pool.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from stapo.core.lazy import KNOWN_NOISE, quiet_known_noise

if TYPE_CHECKING:
    from rich.console import Console

    from stapo.core.config import Config


class CLIError(Exception):
    """A user mistake: printed as one red line, exit status 2."""


class JobError(CLIError):
    """A mistake in what every rank of a launch was given alike (the config, its inputs, the launch's
    size): under a launcher only each node's first rank prints it (:func:`stapo.cli.main.main`), so
    an 8-rank launch shows it once, not eight times."""


ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", metavar="NAME|FILE", help="A preset name (tiny, stapo, grpo, ...: `stapo recipes`) or a YAML config file. Default: the command's preset."),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override one config field, repeatable: --set trainer.max_steps=10 --set algorithm.s2t.tau_p=0.02 (all fields: docs/config.md)",
    ),
]


WIDE = 160
"""Columns of rich output when stdout is not a terminal (a pipe, a log file): tables are not cut at
rich's 80-column fallback. A terminal keeps its own width."""


def console() -> Console:
    """The rich console of a command's output: the terminal's width, or :data:`WIDE` off a terminal."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else WIDE)


__all__ = ["KNOWN_NOISE", "quiet_known_noise"]  # (with the rest: re-exported for the commands)


def not_built(name: str) -> None:
    """Commands not built yet say so and exit non-zero."""
    raise CLIError(f"`stapo {name}` is not built yet in this version of stapo.")


def resolve_config_path(config: Path | None, default: str = "demo", *, what: str = "config") -> Path:
    """A file path, or the name of a preset shipped in `configs/` (demo, tiny, stapo, grpo, ...).

    ``what`` names the option in the error (``recipe`` for ``--recipe``), which offers the closest
    preset names (``did you mean stapo?``) before the full list."""
    import difflib

    from stapo.configs import preset_names, preset_path

    if config is not None and config.is_file():
        return config
    name = str(config) if config is not None else default
    preset = preset_path(name[:-5] if name.endswith(".yaml") else name)
    if preset is None:
        close = difflib.get_close_matches(name.removesuffix(".yaml"), preset_names(), n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise CLIError(f"{what} {name!r} is neither a file nor a preset; {hint}presets: {', '.join(preset_names())}")
    return preset


# A Hugging Face hub id: "name" or "org/name" (letters, digits, ".", "_", "-").
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_MODEL_FIX = "give a model folder (with config.json, e.g. RUN/final), a Hugging Face id, or tiny-random"


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
                raise CLIError(f"model.gguf_file: {path / gguf_file} does not exist")
            return
        wanted = ("tokenizer_config.json", "tokenizer.json") if tokenizer else ("config.json",)
        if not any((path / f).is_file() for f in wanted):
            what = "tokenizer (no tokenizer_config.json)" if tokenizer else "model (no config.json)"
            raise CLIError(f"{field}: {path} is a folder but not a {what}; {_MODEL_FIX}")
        return
    if path.exists():
        raise CLIError(
            f"{field}: {path} is a file; give the model's folder (a GGUF file: model.name_or_path=FOLDER "
            "model.gguf_file=NAME)"
        )
    if not _HUB_ID.match(name):  # an absolute/relative path, ~, or a/b/c: not a hub id, so a missing path
        raise CLIError(f"{field}: {path} does not exist; {_MODEL_FIX}")
    check_hub_id(field, name, tokenizer=tokenizer)


HUB_PROBE_S = 5.0
"""Seconds the hub gets to answer before a hub id that is not cached is refused (the loader itself
retries for about 30 s, printing each retry)."""


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
        raise CLIError(f"{field}: {where}, and HF_HUB_OFFLINE is set; {fix}")
    why = hub_answers(constants.ENDPOINT)
    if why is not None:
        raise CLIError(f"{field}: {where}, and the hub ({constants.ENDPOINT}) cannot be reached ({why}, "
                       f"{HUB_PROBE_S:g} s limit); {fix}")


def check_inputs(cfg: Config) -> None:
    """The model, tokenizer and data source of ``cfg`` exist and are readable (nothing is loaded)."""
    from stapo.core.task.data import DataError, check_source

    try:
        check_model_path("model.name_or_path", cfg.model.name_or_path, gguf_file=cfg.model.gguf_file)
        if cfg.model.tokenizer and cfg.model.tokenizer != cfg.model.name_or_path:
            check_model_path("model.tokenizer", cfg.model.tokenizer, tokenizer=True)
        check_source(cfg.data)
    except (CLIError, DataError) as err:
        raise JobError(str(err)) from None


def check_launch(cfg: Config, environ: Mapping[str, str] = os.environ) -> None:
    """What the launch already knows, checked before the model loads (minutes at 8B): a backend that
    spans the ranks, the prompts split evenly over them (``WORLD_SIZE``), an engine that supports the
    run's asynchronous rollouts, the vLLM engine imports, every ``rollout.server.urls`` entry answers
    as a ``stapo rollout serve`` server and every ``reward.urls`` entry resolves and answers
    ``/readyz``. Each failure is one :class:`JobError` naming the key."""
    from stapo.core.rollout.async_rollout import check_supported

    world = int(environ.get("WORLD_SIZE") or 1)
    if world > 1 and cfg.trainer.backend == "torch":
        raise JobError(
            f"trainer.backend=torch trains in one process, but this launch has {world} ranks: "
            "--set trainer.backend=deepspeed (ZeRO over the ranks), or start one process"
        )
    prompts = cfg.rollout.prompts_per_step
    if prompts % world:
        below, above = nearest_multiples(prompts, world)
        near = f"{below} or {above}" if below else str(above)
        raise JobError(
            f"rollout.prompts_per_step ({prompts}) must be divisible by the number of ranks ({world}): each rank "
            f"samples an equal share of a step's prompts; the nearest valid counts are {near} "
            f"(--set rollout.prompts_per_step=N), or launch a number of ranks that divides {prompts}"
        )
    try:
        check_supported(cfg)
    except ValueError as err:
        raise JobError(str(err)) from None
    check_engine_and_device(cfg, environ)
    if cfg.rollout.engine == "vllm_server":
        for url in cfg.rollout.server.urls:
            _check_rollout_server(url)
    for url in cfg.reward.urls:
        _check_verifier(url)


def check_engine_and_device(cfg: Config, environ: Mapping[str, str] = os.environ) -> None:
    """The optional packages the config names are installed (vLLM, DeepSpeed, wandb) and
    ``trainer.device`` exists on this machine: what `stapo train` and `stapo eval` need before a
    model loads or a memory plan is printed; one :class:`JobError` naming the fix."""
    import importlib.util

    import torch

    from stapo.core.placement import place

    for wanted, module, fix in (
        (cfg.trainer.backend == "deepspeed", "deepspeed", "install stapo[train] or --set trainer.backend=torch"),
        (cfg.logging.wandb, "wandb", "`pip install wandb` (and `wandb login`) or --set logging.wandb=false"),
    ):
        if wanted and importlib.util.find_spec(module) is None:
            what = f"trainer.backend={cfg.trainer.backend}" if module == "deepspeed" else "logging.wandb=true"
            raise JobError(f"{what} needs {module}, which is not installed: {fix}")
    if cfg.trainer.backend == "deepspeed" and cfg.trainer.offload_optimizer:
        from stapo.core.trainer.deepspeed_backend import cpu_adam_build_missing

        if missing := cpu_adam_build_missing(environ):
            raise JobError(
                f"trainer.offload_optimizer=true: DeepSpeed compiles its CPU Adam at the first step (its PyPI "
                f"release ships no compiled op), which needs a C++ compiler ($CXX, default c++) and ninja on PATH; "
                f"missing: {', '.join(missing)}. Install them (apt-get install g++ ninja-build), or DeepSpeed "
                "with the op prebuilt (DS_BUILD_CPU_ADAM=1 pip install deepspeed), or --set "
                "trainer.offload_optimizer=false"
            )
    if cfg.rollout.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except Exception as err:  # missing, or installed beside a torch it was not built for
            raise JobError(
                f"rollout.engine=vllm, but vllm does not import ({type(err).__name__}: {err}); install "
                "stapo[vllm] or --set rollout.engine=hf"
            ) from None
    if not cfg.trainer.device.startswith("cuda"):
        return  # auto and cpu always place
    try:  # the GPU each rank takes at start, decided now (stapo.core.placement)
        tp = cfg.rollout.vllm.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        place(environ, cuda_devices=gpus, requested=cfg.trainer.device, tp_size=tp)
    except ValueError as err:
        raise JobError(str(err)) from None


def nearest_multiples(count: int, world: int) -> tuple[int, int]:
    """The multiples of ``world`` just below (0 when none) and just above ``count``."""
    below = count // world * world
    return below, below + world


def _check_rollout_server(url: str, timeout_s: float = 5.0) -> None:
    """``url`` answers vLLM's ``GET /health`` and, started as ``stapo rollout serve`` starts it
    (``VLLM_SERVER_DEV_MODE=1``), the ``GET /weight_info`` the weight pushes need."""
    import httpx

    serve = "start it with `stapo rollout serve MODEL --port PORT` (docs/rollout.md, \"Starting a server\")"
    try:
        status = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).status_code
        if status != 200:
            raise JobError(f"rollout.server.urls: {url}/health answered {status}: the server is not ready; {serve}")
        info = httpx.get(f"{url.rstrip('/')}/weight_info", timeout=timeout_s).status_code
    except httpx.HTTPError as err:
        raise JobError(f"rollout.server.urls: {url} did not answer ({type(err).__name__}); {serve}") from None
    if info == 404:
        raise JobError(f"rollout.server.urls: {url} runs without VLLM_SERVER_DEV_MODE=1, so it cannot take weight "
                       f"pushes; {serve}")


def _check_verifier(url: str) -> None:
    """``url`` resolves and its ``/readyz`` answers 200 (readiness: its grading pool is up)."""
    import socket
    from urllib.parse import urlsplit

    import httpx

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise JobError(f"reward.urls: {url!r} is not an http(s)://host:port URL")
    try:
        socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    except OSError:
        raise JobError(
            f"reward.urls: cannot resolve {parts.hostname!r} ({url}); give a reachable verifier, or "
            "--set reward.urls=[] to grade in-process"
        ) from None
    try:
        status = httpx.get(f"{url.rstrip('/')}/readyz", timeout=10.0).status_code
    except httpx.HTTPError as err:
        raise JobError(f"reward.urls: {url}/readyz did not answer ({type(err).__name__}); is the verifier up?") from None
    if status != 200:
        raise JobError(f"reward.urls: {url}/readyz answered {status}: the verifier is not ready to grade")


class _BelowError:
    """A ``logging`` filter that keeps errors only (ranks other than 0: rank 0 shows the warnings)."""

    def filter(self, record: object) -> bool:
        return record.levelno >= 40  # type: ignore[attr-defined]  # logging.ERROR


# Libraries whose warnings every rank repeats alike (by logger name); on ranks other than 0 only their
# errors show. transformers reads its verbosity from the environment instead (TRANSFORMERS_VERBOSITY).
PER_RANK_NOISE = ("DeepSpeed", "torch.distributed", "huggingface_hub")


@contextlib.contextmanager
def quiet_job_noise(environ: MutableMapping[str, str], *, terminal: bool) -> Iterator[None]:
    """Around a command, before any library loads: one copy of each warning per job, and no
    progress bars in a log. Everything it changes is put back on exit (a command run in-process).

    Under a launcher every rank imports the same libraries and warns alike (FutureWarnings,
    DeepSpeed's accelerator probe): ranks other than 0 keep errors only, so a 2-rank log carries one
    copy. Off a terminal (a log file, a pipe, a batch job) progress bars are redrawn as lines of
    carriage returns: tqdm's (transformers' loading and saving bars, huggingface_hub's, DeepSpeed's)
    are turned off through their environment switches; a terminal keeps them.
    """
    import logging
    import warnings

    added: dict[str, str] = {}
    if not terminal:
        added["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers and huggingface_hub read it
        added["TQDM_DISABLE"] = "1"  # every other tqdm bar (tqdm >= 4.66 reads TQDM_* defaults)
    rank0 = int(environ.get("RANK") or 0) == 0
    if not rank0:
        added["TRANSFORMERS_VERBOSITY"] = "error"
    added = {k: v for k, v in added.items() if k not in environ}
    environ.update(added)
    filters = [] if rank0 else [(logging.getLogger(name), _BelowError()) for name in PER_RANK_NOISE]
    for logger, f in filters:
        logger.addFilter(f)  # type: ignore[arg-type]
    try:
        with warnings.catch_warnings():
            if not rank0:
                warnings.simplefilter("ignore")
            yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)  # type: ignore[arg-type]
        for key in added:
            environ.pop(key, None)
