"""Every error leaves the API as JSON `{"error": {"code", "message"}}` with a 4xx/5xx status."""

from __future__ import annotations

import logging

from flask import Flask, jsonify
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None):
    resp = jsonify(error={"code": code, "message": message})
    resp.status_code = status
    resp.headers.update(headers or {})
    return resp


def describe(exc: ValidationError) -> str:
    """One line per problem: `field: what is wrong`."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def register(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(exc: APIError):
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    @app.errorhandler(ValidationError)
    def _invalid(exc: ValidationError):
        return error_response(400, "invalid_request", describe(exc))

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):
        code = (exc.name or "error").lower().replace(" ", "_")
        return error_response(exc.code or 500, code, exc.description or exc.name)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal", "internal server error")
