"""A batch's output and error lines, as OpenAI's Batch API and vLLM's run-batch write them:
`{id, custom_id, response: {status_code, request_id, body}, error}`, one JSON object a line."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from tasks.schemas import JobStatus
from webapp import embeddings
from webapp.completions import CompletionService, Submitted
from webapp.errors import error_body, job_error_status


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


def output_line(
    entry: dict,
    jobs: dict[str, dict],
    stopping: str | None,
    result_of: Callable[[str], Any],
    completions: CompletionService,
) -> tuple[str, str, tuple[int, int, int]]:
    """('out' | 'err' | 'drop', the output line, (prompt, completion, cached tokens)) of a
    settled batch line (`entry`: its pending record) from its `jobs`' records and results
    (`result_of(job_id)`, the result backend's). A line whose job the batch's end cancelled
    is dropped (cancelled) or a `batch_expired` error line (expired), as OpenAI writes them."""
    results, error = [], None
    for job_id in entry["ids"]:
        job = jobs.get(job_id)
        if not job:
            error = {"code": "lost", "message": f"job {job_id} is gone (its record expired)"}
            break
        if job["status"] != JobStatus.succeeded.value:
            if job.get("error"):
                error = json.loads(job["error"])
            else:
                error = {"code": job["status"], "message": f"job {job['status']}"}
            break
        result = result_of(job_id)
        if not isinstance(result, dict):
            error = {"code": "lost", "message": f"the result of job {job_id} is gone"}
            break
        results.append(result)
    if error is not None and stopping and error.get("code") in ("cancelled", "expired"):
        if stopping == "expired":
            return "err", expired_line(entry["custom_id"]), (0, 0, 0)
        return "drop", "", (0, 0, 0)
    if error is not None:
        status = job_error_status(error["code"])
        body = error_body(status, error["code"], error["message"])
        return "err", response_line(entry["custom_id"], status, entry["ids"][0], body), (0, 0, 0)
    if entry.get("api") == "embeddings":
        body = embeddings.body(entry, results[0])
        tokens = (body["usage"]["prompt_tokens"], 0, 0)
        return "out", response_line(entry["custom_id"], 200, entry["ids"][0], body), tokens
    body = completions.body(Submitted.from_entry(entry), results)
    usage = body["usage"]
    tokens = (usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
    return "out", response_line(entry["custom_id"], 200, entry["ids"][0], body), tokens
