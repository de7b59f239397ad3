"""The batch store (`/v1/batches`): a batch is a hash (`genq:batch:<id>`) of its status,
timestamps, counts, usage and the feeding cursor into its input file; beside it `pending`
(line -> its jobs), `out` and `err` (the output and error lines so far). The Lua scripts move
the cursor and settle a line atomically, once each (docs/design.md, "Batches")."""

from __future__ import annotations

import json
import uuid

import redis

from tasks import keys
from tasks.config import Settings
from webapp import ids
from webapp.auth import ApiKey
from webapp.batches.files import FileStore, now
from webapp.errors import APIError, owned
from webapp.protocol.batches import Batch, BatchList, BatchRequest

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")


def owner_of(key: ApiKey | None) -> str:
    return key.name if key else ""


# Moves the feeding cursor from (chunk, offset) to the next line, with what became of the line:
# 'skip' (blank), 'pending' (its jobs are on the queue: field -> value in pending), 'error' (an
# error line, value, appended to err, counted failed). Refused (0) if the cursor is no longer
# where the caller read it: another process took the batch over.
# KEYS: batch, pending, err. ARGV: chunk, offset, new chunk, new offset, kind, field, value.
ADVANCE = """
if redis.call('HGET', KEYS[1], 'chunk') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'offset') ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], 'chunk', ARGV[3], 'offset', ARGV[4])
if ARGV[5] == 'pending' then
  redis.call('HSET', KEYS[2], ARGV[6], ARGV[7])
  redis.call('HINCRBY', KEYS[1], 'fed', 1)
elseif ARGV[5] == 'error' then
  redis.call('RPUSH', KEYS[3], ARGV[7])
  redis.call('HINCRBY', KEYS[1], 'fed', 1)
  redis.call('HINCRBY', KEYS[1], 'failed', 1)
  redis.call('HINCRBY', KEYS[1], 'err_bytes', string.len(ARGV[7]))
end
return 1
"""

# A pending line's jobs ended: its output line goes to out or err (or nowhere: 'drop', a line
# cancelled with its batch), counted, once. KEYS: batch, pending, out, err. ARGV: field, kind
# ('out' | 'err' | 'drop'), line, prompt tokens, completion tokens, cached prompt tokens.
SETTLE = """
if redis.call('HDEL', KEYS[2], ARGV[1]) == 0 then return 0 end
if ARGV[2] == 'out' then
  redis.call('RPUSH', KEYS[3], ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'completed', 1)
  redis.call('HINCRBY', KEYS[1], 'out_bytes', string.len(ARGV[3]))
elseif ARGV[2] == 'err' then
  redis.call('RPUSH', KEYS[4], ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'failed', 1)
  redis.call('HINCRBY', KEYS[1], 'err_bytes', string.len(ARGV[3]))
end
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'completion_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[6])
return 1
"""


class BatchStore:
    def __init__(self, client: redis.Redis, settings: Settings, files: FileStore):
        self.r = client
        self.settings = settings
        self.files = files
        self._advance = client.register_script(ADVANCE)
        self._settle = client.register_script(SETTLE)

    def create(self, req: BatchRequest, key: ApiKey | None) -> Batch:
        owner = owner_of(key)
        file = self.files.meta(req.input_file_id, owner)
        if file.get("purpose") != "batch":
            raise APIError(
                400,
                "invalid_request",
                f"input_file_id: {req.input_file_id} is not a purpose=batch file",
                param="input_file_id",
            )
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        at = now()
        rec = {
            "id": batch_id,
            "owner": owner,
            "status": "validating",
            "endpoint": req.endpoint,
            "input_file_id": req.input_file_id,
            "completion_window": req.completion_window,
            "metadata": json.dumps(req.metadata) if req.metadata else "",
            "created_at": at,
            "expires_at": at + 86_400,
            **dict.fromkeys(("total", "completed", "failed", "fed", "chunk", "offset"), 0),
            "key_max_queued": "" if key is None or key.max_queued is None else key.max_queued,
            "key_max_new_tokens": "" if key is None or key.max_new_tokens is None else key.max_new_tokens,
        }
        seq = self.r.incr(keys.BATCHES_SEQ)
        pipe = self.r.pipeline()
        pipe.hset(keys.batch(batch_id), mapping=rec)
        pipe.zadd(keys.batches_of(owner or "-"), {batch_id: seq})
        pipe.sadd(keys.BATCHES_ACTIVE, batch_id)
        # The input must outlive the batch's window.
        ttl = self.settings.file_ttl + 86_400
        pipe.expire(keys.file(req.input_file_id), ttl)
        pipe.expire(keys.file_lines(req.input_file_id), ttl)
        pipe.execute()
        return Batch.from_record(rec)

    def get(self, batch_id: str, owner: str | None) -> dict:
        ids.check("batch", batch_id)  # before Redis: `batch_…:pending` names another key
        return owned(self.r.hgetall(keys.batch(batch_id)), owner, "batch", batch_id)

    def list(self, owner: str, after: str | None, limit: int) -> BatchList:
        index = keys.batches_of(owner or "-")
        if after:
            score = self.r.zscore(index, after)
            if score is None:
                raise APIError(404, "not_found", f"after: no batch {after!r}", param="after")
            ids = self.r.zrevrangebyscore(index, f"({score}", "-inf", start=0, num=limit + 1)
        else:
            ids = self.r.zrevrange(index, 0, limit)
        pipe = self.r.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hgetall(keys.batch(batch_id))
        recs = pipe.execute()
        gone = [i for i, rec in zip(ids, recs) if not rec]
        if gone:
            self.r.zrem(index, *gone)
        data = [Batch.from_record(rec) for rec in recs if rec]
        has_more = len(data) > limit
        data = data[:limit]
        return BatchList(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=has_more,
        )

    def cancel(self, batch_id: str, owner: str | None) -> Batch:
        self.get(batch_id, owner)

        def move(pipe):
            status = pipe.hget(keys.batch(batch_id), "status")
            if status in FINAL or status == "finalizing":
                raise APIError(409, "already_final", f"batch {batch_id} is already {status}")
            if status == "cancelling":
                return
            pipe.multi()
            pipe.hset(keys.batch(batch_id), mapping={"status": "cancelling", "cancelling_at": now()})

        self.r.transaction(move, keys.batch(batch_id))
        return Batch.from_record(self.get(batch_id, owner))
