"""An engine without a model: it answers at once, so a benchmark through it measures the
API, Redis and Celery path alone. Its "tokens" are the prompt's last words."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from tasks.config import Settings
from tasks.schemas import GenerationResult, JobSpec
from tasks.streams import TokenEvent
from worker.engines.base import DirectSink, Engine, Sink


class EchoEngine(Engine):
    name = "echo"

    def __init__(self, settings: Settings, sink: Sink | None = None):
        self.sink = sink or DirectSink()
        self.model = settings.served_model
        self.capacity = settings.max_batch_size
        self.default_max_new = settings.default_max_new_tokens
        self._lock = threading.Lock()
        self._in_flight = 0

    def submit(self, spec: JobSpec) -> Future[GenerationResult]:
        with self._lock:
            self._in_flight += 1
            batch = self._in_flight
        words = spec.prompt.split()
        n = spec.params.max_new_tokens or self.default_max_new
        tokens = [" " + w for w in words[-n:]]
        result = GenerationResult(
            text="".join(tokens),
            finish_reason="length",
            prompt_tokens=len(words),
            completion_tokens=len(tokens),
            batch_size=batch,
            model=self.model,
        )
        usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens}
        events = []
        if spec.stream:
            events = [(spec.id, TokenEvent(i, t)) for i, t in enumerate(tokens)]
            events.append((spec.id, TokenEvent(len(tokens), "", finish="length", usage=usage)))
        future: Future[GenerationResult] = Future()
        self.sink.emit(events, [(future, result)])
        with self._lock:
            self._in_flight -= 1
        return future
