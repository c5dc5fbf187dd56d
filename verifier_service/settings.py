"""Settings of the verification service, read from ``STAPO_VERIFIER_*`` environment variables.

Every field can be set three ways, strongest first: a ``stapo verifier serve`` flag, an environment
variable (``STAPO_VERIFIER_DEADLINE_S=2``), or the default below. The defaults are the safe ones:
bind to loopback, one worker per core, a 5 s hard deadline per item, bounded request sizes and
queue, no token on loopback; ``stapo verifier serve`` refuses a non-loopback address without a
token (``STAPO_VERIFIER_TOKEN``) unless ``--allow-unauthenticated`` says so.

    from stapo.verifier_service.settings import Settings
    s = Settings(workers=2, deadline_s=2.0)     # keyword arguments win over the environment

The pool's settings are not written here: :class:`PoolSettings` is read from the signature of
:class:`~stapo.verifier_service.pool.GraderPool` (each keyword's type, bounds, description and
default), so a pool keyword is a setting (``STAPO_VERIFIER_<KEYWORD>``) as soon as it exists.
:class:`Settings` adds what only the HTTP service has (address, request limits, token, logging).
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Literal

from pydantic import Field, SecretStr, create_model, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from stapo.verifier_service.pool import GraderPool, default_workers

__all__ = ["POOL_KEYWORDS", "PoolSettings", "Settings", "default_workers"]


class _Env(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STAPO_VERIFIER_", extra="ignore", frozen=True)


def _pool_fields() -> dict[str, tuple[Any, Any]]:
    """name -> (annotation with its ``Field`` bounds and description, default) of every keyword of
    ``GraderPool.__init__``."""
    hints = typing.get_type_hints(GraderPool.__init__, include_extras=True)
    params = inspect.signature(GraderPool.__init__).parameters
    return {name: (hints[name], p.default) for name, p in params.items() if name != "self"}


POOL_KEYWORDS: tuple[str, ...] = tuple(_pool_fields())
"""The keywords of ``GraderPool``, in its signature's order: each is a setting of the same name."""

PoolSettings = create_model("PoolSettings", __base__=_Env, __doc__="GraderPool's keywords.", **_pool_fields())
"""The pool's keywords as settings (``STAPO_VERIFIER_DEADLINE_S`` for ``deadline_s``), with the
pool's own defaults, bounds and descriptions."""


class Settings(PoolSettings):  # type: ignore[valid-type, misc]
    """The service's knobs: the pool's (:class:`PoolSettings`) and the HTTP server's; each
    description says what it changes."""

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

    @field_validator("workers")
    @classmethod
    def _default_workers(cls, v: int | None) -> int:
        """No value: one worker per core, as the pool would pick (the settings report the number)."""
        return default_workers() if v is None else v

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

    def pool_kwargs(self) -> dict[str, Any]:
        """The :class:`~stapo.verifier_service.pool.GraderPool` arguments these settings configure."""
        return {name: getattr(self, name) for name in POOL_KEYWORDS}
