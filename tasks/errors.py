"""How a job's failure travels: a typed `JobError` (code, message, and the request field it
concerns), set where the worker refuses or fails the job, written into the job's record as
JSON and read back by the API as the same type (no parsing of its text).

A failing Celery task raises `JobFailed` (`JobRefused` for the client's own bad input): plain
string args, which pickle round-trips and Celery's JSON result backend stores as they are. The
worker's task lists `JobRefused` as expected (Celery's `Task.throws`), so a refused job is one
log line, not an error with a traceback. Also here: the errors the job store writes itself
(expired, cancelled, worker_lost), and the one it raises at submit (QuotaExceeded).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The codes of a job refused for its request (the client's fault, HTTP 400), not failed by
# the server: the worker logs them as one line, the API answers them 400 (webapp/errors.py).
REFUSALS = frozenset({"invalid_request", "prompt_too_long", "no_chat_template"})


@dataclass(frozen=True)
class JobError:
    """Why a job ended without a result. `param`: the request field it concerns, as OpenAI's
    error objects name it (None: none in particular); the API's error names it where it
    answers for the job directly (webapp/service.py `outcome`)."""

    code: str
    message: str
    param: str | None = None

    @property
    def refused(self) -> bool:
        return self.code in REFUSALS

    def stored(self) -> dict[str, str]:
        """As the job's record holds it (`param` only when there is one)."""
        out = {"code": self.code, "message": self.message}
        if self.param is not None:
            out["param"] = self.param
        return out

    def public(self) -> dict[str, str]:
        """As a job's view, its stream's error event and a batch's error line show it: code and
        message."""
        return {"code": self.code, "message": self.message}

    @classmethod
    def from_stored(cls, raw: str | dict[str, Any]) -> JobError:
        """From a record's `error` field (its JSON, or that decoded)."""
        data = json.loads(raw) if isinstance(raw, str) else raw
        return cls(data["code"], data["message"], data.get("param"))


class JobFailed(Exception):
    """A job that failed on its worker, as its Celery task raises it. `partial`: what it had
    generated (a job that ran out of time), for its record; it stays in the worker: pickling
    keeps the args alone."""

    def __init__(self, code: str, message: str, param: str | None = None, partial: dict[str, Any] | None = None):
        super().__init__(code, message, param)
        self.partial = partial

    @classmethod
    def of(cls, error: JobError, partial: dict[str, Any] | None = None) -> JobFailed:
        """The exception for `error`: JobRefused for the client's bad input."""
        kind = JobRefused if error.refused else JobFailed
        return kind(error.code, error.message, error.param, partial)

    def __reduce__(self):
        return type(self), self.args

    def __str__(self) -> str:
        return self.message

    @property
    def error(self) -> JobError:
        return JobError(*self.args)

    @property
    def code(self) -> str:
        return self.args[0]

    @property
    def message(self) -> str:
        return self.args[1]


class JobRefused(JobFailed):
    """A job refused for its request (a code of REFUSALS): an expected outcome, not a fault."""


class QuotaExceeded(Exception):
    """An owner already has `limit` jobs waiting (`queued` of them), too many for more."""

    def __init__(self, owner: str, queued: int, limit: int | None):
        super().__init__(f"{owner} has {queued} jobs waiting; the limit is {limit}")
        self.owner, self.queued, self.limit = owner, queued, limit


WORKER_LOST = "worker_lost"
EXPIRED = JobError("expired", "the job's deadline passed while it waited; it did not run")
CANCELLED = JobError("cancelled", "cancelled by the client")


def worker_lost(attempts: int) -> JobError:
    return JobError(
        WORKER_LOST,
        f"the job's worker died or hung on {attempts} attempts that count (those lost "
        "beside other running jobs do not); it is not tried again (GENQ_MAX_ATTEMPTS)",
    )
