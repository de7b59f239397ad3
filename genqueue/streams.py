"""A job's token stream from Python: `TokenStream` (what `Client.stream` returns), which
reconnects with `Last-Event-ID` after a dropped connection, and `Restart`, which it yields when
the job started over on another worker. genqueue.client re-exports both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from typing import Protocol

import httpx

from genqueue import errors
from genqueue.errors import ConnectError, ServerError


class _Opens(Protocol):
    """What a stream needs of its client (genqueue.client.Client)."""

    max_reconnects: int

    def _open_stream(self, job_id: str, last_event_id: str | int | None) -> httpx.Response: ...


__all__ = ["Restart", "TokenStream"]


class Restart:
    """Yielded by `TokenStream` when the job started over on another worker (its worker died
    while it sampled): the tokens yielded before it are void; those after it are the new
    attempt's, from its first. (A greedy or seeded job gives the same tokens again, so the
    server resumes it without a seam and no Restart is yielded.)"""

    def __init__(self, attempt: int):
        self.attempt = attempt

    def __repr__(self) -> str:
        return f"Restart(attempt={self.attempt})"


class TokenStream:
    """An iterator of a job's tokens (`str`), from `Client.stream`.

    After a dropped connection (or a 5xx, or Redis briefly gone on the server) it reconnects
    with `Last-Event-ID`, up to `client.max_reconnects` times in a row, with backoff. A job
    that started over on another worker with other tokens than those received (a sampled one,
    or a greedy one whose re-run took other tokens) yields a `Restart`: drop the text so far;
    the new attempt's tokens follow from its first.
    After the last token: `finish_reason`, `usage` (`prompt_tokens`, `completion_tokens` and
    `cached_tokens`, the prompt tokens served from the engine's prefix cache, also the attribute
    `cached_tokens`); at any time `text` (the current attempt's text so far), `last_event_id`,
    `reconnects`, `restarts`. A failed or cancelled job raises
    `JobError`/`JobCancelled`. After an exception, iterating again resumes where it stopped.
    `close()` (or `with`) closes the connection."""

    def __init__(self, client: _Opens, job_id: str, last_event_id: str | int | None = None):
        self.client = client
        self.job_id = job_id
        self.last_event_id = None if last_event_id is None else str(last_event_id)
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.done = False
        self.reconnects = 0
        self.restarts = 0
        self._connections = 0
        self._gen: Iterator | None = None

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens the engine's prefix cache served (None before the last token)."""
        return None if self.usage is None else self.usage["cached_tokens"]

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> str | Restart:
        if self._gen is None:
            if self.done:
                raise StopIteration
            self._gen = self._tokens()
        try:
            return next(self._gen)
        except BaseException:
            self._gen = None
            raise

    def read(self) -> str:
        """Consume the stream and return the final text (of the last attempt)."""
        for _ in self:
            pass
        return self.text

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()
            self._gen = None

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _tokens(self) -> Iterator[str | Restart]:
        failures, why = 0, ""
        while not self.done:
            if failures:
                if failures > self.client.max_reconnects:
                    raise ConnectError(None, "connection_error", f"stream of job {self.job_id}: {why}")
                time.sleep(min(0.2 * 2 ** (failures - 1), 5.0))
            try:
                resp = self.client._open_stream(self.job_id, self.last_event_id)
            except (ConnectError, ServerError) as exc:
                failures, why = failures + 1, str(exc)
                if failures > self.client.max_reconnects:
                    raise
                continue
            if self._connections:
                self.reconnects += 1
            self._connections += 1
            why = "the stream ended before the job's last token"
            try:
                for kind, event_id, data in _sse_events(resp.iter_lines()):
                    if kind == "token":
                        failures = 0
                        piece = json.loads(data)["text"]
                        self.last_event_id = event_id
                        self.text += piece
                        yield piece
                    elif kind == "done":
                        body = json.loads(data)
                        self.last_event_id = event_id
                        self.finish_reason, self.usage = body.get("finish_reason"), body.get("usage")
                        if self.usage is not None:  # an older server sends no cached_tokens
                            self.usage.setdefault("cached_tokens", 0)
                        self.done = True
                        if body.get("text"):
                            self.text += body["text"]
                            yield body["text"]
                        return
                    elif kind == "restart":
                        failures = 0
                        attempt = json.loads(data).get("attempt", 0)
                        # Resume from the new attempt's first token (no Last-Event-ID: the
                        # server skips to the newest attempt without another restart event).
                        self.last_event_id = None
                        self.text = ""
                        self.restarts += 1
                        yield Restart(attempt)
                    elif kind == "error":
                        error = (json.loads(data) or {}).get("error") or {}
                        if error.get("code") == "broker_unavailable":
                            why = error.get("message", "broker_unavailable")
                            break  # Redis is back soon and the job goes on: reconnect
                        self.done = True
                        raise errors.job_error(self.job_id, error)
            except httpx.TransportError as exc:
                why = f"{type(exc).__name__}: {exc}"  # a dropped connection: reconnect
            finally:
                resp.close()
            failures += 1


def _sse_events(lines: Iterable[str]) -> Iterator[tuple[str, str | None, str]]:
    """(event, id, data) of each server-sent event (comments and keep-alives skipped)."""
    kind, event_id, data = "message", None, []
    for line in lines:
        if line == "":
            if data:
                yield kind, event_id, "\n".join(data)
            kind, event_id, data = "message", None, []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            kind = value
        elif field == "id":
            event_id = value
        elif field == "data":
            data.append(value)
