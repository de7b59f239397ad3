"""An engine without a model: it answers at once, so a benchmark through it measures the
API, Redis and Celery path alone."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from tasks.config import Settings
from tasks.schemas import GenerationResult, JobSpec
from worker.engines.base import Engine


class EchoEngine(Engine):
    name = "echo"

    def __init__(self, settings: Settings):
        self.model = settings.served_model
        self.capacity = settings.max_batch_size
        self._lock = threading.Lock()
        self._in_flight = 0

    def submit(self, spec: JobSpec) -> Future[GenerationResult]:
        with self._lock:
            self._in_flight += 1
            batch = self._in_flight
        words = spec.prompt.split()
        n = spec.params.max_new_tokens or 1
        completion = words[-n:]
        fut: Future[GenerationResult] = Future()
        fut.set_result(
            GenerationResult(
                text="".join(" " + w for w in completion),
                finish_reason="length",
                prompt_tokens=len(words),
                completion_tokens=len(completion),
                batch_size=batch,
                model=self.model,
            )
        )
        with self._lock:
            self._in_flight -= 1
        return fut
