"""The batch store (`/v1/batches`): a batch is a hash (`genq:batch:<id>`) of its status,
timestamps, counts, usage and the feeding cursor into its input file; beside it `pending`
(line -> its jobs), `out` and `err` (the output and error lines so far; with GENQ_FILES_DIR only
the latest ones, the rest flushed to part files on disk). The Lua scripts move the cursor and
settle a line atomically, once each. Every Redis command of the routes and of the driver
(webapp/batches/driver.py) is here, in ondisk.py (the flush to disk, mixed in) or in the file
store (docs/design.md, "Batches")."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import redis
from redis.exceptions import LockError as LockError  # re-exported: the driver's lock was lost
from redis.lock import Lock

from tasks import keys
from tasks.config import Settings
from webapp import ids
from webapp.auth import ApiKey
from webapp.batches.disk import FINAL as FINAL  # re-exported: the driver's
from webapp.batches.files import FileStore, now
from webapp.batches.files import new_id as new_file_id
from webapp.batches.ondisk import FLUSHED, PARTS, OnDisk
from webapp.errors import APIError, owned
from webapp.protocol.batches import Batch, BatchList, BatchRequest

# Where the driver feeds a batch from: (chunk of the input file, line in the chunk).
Cursor = tuple[int, int]

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


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


# Each key expires after ARGV[1] seconds, unless it is due sooner already (or gone): Redis 7's
# `EXPIRE key seconds LT` on any Redis, and never a key's time lengthened. KEYS: the keys.
# ARGV: seconds. Returns how many it shortened.
SHORTEN = """
local n = 0
for _, key in ipairs(KEYS) do
  local left = redis.call('TTL', key)
  if left == -1 or left > tonumber(ARGV[1]) then
    redis.call('EXPIRE', key, ARGV[1])
    n = n + 1
  end
