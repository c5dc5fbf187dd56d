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

Run it with ``stapo verifier serve`` (uvicorn), or build it in code::

    from stapo.verifier_service.app import create_app
    from stapo.verifier_service.settings import Settings
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
first (``pool.looks_costly``, ``pool.FIRST_SLICE``).

Shutdown: uvicorn stops accepting connections and lets in-flight requests finish, then the
lifespan closes the pool, which finishes queued items before stopping the workers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import orjson
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from fastapi.security import HTTPBearer
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stapo import __version__
from stapo.verifier_service.grader import Verdict
from stapo.verifier_service.metrics import ServiceMetrics
from stapo.verifier_service.pool import GraderPool, PoolBroken, PoolBusy, PoolClosed
from stapo.verifier_service.schemas import (
    RewardRequest,
    RewardResponse,
    VerifyRequest,
    VerifyResponse,
    strip_prompt,
)
from stapo.verifier_service.settings import Settings

log = logging.getLogger("stapo.verifier_service.app")
ModelT = TypeVar("ModelT", bound=BaseModel)


# --------------------------------------------------------------------------- encoding


def clean_text(s: str) -> str:
    """``s`` with lone surrogates (invalid in UTF-8) replaced by U+FFFD; valid pairs are joined."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class SafeJSONResponse(Response):
    """JSON by orjson that always encodes: text with lone surrogates (which orjson refuses, as UTF-8
    has no encoding for them) is cleaned to U+FFFD instead of raising a 500."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        try:
            return orjson.dumps(content)
        except orjson.JSONEncodeError:
            return clean_text(json.dumps(content, ensure_ascii=False, separators=(",", ":"))).encode("utf-8")


# --------------------------------------------------------------------------- middleware

DOCS_ASSETS = "/docs-assets"
"""Where Swagger UI's and ReDoc's scripts are served from (the fastapi-offline package's copies):
``/docs`` and ``/redoc`` load nothing from a CDN, so they work on a cluster with no internet."""
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
"""Routes that never need the token: probes, and the API description (schema only, no data), with
its page assets (under ``DOCS_ASSETS``)."""
QUERY_TOKEN_PATHS = frozenset({"/get_reward"})
"""Routes that accept ``?token=``: OpenRLHF's remote reward client can send no header."""


class AuthMiddleware:
    """401 unless the bearer token matches, decided from the headers alone: the body is never read.

    Checked in constant time. ``/get_reward`` also accepts ``?token=...`` (OpenRLHF
    ``--remote_rm_url http://host:port/get_reward?token=...``); URLs with tokens must not be
    logged, so the access log is redacted (``redact_access_log``).
    """

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if self.token is None or scope["type"] != "http" or path in PUBLIC_PATHS or path.startswith(DOCS_ASSETS + "/"):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, cred = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = cred.strip()
        if not given and scope.get("path", "") in QUERY_TOKEN_PATHS:
            from urllib.parse import parse_qs

            qs = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            if qs.get("token"):
                given = qs["token"][-1].encode("latin-1")
        if not given or not hmac.compare_digest(given, self.token):
            await _send_json(
                send, 401, {"detail": "missing or wrong bearer token"}, [(b"www-authenticate", b"Bearer")]
            )
            return
        await self.app(scope, receive, send)


_TOKEN_IN_URL_RE = re.compile(r"([?&]token=)[^&\s\"]*", re.I)


class _RedactTokenFilter(logging.Filter):
    """Rewrite ``?token=...`` in uvicorn's access-log lines to ``?token=***``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(
                _TOKEN_IN_URL_RE.sub(r"\1***", a) if isinstance(a, str) and "token=" in a.lower() else a
                for a in record.args
            )
        elif isinstance(record.msg, str) and "token=" in record.msg.lower():
            record.msg = _TOKEN_IN_URL_RE.sub(r"\1***", record.msg)
        return True


def redact_access_log() -> None:
    """Install the token redaction on uvicorn's access logger (idempotent)."""
    lg = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _RedactTokenFilter) for f in lg.filters):
        lg.addFilter(_RedactTokenFilter())


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``: on Content-Length before reading, and while reading.

    A chunked body has no Content-Length, so the byte count is enforced as it arrives; the
    exception raised from ``receive`` is an HTTPException, which FastAPI passes through its body
    parsing unchanged, so the client gets a JSON 413 with the reason.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    n = int(value)
                except ValueError:
                    await _send_json(send, 400, {"detail": "Content-Length: not an integer"})
                    return
                if n > self.max_bytes:
                    await _send_json(send, 413, {"detail": self._reason(n)})
                    return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._reason(seen, partial=True))
            return msg

        await self.app(scope, limited, send)

    def _reason(self, n: int, partial: bool = False) -> str:
        got = f"over {n}" if partial else f"{n}"
        return f"request body is {got} bytes; the limit is {self.max_bytes} (STAPO_VERIFIER_MAX_BODY_BYTES)"


