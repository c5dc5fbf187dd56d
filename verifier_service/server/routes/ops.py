"""Operations: ``/healthz`` (alive), ``/readyz`` (can grade now), ``/metrics`` (Prometheus)."""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from stapo.verifier_service.server.deps import AUTH, MetricsDep, StartedPoolDep
from stapo.verifier_service.server.responses import SafeJSONResponse

router = APIRouter(tags=["ops"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Alive: the process answers HTTP. Never requires the token."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(p: StartedPoolDep) -> Response:
    """200 only when the pool can grade now (a worker is up, not broken, not closing); else 503.

    The body has the counts: workers up, items queued or in flight, estimated queued seconds;
    for a broken pool the reason and when it restarts. Worker PIDs are nobody's business.
    """
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


@router.get("/metrics", dependencies=AUTH)
async def prometheus_metrics(metrics: MetricsDep) -> Response:
    """Prometheus text format."""
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
