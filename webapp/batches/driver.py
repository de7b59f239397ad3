"""The batch driver: a thread (a greenlet under gunicorn's gevent workers) in every API process
that each tick takes, per active batch, an expiring Redis lock and moves the batch on: validates
its input, collects the lines whose jobs ended into output or error lines, feeds the next lines
as ordinary jobs through the completions service (webapp/completions.py; embeddings lines:
webapp/embeddings.py) at the least urgent priority, within a window and the fleet's room, and
ends it (completed, cancelled, expired, failed); with GENQ_FILES_DIR it flushes the batch's
output lines to disk as they come and sweeps the files no one owns. Nothing lives in the
process: another one takes the lock and goes on (docs/design.md, "Batches")."""

from __future__ import annotations

import json
import logging
import math
import threading
import time

from pydantic import ValidationError

from tasks.schemas import PRIORITY_MAX, JobStatus
from webapp import embeddings
from webapp.auth import ApiKey
from webapp.batches.files import chunk_lines, now
from webapp.batches.ondisk import Spill
from webapp.batches.output import expired_line, output_line, response_line
from webapp.batches.store import FINAL, BatchStore, LockError
from webapp.batches.validation import check_input
from webapp.completions import CompletionService
from webapp.errors import BROKER_ERRORS, APIError, describe, error_body
from webapp.protocol.chat import ChatCompletionRequest
from webapp.protocol.completions import CompletionRequest
from webapp.protocol.embeddings import EmbeddingRequest
from webapp.protocol.jobs import Scheduling

log = logging.getLogger(__name__)

