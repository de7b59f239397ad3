"""Reading a JSON body into a pydantic model, with JSON errors for every way it can be wrong."""

from __future__ import annotations

from typing import TypeVar

from flask import request
from pydantic import BaseModel, ValidationError

from webapp.errors import APIError

M = TypeVar("M", bound=BaseModel)


def parse(model: type[M]) -> M:
    raw = request.get_data(cache=False)
    if not raw.strip():
        raise APIError(400, "invalid_request", "the request needs a JSON body")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise APIError(400, "invalid_json", "the body is not valid JSON") from None
        raise
