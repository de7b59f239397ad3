"""Token events of one job, in a Redis Stream of its own.

A worker appends one entry per generated token, `{"i": n, "t": text}` (and `"lp"`, the
log-probabilities, when the job asked for them), numbered from 0 within one attempt at the job,
and a last entry with `"finish"` and `"usage"`. The API reads them with XREAD, so a client that
connects late or resumes (`Last-Event-ID`) still gets every token. A job run again after its
worker died or hung restarts its stream (marker `{"restart": n}`, ids `n:k`); `follow` skips
the new attempt's tokens while they agree with those the reader has and yields a `Restart` at
the first that differs, so no reader sees two attempts mixed. How and why: docs/design.md,
"Token streams".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis

from tasks import keys
from tasks.records import record_error
from tasks.schemas import JobStatus

# Longest a reader blocks in one XREAD: below redis-py's socket timeout, and short enough to
# notice a client that went away (a keep-alive is written after each empty read).
BLOCK_S = 2.0


@dataclass
class TokenEvent:
    index: int
    text: str
    finish: str | None = None
    usage: dict | None = None
    attempt: int = 1
    logprobs: dict | None = None  # tasks.schemas.Logprobs of the tokens behind `text`

    @property
    def event_id(self) -> str:
        return str(self.index) if self.attempt == 1 else f"{self.attempt}:{self.index}"

    @classmethod
    def parse(cls, fields: dict[str, str]) -> TokenEvent:
        return cls(
            index=int(fields["i"]),
            text=fields.get("t", ""),
            finish=fields.get("finish"),
            usage=json.loads(fields["usage"]) if "usage" in fields else None,
            logprobs=json.loads(fields["lp"]) if "lp" in fields else None,
        )


@dataclass
class StreamEnd:
    """The job ended without a finish event: failed, cancelled or expired (`error` says why)."""

    status: str
    error: dict


@dataclass
class Restart:
    """A job started over on another worker with other tokens than the reader has: discard
    its text received so far; the new attempt's tokens follow from the first."""

    attempt: int


KeepAlive = None


def parse_event_id(raw: str | int) -> tuple[int, int]:
    """`k` (attempt 1) or `n:k` -> (attempt, index); ValueError otherwise."""
    attempt, _, index = str(raw).rpartition(":")
    return (int(attempt) if attempt else 1), int(index)


def follow(
    client: redis.Redis,
    job_ids: list[str],
    get_record: Callable[[str], dict[str, str] | None],
    after: dict[str, str | int] | None = None,
) -> Iterator[tuple[str, TokenEvent | StreamEnd | Restart] | None]:
    """Yield `(job_id, event)` for the jobs' token events as they arrive, until each job has
    finished; `None` after every read that brought nothing (time for a keep-alive).

    `after[job_id]` is an event id (Last-Event-ID): events up to it are skipped. A job that
    reaches a final status without a finish event (failed, cancelled) yields a `StreamEnd`; a
    job that started over with other tokens than the reader has yields a `Restart` (see the
    module's docstring).
    """
    views = {job_id: _View() for job_id in job_ids}
    for job_id, event_id in (after or {}).items():
        view = views[job_id]
        view.attempt, view.last = parse_event_id(event_id)
        view.seen = view.attempt
    cursors: dict[str, str] = {}
    owner: dict[str, str] = {}
    for job_id in job_ids:
        cursors[keys.stream(job_id)] = "0"
        cursors[keys.done(job_id)] = "0"
        owner[keys.stream(job_id)] = owner[keys.done(job_id)] = job_id
    open_jobs = set(job_ids)
    ended: set[str] = set()  # final status seen; its finish event may still be on its way
    while open_jobs:
        reply = client.xread(cursors, block=int(BLOCK_S * 1000))
        if not reply:
            for job_id in list(ended & open_jobs):
                # Succeeded, yet no finish event for a whole block: the stream lost entries.
                open_jobs.discard(job_id)
                yield job_id, _lost(job_id)
            yield KeepAlive
            continue
        # Token entries before done entries: a finished job's finish event is never missed.
        reply.sort(key=lambda item: item[0].startswith(keys.done("")))
        for key, entries in reply:
            job_id = owner[key]
            cursors[key] = entries[-1][0]
            if key.startswith(keys.done("")):
                if job_id in open_jobs:
                    status = entries[-1][1].get("status")
                    if status != JobStatus.succeeded.value:
                        end = _end_of(get_record, job_id)
                        if end is not None:
                            open_jobs.discard(job_id)
                            yield job_id, end
                            continue
                    ended.add(job_id)
                continue
            view = views[job_id]
            for _, fields in entries:
                if job_id not in open_jobs:
                    break
                if "restart" in fields:
                    view.new_attempt(int(fields["restart"]))
                    continue
                event = TokenEvent.parse(fields)
                event.attempt = view.attempt
                for out in view.take(event):
                    yield job_id, out
                    if isinstance(out, TokenEvent) and out.finish:
                        open_jobs.discard(job_id)
        cursors = {k: v for k, v in cursors.items() if owner[k] in open_jobs}


