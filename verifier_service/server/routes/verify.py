"""``POST /v1/verify``: a batch of (prediction, gold, mode) items graded, one result per item, in order."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from stapo.verifier_service.grader import Verdict
from stapo.verifier_service.server.deps import AUTH, VERIFY_DOC, GradingDep, VerifyBody
from stapo.verifier_service.server.responses import SafeJSONResponse
from stapo.verifier_service.server.schemas import VerifyResponse

router = APIRouter(tags=["verify"], dependencies=AUTH)


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


@router.post("/v1/verify", response_model=VerifyResponse, openapi_extra=VERIFY_DOC)
async def verify(req: VerifyBody, grading: GradingDep) -> Response:
    """Grade a batch: one result per item, in order. A failed item is a status, not an HTTP error.

    With ``explain: true`` each result also names the grader's rule that decided it."""
    items = [(it.prediction, it.gold, it.mode) for it in req.items]
    results = await grading(items, req.budget_s)
    return SafeJSONResponse(results_body(results, explain=req.explain))
