"""The shapes of the ids the API hands out, checked before an id from a client touches Redis.

An id becomes part of a Redis key name (tasks/keys.py): an id that is not one the API could
have made (`file-…:lines`, another key's suffix) could name a key of another type (Redis
`WRONGTYPE`, a 500) or another record, and whether that key exists would show. Anything not
of the shape is a 404, the same answer as an id of the right shape that does not exist.

Where they are made: job ids `str(uuid.uuid4())` (webapp/service.py, JobService.submit),
file ids `file-` + 24 hex digits and batch ids `batch_` + 24 hex digits (webapp/batches/:
FileStore.create, BatchDriver.finalize and BatchStore.create).
"""

from __future__ import annotations

import re

from flask import Flask, request

from webapp.errors import APIError

PATTERNS = {
    "job": re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
    "file": re.compile(r"file-[0-9a-f]{24}"),
    "batch": re.compile(r"batch_[0-9a-f]{24}"),
}
# The URL variables that hold ids, and what they name.
VIEW_ARGS = {"job_id": "job", "file_id": "file", "batch_id": "batch"}


def valid(kind: str, ident: object) -> bool:
    return isinstance(ident, str) and PATTERNS[kind].fullmatch(ident) is not None


def check(kind: str, ident: object, param: str | None = None) -> str:
    """`ident`, if it is of the shape of a `kind` id; else the 404 of an unknown one."""
    if not valid(kind, ident):
        where = f"{param}: " if param else ""
        raise APIError(404, "not_found", f"{where}no {kind} {ident!r}", param=param)
    return ident


def init_app(app: Flask) -> None:
    """Every id in a URL (`<job_id>`, `<file_id>`, `<batch_id>`) checked before the view runs.
    Registered after auth.init_app: a request without a valid key still gets its 401 first."""

    @app.before_request
    def _check_ids():
        for name, value in (request.view_args or {}).items():
            kind = VIEW_ARGS.get(name)
            if kind:
                check(kind, value)