class MetricsMiddleware:
    """Count every HTTP request by route and status code, and time it."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        code = 500

        async def send_wrapper(msg: Message) -> None:
            nonlocal code
            if msg["type"] == "http.response.start":
                code = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.observe_request(scope.get("path", ""), code, time.perf_counter() - t0)


async def _send_json(
    send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
            + (headers or []),
        }
    )
    await send({"type": "http.response.body", "body": data})


# --------------------------------------------------------------------------- app


def results_body(results: list[Verdict], *, explain: bool = False) -> dict[str, Any]:
    """``/v1/verify``'s answer; with ``explain`` each result also names the rule that decided it."""
    if not explain:
        return {"results": [
            {"correct": r.correct, "score": r.score, "status": r.status, "extracted": r.extracted, "ms": r.ms}
            for r in results
        ]}  # fmt: skip
    return {"results": [
        {"correct": r.correct, "score": r.score, "status": r.status, "extracted": r.extracted, "ms": r.ms,
         "rule": r.rule}
        for r in results
    ]}  # fmt: skip


def read_model(body: bytes, content_type: str | None, model: type[ModelT]) -> ModelT:
    """The request body validated as ``model`` straight from its bytes (pydantic's JSON parser,
    which skips the dict that ``json.loads`` + validation would build first).

    Content types as FastAPI reads them: none, ``application/json`` or ``application/*+json`` are
    JSON; anything else is validated as it is, and fails with the reason. Errors are FastAPI's 422,
    with ``body`` leading each location.
    """
    try:
        if content_type:
            main, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
            if main != "application" or not (sub == "json" or sub.endswith("+json")):
                return model.model_validate(body)
        return model.model_validate_json(body)
    except ValidationError as err:
        errors = [
            {"type": "json_invalid", "loc": ("body",), "msg": f"JSON decode error: {e['msg']}"}
            if e["type"] == "json_invalid"
            else {**e, "loc": ("body", *e["loc"])}
            for e in err.errors(include_url=False, include_input=False)
        ]
        raise RequestValidationError(errors) from None


