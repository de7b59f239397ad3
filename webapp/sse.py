"""Server-sent events: framing, the response that carries them, and the one loop that relays a
job's token events to a client (`relay`), which every streaming route uses with its own
framing of tokens, restarts and ends.

The OpenAI routes send no SSE comment (`comments=False`), as vLLM's server sends none:
clients written for it may not parse one (vLLM's benchmark client strips each network read
before splitting on blank lines, and after a lone `: keep-alive` read no later event of the
response). Those streams notice a client that went away by its socket instead."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from flask import Response, has_request_context, request

from tasks.streams import Restart, StreamEnd, TokenEvent
from webapp.hangup import client_gone


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


@dataclass(frozen=True)
class Last:
    """A frame after which the relay stops reading events (the `tail` still follows)."""

    frame: str


# What a framing callback returns: a frame to send, a Last one, or None to send nothing.
Frame = str | Last | None


def relay(
    events: Iterable,
    token: Callable[[str, TokenEvent], Frame],
    end: Callable[[str | None, StreamEnd], Frame],
    restart: Callable[[str, Restart], Frame],
    head: Iterable[str] = (),
    tail: Callable[[bool], Iterable[str]] | None = None,
    comments: bool = True,
) -> Response:
    """An SSE response relaying `events` (JobService.events: `(job_id, event)` pairs, None
    while nothing happens): `head` first, a keep-alive for each None, then each event as the
    route frames it, and last `tail(complete)`, where `complete` is False if a callback ended
    the stream early with a `Last` frame. The events are closed when the response ends, also
    when the client went away, so the jobs a stream owns are cancelled then at once.

    `comments=False`: no keep-alive; the headers go at once (an empty first chunk) and at
    each None the client's socket says whether it is still there (where the server tells:
    gunicorn), ending the stream, without its tail, when it is not."""
    gone = None if comments or not has_request_context() else client_gone(request.environ)

    def chunks() -> Iterator[str]:
        try:
            if not comments:
                yield ""  # gunicorn sends the headers with it, no body
            yield from head
            complete = True
            for item in events:
                if item is None:
                    if comments:
                        yield KEEPALIVE
                    elif gone is not None and gone():
                        return
                    continue
                job_id, ev = item
                if isinstance(ev, StreamEnd):
                    out = end(job_id, ev)
                elif isinstance(ev, Restart):
                    out = restart(job_id, ev)
                else:
                    out = token(job_id, ev)
                if isinstance(out, Last):
                    yield out.frame
                    complete = False
                    break
                if out:
                    yield out
            if tail is not None:
                yield from tail(complete)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()

    return response(chunks())
