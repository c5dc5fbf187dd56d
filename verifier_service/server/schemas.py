"""Wire types of the verification service (pydantic): the batch endpoint and OpenRLHF's protocol.

``POST /v1/verify``::

    {"items": [{"prediction": "... \\\\boxed{2}", "gold": "2", "mode": "math"}]}
    -> {"results": [{"correct": true, "score": 1.0, "status": "ok", "extracted": "2", "ms": 0.4}]}

``POST /get_reward`` (OpenRLHF ``--remote_rm_url``): ``query`` holds prompt + response as decoded
text, ``prompts`` the prompts, ``labels`` the gold answers; the answer carries ``rewards``,
``scores`` and per-sample ``extra_logs``.

Types are strict where it matters: a number where a string is expected is a 422 naming the field,
not a silently stringified gold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

Mode = Literal["math", "dapo"]
MODES: frozenset[str] = frozenset(get_args(Mode))
"""The modes as a set, for the hand check on the pool's hot path (``as_item``)."""
Status = Literal["ok", "no_answer", "undecided", "timeout", "error", "too_large"]
STATUSES: tuple[str, ...] = ("ok", "no_answer", "undecided", "timeout", "error", "too_large")


class VerifyItem(BaseModel):
    """One thing to grade: a model's full response and the reference answer."""

    model_config = ConfigDict(frozen=True)

    prediction: StrictStr = Field(
        description="The model's full response; the final answer is extracted from it."
    )
    gold: StrictStr = Field(description="The reference answer (LaTeX or plain text).")
    mode: Mode = Field(
        "math", description="'math': math-verify equivalence; 'dapo': DAPO's 'Answer:' exact match."
    )


class VerifyRequest(BaseModel):
    items: list[VerifyItem] = Field(description="Items to grade; answered one result per item, in order.")
    budget_s: float | None = Field(
        None,
        gt=0,
        le=86_400,
        description="Seconds the caller will wait; items not graded within it answer 'timeout' "
        "(the stapo client sends its HTTP timeout). Without it the service's default budget applies.",
    )
    explain: bool = Field(False, description="Each result also names the grader's rule that decided it.")


class VerifyResult(BaseModel):
    correct: bool
    score: float = Field(description="1.0 / 0.0 for the binary modes.")
    status: Status = Field(
        description="ok | no_answer | undecided | timeout | error | too_large; only 'ok' can be correct; "
        "'undecided': an answer was found but the grader could not compare it with the gold (no verdict)."
    )
    extracted: str | None = Field(
        description="The answer text taken from the prediction, when one was found."
    )
    ms: float = Field(description="Grading time of this item in milliseconds (0 for a cache hit).")
    rule: str | None = Field(
        None, description="With explain: the grader's rule that decided the verdict (None when unknown)."
    )


class VerifyResponse(BaseModel):
    results: list[VerifyResult]


class RewardRequest(BaseModel):
    """OpenRLHF's remote reward request; extra keys (``metas``) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    query: list[StrictStr] = Field(description="Prompt + response, decoded; the prompt prefix is stripped.")
    prompts: list[StrictStr] | None = Field(
        None, description="The prompts (used to strip the prefix of `query`)."
    )
    labels: list[StrictStr | StrictInt | StrictFloat] = Field(
        description="Gold answers, one per query (numbers from a JSON data set are taken as their text)."
    )
    mode: Mode = Field("math", description="Grading mode for every item of this request.")

    @field_validator("labels", mode="after")
    @classmethod
    def _labels_as_text(cls, v: list[str | int | float]) -> list[str]:
        return [x if isinstance(x, str) else str(x) for x in v]

    @model_validator(mode="after")
    def _same_lengths(self) -> RewardRequest:
        if len(self.labels) != len(self.query):
            raise ValueError(
                f"labels: {len(self.labels)} labels for {len(self.query)} queries; they must match"
            )
        if self.prompts is not None and len(self.prompts) != len(self.query):
            raise ValueError(
                f"prompts: {len(self.prompts)} prompts for {len(self.query)} queries; they must match"
            )
        return self


class RewardResponse(BaseModel):
    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, Any]


def strip_prompt(query: str, prompt: str | None) -> str:
    """The response part of an OpenRLHF ``query`` (= prompt + response).

    OpenRLHF decodes prompt and response together; the prompt string it sends is the same decoded
    prefix, so removing it leaves the response. When the prefix does not match exactly (a tokenizer
    that re-spaces on decode), the whole query is graded: the answer extractor looks for the LAST
    boxed / ``Answer:`` marker, which lives in the response, so this is the safe fallback.
    The prompt is searched anywhere in the query, not only at its start: left padding
    (``<|endoftext|>`` x n) comes before it.
    """
    if prompt:
        idx = query.find(prompt)
        if idx >= 0:
            return query[idx + len(prompt) :]
    return query


def as_item(x: VerifyItem | dict[str, Any] | Sequence[str], where: str = "item") -> tuple[str, str, str]:
    """Accept a VerifyItem, a dict with prediction/gold(/mode), or a (prediction, gold[, mode]) tuple."""
    if type(x) is tuple and len(x) == 3:  # what the service sends: validated already, skip pydantic
        pred, gold, mode = x
        if type(pred) is str and type(gold) is str and type(mode) is str and mode in MODES:
            return x
    if isinstance(x, VerifyItem):
        return (x.prediction, x.gold, x.mode)
    if isinstance(x, dict):
        v = VerifyItem.model_validate(x)  # a clear error naming the bad field
        return (v.prediction, v.gold, v.mode)
    if isinstance(x, (tuple, list)) and len(x) in (2, 3):
        v = VerifyItem(prediction=x[0], gold=x[1], mode=x[2] if len(x) == 3 else "math")
        return (v.prediction, v.gold, v.mode)
    raise TypeError(
        f"{where}: expected a VerifyItem, a dict or a (prediction, gold[, mode]) tuple, got {type(x).__name__}"
    )
