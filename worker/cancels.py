"""One thread per worker process that looks for cancelled and superseded jobs.

A job this process runs ends early when its record says `cancelled` (a client cancelled it or
hung up), when the record is gone, or when its attempt number is no longer this process's (the
job was given up for dead while this process hung, and runs elsewhere now). Every `interval`,
`CancelWatch` reads the status and attempt of every job it watches in one Redis round trip and
tells the engine to drop those. Each task thread used to look for its own job twice a second:
64 waiting threads woke 128 times a second, each taking the GIL from the engine's thread, which
cost the hf engine a few per cent of its requests/s at 64 clients (docs/benchmarks.md, "One
look for cancellations").
"""

from __future__ import annotations

import logging
import threading

import redis

from tasks import keys
from tasks.jobs import JobStore
from tasks.schemas import JobStatus
from worker.engines import Engine

log = logging.getLogger(__name__)


class CancelWatch:
    def __init__(self, store: JobStore, engine: Engine, interval: float):
        self.store, self.engine, self.interval = store, engine, interval
        self._jobs: dict[str, int] = {}  # job id -> the attempt number this process runs
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, job_id: str, attempt: int) -> None:
        with self._lock:
            self._jobs[job_id] = attempt

    def unwatch(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def look(self) -> list[str]:
        """One look at every watched job; the engine drops those that are cancelled, gone or
        superseded, and they are watched no more. Returns their ids."""
        with self._lock:
            jobs = list(self._jobs.items())
        if not jobs:
            return []
        pipe = self.store.r.pipeline(transaction=False)
        for job_id, _ in jobs:
            pipe.hmget(keys.job(job_id), "status", "attempts")
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
        if dropped:
            with self._lock:
                for job_id in dropped:
                    self._jobs.pop(job_id, None)
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
