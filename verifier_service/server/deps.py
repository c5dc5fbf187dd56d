"""The routes' dependencies, typed: each route names what it needs as an ``Annotated`` parameter
type (``PoolDep``, ``SettingsDep``, ``GradingDep``, ...) and FastAPI builds it per request from the
app's state (``create_app`` puts the settings, the metrics and the pool there)."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPBearer
from starlette.types import Receive

from stapo.verifier_service.grader import Verdict
from stapo.verifier_service.server.metrics import ServiceMetrics
from stapo.verifier_service.server.pool import GraderPool, PoolBroken, PoolClosed
from stapo.verifier_service.server.responses import json_body
from stapo.verifier_service.server.scheduler import PoolBusy
from stapo.verifier_service.server.schemas import RewardRequest, VerifyRequest
from stapo.verifier_service.server.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_metrics(request: Request) -> ServiceMetrics:
    return request.app.state.metrics


def get_started_pool(request: Request) -> GraderPool | None:
    """The pool, or None while the lifespan is still starting it."""
    return request.app.state.pool


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
StartedPoolDep = Annotated[GraderPool | None, Depends(get_started_pool)]

bearer = HTTPBearer(auto_error=False, description="Required when STAPO_VERIFIER_TOKEN is set.")
AUTH = [Depends(bearer)]
"""Documents the bearer scheme in the OpenAPI schema; the check itself is ``AuthMiddleware``'s,
decided before the body is read."""

_verify_body, VERIFY_DOC = json_body(VerifyRequest)
_reward_body, REWARD_DOC = json_body(RewardRequest)
VerifyBody = Annotated[VerifyRequest, Depends(_verify_body)]
RewardBody = Annotated[RewardRequest, Depends(_reward_body)]
"""Request bodies validated from their bytes (``responses.read_model``); ``VERIFY_DOC`` /
``REWARD_DOC`` are their OpenAPI entries (the routes pass them as ``openapi_extra``)."""


class ClientGone(Exception):
    """The client disconnected before its items were graded (answered 499, read by nobody)."""


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the client goes away (the body was read already; the next message is the end)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


def _retry_after(err: Exception, default_s: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(getattr(err, "retry_after_s", default_s))))}


class Grading:
    """One request's items graded on the pool, the HTTP way: too many items 413, too much queued work
    429 with a Retry-After, no pool or a broken one 503; a client that goes away cancels its items
    still queued (they never reach a worker)."""

    def __init__(
        self, request: Request, pool: GraderPool | None, settings: Settings, metrics: ServiceMetrics
    ) -> None:
        self.request, self.pool, self.settings, self.metrics = request, pool, settings, metrics

    async def __call__(self, items: list[tuple[str, str, str]], budget_s: float | None) -> list[Verdict]:
        settings, metrics = self.settings, self.metrics
        if len(items) > settings.max_items:
            raise HTTPException(
                413,
                f"{len(items)} items in one request; the limit is {settings.max_items} (STAPO_VERIFIER_MAX_ITEMS)",
            )
        if self.pool is None:
            raise HTTPException(503, "the grader pool is not started yet")
        try:
            # A client that sends no budget (OpenRLHF's /get_reward, curl) gets the default one, so a
            # request of pathological items answers in bounded time whoever sends it.
            fut = self.pool.submit(items, budget_s=budget_s, default_budget_s=settings.request_budget_s())
        except PoolBusy as err:
            raise HTTPException(429, str(err), headers=_retry_after(err, 1.0)) from err
        except (PoolBroken, PoolClosed) as err:
            raise HTTPException(503, str(err), headers=_retry_after(err, 5.0)) from err
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            # answered in this process (caches, inline verdicts): nothing queued to cancel
            results = fut.result()
            metrics.observe_statuses([r.status for r in results])
            return results
        graded = asyncio.wrap_future(fut)
        gone = asyncio.ensure_future(_wait_disconnect(self.request.receive))
        try:
            await asyncio.wait({graded, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not graded.done():
                graded.cancel()  # the client went away: its queued items never reach a worker
                metrics.cancelled_requests.inc()
            gone.cancel()
        if not graded.done() or graded.cancelled():
            raise ClientGone
        try:
            results = graded.result()
        except (PoolBroken, PoolClosed) as err:
            raise HTTPException(503, str(err), headers=_retry_after(err, 5.0)) from err
        metrics.observe_statuses([r.status for r in results])
        return results


def get_grading(
    request: Request, pool: StartedPoolDep, settings: SettingsDep, metrics: MetricsDep
) -> Grading:
    return Grading(request, pool, settings, metrics)


GradingDep = Annotated[Grading, Depends(get_grading)]
