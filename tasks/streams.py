"""Token events of one job, in a Redis Stream of its own.

A worker appends one entry per generated token, `{"i": n, "t": text}`, numbered from 0 within
one attempt at the job, and a last entry with `"finish"` (the finish reason) and `"usage"`. The
API reads them with XREAD, so a client that connects late, or reconnects, still gets every
token: SSE event ids are the `i` numbers, and a reader resuming after `Last-Event-ID: k` skips
entries up to `k`. A job delivered again after its worker died starts again from 0, and the
same rule skips what the client already has.
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

    def fields(self) -> dict[str, str]:
        out = {"i": str(self.index), "t": self.text}
        if self.finish:
            out["finish"] = self.finish
            out["usage"] = json.dumps(self.usage or {})
        return out

    @classmethod
    def parse(cls, fields: dict[str, str]) -> "TokenEvent":
        return cls(
            index=int(fields["i"]),
            text=fields.get("t", ""),
            finish=fields.get("finish"),
            usage=json.loads(fields["usage"]) if "usage" in fields else None,
        )


@dataclass
class StreamEnd:
    """The job ended without a finish event: failed or cancelled (`error` says why)."""

    status: str
    error: dict


KeepAlive = None


def follow(
    client: redis.Redis,
    job_ids: list[str],
    get_record: Callable[[str], dict[str, str] | None],
    after: dict[str, int] | None = None,
) -> Iterator[tuple[str, TokenEvent | StreamEnd] | None]:
    """Yield `(job_id, event)` for the jobs' token events as they arrive, until each job has
    finished; `None` after every read that brought nothing (time for a keep-alive).

    `after[job_id] = k` skips events numbered up to k (Last-Event-ID). A job that reaches a
    final status without a finish event (failed, cancelled) yields a `StreamEnd`.
    """
    last = {job_id: -1 for job_id in job_ids}
    last.update(after or {})
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
                event = TokenEvent.parse(fields)
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
    if status in (JobStatus.failed.value, JobStatus.cancelled.value):
        error = json.loads(rec["error"]) if rec.get("error") else {"code": status, "message": status}
        return StreamEnd(status, error)
    return None


def _lost(job_id: str) -> StreamEnd:
    return StreamEnd(
        "failed",
        {"code": "stream_incomplete", "message": f"job {job_id} finished but its token stream is incomplete"},
    )
