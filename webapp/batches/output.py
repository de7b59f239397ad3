"""A batch's output and error lines, as OpenAI's Batch API and vLLM's run-batch write them:
`{id, custom_id, response: {status_code, request_id, body}, error}`, one JSON object a line."""

from __future__ import annotations

import json
import uuid


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex[:24]}"


def response_line(custom_id: str | None, status: int, request_id: str | None, body: dict) -> str:
    """One output line: the status and body the endpoint would have answered the request with."""
    line = {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id or f"req_{uuid.uuid4().hex[:24]}", "body": body},
        "error": None,
    }
    return json.dumps(line, ensure_ascii=False) + "\n"


def expired_line(custom_id: str | None) -> str:
    """The error line of a request the batch's completion window closed on, as OpenAI's."""
    line = {
        "id": _line_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {
            "code": "batch_expired",
            "message": "This request could not be executed before the completion window expired.",
        },
    }
    return json.dumps(line, ensure_ascii=False) + "\n"
