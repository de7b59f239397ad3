"""OpenAI's Batch API on the job queue: files (`/v1/files`) and batches (`/v1/batches`).

Files live in Redis: a hash of metadata (`genq:file:<id>`) and the content as a list of
chunks of whole lines (`genq:file:<id>:lines`, about CHUNK_BYTES each), so that neither an
upload nor a download ever holds more than one chunk per step, and a batch reads its input a
chunk at a time. Both keys expire after `GENQ_FILE_TTL`. An upload is checked line by line
(UTF-8, one JSON object per line) and refused with the first bad line's number; it is written
under a temporary key and renamed into place only once it is whole.

A batch is a hash (`genq:batch:<id>`) holding everything about it: status, timestamps,
`request_counts`, usage and the feeding cursor (chunk, line in the chunk) into its input file;
beside it `pending` (line -> the ids of the jobs it became, while they run), `out` and `err`
(the output and error lines so far, one per list item: at the end they are renamed into the
output and error files, without a copy). The statuses are OpenAI's: validating -> in_progress
-> finalizing -> completed; failed (validation); cancelling -> cancelled; expired (past its
24 h completion window).

The driver (BatchDriver) runs in every API process, a thread (a greenlet under gunicorn's
gevent workers) that each tick takes, per active batch, a Redis lock (`...:lock`, expiring:
a process that dies while holding it only delays its batch). Holding it, a process

- validates the input file (validating -> in_progress, or failed with `errors.data[]`, each
  naming its line, as OpenAI lists them);
- collects: lines whose jobs all ended become output lines (`{id, custom_id, response
  {status_code, request_id, body}, error}`, the body as `/v1/completions` would answer) in
  `out`, or, if a job failed, in `err` with the status and error body that route would send;
  each line moves out of `pending` exactly once (a Lua script), counted in `request_counts`;
- feeds: the next lines become ordinary jobs (JobService.submit, the same validation and key
  limits as `/v1/completions`) at priority BATCH_PRIORITY, the least urgent, until the batch
  has `GENQ_BATCH_WINDOW` lines on the queue: a batch of any size costs the broker a bounded
  number of messages, and interactive jobs (priority 0) overtake its waiting lines. While the
  live workers keep threads for foreground jobs (GENQ_RESERVED_SLOTS, hf engine), the lines of
  all batches together stay within the workers' capacity and half that reserve (`fleet_room`),
  so that an interactive job is taken at once and, preempting a line, runs instead of waiting
  for a line to finish. A line the
  completions route would refuse, or whose `url` is not the batch's endpoint, becomes an error
  line at once. Each line's jobs are recorded in `pending` in the same Lua call that moves the
  cursor, guarded by the cursor's old value: if the lock was lost meanwhile, the jobs are
  cancelled and nothing is counted twice. A crash between the submit and that call submits the
  line again on the next tick: a job may run twice, a line is never lost or doubled;
- cancels (cancelling, or expired): the waiting jobs of its pending lines are cancelled (what
  runs finishes and is written out), nothing more is fed, and the batch ends once `pending` is
  empty.

Nothing lives in the process: a batch goes on after an API restart (another process, or the
restarted one, takes the lock) and after a worker dies (its jobs are ordinary jobs, which the
workers' recovery puts back on the queue, worker/recovery.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import IO, Any, Iterator

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.exceptions import LockError
from typing import Literal

from tasks import keys
from tasks.config import Settings
from tasks.schemas import PRIORITY_MAX, JobStatus, Scheduling
from webapp import ids, protocol
from webapp.auth import ApiKey
from webapp import chat
from webapp.completions import CompletionService, Submitted
from webapp.errors import BROKER_ERRORS, APIError, describe, error_body, job_error_status, owned

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 1024
TICK_S = 0.2
# While lines move, the next tick comes sooner.
BUSY_TICK_S = 0.05
LOCK_S = 5
# The most validation errors a failed batch lists.
MAX_ERRORS = 100
# Batch lines wait behind every interactive job (0 by default): vLLM's order, lower first.
BATCH_PRIORITY = PRIORITY_MAX
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "expired", "cancelled")


class LineError(APIError):
    """A 400 about one line of an uploaded file (1-based `line`, also in the error body)."""

    def __init__(self, line: int, message: str):
        super().__init__(400, "invalid_file", f"line {line}: {message}", param="file")
        self.line = line

    def body(self) -> dict:
        body = super().body()
        body["error"]["line"] = self.line
        return body


def owner_of(key: ApiKey | None) -> str:
    return key.name if key else ""


def _now() -> int:
    return int(time.time())


def _refuse_lone_surrogates(n: int, text: str, obj: dict) -> None:
    """LineError if a string of the line holds a `\\ud800`-`\\udfff` escape that is not half
    of a pair: valid JSON, but no Unicode text, which no job, Redis write or output line takes
    (a batch would retry the line forever). Only lines with a `\\u` escape are re-encoded."""
    if "\\u" not in text:
        return
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise LineError(n, "a string holds a lone surrogate (a \\ud800-\\udfff escape not part of a pair)") from None
    except RecursionError:
        raise LineError(n, "not valid JSON (nested too deeply)") from None


def _lines(chunk: str) -> list[str]:
    """The lines of one stored chunk (every chunk ends with a newline)."""
    return chunk.split("\n")[:-1]


# -- files ----------------------------------------------------------------------------------


class FileStore:
    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings

    def create(self, stream: IO[bytes], filename: str, owner: str) -> dict:
        """Store an uploaded JSONL file: each non-blank line one JSON object, checked as it is
        read. Raises LineError (400) naming the first bad line, APIError 413 past the limit."""
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        target = keys.file_lines(file_id)
        tmp = f"{target}:upload"
        limit = self.settings.max_file_bytes
        size = lines = buffered = 0
        buf: list[str] = []
        pipe = self.r.pipeline(transaction=False)
        try:
            for n, raw in enumerate(stream, 1):
                size += len(raw)
                if size > limit:
                    raise APIError(
                        413, "file_too_large", f"the file is over {limit} bytes (GENQ_MAX_FILE_BYTES)", param="file"
                    )
                try:
                    text = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError:
                    raise LineError(n, "not UTF-8 text") from None
                if text.strip():
                    try:
                        obj = json.loads(text)
                    except RecursionError:
                        raise LineError(n, "not valid JSON (nested too deeply)") from None
                    except ValueError as exc:
                        raise LineError(n, f"not valid JSON ({getattr(exc, 'msg', exc)})") from None
                    if not isinstance(obj, dict):
                        raise LineError(n, "not a JSON object")
                    _refuse_lone_surrogates(n, text, obj)
                    lines += 1
                buf.append(text + "\n")
                buffered += len(text) + 1
                if buffered >= CHUNK_BYTES:
                    pipe.rpush(tmp, "".join(buf))
                    buf, buffered = [], 0
                    if len(pipe) >= 16:
                        pipe.expire(tmp, 3600)
                        pipe.execute()
            if buf:
                pipe.rpush(tmp, "".join(buf))
            meta = {
                "id": file_id, "bytes": size, "created_at": _now(), "filename": filename or "upload.jsonl",
                "purpose": "batch", "owner": owner, "lines": lines,
                "expires_at": _now() + self.settings.file_ttl,
            }  # fmt: skip
            if size:
                pipe.rename(tmp, target)
                pipe.expire(target, self.settings.file_ttl)
            pipe.hset(keys.file(file_id), mapping=meta)
            pipe.expire(keys.file(file_id), self.settings.file_ttl)
            pipe.execute()
        except BaseException:
            try:
                pipe.reset()
                self.r.delete(tmp)
            except BROKER_ERRORS:
                pass
            raise
        return public_file(meta)

    def meta(self, file_id: str, owner: str | None) -> dict:
        """The file's metadata; a 404 if it does not exist or, with `owner`, is not theirs."""
        ids.check("file", file_id)  # before Redis: `file-…:lines` names the content list
        return owned(self.r.hgetall(keys.file(file_id)), owner, "file", file_id)

    def chunks(self, file_id: str, start: int = 0, step: int = 64) -> Iterator[str]:
        """The file's content, chunk by chunk, `step` chunks per Redis call."""
        key = keys.file_lines(file_id)
        while True:
            part = self.r.lrange(key, start, start + step - 1)
            yield from part
            if len(part) < step:
                return
            start += step

    def delete(self, file_id: str, owner: str) -> dict:
        self.meta(file_id, owner)
        self.r.delete(keys.file(file_id), keys.file_lines(file_id))
        return {"id": file_id, "object": "file", "deleted": True}


