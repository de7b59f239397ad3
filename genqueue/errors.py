"""The exceptions the client raises. Every one is a `GenqError` with `status` (the HTTP status,
or None when no response came), `code` (the API's error code, e.g. `not_found`) and `message`;
each subclass below says when it is raised. `from_response` picks the class of an error
response by its status (`of_response` from an httpx response), `job_error` that of a job that
ended without a result.
"""

from __future__ import annotations

from typing import Any


class GenqError(Exception):
    def __init__(self, status: int | None, code: str, message: str, **extra: Any):
        super().__init__(status, code, message)
        self.status, self.code, self.message = status, code, message
        for name, value in extra.items():
            setattr(self, name, value)

    def __str__(self) -> str:
        where = f"{self.status} {self.code}" if self.status else self.code
        return f"{self.message} ({where})"


class BadRequest(GenqError):
    """400, 413, 422 and other 4xx: the request itself was refused."""


class AuthError(GenqError):
    """401, 403: missing or wrong API key."""


class NotFound(GenqError):
    """404: unknown job, model, file or batch (or another key's)."""


class Conflict(GenqError):
    """409: e.g. cancelling a job that has already ended."""


class RateLimited(GenqError):
    """429: queue full or the key's quota used up (`retry_after`: seconds, if the server said)."""

    retry_after: float | None = None


class ServerError(GenqError):
    """5xx: the server could not do it (no worker, Redis down, ...)."""


class ConnectError(GenqError):
    """No answer: connection refused, reset or timed out."""


class WaitTimeout(GenqError):
    """The job had not ended when `wait(timeout=...)` gave up."""


class JobError(GenqError):
    """The job ended without a result: it failed (`job_id`; `job`: its record, where the client has it)."""

    job_id: str | None = None
    job: dict | None = None


class JobCancelled(JobError):
    """The job ended without a result because it was cancelled."""


class BatchError(GenqError):
    """A batch failed, expired or was cancelled (`batch`, `results`)."""

    batch: dict | None = None
    results: list | None = None


# The HTTP status the API gives a job's error code (webapp/errors.py: JOB_ERROR_STATUS), so a
# JobError from a stream or a poll carries the same status as one from a blocking call.
_JOB_ERROR_STATUS = {"prompt_too_long": 400, "invalid_request": 400, "cancelled": 409, "timeout": 504, "expired": 504}


def job_error(job_id: str, error: dict | None, job: dict | None = None, status: str | None = None) -> JobError:
    """The exception for a job that ended without a result."""
    error = error or {}
    code = error.get("code") or status or "failed"
    message = error.get("message") or f"job {job_id} {status or 'failed'}"
    cls = JobCancelled if code == "cancelled" or status == "cancelled" else JobError
    return cls(_JOB_ERROR_STATUS.get(code, 502), code, message, job_id=job_id, job=job)


def from_response(status: int, body: Any, headers: Any = None) -> GenqError:
    """The exception for an error response (`{"error": {"code", "message"}}`, or anything)."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        code = str(err.get("code") or err.get("type") or "error")
        message = str(err.get("message") or code)
    else:
        code, message = f"http_{status}", (str(body)[:500] if body else f"HTTP {status}")
    if status in (401, 403):
        cls = AuthError
    elif status == 404:
        cls = NotFound
    elif status == 409:
        cls = Conflict
    elif status == 429:
        retry = (headers or {}).get("Retry-After")
        try:
            retry_after = float(retry) if retry is not None else None
        except ValueError:
            retry_after = None
        return RateLimited(status, code, message, retry_after=retry_after, body=body)
    elif status >= 500:
        cls = ServerError
    else:
        cls = BadRequest
    return cls(status, code, message, body=body)


def of_response(resp: Any) -> GenqError:
    """The exception for an httpx error response: its JSON body, else its text."""
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    return from_response(resp.status_code, body, resp.headers)
