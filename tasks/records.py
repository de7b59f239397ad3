"""A job's record (a Redis hash, tasks/jobs.py): the fields it is created with, and read back:
the view a client sees of it, and the error that ended it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tasks.errors import JobError
from tasks.schemas import JobSpec, JobStatus


def queued_record(spec: JobSpec, queue: str, now: str) -> dict[str, str | int]:
    """The fields of a job's record as the API creates it, queued on `queue` at `now`."""
    return {
        "id": spec.id,
        "model": spec.model,
        "queue": queue,
        "status": JobStatus.queued.value,
        "created": now,
        "params": spec.params.model_dump_json(exclude_defaults=True),
        "attempts": 0,
        "priority": spec.priority,
        "deadline": "" if spec.deadline is None else repr(spec.deadline),
        "owner": spec.owner or "",
        # Where its record is POSTed once it ends ('' none): tasks/jobs.py, webapp/callbacks.py.
        "callback_url": spec.callback_url or "",
        # The message's content, to publish it again should the broker lose it.
        "spec": spec.model_dump_json(),
    }


def record_error(rec: dict[str, str]) -> JobError | None:
    """The error a job's record holds, if any."""
    return JobError.from_stored(rec["error"]) if rec.get("error") else None


def decode_record(rec: dict[str, str]) -> dict[str, Any]:
    """The public view of a record: status, priority, deadline, error, timings, and the
    partial result of a failed job that has one."""

    def ts(name: str) -> float | None:
        return float(rec[name]) if rec.get(name) else None

    created, started, finished = ts("created"), ts("started"), ts("finished")
    timings: dict[str, float | None] = {"created": created, "started": started, "finished": finished}
    if started is not None:
        timings["queued_s"] = round(started - created, 6)
    if finished is not None:
        timings["total_s"] = round(finished - created, 6)
        if started is not None:
            timings["run_s"] = round(finished - started, 6)
    out: dict[str, Any] = {
        "id": rec["id"],
        "model": rec["model"],
        "status": rec["status"],
        "attempts": int(rec.get("attempts", 0)),
        "attempts_forgiven": int(rec.get("forgiven") or 0),
        "priority": int(rec.get("priority") or 0),
        "deadline": float(rec["deadline"]) if rec.get("deadline") else None,
        "timings": timings,
    }
    if rec.get("worker"):
        out["worker"] = rec["worker"]
    error = record_error(rec)
    if error is not None:
        out["error"] = error.public()  # its field is for the API's own answer (JobError.param)
    if rec.get("result"):
        out["result"] = json.loads(rec["result"])
    return out


@dataclass
class Attempt:
    """What starting a job's attempt found: `run` it (as attempt number `number`), or not,
    because the job was `prev` (cancelled, final, expired: None) or had used up its attempts
    (`exhausted`: it is now failed). `solo`: it runs alone on its worker (it was forgiven
    SOLO_AFTER_FORGIVEN attempts: lost beside other jobs that often)."""

    run: bool
    prev: JobStatus | None
    number: int
    exhausted: bool = False
    solo: bool = False
