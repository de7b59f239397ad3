"""Every error leaves the API as JSON `{"error": {"code", "message", "type", "param"}}` with a
4xx/5xx status: our own `code` and `message`, plus the `type` and `param` of OpenAI's error
format, so OpenAI clients read our errors too (its model: webapp/protocol/errors.py)."""

from __future__ import annotations

import logging

import redis
from flask import Flask, current_app, jsonify
from kombu.exceptions import OperationalError
from pydantic import ValidationError
from werkzeug.exceptions import ClientDisconnected, HTTPException

from tasks.errors import REFUSALS
from webapp.protocol.errors import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)

# Redis (broker, result backend, job records) not answering, as the API's Redis client,
# Celery's publisher (kombu) and the sockets below them report it: down, restarting, loading
# its data. A client may retry soon, so these are 503 with Retry-After, not 500. (A Redis
# `ResponseError` is a bug of ours, not an outage, and stays a 500.)
BROKER_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    OperationalError,
    ConnectionError,
)
BROKER_RETRY_AFTER = {"Retry-After": "2"}

# A request body framed wrongly, as gunicorn's body reader raises it while the app reads the
# body: chunked encoding with a bad chunk size, a chunk without its CRLF, a bad extension or
# trailer (ParseException's subclasses), or the connection closing mid-body (NoMoreData). A
# 400: the client's fault. gunicorn closes the connection after the answer (where the next
# request would start is unknown). Not gunicorn (the Flask test client): none.
try:
    from gunicorn.http.errors import NoMoreData, ParseException

    BODY_ERRORS: tuple[type[Exception], ...] = (ParseException, NoMoreData)
except ImportError:  # pragma: no cover
    BODY_ERRORS = ()


class BodyTimeout(Exception):
    """The client did not send its body within its deadline (webapp/bodyguard.py)."""


class BodyCutShort(Exception):
    """The body ended before its Content-Length: the client closed its side (webapp/bodyguard.py)."""


BROKER_UNAVAILABLE = {
    "code": "broker_unavailable",
    "message": "the job queue (Redis) is unavailable; try again shortly",
}


# The HTTP status that tells a client how its job ended, by the job's error code: its own
# request was wrong (400: a refusal, tasks/errors.py), it cancelled it (409), it ran out of time: its deadline (timeout_s,
# deadline) or the worker's GENQ_JOB_TIMEOUT passed while it ran (`timeout`) or waited
# (`expired`) (504). Any other code is the server's fault (502).
JOB_ERROR_STATUS = {
    **dict.fromkeys(REFUSALS, 400),
    "cancelled": 409,
    "timeout": 504,
    "expired": 504,
}


def job_error_status(code: str) -> int:
    return JOB_ERROR_STATUS.get(code, 502)


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


def owned(rec: dict | None, owner: str | None, what: str, ident: str) -> dict:
    """`rec` (a job's, file's or batch's record), unless it is missing or, with `owner` (an API
    key's name), another key's: both are the same 404, which does not tell that it exists."""
    if not rec or (owner is not None and rec.get("owner", "") != owner):
        raise APIError(404, "not_found", f"no {what} {ident!r}")
    return rec


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    """The error shape (webapp.protocol.errors.ErrorResponse) as JSON: a 4xx is the client's
    error (`invalid_request_error`), a 5xx the server's."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ErrorResponse(error=ErrorDetail(code=code, message=message, type=kind, param=param)).model_dump()


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

    def _broker(exc: Exception):
        log.warning("Redis unavailable: %s: %s", type(exc).__name__, exc)
        service = current_app.extensions.get("genq")  # webapp.service.EXTENSION
        if service is not None:
            service.redis_failed()  # readiness is not held up by it once Redis is back
        return error_response(503, **BROKER_UNAVAILABLE, headers=BROKER_RETRY_AFTER)

    for cls in BROKER_ERRORS:
        app.register_error_handler(cls, _broker)

    def _body(exc: Exception):
        why = str(exc) if isinstance(exc, ParseException) else "the connection closed before its end"
        return error_response(400, "invalid_body", f"the request body is malformed: {why}")

    for cls in BODY_ERRORS:
        app.register_error_handler(cls, _body)

    @app.errorhandler(BodyCutShort)
    @app.errorhandler(ClientDisconnected)
    def _cut_short(exc: Exception):
        why = str(exc) if isinstance(exc, BodyCutShort) else ""
        message = "the request body is malformed: the connection closed before its end"
        return error_response(400, "invalid_body", f"{message} ({why})" if why else message, {"Connection": "close"})

    @app.errorhandler(BodyTimeout)
    def _slow_body(exc: BodyTimeout):
        message = "the request body did not arrive in time (GENQ_BODY_TIMEOUT)"
        return error_response(408, "body_timeout", message, {"Connection": "close"})

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):
        code = (exc.name or "error").lower().replace(" ", "_")
        return error_response(exc.code or 500, code, exc.description or exc.name)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal", "internal server error")
