"""``POST /get_reward``: OpenRLHF's remote reward protocol (``--remote_rm_url``).

The token may also come as ``?token=`` (OpenRLHF's client sends no headers; ``AuthMiddleware``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from stapo.verifier_service.server.deps import AUTH, REWARD_DOC, GradingDep, RewardBody
from stapo.verifier_service.server.responses import SafeJSONResponse
from stapo.verifier_service.server.schemas import RewardResponse, strip_prompt

router = APIRouter(tags=["verify"], dependencies=AUTH)

FLAGS = (
    ("verifier_no_answer", ("no_answer",)),
    ("verifier_timeout", ("timeout",)),
    ("verifier_too_large", ("too_large",)),  # the request's sizes, not the grader's fault
    ("verifier_error", ("error", "undecided")),
)
"""``extra_logs`` flags: name -> the statuses it marks with 1.0."""


@router.post("/get_reward", response_model=RewardResponse, openapi_extra=REWARD_DOC)
async def get_reward(req: RewardBody, grading: GradingDep) -> Response:
    """OpenRLHF ``--remote_rm_url``: reward = score; per-sample statuses are in ``extra_logs``.

    OpenRLHF needs a number for every sample, so an item that timed out or errored gets reward
    0 here, but it is never silent: ``extra_logs`` carries per-sample ``verifier_timeout`` /
    ``verifier_error`` (errors, oversized and undecided items) /
    ``verifier_no_answer`` flags and the metrics count them.
    """
    prompts = req.prompts or [None] * len(req.query)
    items = [(strip_prompt(q, p), lbl, req.mode) for q, p, lbl in zip(req.query, prompts, req.labels, strict=True)]
    results = await grading(items, None)
    scores = [float(r.score) for r in results]
    flags = {name: [1.0 if r.status in statuses else 0.0 for r in results] for name, statuses in FLAGS}
    body = {
        "rewards": scores,
        "scores": scores,
        "extra_logs": {"accuracy": [float(r.correct) for r in results], **flags},
    }
    return SafeJSONResponse(body)
