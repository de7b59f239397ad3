"""A batch's check of its input file before it runs (status `validating`): every line's shape
(custom_id, method, url, body; custom_ids distinct), each error naming its line, as OpenAI lists
a failed batch's `errors.data[]` (docs/design.md, "Batches")."""

from __future__ import annotations

import json
import time

from pydantic import ValidationError

from webapp.batches.files import FileStore, chunk_lines
from webapp.errors import describe
from webapp.protocol.batches import BatchLine

# The most validation errors a failed batch lists.
MAX_ERRORS = 100


def check_input(files: FileStore, file_id: str, lock, renew_s: float) -> tuple[list[dict], int]:
    """(the input's errors, at most MAX_ERRORS; its number of requests, the non-blank lines).
    The batch's `lock` is renewed every `renew_s` seconds of the pass (LockError if it was
    lost: the pass ends, its new holder validates)."""
    errors: list[dict] = []
    seen: set[str] = set()
    total = n = 0
    if not files.exists(file_id):
        return [_file_error("file_not_found", f"input file {file_id} is gone")], 0
    started = time.monotonic()
    for chunk in files.chunks(file_id):
        for text in chunk_lines(chunk):
            n += 1
            if not text.strip():
                continue
            total += 1
            problem = _line_problem(text, seen)
            if problem:
                errors.append({**problem, "line": n})
        if len(errors) >= MAX_ERRORS:
            break
        if time.monotonic() - started > renew_s:
            lock.reacquire()
            started = time.monotonic()
        time.sleep(0)  # let a gevent worker serve requests meanwhile
    if total == 0 and not errors:
        errors.append(_file_error("empty_file", "the input file holds no request"))
    return errors[:MAX_ERRORS], total


def _file_error(code: str, message: str) -> dict:
    return {"code": code, "message": message, "param": "input_file_id", "line": None}


def _line_problem(text: str, seen: set[str]) -> dict | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return {"code": "invalid_json_line", "message": "this line is not valid JSON", "param": None}
    try:
        line = BatchLine.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]["loc"]
        return {"code": "invalid_request", "message": describe(exc), "param": ".".join(str(p) for p in first) or None}
    if line.custom_id in seen:
        return {
            "code": "duplicate_custom_id",
            "message": f"custom_id {line.custom_id!r} is used more than once",
            "param": "custom_id",
        }
    seen.add(line.custom_id)
    return None
