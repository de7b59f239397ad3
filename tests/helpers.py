"""Client-side helpers the end-to-end tests share: submitting jobs and reading SSE."""

from __future__ import annotations

import json

import requests


def sse_events(resp: requests.Response, limit: int | None = None) -> list[dict]:
    """Parse SSE events (id, event, data) until the stream ends or `limit` events arrived."""
    events, current = [], {}
    for line in resp.iter_lines(decode_unicode=True):
        if line == "":
            if "data" in current:
                events.append(current)
                if limit and len(events) >= limit:
                    break
            current = {}
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(": ")
            current[field] = value
    return events


def submit(stack, **body) -> str:
    resp = stack.post("/v1/jobs", json=body)
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def stream(stack, job_id: str, **headers) -> list[dict]:
    with stack.http.get(f"{stack.base}/v1/jobs/{job_id}/stream", headers=headers, stream=True, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return sse_events(resp)


def joined(events: list[dict]) -> str:
    return "".join(json.loads(e["data"])["text"] for e in events if e.get("event") in ("token", "done"))
