"""Server-sent events: framing, and the response that carries them."""

from __future__ import annotations

import json
from typing import Iterable

from flask import Response


def event(data, event: str | None = None, id: int | str | None = None) -> str:
    lines = []
    if id is not None:
        lines.append(f"id: {id}")
    if event:
        lines.append(f"event: {event}")
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    lines.append(f"data: {payload}")
    return "\n".join(lines) + "\n\n"


KEEPALIVE = ": keep-alive\n\n"


def response(chunks: Iterable[str]) -> Response:
    return Response(
        chunks,
        mimetype="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
