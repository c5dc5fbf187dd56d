"""How the service reads request bodies and writes answers: JSON in by pydantic from bytes, JSON out
by orjson, always valid UTF-8, validation errors without the offending input."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

ModelT = TypeVar("ModelT", bound=BaseModel)


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


def validation_detail(errors: Any) -> list[dict[str, Any]]:
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


async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
    """422 with pydantic's reasons, naming the field; never the input itself."""
    return SafeJSONResponse({"detail": validation_detail(exc.errors())}, status_code=422)
