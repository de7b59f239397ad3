"""Token events of one job, in a Redis Stream of its own.

A worker appends one entry per generated token, `{"i": n, "t": text}`, numbered from 0 within
one attempt at the job, and a last entry with `"finish"` (the finish reason) and `"usage"`. A
job that asked for `logprobs` has `"lp"` in its entries too: the log-probabilities of the tokens
behind the entry's text (JSON, OpenAI's logprobs object, text offsets from the completion's
start). The
API reads them with XREAD, so a client that connects late, or reconnects, still gets every
token: SSE event ids are the `i` numbers, and a reader resuming after `Last-Event-ID: k` skips
entries up to `k`.

A job run again after its worker died or hung (attempt n > 1) replaces its stream: the new
attempt empties it and starts it with a marker `{"restart": n}`, then numbers its tokens from 0
again (tasks/jobs.py does both in the call that starts the attempt). A greedy or seeded job
gives the same tokens again, so a reader skips what it already has and sees no seam. For a
sampled job the new tokens differ: the reader yields a `Restart`, the client drops the text it
had, and event ids of later attempts read `n:k` so that a resumed reader knows which attempt
its `Last-Event-ID` belongs to. No reader ever sees tokens of two attempts mixed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Iterator

import redis

from tasks import keys
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
    def parse(cls, fields: dict[str, str]) -> "TokenEvent":
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
    """A sampled job started over on another worker: discard its text received so far."""

    attempt: int


KeepAlive = None


def parse_event_id(raw: str | int) -> tuple[int, int]:
    """`k` (attempt 1) or `n:k` -> (attempt, index); ValueError otherwise."""
    attempt, _, index = str(raw).rpartition(":")
    return (int(attempt) if attempt else 1), int(index)


def _replays(rec: dict[str, str] | None) -> bool:
    """Whether a new attempt at this job gives the tokens of the last one again."""
    params = json.loads(rec.get("params") or "{}") if rec else {}
    return not params.get("temperature") or params.get("seed") is not None


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
    sampled job that started over yields a `Restart` (see the module's docstring).
    """
    last = {job_id: -1 for job_id in job_ids}
    attempt = {job_id: 1 for job_id in job_ids}
    for job_id, event_id in (after or {}).items():
        attempt[job_id], last[job_id] = parse_event_id(event_id)
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
            for _, fields in entries:
                if "restart" in fields:
                    n = int(fields["restart"])
                    if n > attempt[job_id]:
                        attempt[job_id] = n
                        if not _replays(get_record(job_id)):
                            if last[job_id] >= 0:
                                yield job_id, Restart(n)
                            last[job_id] = -1
                    continue
                event = TokenEvent.parse(fields)
                event.attempt = attempt[job_id]
                if event.index <= last[job_id] or job_id not in open_jobs:
                    continue
                last[job_id] = event.index
                yield job_id, event
                if event.finish:
                    open_jobs.discard(job_id)
        cursors = {k: v for k, v in cursors.items() if owner[k] in open_jobs}


def _end_of(get_record, job_id: str) -> StreamEnd | None:
    """How a job that reached a final status without a finish event ended; None if it has
    not ended, or succeeded and its finish event can still be expected."""
    rec = get_record(job_id)
    if rec is None:
        return StreamEnd("failed", {"code": "not_found", "message": f"job {job_id} expired"})
    status = rec.get("status")
    if status in (JobStatus.failed.value, JobStatus.cancelled.value, JobStatus.expired.value):
        error = json.loads(rec["error"]) if rec.get("error") else {"code": status, "message": status}
        return StreamEnd(status, error)
    return None


def _lost(job_id: str) -> StreamEnd:
    return StreamEnd(
        "failed",
        {"code": "stream_incomplete", "message": f"job {job_id} finished but its token stream is incomplete"},
    )
