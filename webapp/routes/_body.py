"""Reading a JSON body into a pydantic model, with JSON errors for every way it can be wrong."""

from __future__ import annotations

import json
from typing import TypeVar

from flask import request
from pydantic import BaseModel, ValidationError

from webapp import idempotency
from webapp.errors import APIError

M = TypeVar("M", bound=BaseModel)


def parse(model: type[M]) -> M:
    """The body as `model`: 415 unless it is sent as JSON (`application/json`, or a `+json`
    type), 400 if it is empty, not JSON (UTF-8) or not valid for the model."""
    mimetype = request.mimetype
    if mimetype != "application/json" and not (mimetype.startswith("application/") and mimetype.endswith("+json")):
        raise APIError(
            415,
            "unsupported_media_type",
            f"the body must be JSON, sent with `Content-Type: application/json` (got {mimetype!r})"
            if mimetype
            else "the body must be JSON, sent with `Content-Type: application/json`",
        )
    raw = request.get_data(cache=False)
    if not raw.strip():
        raise APIError(400, "invalid_request", "the request needs a JSON body")
    idempotency.remember_body(strict_json(raw))
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise APIError(400, "invalid_json", "the body is not valid JSON") from None
        raise


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the key {key!r} appears twice in one object")
        seen[key] = value
    return seen


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def strict_json(raw: bytes) -> object:
    """400 `invalid_json` for what pydantic's parser lets through or reports vaguely: a key
    twice in one object (it would keep the last, silently), NaN and Infinity (not JSON),
    nesting too deep for a parser, bytes that are not UTF-8, a number too long to read."""
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "invalid_json", "the body is not valid JSON: nested too deeply") from None
    except UnicodeDecodeError:
        raise APIError(400, "invalid_json", "the body is not valid JSON: not UTF-8") from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise APIError(400, "invalid_json", f"the body is not valid JSON: {exc.msg} ({where})") from None
    except ValueError as exc:
        raise APIError(400, "invalid_json", f"the body is not valid JSON: {exc}") from None