end
return n
"""
# The most keys one SHORTEN call names (the calls of one `release_jobs` go in one round trip).
SHORTEN_MAX = 1024


class BatchStore(OnDisk):
    def __init__(self, client: redis.Redis, settings: Settings, files: FileStore):
        self.r = client
        self.settings = settings
        self.files = files
        self._advance = client.register_script(ADVANCE)
        self._settle = client.register_script(SETTLE)
        self._flushed = client.register_script(FLUSHED)
        self._shorten = client.register_script(SHORTEN)

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
            "callback_url": req.callback_url or "",
            "created_at": at,
            "expires_at": at + 86_400,
            **dict.fromkeys(("total", "completed", "failed", "fed", "chunk", "offset"), 0),
            "key_max_queued": "" if key is None or key.max_queued is None else key.max_queued,
            "key_max_new_tokens": "" if key is None or key.max_new_tokens is None else key.max_new_tokens,
            "key_weight": "" if key is None else key.weight,
            # Where its output goes as it runs ("": in Redis till it ends), for whoever drives it.
            "files_dir": self.files.dir,
            "files_flush_lines": self.settings.files_flush_lines,  # the creator's, as files_dir
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

    # -- the driver's steps (webapp/batches/driver.py), each under the batch's lock

    def active(self) -> set[str]:
        """The batches not yet ended, which the driver moves on."""
        return self.r.smembers(keys.BATCHES_ACTIVE)

    def lock(self, batch_id: str, timeout: float) -> Lock:
        """The batch's lock (not taken yet: `acquire` does not block), expiring after `timeout`
        seconds, so that a process that dies holding it only delays its batch."""
        return self.r.lock(keys.batch_part(batch_id, "lock"), timeout=timeout, blocking=False)

    def record(self, batch_id: str) -> dict:
        """The batch's hash as stored ({} once it is gone), whoever owns it."""
        return self.r.hgetall(keys.batch(batch_id))

    def update(self, batch_id: str, **fields: Any) -> None:
        self.r.hset(keys.batch(batch_id), mapping=fields)

    def stop(self, batch_id: str, why: str, errors: list[dict] | None = None) -> None:
        """Mark the batch to stop early (`expired`, `failed`), with what failed it."""
        fields: dict[str, Any] = {"stopping": why}
        if errors:
            fields = {"errors": _errors(errors), **fields}
        self.update(batch_id, **fields)

    def deactivate(self, batch_id: str) -> None:
        self.r.srem(keys.BATCHES_ACTIVE, batch_id)

    def fail_validation(self, batch_id: str, errors: list[dict], total: int) -> None:
        """End a batch whose input is invalid: failed, listing `errors`, expiring with files."""
        key = keys.batch(batch_id)
        pipe = self.r.pipeline()
        pipe.hset(key, mapping={"status": "failed", "failed_at": now(), "errors": _errors(errors), "total": total})
        pipe.expire(key, self.settings.file_ttl)
        pipe.srem(keys.BATCHES_ACTIVE, batch_id)
        if self.r.hget(key, "callback_url"):
            pipe.zadd(keys.CALLBACKS_DUE, {f"batch:{batch_id}": time.time()}, nx=True)
        pipe.execute()

    def start(self, batch_id: str, total: int) -> None:
        """validating -> in_progress, with its `total` lines; not if it was cancelled meanwhile
        (the driver's next step ends it)."""
        key = keys.batch(batch_id)

        def start(pipe):
            if pipe.hget(key, "status") != "validating":
                return
            pipe.multi()
            pipe.hset(key, mapping={"status": "in_progress", "in_progress_at": now(), "total": total})

        self.r.transaction(start, key)

    def pending(self, batch_id: str) -> dict[str, dict]:
        """The batch's lines on the queue: `chunk:offset` -> its entry (custom_id and jobs:
        webapp/completions.py `Submitted.entry`)."""
        return {f: json.loads(v) for f, v in self.r.hgetall(keys.batch_part(batch_id, "pending")).items()}

    def pending_count(self, batch_id: str) -> int:
        return self.r.hlen(keys.batch_part(batch_id, "pending"))

    def pending_of(self, batch_ids: Iterable[str]) -> list[dict]:
        """The entries of all these batches' lines on the queue, in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for batch_id in batch_ids:
            pipe.hvals(keys.batch_part(batch_id, "pending"))
        return [json.loads(value) for values in pipe.execute() for value in values]

    def job_statuses(self, job_ids: list[str]) -> list[str | None]:
        """Each job's status (None: its record is gone), one small reply per job."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(keys.job(job_id), "status")
        return pipe.execute()

    def job_records(self, job_ids: list[str]) -> dict[str, dict]:
        """Each job's whole record (tasks/jobs.py; {} once gone), in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        return dict(zip(job_ids, pipe.execute()))

    def advance(
        self, batch_id: str, at: Cursor, to: Cursor, kind: str = "skip", field: str = "", value: str = ""
    ) -> bool:
        """Move the feeding cursor from `at` to `to` (chunk, offset) with what became of the line
        (ADVANCE: `value` is its pending entry's JSON or its error line); False, and nothing
        done, if the cursor is no longer at `at`: another process took the batch over."""
        return bool(
            self._advance(
                keys=[keys.batch(batch_id), keys.batch_part(batch_id, "pending"), keys.batch_part(batch_id, "err")],
                args=[*at, *to, kind, field, value],
            )
        )

    def settle(self, batch_id: str, field: str, kind: str, line: str, tokens: tuple[int, int, int]) -> bool:
        """Write a pending line's output line (SETTLE); False if it was settled already."""
        return bool(
            self._settle(
                keys=[
                    keys.batch(batch_id),
                    keys.batch_part(batch_id, "pending"),
                    keys.batch_part(batch_id, "out"),
                    keys.batch_part(batch_id, "err"),
                ],
                args=[field, kind, line, *tokens],
            )
        )

    def release_jobs(self, ttls: dict[str, int], result_key: Callable[[str], str | bytes]) -> int:
        """The jobs of settled lines (job id -> seconds): every key each left (tasks/keys.py
        `job_keys`, and `result_key(job_id)`, the result backend's) expires after its seconds,
        or sooner if it was due sooner, in one round trip. Nothing else of the job: its tokens
        are counted in usage already. Returns how many keys it shortened."""
        by_ttl: dict[int, list] = {}
        for job_id, ttl in ttls.items():
            by_ttl.setdefault(ttl, []).extend([*keys.job_keys(job_id), result_key(job_id)])
        if not by_ttl:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for ttl, names in by_ttl.items():
            for i in range(0, len(names), SHORTEN_MAX):
                self._shorten(keys=names[i : i + SHORTEN_MAX], args=[ttl], client=pipe)
        return sum(pipe.execute())

    def write_expired(self, batch_id: str, lines: list[str], next_chunk: int) -> None:
        """Append the `batch_expired` error lines of one chunk's lines never fed, counted, and
        the cursor past that chunk, in one transaction."""
        key, err = keys.batch(batch_id), keys.batch_part(batch_id, "err")
        pipe = self.r.pipeline()
        if lines:
            pipe.rpush(err, *lines)
            pipe.hincrby(key, "failed", len(lines))
            pipe.hincrby(key, "fed", len(lines))
            pipe.hincrby(key, "err_bytes", sum(len(line.encode()) for line in lines))
        pipe.hset(key, mapping={"chunk": next_chunk, "offset": 0})
        pipe.execute()

    def finalize(self, batch_id: str, final: str, owner: str) -> None:
        """End the batch as `final` (once: not if it is final already): `out` and `err` become
        its output and error files (renamed, in Redis or on disk), the batch and they expiring
        after GENQ_FILE_TTL."""
        ttl, key, at = self.settings.file_ttl, keys.batch(batch_id), now()
        root = self.r.hget(key, "files_dir")
        if root:
            self._finalize_on_disk(batch_id, final, owner, root)
            return

        def end(pipe):
            current = pipe.hgetall(key)
            if not current or current["status"] in FINAL:
                return
            files = {}
            for part, purpose, size in PARTS:
                if pipe.exists(keys.batch_part(batch_id, part)):
                    files[part] = (new_file_id(), purpose, int(current.get(size) or 0))
            pipe.multi()
            fields: dict[str, Any] = {"status": final, f"{final}_at": at}
            for part, (file_id, purpose, size) in files.items():
                pipe.rename(keys.batch_part(batch_id, part), keys.file_lines(file_id))
                pipe.expire(keys.file_lines(file_id), ttl)
                fields[f"{purpose}_file_id"] = file_id
                self._file_meta(pipe, file_id, batch_id, purpose, size, owner, at, None)
            self._end(pipe, batch_id, current, fields)

        self.r.transaction(end, key, keys.batch_part(batch_id, "out"), keys.batch_part(batch_id, "err"))

    def _file_meta(self, pipe, file_id, batch_id, purpose, size, owner, at, root) -> None:
        ttl = self.settings.file_ttl
        meta = {
            "id": file_id,
            "bytes": size,
            "created_at": at,
            "filename": f"{batch_id}_{purpose}.jsonl",
            "purpose": "batch_output",
            "owner": owner,
            "expires_at": at + ttl,
        }
        if root:
            meta["dir"] = root
        pipe.hset(keys.file(file_id), mapping=meta)
        pipe.expire(keys.file(file_id), ttl)

    def _end(self, pipe, batch_id: str, current: dict, fields: dict) -> None:
        key = keys.batch(batch_id)
        pipe.hset(key, mapping=fields)
        pipe.expire(key, self.settings.file_ttl)
        pipe.delete(keys.batch_part(batch_id, "pending"))
        pipe.srem(keys.BATCHES_ACTIVE, batch_id)
        if current.get("callback_url"):  # due with the end, in its transaction (webapp/callbacks.py)
            pipe.zadd(keys.CALLBACKS_DUE, {f"batch:{batch_id}": time.time()}, nx=True)


def _errors(errors: list[dict]) -> str:
    """A batch's `errors` field as stored: OpenAI's list object."""
    return json.dumps({"object": "list", "data": errors})