TICK_S = 0.2
# While lines move, the next tick comes sooner; while no batch is active, later (a batch this
# process creates wakes its driver at once: `wake`; another process's is seen within this).
BUSY_TICK_S = 0.05
IDLE_TICK_S = 1.0
LOCK_S = 5
# With GENQ_FILES_DIR: how often a process lists the directory for files no one owns.
SWEEP_S = 60
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
        self.settings = store.settings
        self.files = store.files
        self.stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = 0.0
        # Per model, the batch lines its workers may still take this tick (a model not in it:
        # no limit but each batch's window).
        self._room: dict[str, int] = {}
        self.idle = False  # no batch was active at the last tick
        self._wake = threading.Event()
        self._swept = time.monotonic()

    # -- the loop

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self.run, name="genq-batches", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self._wake.set()

    def wake(self) -> None:
        """A batch was created here: the next tick comes now."""
        self._wake.set()

    def run(self) -> None:
        pause = TICK_S
        while True:
            self._wake.wait(pause)
            self._wake.clear()
            if self.stopped.is_set():
                return
            pause = TICK_S
            try:
                busy = self.tick()
                pause = BUSY_TICK_S if busy else IDLE_TICK_S if self.idle else TICK_S
                if self.settings.files_dir and time.monotonic() - self._swept > SWEEP_S:
                    self._swept = time.monotonic()
                    self.files.sweep()
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
        active = self.store.active()
        self.idle = not active
        self._room = self.fleet_room(active)
        for batch_id in active:
            lock = self.store.lock(batch_id, LOCK_S)
            if not lock.acquire():
                continue
            try:
                moved |= bool(self.step(batch_id, lock))
            except LockError:
                pass  # held too long and lost: whoever holds it now goes on
            except OSError as exc:  # its files on disk (GENQ_FILES_DIR): the other batches go on
                log.error("batch %s: %s", batch_id, exc)
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
        for: the others have no limit but each batch's window. No batch, no look at the
        workers: an idle API's every tick read them (a Lua call of 5 commands, 5 times a second
        per API process, docs/benchmarks.md "Redis commands per job")."""
        if not active:
            return {}
        workers = self.service.registry.live()
        room: dict[str, int] = {}
        for model in {w.model for w in workers if w.reserved}:
            room[model] = sum(w.capacity + w.reserved // 2 for w in workers if w.model == model)
        if not room:
            return room
        for entry in self.store.pending_of(active):
            if entry.get("model") in room:
                room[entry["model"]] -= 1
        return room

    def step(self, batch_id: str, lock) -> bool:
        rec = self.store.record(batch_id)
        if not rec or rec["status"] in FINAL:
            self.store.deactivate(batch_id)
            return
        if rec["status"] == "validating":
            self.validate(rec, lock)
            return
        if rec["status"] == "in_progress" and time.time() >= float(rec["expires_at"]) and not rec.get("stopping"):
            self.store.stop(batch_id, "expired")
            rec["stopping"] = "expired"
        # Why the batch stops early, if it does: cancelled, expired or failed (its input gone).
        stopping = rec.get("stopping") or ("cancelled" if rec["status"] == "cancelling" else None)
        if stopping:
            self.cancel_waiting(batch_id)
        spill = self.store.spill(rec)
        moved = self.collect(batch_id, stopping, spill)
        if not stopping:
            moved += self.feed(rec, lock, spill)
        rec = self.store.record(batch_id)
        if self.store.pending_count(batch_id):
            return moved > 0
        if rec.get("stopping") == "expired":
            self.expire_unfed(rec, lock, spill)
            self.finalize(rec, "expired")
        elif rec["status"] == "cancelling":
            self.finalize(rec, "cancelled")
        elif int(rec["fed"]) >= int(rec["total"]):
            self.store.update(batch_id, status="finalizing", finalizing_at=now())
            self.finalize(rec, "completed")

    # -- validating

    def validate(self, rec: dict, lock) -> None:
        """Check every line's shape: validating -> in_progress, or failed with the errors."""
        errors, total = check_input(self.files, rec["input_file_id"], lock, LOCK_S / 3)
        if errors:
            self.store.fail_validation(rec["id"], errors, total)
        else:
            self.store.start(rec["id"], total)

    # -- collecting

    def collect(self, batch_id: str, stopping: str | None, spill: Spill) -> int:
        """Settle the pending lines whose jobs all ended; returns how many. A settled line's
        jobs then expire after GENQ_BATCH_JOB_TTL (`job_ttl`), not GENQ_RESULT_TTL: a batch of
        any size leaves no more of its lines in Redis than its last few minutes' worth."""
        entries = self.store.pending(batch_id)
        if not entries:
            return 0
        # First only each job's status (one small reply per job), then the whole records of
        # the lines whose jobs have all ended.
        statuses = iter(self.store.job_statuses([job_id for entry in entries.values() for job_id in entry["ids"]]))
        done = []
        for field, entry in entries.items():
            ended = [s is None or JobStatus(s).terminal for s in (next(statuses) for _ in entry["ids"])]
            if all(ended):
                done.append(field)
        settled = 0
        released: dict[str, int] = {}  # the jobs of the lines settled: job id -> their keys' seconds
        try:
            for field in done:
                entry = entries[field]
                jobs = self.store.job_records(entry["ids"])
                kind, line, tokens = output_line(entry, jobs, stopping, self.job_result, self.completions)
                if self.store.settle(batch_id, field, kind, line, tokens):
                    settled += 1
                    released.update((job_id, self.job_ttl(jobs.get(job_id))) for job_id in entry["ids"])
                    if kind != "drop":
                        spill.added(kind)
        finally:
            if released:
                self.store.release_jobs(released, self.result_key)
        return settled

    def job_ttl(self, job: dict | None) -> int:
        """How long a settled line's job is kept from now (GENQ_BATCH_JOB_TTL): its line holds
        what anyone needs of it. A job with a callback_url keeps its record while its callback
        may still be retried (GENQ_CALLBACK_DEADLINE)."""
        ttl = self.settings.batch_job_ttl
        if job and job.get("callback_url"):
            ttl = max(ttl, math.ceil(self.settings.callback_deadline))
        return ttl

    def job_result(self, job_id: str):
        """A job's result from the result backend (None where it is gone)."""
        return self.service.celery.AsyncResult(job_id).result

    def result_key(self, job_id: str) -> str | bytes:
        """Where the result backend keeps a job's result that is not in its done stream (a
        failure's: tasks/backend.py)."""
        return self.service.celery.backend.get_key_for_task(job_id)

    # -- feeding

    def window(self, key: ApiKey | None = None) -> int:
        """Lines of one batch on the queue at once: GENQ_BATCH_WINDOW, and at most half the
        queue's depth and half the key's `max_queued`, so that interactive requests (the
        key's own too) still find room beside a batch."""
        limits = [self.settings.batch_window, self.settings.max_queue_depth // 2]
        if key is not None and key.max_queued is not None:
            limits.append(key.max_queued // 2)
        return max(1, min(limits))

    def feed(self, rec: dict, lock, spill: Spill) -> int:
        """Put the next lines on the queue, up to the window; returns how many."""
        batch_id = rec["id"]
        key = self._owner_key(rec)
        room = self.window(key) - self.store.pending_count(batch_id)
        chunk_i, offset = int(rec["chunk"]), int(rec["offset"])
        started, fed = time.monotonic(), 0
        cached: tuple[int, list[str]] | None = None
        while room > 0 and int(rec["fed"]) < int(rec["total"]):
            if cached is None or cached[0] != chunk_i:
                chunk = self.files.chunk(rec["input_file_id"], chunk_i)
                if chunk is None:
                    self._fail(
                        rec, "file_not_found", f"input file {rec['input_file_id']} was deleted or expired mid-batch"
                    )
                    return fed
                cached = (chunk_i, chunk_lines(chunk))
            lines = cached[1]
            if offset >= len(lines):
                if not self.store.advance(batch_id, (chunk_i, offset), (chunk_i + 1, 0)):
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
            if not self.store.advance(batch_id, (chunk_i, offset), (chunk_i, offset + 1), kind, field, value):
                self.service.abandon(ids)  # the batch was taken over: its new holder feeds it
                return fed
            offset += 1
            if kind == "error":
                spill.added("err")
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
            if rec["endpoint"] == "/v1/embeddings":
                req = EmbeddingRequest.model_validate(line.get("body"))
                entry = {"custom_id": custom_id, **embeddings.submit(req, key, self.completions, False, BATCH_PRIORITY)}
                return "pending", json.dumps(entry), entry["ids"]
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

        weight = limit("key_weight") or 1
        return ApiKey(rec["owner"], b"", limit("key_max_queued"), limit("key_max_new_tokens"), weight=weight)

    # -- cancelling and the end

    def cancel_waiting(self, batch_id: str) -> None:
        """Cancel the jobs of pending lines that have not started; running ones finish."""
        error = {"code": "cancelled", "message": "the batch was cancelled"}
        for entry in self.store.pending(batch_id).values():
            for job_id in entry["ids"]:
                self.service.store.transition(
                    job_id, JobStatus.cancelled, (JobStatus.queued,), finished=repr(time.time()), error=error
                )

    def expire_unfed(self, rec: dict, lock, spill: Spill) -> None:
        """Write the lines never fed to the error file as `batch_expired`, a chunk at a time,
        each chunk's lines and the cursor past them in one transaction."""
        chunk_i, offset = int(rec["chunk"]), int(rec["offset"])
        while True:
            chunk = self.files.chunk(rec["input_file_id"], chunk_i)
            if chunk is None:
                return
            lines = []
            for text in chunk_lines(chunk)[offset:]:
                if text.strip():
                    try:
                        lines.append(expired_line(json.loads(text).get("custom_id")))
                    except (ValueError, AttributeError):
                        continue
            self.store.write_expired(rec["id"], lines, chunk_i + 1)
            spill.added("err", len(lines))
            chunk_i, offset = chunk_i + 1, 0
            lock.reacquire()

    def _fail(self, rec: dict, code: str, message: str) -> None:
        error = {"code": code, "message": message, "param": "input_file_id", "line": None}
        self.store.stop(rec["id"], "failed", [error])
        self.cancel_waiting(rec["id"])
        self.store.update(rec["id"], status="cancelling")

    def finalize(self, rec: dict, final: str) -> None:
        """Rename `out` and `err` into the output and error files; end the batch."""
        self.store.finalize(rec["id"], "failed" if rec.get("stopping") == "failed" else final, rec.get("owner", ""))