def public_file(rec: dict) -> dict:
    return {
        "id": rec["id"],
        "object": "file",
        "bytes": int(rec["bytes"]),
        "created_at": int(rec["created_at"]),
        "expires_at": int(rec["expires_at"]) if rec.get("expires_at") else None,
        "filename": rec["filename"],
        "purpose": rec["purpose"],
        "status": "processed",
        "status_details": None,
    }


# -- batches --------------------------------------------------------------------------------


class BatchRequest(BaseModel):
    """Body of POST /v1/batches."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str = Field(min_length=1)
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)


class BatchLine(BaseModel):
    """One line of a batch's input file (its body is checked when the line is fed, as the
    completions route checks a request)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


def public_batch(rec: dict) -> dict:
    def ts(name: str) -> int | None:
        return int(float(rec[name])) if rec.get(name) else None

    def num(name: str) -> int:
        return int(rec.get(name) or 0)

    inp, out = num("prompt_tokens"), num("completion_tokens")
    return {
        "id": rec["id"],
        "object": "batch",
        "endpoint": rec["endpoint"],
        "errors": json.loads(rec["errors"]) if rec.get("errors") else None,
        "input_file_id": rec["input_file_id"],
        "completion_window": rec["completion_window"],
        "status": rec["status"],
        "output_file_id": rec.get("output_file_id") or None,
        "error_file_id": rec.get("error_file_id") or None,
        "created_at": ts("created_at"),
        "in_progress_at": ts("in_progress_at"),
        "expires_at": ts("expires_at"),
        "finalizing_at": ts("finalizing_at"),
        "completed_at": ts("completed_at"),
        "failed_at": ts("failed_at"),
        "expired_at": ts("expired_at"),
        "cancelling_at": ts("cancelling_at"),
        "cancelled_at": ts("cancelled_at"),
        "request_counts": {"total": num("total"), "completed": num("completed"), "failed": num("failed")},
        "usage": {
            "input_tokens": inp,
            "output_tokens": out,
            "total_tokens": inp + out,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
        "metadata": json.loads(rec["metadata"]) if rec.get("metadata") else None,
    }


# Moves the feeding cursor from (chunk, offset) to the next line, with what became of the line:
# 'skip' (blank), 'pending' (its jobs are on the queue: field -> value in pending), 'error' (an
# error line, value, appended to err, counted failed). Refused (0) if the cursor is no longer
# where the caller read it: another process took the batch over.
# KEYS: batch, pending, err. ARGV: chunk, offset, new chunk, new offset, kind, field, value.
_ADVANCE = """
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
# ('out' | 'err' | 'drop'), line, prompt tokens, completion tokens.
_SETTLE = """
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
return 1
"""


class Backoff(Exception):
    """The queue is full (or the owner's quota, or Redis): feed no more this tick."""


class BatchStore:
    def __init__(self, client: redis.Redis, settings: Settings, files: FileStore):
        self.r = client
        self.settings = settings
        self.files = files
        self._advance = client.register_script(_ADVANCE)
        self._settle = client.register_script(_SETTLE)

    def create(self, req: BatchRequest, key: ApiKey | None) -> dict:
        owner = owner_of(key)
        file = self.files.meta(req.input_file_id, owner)
        if file.get("purpose") != "batch":
            raise APIError(
                400, "invalid_request", f"input_file_id: {req.input_file_id} is not a purpose=batch file",
                param="input_file_id",
            )  # fmt: skip
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        now = _now()
        rec = {
            "id": batch_id, "owner": owner, "status": "validating", "endpoint": req.endpoint,
            "input_file_id": req.input_file_id, "completion_window": req.completion_window,
            "metadata": json.dumps(req.metadata) if req.metadata else "",
            "created_at": now, "expires_at": now + 86_400,
            "total": 0, "completed": 0, "failed": 0, "fed": 0, "chunk": 0, "offset": 0,
            "key_max_queued": "" if key is None or key.max_queued is None else key.max_queued,
            "key_max_new_tokens": "" if key is None or key.max_new_tokens is None else key.max_new_tokens,
        }  # fmt: skip
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
        return public_batch(rec)

    def get(self, batch_id: str, owner: str | None) -> dict:
        ids.check("batch", batch_id)  # before Redis: `batch_…:pending` names another key
        return owned(self.r.hgetall(keys.batch(batch_id)), owner, "batch", batch_id)

    def list(self, owner: str, after: str | None, limit: int) -> dict:
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
        data = [public_batch(rec) for rec in recs if rec]
        has_more = len(data) > limit
        data = data[:limit]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }

    def cancel(self, batch_id: str, owner: str | None) -> dict:
        self.get(batch_id, owner)

        def move(pipe):
            status = pipe.hget(keys.batch(batch_id), "status")
            if status in FINAL or status == "finalizing":
                raise APIError(409, "already_final", f"batch {batch_id} is already {status}")
            if status == "cancelling":
                return
            pipe.multi()
            pipe.hset(keys.batch(batch_id), mapping={"status": "cancelling", "cancelling_at": _now()})

        self.r.transaction(move, keys.batch(batch_id))
        return public_batch(self.get(batch_id, owner))


# -- the driver -----------------------------------------------------------------------------


class BatchDriver:
    """Moves every active batch on, a step per tick, from every API process (see the top)."""

    def __init__(self, service, store: BatchStore):
        self.service = service
        self.completions = CompletionService(service)
        self.store = store
        self.r = store.r
        self.settings = store.settings
        self.files = store.files
        self._advance, self._settle = store._advance, store._settle
        self.stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = 0.0
        # Per model, the batch lines its workers may still take this tick (a model not in it:
        # no limit but each batch's window).
        self._room: dict[str, int] = {}

    # -- the loop

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self.run, name="genq-batches", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        busy = False
        while not self.stopped.wait(BUSY_TICK_S if busy else TICK_S):
            busy = False
            try:
                busy = self.tick()
            except BROKER_ERRORS as exc:
                if time.monotonic() - self._warned > 30:
                    self._warned = time.monotonic()
                    log.warning("batch driver: Redis unavailable: %s", exc)
            except Exception:
                log.exception("batch driver: unexpected error")

    def tick(self) -> bool:
        """One step of every active batch this process can lock; whether any line moved (then
        the next tick comes at once)."""
        moved = False
        active = self.r.smembers(keys.BATCHES_ACTIVE)
        self._room = self.fleet_room(active)
        for batch_id in active:
            lock = self.r.lock(keys.batch_part(batch_id, "lock"), timeout=LOCK_S, blocking=False)
            if not lock.acquire():
                continue
            try:
                moved |= bool(self.step(batch_id, lock))
            except LockError:
                pass  # held too long and lost: whoever holds it now goes on
            finally:
                try:
                    lock.release()
                except LockError:
                    pass
        return moved

    def fleet_room(self, active) -> dict[str, int]:
        """Per model: how many more lines (of all batches together) its live workers may hold,
        queued or running, so that an interactive job always finds a worker thread free to take
        it (it then preempts a line: worker/engines/hf.py): per worker its capacity, plus half
        its reserve (GENQ_RESERVED_SLOTS, the threads it runs beyond its capacity) as lines
        waiting on the worker to step in at once. Only models some live worker keeps a reserve
        for: the others have no limit but each batch's window."""
        workers = self.service.registry.live()
        room: dict[str, int] = {}
        for model in {w.model for w in workers if w.reserved}:
            room[model] = sum(w.capacity + w.reserved // 2 for w in workers if w.model == model)
        if not room:
            return room
        pipe = self.r.pipeline(transaction=False)
        for batch_id in active:
            pipe.hvals(keys.batch_part(batch_id, "pending"))
        for entries in pipe.execute():
            for entry in entries:
                model = json.loads(entry).get("model")
                if model in room:
                    room[model] -= 1
        return room

    def step(self, batch_id: str, lock) -> bool:
        rec = self.r.hgetall(keys.batch(batch_id))
        if not rec or rec["status"] in FINAL:
            self.r.srem(keys.BATCHES_ACTIVE, batch_id)
            return
        if rec["status"] == "validating":
            self.validate(rec, lock)
            return
        if rec["status"] == "in_progress" and time.time() >= float(rec["expires_at"]) and not rec.get("stopping"):
            self.r.hset(keys.batch(batch_id), "stopping", "expired")
            rec["stopping"] = "expired"
        # Why the batch stops early, if it does: cancelled, expired or failed (its input gone).
        stopping = rec.get("stopping") or ("cancelled" if rec["status"] == "cancelling" else None)
        if stopping:
            self.cancel_waiting(batch_id)
        moved = self.collect(batch_id, stopping)
        if not stopping:
            moved += self.feed(rec, lock)
        rec = self.r.hgetall(keys.batch(batch_id))
        if self.r.hlen(keys.batch_part(batch_id, "pending")):
            return moved > 0
        if rec.get("stopping") == "expired":
            self.expire_unfed(rec, lock)
            self.finalize(rec, "expired")
        elif rec["status"] == "cancelling":
            self.finalize(rec, "cancelled")
        elif int(rec["fed"]) >= int(rec["total"]):
            self.r.hset(keys.batch(batch_id), mapping={"status": "finalizing", "finalizing_at": _now()})
            self.finalize(rec, "completed")

    # -- validating

    def validate(self, rec: dict, lock) -> None:
        """Check every line's shape (custom_id, method, url, body; custom_ids distinct)."""
        batch_id, errors, seen, total, n = rec["id"], [], set(), 0, 0
        if not self.r.exists(keys.file(rec["input_file_id"])):
            errors.append({"code": "file_not_found", "message": f"input file {rec['input_file_id']} is gone",
                           "param": "input_file_id", "line": None})  # fmt: skip
        else:
            started = time.monotonic()
            for chunk in self.files.chunks(rec["input_file_id"]):
                for text in _lines(chunk):
                    n += 1
                    if not text.strip():
                        continue
                    total += 1
                    problem = _line_problem(text, seen)
                    if problem:
                        errors.append({**problem, "line": n})
                if len(errors) >= MAX_ERRORS:
                    break
                if time.monotonic() - started > LOCK_S / 3:
                    lock.reacquire()  # LockError if lost: this pass ends, the holder validates
                    started = time.monotonic()
                time.sleep(0)  # let a gevent worker serve requests meanwhile
            if total == 0 and not errors:
                errors.append({"code": "empty_file", "message": "the input file holds no request",
                               "param": "input_file_id", "line": None})  # fmt: skip
        key = keys.batch(batch_id)
        if errors:
            now = _now()
            data = {"object": "list", "data": errors[:MAX_ERRORS]}
            pipe = self.r.pipeline()
            pipe.hset(key, mapping={"status": "failed", "failed_at": now, "errors": json.dumps(data), "total": total})
            pipe.expire(key, self.settings.file_ttl)
            pipe.srem(keys.BATCHES_ACTIVE, batch_id)
            pipe.execute()
            return

        def start(pipe):
            if pipe.hget(key, "status") != "validating":
                return  # cancelled meanwhile: the next step ends it
            pipe.multi()
            pipe.hset(key, mapping={"status": "in_progress", "in_progress_at": _now(), "total": total})

        self.r.transaction(start, key)

    # -- collecting

    def collect(self, batch_id: str, stopping: str | None) -> int:
        """Settle the pending lines whose jobs all ended; returns how many."""
        pending = self.r.hgetall(keys.batch_part(batch_id, "pending"))
        if not pending:
            return 0
        entries = {field: json.loads(value) for field, value in pending.items()}
        # First only each job's status (one small reply per job), then the whole records of
        # the lines whose jobs have all ended.
        pipe = self.r.pipeline(transaction=False)
        for entry in entries.values():
            for job_id in entry["ids"]:
                pipe.hget(keys.job(job_id), "status")
        statuses = iter(pipe.execute())
        done = []
        for field, entry in entries.items():
            ended = [s is None or JobStatus(s).terminal for s in (next(statuses) for _ in entry["ids"])]
            if all(ended):
                done.append(field)
        settled = 0
        for field in done:
            entry = entries[field]
            pipe = self.r.pipeline(transaction=False)
            for job_id in entry["ids"]:
                pipe.hgetall(keys.job(job_id))
            jobs = dict(zip(entry["ids"], pipe.execute()))
            kind, line, tokens = self.output_line(entry, jobs, stopping)
            settled += self._settle(
                keys=[keys.batch(batch_id), keys.batch_part(batch_id, "pending"),
                      keys.batch_part(batch_id, "out"), keys.batch_part(batch_id, "err")],
                args=[field, kind, line, *tokens],
            )  # fmt: skip
        return settled

    def output_line(self, entry: dict, jobs: dict[str, dict], stopping: str | None) -> tuple[str, str, tuple[int, int]]:
        """('out' | 'err' | 'drop', the output line, (prompt tokens, completion tokens)). A
        line whose job the batch's end cancelled is dropped (cancelled) or a `batch_expired`
        error line (expired), as OpenAI writes them."""
        results, error = [], None
        for job_id in entry["ids"]:
            job = jobs.get(job_id)
            if not job:
                error = {"code": "lost", "message": f"job {job_id} is gone (its record expired)"}
                break
            if job["status"] != JobStatus.succeeded.value:
                error = json.loads(job["error"]) if job.get("error") else {
                    "code": job["status"], "message": f"job {job['status']}"}
                break
            result = self.service.celery.AsyncResult(job_id).result
            if not isinstance(result, dict):
                error = {"code": "lost", "message": f"the result of job {job_id} is gone"}
                break
            results.append(result)
        if error is not None and stopping and error.get("code") in ("cancelled", "expired"):
            if stopping == "expired":
                return "err", _expired(entry["custom_id"]), (0, 0)
            return "drop", "", (0, 0)
        if error is not None:
            status = job_error_status(error["code"])
            body = error_body(status, error["code"], error["message"])
            return "err", _output(entry["custom_id"], status, entry["ids"][0], body), (0, 0)
        body = self.completions.body(Submitted.from_entry(entry), results)
        p_tok, c_tok = body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
        return "out", _output(entry["custom_id"], 200, entry["ids"][0], body), (p_tok, c_tok)

    # -- feeding

    def window(self, key: ApiKey | None = None) -> int:
        """Lines of one batch on the queue at once: GENQ_BATCH_WINDOW, and at most half the
        queue's depth and half the key's `max_queued`, so that interactive requests (the
        key's own too) still find room beside a batch."""
        limits = [self.settings.batch_window, self.settings.max_queue_depth // 2]
        if key is not None and key.max_queued is not None:
            limits.append(key.max_queued // 2)
        return max(1, min(limits))

    def feed(self, rec: dict, lock) -> int:
        """Put the next lines on the queue, up to the window; returns how many."""
        batch_id = rec["id"]
        key = self._owner_key(rec)
        room = self.window(key) - self.r.hlen(keys.batch_part(batch_id, "pending"))
        chunk_i, offset = int(rec["chunk"]), int(rec["offset"])
        started, fed = time.monotonic(), 0
        batch_keys = [keys.batch(batch_id), keys.batch_part(batch_id, "pending"), keys.batch_part(batch_id, "err")]
        cached: tuple[int, list[str]] | None = None
        while room > 0 and int(rec["fed"]) < int(rec["total"]):
            if cached is None or cached[0] != chunk_i:
                chunk = self.r.lindex(keys.file_lines(rec["input_file_id"]), chunk_i)
                if chunk is None:
                    self._fail(rec, "file_not_found", f"input file {rec['input_file_id']} was deleted or expired mid-batch")
                    return fed
                cached = (chunk_i, _lines(chunk))
            lines = cached[1]
            if offset >= len(lines):
                if not self._advance(keys=batch_keys, args=[chunk_i, offset, chunk_i + 1, 0, "skip", "", ""]):
                    return fed
                chunk_i, offset = chunk_i + 1, 0
                continue
            text = lines[offset]
            kind, field, value, ids = "skip", "", "", []
            model = None
            if text.strip():
                line = json.loads(text)
                body = line.get("body")
                model = (body.get("model") if isinstance(body, dict) else None) or self.settings.served_model
                if self._room.get(model, 1) <= 0:
                    return fed  # its workers hold all the lines they run beside their reserve
                try:
                    kind, value, ids = self.submit_line(rec, line, key)
                except Backoff:
                    return fed
                field = f"{chunk_i}:{offset}"
            if not self._advance(keys=batch_keys, args=[chunk_i, offset, chunk_i, offset + 1, kind, field, value]):
                self.service.abandon(ids)  # the batch was taken over: its new holder feeds it
                return fed
            offset += 1
            if kind != "skip":
                rec["fed"] = int(rec["fed"]) + 1
                fed += 1
                room -= kind == "pending"
                if kind == "pending" and model in self._room:
                    self._room[model] -= 1
            if time.monotonic() - started > LOCK_S / 3:
                try:
                    lock.reacquire()
                except LockError:
                    return fed  # lost it: the cursor's guard keeps the new holder's work whole
                started = time.monotonic()
        return fed

    def submit_line(self, rec: dict, line: dict, key: ApiKey | None) -> tuple[str, str, list[str]]:
        """('pending', the pending entry, job ids) or ('error', the error line, [])."""
        custom_id = line.get("custom_id")
        if line.get("url") != rec["endpoint"]:
            body = error_body(
                400, "invalid_url",
                f"url: {line.get('url')!r}; this batch's endpoint is {rec['endpoint']}, and every line must use it",
                "url",
            )  # fmt: skip
            return "error", _output(custom_id, 400, None, body), []
        try:
            model = chat.ChatCompletionRequest if rec["endpoint"] == "/v1/chat/completions" else protocol.CompletionRequest
            jobs = model.model_validate(line.get("body")).to_jobs()
            if jobs.stream:
                raise APIError(400, "invalid_request", "stream: a batch line cannot be streamed", param="stream")
            jobs.sched = Scheduling(priority=BATCH_PRIORITY)
            sub = self.completions.submit(jobs, key, wait=False)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]["loc"]
            body = error_body(400, "invalid_request", describe(exc), ".".join(str(p) for p in first) or None)
            return "error", _output(custom_id, 400, None, body), []
        except APIError as exc:
            if exc.status in (429, 503):
                raise Backoff() from exc
            return "error", _output(custom_id, exc.status, None, exc.body()), []
        entry = {"custom_id": custom_id, **sub.entry()}
        return "pending", json.dumps(entry), sub.ids

    def _owner_key(self, rec: dict) -> ApiKey | None:
        if not rec.get("owner"):
            return None

        def limit(name: str) -> int | None:
            return int(rec[name]) if rec.get(name) else None

        return ApiKey(rec["owner"], b"", limit("key_max_queued"), limit("key_max_new_tokens"))

    # -- cancelling and the end

    def cancel_waiting(self, batch_id: str) -> None:
        """Cancel the jobs of pending lines that have not started; running ones finish."""
        error = {"code": "cancelled", "message": "the batch was cancelled"}
        for value in self.r.hvals(keys.batch_part(batch_id, "pending")):
            for job_id in json.loads(value)["ids"]:
                self.service.store.transition(
                    job_id, JobStatus.cancelled, (JobStatus.queued,), finished=repr(time.time()), error=error
                )

    def expire_unfed(self, rec: dict, lock) -> None:
        """Write the lines never fed to the error file as `batch_expired`, a chunk at a time,
        each chunk's lines and the cursor past them in one transaction."""
        key, err = keys.batch(rec["id"]), keys.batch_part(rec["id"], "err")
        chunk_i, offset = int(rec["chunk"]), int(rec["offset"])
        while True:
            chunk = self.r.lindex(keys.file_lines(rec["input_file_id"]), chunk_i)
            if chunk is None:
                return
            lines = []
            for text in _lines(chunk)[offset:]:
                if text.strip():
                    try:
                        lines.append(_expired(json.loads(text).get("custom_id")))
                    except (ValueError, AttributeError):
                        continue
            pipe = self.r.pipeline()
            if lines:
                pipe.rpush(err, *lines)
                pipe.hincrby(key, "failed", len(lines))
                pipe.hincrby(key, "fed", len(lines))
                pipe.hincrby(key, "err_bytes", sum(len(line.encode()) for line in lines))
            pipe.hset(key, mapping={"chunk": chunk_i + 1, "offset": 0})
            pipe.execute()
            chunk_i, offset = chunk_i + 1, 0
            lock.reacquire()

    def _fail(self, rec: dict, code: str, message: str) -> None:
        self.r.hset(
            keys.batch(rec["id"]),
            mapping={"errors": json.dumps({"object": "list", "data": [
                {"code": code, "message": message, "param": "input_file_id", "line": None}]}),
                "stopping": "failed"},
        )  # fmt: skip
        self.cancel_waiting(rec["id"])
        self.r.hset(keys.batch(rec["id"]), "status", "cancelling")

    def finalize(self, rec: dict, final: str) -> None:
        """Rename `out` and `err` into the output and error files; end the batch."""
        batch_id, owner, ttl = rec["id"], rec.get("owner", ""), self.settings.file_ttl
        if rec.get("stopping") == "failed":
            final = "failed"
        key = keys.batch(batch_id)
        now = _now()

        def end(pipe):
            current = pipe.hgetall(key)
            if not current or current["status"] in FINAL:
                return
            files = {}
            for part, purpose, size in (("out", "output", "out_bytes"), ("err", "error", "err_bytes")):
                if pipe.exists(keys.batch_part(batch_id, part)):
                    files[part] = (f"file-{uuid.uuid4().hex[:24]}", purpose, int(current.get(size) or 0))
            pipe.multi()
            fields: dict[str, Any] = {"status": final, f"{final}_at": now}
            for part, (file_id, purpose, size) in files.items():
                pipe.rename(keys.batch_part(batch_id, part), keys.file_lines(file_id))
                pipe.expire(keys.file_lines(file_id), ttl)
                meta = {"id": file_id, "bytes": size, "created_at": now, "filename": f"{batch_id}_{purpose}.jsonl",
                        "purpose": "batch_output", "owner": owner, "expires_at": now + ttl}  # fmt: skip
                pipe.hset(keys.file(file_id), mapping=meta)
                pipe.expire(keys.file(file_id), ttl)
                fields[f"{purpose}_file_id"] = file_id
            pipe.hset(key, mapping=fields)
            pipe.expire(key, ttl)
            pipe.delete(keys.batch_part(batch_id, "pending"))
            pipe.srem(keys.BATCHES_ACTIVE, batch_id)

        self.r.transaction(end, key, keys.batch_part(batch_id, "out"), keys.batch_part(batch_id, "err"))


def _line_problem(text: str, seen: set[str]) -> dict | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return {"code": "invalid_json_line", "message": "this line is not valid JSON", "param": None}
    try:
        line = BatchLine.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]["loc"]
        return {"code": "invalid_request", "message": describe(exc), "param": ".".join(str(p) for p in first) or None}
    if line.custom_id in seen:
        return {"code": "duplicate_custom_id", "message": f"custom_id {line.custom_id!r} is used more than once",
                "param": "custom_id"}  # fmt: skip
    seen.add(line.custom_id)
    return None


def _expired(custom_id: str | None) -> str:
    """The error line of a request the batch's completion window closed on, as OpenAI's."""
    line = {
        "id": f"batch_req_{uuid.uuid4().hex[:24]}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."},
    }
    return json.dumps(line, ensure_ascii=False) + "\n"


def _output(custom_id: str | None, status: int, request_id: str | None, body: dict) -> str:
    """One output line, as OpenAI's and vLLM's run-batch write them."""
    line = {
        "id": f"batch_req_{uuid.uuid4().hex[:24]}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id or f"req_{uuid.uuid4().hex[:24]}", "body": body},
        "error": None,
    }
    return json.dumps(line, ensure_ascii=False) + "\n"


# -- wiring ---------------------------------------------------------------------------------

EXTENSION = "genq_batches"


class Batches:
    """What the routes and the driver share, one per app (app.extensions[EXTENSION])."""

    def __init__(self, service, settings: Settings):
        self.files = FileStore(service.r, settings)
        self.store = BatchStore(service.r, settings, self.files)
        self.driver = BatchDriver(service, self.store)


def init_app(app, settings: Settings) -> None:
    from webapp.routes import batches as routes

    app.extensions[EXTENSION] = Batches(app.extensions["genq"], settings)
    app.register_blueprint(routes.bp)


def start_driver(app) -> None:
    """Start the app's batch driver (gunicorn's post_worker_init: once per API process)."""
    app.extensions[EXTENSION].driver.start()
