"""The service's ASGI middleware: the bearer token (decided from the headers, before the body is
read), the body size limit, request metrics, and the token's redaction from the access log."""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stapo.verifier_service.server.metrics import ServiceMetrics

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
