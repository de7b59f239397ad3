"""One thread per worker process that looks for cancelled and superseded jobs.

A job this process runs ends early when its record says `cancelled` (a client cancelled it or
hung up), when the record is gone, or when its attempt number is no longer this process's (the
job was given up for dead while this process hung, and runs elsewhere now). Every `interval`,
`CancelWatch` reads the status and attempt of every job it watches in one Redis round trip and
tells the engine to drop those. Each task thread used to look for its own job twice a second:
64 waiting threads woke 128 times a second, each taking the GIL from the engine's thread, which
cost the hf engine a few per cent of its requests/s at 64 clients (docs/benchmarks.md, "One
look for cancellations"). Each look reads one counter (`keys.CANCELS`), which a cancel and a
job's second or later start add to, and reads a record only where the counter moved since the
job's own last look (or since before it started), or every `full_every`: a record that is
gone says nothing (docs/benchmarks.md, "Redis commands per job").
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from tasks import keys
from tasks.jobs import JobStore
from tasks.schemas import JobStatus
from worker.engines import Engine

log = logging.getLogger(__name__)


class CancelWatch:
    def __init__(self, store: JobStore, engine: Engine, interval: float, full_every: float = 30.0):
        self.store, self.engine, self.interval, self.full_every = store, engine, interval, full_every
        # job id -> [the attempt number this process runs, the counter at its last look]
        self._jobs: dict[str, list] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.seen: str | None = None  # the counter at the last look (None: not read yet)
        self._full_at = time.monotonic()
        self.reads = 0  # records read, in all (tests/test_cancels.py)

    def mark(self) -> str | None:
        """What the counter was at the last look: taken before a job's start, and handed to
        `watch` with it, so that a cancel between the start and the watch is not missed."""
        return self.seen

    def watch(self, job_id: str, attempt: int, since: str | None = None) -> None:
        with self._lock:
            self._jobs[job_id] = [attempt, since]

    def unwatch(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def look(self) -> list[str]:
        """One look at every watched job; the engine drops those that are cancelled, gone or
        superseded, and they are watched no more. Returns their ids."""
        with self._lock:
            if not self._jobs:
                return []
        counter = self.store.r.get(keys.CANCELS)
        counter = counter.decode() if isinstance(counter, bytes) else (counter or "0")
        full = time.monotonic() - self._full_at >= self.full_every
        with self._lock:
            jobs = [(job_id, w[0]) for job_id, w in self._jobs.items() if full or w[1] != counter]
        if full:
            self._full_at = time.monotonic()
        self.seen = counter
        if not jobs:
            return []
        pipe = self.store.r.pipeline(transaction=False)
        for job_id, _ in jobs:
            pipe.hmget(keys.job(job_id), "status", "attempts")
        self.reads += len(jobs)
        dropped = []
        for (job_id, attempt), (status, attempts) in zip(jobs, pipe.execute()):
            ended = status is None or status == JobStatus.cancelled.value  # cancelled, or gone
            superseded = not ended and int(attempts or 0) != attempt
            if not (ended or superseded):
                continue
            if superseded:
                log.warning("job %s attempt %d superseded; dropping it", job_id, attempt)
            self.engine.cancel(job_id)
            dropped.append(job_id)
        with self._lock:
            for job_id, _ in jobs:
                if job_id in dropped:
                    self._jobs.pop(job_id, None)
                elif job_id in self._jobs:
                    self._jobs[job_id][1] = counter
        return dropped

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="genq-cancel-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self.look()
            except redis.RedisError:
                pass  # Redis is away; the jobs go on, the next look may work
            except Exception:  # never let the watch die: jobs would no longer be cancelled
                log.exception("looking for cancelled jobs failed")