def json_body(model: type[ModelT]) -> tuple[Callable[[Request], Any], dict[str, Any]]:
    """A dependency that reads the body as ``model`` (``read_model``), and the OpenAPI entry that
    documents it (the model itself is added to the schema's components by ``create_app``)."""

    async def dep(request: Request) -> ModelT:
        return read_model(await request.body(), request.headers.get("content-type"), model)

    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return dep, {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _validation_detail(errors: Any) -> list[dict[str, Any]]:
    """pydantic's errors without the offending input (it may be huge, or not encodable)."""
    out = []
    for e in errors:
        out.append(
            {
                "type": e.get("type"),
                "loc": [clean_text(x) if isinstance(x, str) else x for x in e.get("loc", ())],
                "msg": clean_text(str(e.get("msg", ""))),
            }
        )
    return out


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the client goes away (the body was read already; the next message is the end)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class _ClientGone(Exception):
    pass


def create_app(settings: Settings | None = None, *, pool: GraderPool | None = None) -> FastAPI:
    """Build the app. ``pool``: use this pool (not closed on shutdown); else one is made from settings."""
    settings = settings or Settings()
    state: dict[str, Any] = {"pool": pool}
    metrics = ServiceMetrics(lambda: state["pool"])

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = state["pool"] is None
        if own:
            state["pool"] = await asyncio.to_thread(lambda: GraderPool(**settings.pool_kwargs()))
        app.state.pool = state["pool"]
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
                await asyncio.to_thread(state["pool"].close, settings.graceful_shutdown_s)

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
    app.state.metrics = metrics
    # Outermost last: metrics see every answer (401s too); the token is checked before the body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, token=settings.token_value())
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    redact_access_log()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return SafeJSONResponse({"detail": _validation_detail(exc.errors())}, status_code=422)

    # The check itself is AuthMiddleware's; this only documents the scheme in the OpenAPI schema.
    bearer = HTTPBearer(auto_error=False, description="Required when STAPO_VERIFIER_TOKEN is set.")
    Auth = [Depends(bearer)]

    def get_pool() -> GraderPool:
        p = state["pool"]
        if p is None:
            raise HTTPException(503, "the grader pool is not started yet")
        return p

    async def grade(
        request: Request, items: list[tuple[str, str, str]], budget_s: float | None
    ) -> list[Verdict]:
        if len(items) > settings.max_items:
            raise HTTPException(
                413,
                f"{len(items)} items in one request; the limit is {settings.max_items} (STAPO_VERIFIER_MAX_ITEMS)",
            )
        pool = get_pool()
        try:
            # A client that sends no budget (OpenRLHF's /get_reward, curl) gets the default one, so a
            # request of pathological items answers in bounded time whoever sends it.
            fut = pool.submit(items, budget_s=budget_s, default_budget_s=settings.request_budget_s())
        except PoolBusy as err:
            retry = str(max(1, math.ceil(err.retry_after_s)))
            raise HTTPException(429, str(err), headers={"Retry-After": retry}) from err
        except (PoolBroken, PoolClosed) as err:
            retry = str(max(1, math.ceil(getattr(err, "retry_after_s", 5.0))))
            raise HTTPException(503, str(err), headers={"Retry-After": retry}) from err
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            # answered in this process (caches, in-process verdicts): nothing queued to cancel
            results = fut.result()
            metrics.observe_statuses([r.status for r in results])
            return results
        graded = asyncio.wrap_future(fut)
        gone = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({graded, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not graded.done():
                graded.cancel()  # the client went away: its queued items never reach a worker
                metrics.cancelled_requests.inc()
            gone.cancel()
        if not graded.done() or graded.cancelled():
            raise _ClientGone
        try:
            results = graded.result()
        except (PoolBroken, PoolClosed) as err:
            retry = str(max(1, math.ceil(getattr(err, "retry_after_s", 5.0))))
            raise HTTPException(503, str(err), headers={"Retry-After": retry}) from err
        metrics.observe_statuses([r.status for r in results])
        return results

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    async def reward_handler(req: RewardRequest, request: Request) -> Response:
        """``/get_reward``'s answer (see the route below)."""
        prompts = req.prompts or [None] * len(req.query)
        items = [
            (strip_prompt(q, p), lbl, req.mode)
            for q, p, lbl in zip(req.query, prompts, req.labels, strict=True)
        ]
        results = await grade(request, items, None)
        scores = [float(r.score) for r in results]
        flags = {
            name: [1.0 if r.status in statuses else 0.0 for r in results]
            for name, statuses in (
                ("verifier_no_answer", ("no_answer",)),
                ("verifier_timeout", ("timeout",)),
                ("verifier_too_large", ("too_large",)),  # the request's sizes, not the grader's fault
                ("verifier_error", ("error", "undecided")),
            )
        }
        body = {
            "rewards": scores,
            "scores": scores,
            "extra_logs": {"accuracy": [float(r.correct) for r in results], **flags},
        }
        return SafeJSONResponse(body)

    verify_body, verify_doc = json_body(VerifyRequest)
    reward_body, reward_doc = json_body(RewardRequest)

    @app.post(
        "/v1/verify",
        response_model=VerifyResponse,
        dependencies=Auth,
        tags=["verify"],
        openapi_extra=verify_doc,
    )
    async def verify(request: Request, req: VerifyRequest = Depends(verify_body)) -> Response:
        """Grade a batch: one result per item, in order. A failed item is a status, not an HTTP error.

        With ``explain: true`` each result also names the grader's rule that decided it."""
        items = [(it.prediction, it.gold, it.mode) for it in req.items]
        results = await grade(request, items, req.budget_s)
        return SafeJSONResponse(results_body(results, explain=req.explain))

    @app.post(
        "/get_reward",
        response_model=RewardResponse,
        dependencies=Auth,
        tags=["verify"],
        openapi_extra=reward_doc,
    )
    async def get_reward(request: Request, req: RewardRequest = Depends(reward_body)) -> Response:
        """OpenRLHF ``--remote_rm_url``: reward = score; per-sample statuses are in ``extra_logs``.

        OpenRLHF needs a number for every sample, so an item that timed out or errored gets reward
        0 here, but it is never silent: ``extra_logs`` carries per-sample ``verifier_timeout`` /
        ``verifier_error`` (errors, oversized and undecided items) /
        ``verifier_no_answer`` flags and the metrics count them.
        """
        return await reward_handler(req, request)

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """Alive: the process answers HTTP. Never requires the token."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz() -> Response:
        """200 only when the pool can grade now (a worker is up, not broken, not closing); else 503.

        The body has the counts: workers up, items queued or in flight, estimated queued seconds;
        for a broken pool the reason and when it restarts. Worker PIDs are nobody's business.
        """
        p = state["pool"]
        if p is None:
            return SafeJSONResponse({"ready": False, "reason": "starting"}, status_code=503)
        n = p.ready_workers()
        ok = n > 0 and not p.closed and p.broken is None
        body: dict[str, Any] = {
            "ready": ok,
            "workers_ready": n,
            "workers": p.size,
            "pending_items": p.pending_items(),
            "queued_seconds": round(p.queued_seconds(), 3),
        }
        if p.broken:
            body["reason"] = p.broken
            left = p.restart_in_s()
            if left is not None and math.isfinite(left):
                body["restart_in_s"] = round(left, 1)
        elif p.closed:
            body["reason"] = "shutting down"
        elif n == 0:
            body["reason"] = "no grading worker is up yet"
        return SafeJSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", dependencies=Auth, tags=["ops"])
    async def prometheus_metrics() -> Response:
        """Prometheus text format."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus the request models that the routes read themselves (``json_body``)."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (VerifyRequest, RewardRequest):
                spec = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(spec.pop("$defs", {}))
                components[model.__name__] = spec
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