class _View:
    """What one reader has of one job's tokens, and how a new attempt's tokens compare.

    `last`: the highest index the reader has; `seen`: the attempt whose tokens the reader holds
    up to `last` (those of earlier attempts it had were found equal to them); `texts`: those
    tokens it has read here, to compare a new attempt's with; `held`: the new attempt's tokens
    found equal so far, not sent again."""

    def __init__(self) -> None:
        self.attempt = 1
        self.seen = 1
        self.last = -1
        self.texts: dict[int, tuple[str, str | None]] = {}
        self.held: list[TokenEvent] = []

    def new_attempt(self, n: int) -> None:
        if n > self.attempt:
            self.attempt, self.held = n, []

    def take(self, ev: TokenEvent) -> list[TokenEvent | Restart]:
        """What to send the reader for this token event of the current attempt."""
        i = ev.index
        if self.attempt == self.seen:
            if i <= self.last:  # its own tokens again (a resumed reader reads from the start)
                self.texts[i] = (ev.text, ev.finish)
                return []
            return self._send(ev)
        # A new attempt: skip what the reader has while it agrees.
        if i <= self.last and self.texts.get(i) == (ev.text, ev.finish) and i == len(self.held):
            self.held.append(ev)
            return []
        if i > self.last and len(self.held) == self.last + 1:
            self.seen, self.held = self.attempt, []  # every token the reader had agreed
            return self._send(ev)
        # It differs (or cannot be compared): start the reader over on this attempt.
        out: list[TokenEvent | Restart] = [Restart(self.attempt)] if self.last >= 0 else []
        replay, self.held, self.texts = [*self.held, ev], [], {}
        self.seen, self.last = self.attempt, -1
        for e in replay:
            out += self._send(e)
        return out

    def _send(self, ev: TokenEvent) -> list[TokenEvent | Restart]:
        self.last = ev.index
        self.texts[ev.index] = (ev.text, ev.finish)
        return [ev]


def _end_of(get_record, job_id: str) -> StreamEnd | None:
    """How a job that reached a final status without a finish event ended; None if it has
    not ended, or succeeded and its finish event can still be expected."""
    rec = get_record(job_id)
    if rec is None:
        return StreamEnd("failed", {"code": "not_found", "message": f"job {job_id} expired"})
    status = rec.get("status")
    if status in (JobStatus.failed.value, JobStatus.cancelled.value, JobStatus.expired.value):
        error = record_error(rec)
        return StreamEnd(status, error.public() if error else {"code": status, "message": status})
    return None


def _lost(job_id: str) -> StreamEnd:
    return StreamEnd(
        "failed",
        {"code": "stream_incomplete", "message": f"job {job_id} finished but its token stream is incomplete"},
    )
