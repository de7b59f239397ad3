"""The batch driver: a thread (a greenlet under gunicorn's gevent workers) in every API process
that each tick takes, per active batch, an expiring Redis lock and moves the batch on: validates
its input, collects the lines whose jobs ended into output or error lines, feeds the next lines
as ordinary jobs through the completions service (webapp/completions.py) at the least urgent
priority, within a window and the fleet's room, and ends it (completed, cancelled, expired,
failed). Nothing lives in the process: another one takes the lock and goes on (docs/design.md,
"Batches")."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from pydantic import ValidationError
from redis.exceptions import LockError

from tasks import keys
from tasks.schemas import PRIORITY_MAX, JobStatus
from webapp.auth import ApiKey
from webapp.batches.files import chunk_lines, now
from webapp.batches.files import new_id as new_file_id
from webapp.batches.output import expired_line, response_line
from webapp.batches.store import FINAL, BatchStore
from webapp.completions import CompletionService, Submitted
from webapp.errors import BROKER_ERRORS, APIError, describe, error_body, job_error_status
from webapp.protocol.batches import BatchLine
from webapp.protocol.chat import ChatCompletionRequest
from webapp.protocol.completions import CompletionRequest
from webapp.protocol.jobs import Scheduling

log = logging.getLogger(__name__)

TICK_S = 0.2
# While lines move, the next tick comes sooner.
BUSY_TICK_S = 0.05
LOCK_S = 5
# The most validation errors a failed batch lists.
MAX_ERRORS = 100
# Batch lines wait behind every interactive job (0 by default): vLLM's order, lower first.
BATCH_PRIORITY = PRIORITY_MAX


class Backoff(Exception):
    """The queue is full (or the owner's quota, or Redis): feed no more this tick."""


class BatchDriver:
    """Moves every active batch on, a step per tick, from every API process (docs/design.md, "Batches")."""

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
            self.r.hset(keys.batch(batch_id), mapping={"status": "finalizing", "finalizing_at": now()})
            self.finalize(rec, "completed")

    # -- validating

    def validate(self, rec: dict, lock) -> None:
        """Check every line's shape (custom_id, method, url, body; custom_ids distinct)."""
        batch_id, errors, seen, total, n = rec["id"], [], set(), 0, 0
        if not self.r.exists(keys.file(rec["input_file_id"])):
            errors.append(
                {
                    "code": "file_not_found",
                    "message": f"input file {rec['input_file_id']} is gone",
                    "param": "input_file_id",
                    "line": None,
                }
            )
        else:
            started = time.monotonic()
            for chunk in self.files.chunks(rec["input_file_id"]):
                for text in chunk_lines(chunk):
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
                errors.append(
                    {
                        "code": "empty_file",
                        "message": "the input file holds no request",
                        "param": "input_file_id",
                        "line": None,
                    }
                )
        key = keys.batch(batch_id)
        if errors:
            at = now()
            data = {"object": "list", "data": errors[:MAX_ERRORS]}
            pipe = self.r.pipeline()
            pipe.hset(key, mapping={"status": "failed", "failed_at": at, "errors": json.dumps(data), "total": total})
            pipe.expire(key, self.settings.file_ttl)
            pipe.srem(keys.BATCHES_ACTIVE, batch_id)
            pipe.execute()
            return

        def start(pipe):
            if pipe.hget(key, "status") != "validating":
                return  # cancelled meanwhile: the next step ends it
            pipe.multi()
            pipe.hset(key, mapping={"status": "in_progress", "in_progress_at": now(), "total": total})

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
                keys=[
                    keys.batch(batch_id),
                    keys.batch_part(batch_id, "pending"),
                    keys.batch_part(batch_id, "out"),
                    keys.batch_part(batch_id, "err"),
                ],
                args=[field, kind, line, *tokens],
            )
        return settled

    def output_line(
        self, entry: dict, jobs: dict[str, dict], stopping: str | None
    ) -> tuple[str, str, tuple[int, int, int]]:
        """('out' | 'err' | 'drop', the output line, (prompt, completion, cached tokens)). A
        line whose job the batch's end cancelled is dropped (cancelled) or a `batch_expired`
        error line (expired), as OpenAI writes them."""
        results, error = [], None
        for job_id in entry["ids"]:
            job = jobs.get(job_id)
            if not job:
                error = {"code": "lost", "message": f"job {job_id} is gone (its record expired)"}
                break
            if job["status"] != JobStatus.succeeded.value:
                if job.get("error"):
                    error = json.loads(job["error"])
                else:
                    error = {"code": job["status"], "message": f"job {job['status']}"}
                break
            result = self.service.celery.AsyncResult(job_id).result
            if not isinstance(result, dict):
                error = {"code": "lost", "message": f"the result of job {job_id} is gone"}
                break
            results.append(result)
        if error is not None and stopping and error.get("code") in ("cancelled", "expired"):
            if stopping == "expired":
                return "err", expired_line(entry["custom_id"]), (0, 0, 0)
            return "drop", "", (0, 0, 0)
        if error is not None:
            status = job_error_status(error["code"])
            body = error_body(status, error["code"], error["message"])
            return "err", response_line(entry["custom_id"], status, entry["ids"][0], body), (0, 0, 0)
        body = self.completions.body(Submitted.from_entry(entry), results)
        usage = body["usage"]
        tokens = (usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
        return "out", response_line(entry["custom_id"], 200, entry["ids"][0], body), tokens

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
                    self._fail(
                        rec, "file_not_found", f"input file {rec['input_file_id']} was deleted or expired mid-batch"
                    )
                    return fed
                cached = (chunk_i, chunk_lines(chunk))
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
                400,
                "invalid_url",
                f"url: {line.get('url')!r}; this batch's endpoint is {rec['endpoint']}, and every line must use it",
                "url",
            )
            return "error", response_line(custom_id, 400, None, body), []
        try:
            chat = rec["endpoint"] == "/v1/chat/completions"
            model = ChatCompletionRequest if chat else CompletionRequest
            jobs = model.model_validate(line.get("body")).to_jobs()
            if jobs.stream:
                raise APIError(400, "invalid_request", "stream: a batch line cannot be streamed", param="stream")
            jobs.sched = Scheduling(priority=BATCH_PRIORITY)
            sub = self.completions.submit(jobs, key, wait=False)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]["loc"]
            body = error_body(400, "invalid_request", describe(exc), ".".join(str(p) for p in first) or None)
            return "error", response_line(custom_id, 400, None, body), []
        except APIError as exc:
            if exc.status in (429, 503):
                raise Backoff() from exc
            return "error", response_line(custom_id, exc.status, None, exc.body()), []
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
            for text in chunk_lines(chunk)[offset:]:
                if text.strip():
                    try:
                        lines.append(expired_line(json.loads(text).get("custom_id")))
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
        error = {"code": code, "message": message, "param": "input_file_id", "line": None}
        self.r.hset(
            keys.batch(rec["id"]),
            mapping={"errors": json.dumps({"object": "list", "data": [error]}), "stopping": "failed"},
        )
        self.cancel_waiting(rec["id"])
        self.r.hset(keys.batch(rec["id"]), "status", "cancelling")

    def finalize(self, rec: dict, final: str) -> None:
        """Rename `out` and `err` into the output and error files; end the batch."""
        batch_id, owner, ttl = rec["id"], rec.get("owner", ""), self.settings.file_ttl
        if rec.get("stopping") == "failed":
            final = "failed"
        key = keys.batch(batch_id)
        at = now()

        def end(pipe):
            current = pipe.hgetall(key)
            if not current or current["status"] in FINAL:
                return
            files = {}
            for part, purpose, size in (("out", "output", "out_bytes"), ("err", "error", "err_bytes")):
                if pipe.exists(keys.batch_part(batch_id, part)):
                    files[part] = (new_file_id(), purpose, int(current.get(size) or 0))
            pipe.multi()
            fields: dict[str, Any] = {"status": final, f"{final}_at": at}
            for part, (file_id, purpose, size) in files.items():
                pipe.rename(keys.batch_part(batch_id, part), keys.file_lines(file_id))
                pipe.expire(keys.file_lines(file_id), ttl)
                meta = {
                    "id": file_id,
                    "bytes": size,
                    "created_at": at,
                    "filename": f"{batch_id}_{purpose}.jsonl",
                    "purpose": "batch_output",
                    "owner": owner,
                    "expires_at": at + ttl,
                }
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
        return {
            "code": "duplicate_custom_id",
            "message": f"custom_id {line.custom_id!r} is used more than once",
            "param": "custom_id",
        }
    seen.add(line.custom_id)
    return None
