"""Every error leaves the API as JSON `{"error": {"code", "message", "type", "param"}}` with a
4xx/5xx status: our own `code` and `message`, plus the `type` and `param` of OpenAI's error
format, so OpenAI clients read our errors too."""

from __future__ import annotations

import logging

from flask import Flask, jsonify
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.code, self.message, self.param)


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"code": code, "message": message, "type": kind, "param": param}}


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, param: str | None = None
):
    resp = jsonify(error_body(status, code, message, param))
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
        return error_response(exc.status, exc.code, exc.message, exc.headers, exc.param)

    @app.errorhandler(ValidationError)
    def _invalid(exc: ValidationError):
        first = exc.errors(include_url=False)[0]["loc"]
        param = ".".join(str(p) for p in first) or None
        return error_response(400, "invalid_request", describe(exc), param=param)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):
        code = (exc.name or "error").lower().replace(" ", "_")
        return error_response(exc.code or 500, code, exc.description or exc.name)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal", "internal server error")
