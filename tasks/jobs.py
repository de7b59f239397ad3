"""Job records in Redis: one hash per job id, written by the API and advanced by workers.

Celery calls every id it has never seen PENDING; this record is what makes an unknown id a
404, and it carries status, timings and errors. The result itself lives in Celery's result
backend. Status changes go through one Lua script so that, for example, a job cancelled while
queued is never marked running by the worker that picks it up afterwards. A final status also
writes a one-entry stream `genq:done:<id>`, which any number of waiters block on with XREAD.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from tasks import keys
from tasks.schemas import JobSpec, JobStatus

_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
local allowed = false
for s in string.gmatch(ARGV[2], '[^,]+') do
  if s == cur then allowed = true end
end
if not allowed then return {0, cur} end
redis.call('HSET', KEYS[1], 'status', ARGV[1], unpack(ARGV, 5))
if ARGV[4] == '1' then
  redis.call('HINCRBY', KEYS[1], 'attempts', 1)
end
if ARGV[3] ~= '' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '1', '*', 'status', ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
return {1, cur}
"""

# Creates the records of queued jobs unless the queue already holds `max_depth` messages.
# KEYS: the queue, then one record key per job. ARGV: max depth, TTL, the number of fields per
# record, then each record's field/value pairs in order. Returns the depth, negated if refused.
_CREATE = """
local depth = redis.call('LLEN', KEYS[1])
if depth + #KEYS - 1 > tonumber(ARGV[1]) then return -depth - 1 end
local n = tonumber(ARGV[3]) * 2
for i = 2, #KEYS do
  local base = 3 + (i - 2) * n
  redis.call('HSET', KEYS[i], unpack(ARGV, base + 1, base + n))
  redis.call('EXPIRE', KEYS[i], ARGV[2])
end
return depth
"""

ACTIVE = (JobStatus.queued, JobStatus.running)
MAX_BLOCK_S = 3.0


class JobStore:
    def __init__(self, client: redis.Redis, ttl: int):
        self.r = client
        self.ttl = ttl
        self._transition = client.register_script(_TRANSITION)
        self._create = client.register_script(_CREATE)

    def create(self, specs: list[JobSpec], queue: str, max_depth: int) -> tuple[bool, int]:
        """Record queued jobs, atomically with a look at their queue: unless it already holds
        too many waiting messages. Returns (created, the queue's depth)."""
        now = repr(time.time())
        args: list = [max_depth, self.ttl, 6]
        for spec in specs:
            args += [
                "id", spec.id,
                "model", spec.model,
                "status", JobStatus.queued.value,
                "created", now,
                "params", spec.params.model_dump_json(exclude_defaults=True),
                "attempts", 0,
            ]  # fmt: skip
        depth = self._create(keys=[queue, *(keys.job(s.id) for s in specs)], args=args)
        return depth >= 0, depth if depth >= 0 else -depth - 1

    def get(self, job_id: str) -> dict[str, str] | None:
        rec = self.r.hgetall(keys.job(job_id))
        return rec or None

    def transition(
        self, job_id: str, to: JobStatus, allowed: tuple[JobStatus, ...], **fields: Any
    ) -> tuple[bool, JobStatus | None]:
        """Move a job to `to` if its status is one of `allowed`; return (moved, previous)."""
        flat: list[str] = []
        for k, v in fields.items():
            flat += [k, v if isinstance(v, str) else json.dumps(v)]
        res = self._transition(
            keys=[keys.job(job_id), keys.done(job_id)],
            args=[
                to.value,
                ",".join(s.value for s in allowed),
                str(self.ttl) if to.terminal else "",
                "1" if to is JobStatus.running else "0",
                *flat,
            ],
        )
        if res is None:
            return False, None
        moved, prev = res
        return bool(moved), JobStatus(prev.decode() if isinstance(prev, bytes) else prev)

    def mark_running(self, job_id: str, worker: str) -> tuple[bool, JobStatus | None]:
        # `running` is allowed as a source: a job redelivered after its worker died runs again.
        return self.transition(
            job_id, JobStatus.running, ACTIVE, started=repr(time.time()), worker=worker
        )

    def finish(
        self, job_id: str, status: JobStatus, error: dict[str, str] | None = None
    ) -> tuple[bool, JobStatus | None]:
        fields: dict[str, Any] = {"finished": repr(time.time())}
        if error:
            fields["error"] = error
        return self.transition(job_id, status, ACTIVE, **fields)

    def cancel(self, job_id: str) -> tuple[bool, JobStatus | None]:
        return self.finish(
            job_id, JobStatus.cancelled, {"code": "cancelled", "message": "cancelled by the client"}
        )

    def wait(self, job_id: str, timeout: float, exists: bool = False) -> dict[str, str] | None:
        """The job's record once it is final, or as it stands when `timeout` runs out.

        `exists`: the caller knows the job exists (it just created it), so the first look at
        the record can wait for the done stream instead of finding the job still running.
        """
        deadline = time.monotonic() + timeout
        if not exists:
            rec = self.get(job_id)
            if rec is None or JobStatus(rec["status"]).terminal:
                return rec
        while True:
            left = deadline - time.monotonic()
            if left > 0:
                # An entry in the done stream means the record is final. Each block stays
                # below the client's socket timeout (redis-py's default is 5 s).
                block_ms = max(1, int(min(left, MAX_BLOCK_S) * 1000))
                self.r.xread({keys.done(job_id): "0"}, block=block_ms, count=1)
            rec = self.get(job_id)
            if rec is None or JobStatus(rec["status"]).terminal or time.monotonic() >= deadline:
                return rec


def decode_record(rec: dict[str, str]) -> dict[str, Any]:
    """The public view of a record: status, error and timings."""

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
        "timings": timings,
    }
    if rec.get("worker"):
        out["worker"] = rec["worker"]
    if rec.get("error"):
        out["error"] = json.loads(rec["error"])
    return out
