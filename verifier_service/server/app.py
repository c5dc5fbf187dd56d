"""The math-verification service: FastAPI app over the grader pool.

Routes::

    POST /v1/verify     {"items": [{"prediction", "gold", "mode"?}]} -> {"results": [...]}, in order
    POST /get_reward    OpenRLHF's remote reward protocol ({"query", "prompts", "labels"});
                        the token may also come as ``?token=`` (OpenRLHF's client sends no headers)
    GET  /healthz       alive (the process answers)                    -- never needs the token
    GET  /readyz        the pool can grade now (503 otherwise: starting, broken, closing)
                        -- never needs the token; what container health checks should probe
    GET  /metrics       Prometheus text format
    GET  /docs          OpenAPI UI (schema only, no data; open without the token)

Layout (the FastAPI full-stack template's): one router per concern (``routes/verify.py``,
``routes/openrlhf.py``, ``routes/ops.py``), typed dependencies (``deps``: ``Annotated`` aliases a route
names as parameter types), middleware (``middleware``), request/response encoding (``responses``);
``create_app`` wires them and owns the pool's lifespan.

Run it with ``stapo verifier serve`` (uvicorn), or build it in code::

    from stapo.verifier_service.server.app import create_app
    from stapo.verifier_service.server.settings import Settings
    app = create_app(Settings(workers=2, deadline_s=2))   # uvicorn.run(app, host=..., port=...)

Errors are explicit: malformed JSON or wrong types 422 (pydantic's reason, naming the field; the
offending input is never echoed back), an oversize body 413 (Content-Length checked before reading,
the byte count enforced while reading), too many items 413, too much queued work 429 with a
Retry-After estimated from the queue, no workers 503, a missing or wrong token 401 (checked in a
middleware before the body is read). A failed item is not an HTTP error: it is a status in its
result. Responses are always valid UTF-8 JSON: text that cannot be encoded (a lone surrogate sent
as ``"\\ud800"``) comes back with U+FFFD in its place.

A request whose client disconnects is cancelled: its items still queued are dropped before they
reach a worker. ``/v1/verify`` takes an optional ``budget_s``: items not graded within it answer
'timeout' (our client sends its own HTTP timeout); a request without one (``/get_reward``, curl)
gets the default budget (``default_budget_factor`` x the item deadline, from its arrival) once one
of its items timed out, so every client gets an answer in bounded time, its ordinary items graded
first (``scheduler.looks_costly``, ``scheduler.FIRST_SLICE``).

Shutdown: uvicorn stops accepting connections and lets in-flight requests finish, then the
lifespan closes the pool, which finishes queued items before stopping the workers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from fastapi_offline import FastAPIOffline

from stapo import __version__
from stapo.verifier_service.server.deps import ClientGone
from stapo.verifier_service.server.metrics import ServiceMetrics
from stapo.verifier_service.server.middleware import (
    DOCS_ASSETS,
    AuthMiddleware,
    BodyLimitMiddleware,
    MetricsMiddleware,
    redact_access_log,
)
from stapo.verifier_service.server.pool import GraderPool
from stapo.verifier_service.server.responses import SafeJSONResponse, invalid_request
from stapo.verifier_service.server.routes import openrlhf, ops, verify
from stapo.verifier_service.server.schemas import RewardRequest, VerifyRequest
from stapo.verifier_service.server.settings import Settings

log = logging.getLogger("stapo.verifier_service.server.app")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the pool (unless one was given to ``create_app``: the caller closes that one); on
    shutdown, after uvicorn let in-flight requests finish, close it: queued items finish first."""
    settings: Settings = app.state.settings
    own = app.state.pool is None
    if own:
        app.state.pool = await asyncio.to_thread(lambda: GraderPool(settings))
    redact_access_log()
    log.info(
        "stapo verifier: %d workers, deadline %.1fs, token %s",
        settings.workers,
        settings.deadline_s,
        "on" if settings.token else "off",
    )
    try:
        yield
    finally:
        if own:
            await asyncio.to_thread(app.state.pool.close, settings.graceful_shutdown_s)


async def client_gone(request: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request models that the routes read themselves (``deps.VerifyBody``,
    ``deps.RewardBody``: validated from the body's bytes, so FastAPI does not see them)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (VerifyRequest, RewardRequest):
            spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(spec.pop("$defs", {}))
            components[model.__name__] = spec
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(settings: Settings | None = None, *, pool: GraderPool | None = None) -> FastAPI:
    """Build the app. ``pool``: use this pool (not closed on shutdown); else one is made from settings."""
    settings = settings or Settings()
    # FastAPI's own /docs and /redoc load their scripts from a CDN; fastapi-offline serves the same
    # pages with the scripts it ships (FastAPI's documented self-hosting recipe, packaged).
    app = FastAPIOffline(
        title="stapo verifier",
        version=__version__,
        summary="Math answer verification with hard per-item deadlines (math-verify behind a worker pool).",
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
        static_url=DOCS_ASSETS,
        swagger_ui_parameters={"validatorUrl": None},  # no badge from validator.swagger.io
    )
    app.state.settings = settings
    app.state.pool = pool
    app.state.metrics = metrics = ServiceMetrics(lambda: app.state.pool)
    # Outermost last: metrics see every answer (401s too); the token is checked before the body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, token=settings.token_value())
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    redact_access_log()
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(ClientGone, client_gone)
    for routes in (verify, openrlhf, ops):
        app.include_router(routes.router)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    return app
