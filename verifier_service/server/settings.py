"""Settings of the grader pool and the verification service, declared here, read from ``STAPO_VERIFIER_*``.

:class:`PoolSettings` holds the grader pool's knobs (workers, deadline, caches, admission, worker
recycling); :class:`~stapo.verifier_service.server.pool.GraderPool` takes one. :class:`Settings`
adds what only the HTTP service has (address, request limits, token, logging) and reads every field
from the environment, strongest first: a ``stapo verifier serve`` flag, an environment variable
(``STAPO_VERIFIER_DEADLINE_S=2``), or the default below. The defaults are the safe ones: bind to
loopback, one worker per core, a 5 s hard deadline per item, bounded request sizes and queue, no
token on loopback; ``stapo verifier serve`` refuses a non-loopback address without a token
(``STAPO_VERIFIER_TOKEN``) unless ``--allow-unauthenticated`` says so.

    from stapo.verifier_service.server.settings import PoolSettings, Settings
    s = Settings(workers=2, deadline_s=2.0)     # keyword arguments win over the environment
    PoolSettings(workers=2)                     # the pool's knobs alone: no environment read

This module imports no other part of the service (the FastAPI template's ``core/config.py``): the
pool, the app and the adapters read their settings from here.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["PoolSettings", "Settings", "default_workers"]


def default_workers() -> int:
    """One worker per core this process may run on (cgroup/affinity aware where the OS says)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class PoolSettings(BaseModel):
    """The grader pool's knobs; each description says what it changes. No environment is read
    here (a training process's pool is what its config says); :class:`Settings` reads it."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    workers: int | None = Field(None, ge=1, le=256, description="Grading worker processes (default: one per core).")
    deadline_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="Hard wall-clock limit per item; an overrunning worker is killed and the item answers 'timeout'.",
    )
    max_prediction_chars: int = Field(
        100_000, ge=1, description="A longer prediction answers status 'too_large' without reaching a worker."
    )
    max_gold_chars: int = Field(
        10_000, ge=1, description="A longer gold answer answers status 'too_large' without reaching a worker."
    )
    cache_size: int = Field(
        65_536,
        ge=0,
        description="Entries remembered per cache (results by item, verdicts by extracted answer); 0 = off.",
    )
    cache_max_mb: float = Field(
        64.0, ge=0, description="Memory bound of the result caches together, in MiB (estimated bytes)."
    )
    verdict_cache: bool = Field(
        True,
        description="Extract answers in the server process and reuse verdicts by (mode, gold, answer): "
        "a repeated final answer skips the workers.",
    )
    inline_verdicts: bool = Field(
        True,
        description="Decide in the server process the verdicts that need only string and exact-number "
        "tests on short answers (integer golds, equal strings, DAPO's string rule): no worker round "
        "trip. Needs verdict_cache.",
    )
    max_pending_items: int = Field(
        200_000, ge=1, description="Hard cap on items queued in the pool; past it new requests get 429."
    )
    max_queue_s: float = Field(
        60.0,
        gt=0,
        description="Admission bound in work: when the queued items' estimated grading time (items x "
        "recent per-item time of their mode / workers) would exceed it, a request gets 429 with a "
        "Retry-After from the estimate.",
    )
    retry_deadline_factor: float = Field(
        2.0,
        ge=1.0,
        le=10.0,
        description="An item that timed out recently gets this many deadlines on its next try (a retry).",
    )
    start_method: Literal["forkserver", "spawn"] = Field(
        "forkserver",
        description="How workers start (never plain fork under threads). Both are safe under uvicorn's "
        "threads; forkserver restarts a killed worker in ms.",
    )
    worker_memory_mb: int = Field(
        0, ge=0, description="Address-space limit per worker in MiB (RLIMIT_AS); 0 leaves it unlimited."
    )
    worker_max_items: int = Field(
        50_000, ge=0, description="Recycle a worker after grading this many items (0: never)."
    )
    worker_max_rss_mb: int = Field(
        1024,
        ge=0,
        description="Replace the workers once one's resident memory exceeds this after a task (MiB; 0: "
        "never); items still running are graded again.",
    )
    startup_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Time without any ready worker (at start, or after the last ready one died) before "
        "the pool reports itself broken and tries again after a backoff.",
    )
    crash_retries: int = Field(
        1,
        ge=0,
        description="How many times an item whose worker died under it is graded again before it answers 'error'.",
    )
    max_start_failures: int = Field(
        5,
        ge=0,
        description="Workers that may die in a row while starting before the pool reports itself "
        "broken and tries again after a backoff.",
    )
    warmup: bool = Field(
        True,
        description="Each worker (or the fork server it is forked from) grades a few items before its "
        "first task, so no item's deadline pays for loading math-verify and sympy.",
    )

    @field_validator("workers")
    @classmethod
    def _default_workers(cls, v: int | None) -> int:
        """No value: one worker per core (the settings report the number)."""
        return default_workers() if v is None else v


class Settings(BaseSettings, PoolSettings):
    """The service's knobs: the pool's (:class:`PoolSettings`) and the HTTP server's, each read from
    ``STAPO_VERIFIER_<NAME>``; each description says what it changes."""

    model_config = SettingsConfigDict(env_prefix="STAPO_VERIFIER_", extra="ignore", frozen=True)

    host: str = Field("127.0.0.1", description="Interface to bind. Loopback unless told otherwise.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 picks a free one).")
    max_items: int = Field(4096, ge=1, description="Most items in one request; more is answered 413.")
    max_body_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        description="Largest request body; checked on Content-Length and while reading.",
    )
    limit_concurrency: int | None = Field(
        None,
        ge=1,
        description="Most concurrent connections/requests uvicorn serves before answering 503 (None: no limit).",
    )
    token: SecretStr | None = Field(
        None,
        description="Bearer token; when set every route except /healthz, /readyz and the docs requires it.",
    )
    default_budget_factor: float = Field(
        2.8,
        gt=0,
        description="A request that sends no budget_s (OpenRLHF's /get_reward, curl) gets this many item "
        "deadlines from its arrival once it shows an item that can take a whole deadline (a known costly "
        "shape, a timeout): items not graded by then answer 'timeout', "
        "so every client gets an answer in bounded time (ordinary requests are never cut). 2.8: stopping "
        "the items in flight and answering takes a fraction of a second more, so such a request answers "
        "within 3 deadlines.",
    )
    graceful_shutdown_s: float = Field(
        30.0, ge=0, description="How long shutdown waits for in-flight requests."
    )
    switch_interval_ms: float = Field(
        0.5,
        gt=0,
        description="The server process's GIL switch interval (sys.setswitchinterval; Python's default is "
        "5 ms). The event loop grades cached and quick items on the CPU while pebble's threads wait for "
        "the GIL to hand a worker's result back; a shorter interval shortens that wait. Set by "
        "`stapo verifier serve` only, never in a training process.",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="uvicorn log level."
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve on a non-loopback address without a token (refused otherwise).",
    )

    @field_validator("token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, v: object) -> object:
        """``STAPO_VERIFIER_TOKEN=`` (empty) means no token, not an empty-string token everyone knows."""
        if v is None or (isinstance(v, str) and not v.strip()):
            return None
        return v

    def request_budget_s(self) -> float:
        """The budget of a request that sends none."""
        return self.default_budget_factor * self.deadline_s

    def token_value(self) -> str | None:
        """The token as plain text, or None when auth is off."""
        return self.token.get_secret_value() if self.token is not None else None
