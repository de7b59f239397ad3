"""An engine without a model: it answers at once, so a benchmark through it measures the
API, Redis and Celery path alone. Its "tokens" are the prompt's last words.

It takes every sampling parameter and ignores those that only shape a model's choices
(temperature, penalties, min_tokens, stop strings and token ids). With `logprobs` it reports
each word as certain (log-probability 0, its only alternative), so clients that ask for them
find them where a model's engine puts them."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from itertools import accumulate

from tasks.config import Settings
from tasks.schemas import GenerationResult, JobSpec, Logprobs
from tasks.streams import TokenEvent
from worker.engines.base import DirectSink, Engine, GenerationError, Sink


class EchoEngine(Engine):
    name = "echo"

    def __init__(self, settings: Settings, sink: Sink | None = None):
        self.sink = sink or DirectSink()
        self.model = settings.served_model
        self.capacity = settings.max_batch_size
        self.default_max_new = settings.default_max_new_tokens
        self.job_timeout = settings.job_timeout
        self._lock = threading.Lock()
        self._in_flight = 0

    def submit(self, spec: JobSpec) -> Future[GenerationResult]:
        left, why = self.time_limit(spec)
        if left <= 0:
            raise GenerationError("timeout", why)
        with self._lock:
            self._in_flight += 1
            batch = self._in_flight
        words = spec.prompt.split()
        n = spec.params.max_new_tokens or self.default_max_new
        tokens = [" " + w for w in words[-n:]]
        certain = spec.params.logprobs is not None
        offsets = list(accumulate(map(len, tokens), initial=0))[: len(tokens)] if certain else []

        def logprobs(i: slice) -> Logprobs | None:
            if not certain:
                return None
            picked = tokens[i]
            return Logprobs(
                tokens=picked,
                token_logprobs=[0.0] * len(picked),
                top_logprobs=[{t: 0.0} for t in picked],
                text_offset=offsets[i],
            )

        result = GenerationResult(
            text="".join(tokens),
            finish_reason="length",
            prompt_tokens=len(words),
            completion_tokens=len(tokens),
            batch_size=batch,
            model=self.model,
            logprobs=logprobs(slice(None)),
        )
        usage = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "cached_tokens": 0,
        }
        events = []
        if spec.stream:
            for i, t in enumerate(tokens):
                lp = logprobs(slice(i, i + 1))
                events.append((spec.id, TokenEvent(i, t, logprobs=lp and lp.model_dump())))
            events.append((spec.id, TokenEvent(len(tokens), "", finish="length", usage=usage)))
        future: Future[GenerationResult] = Future()
        self.sink.emit(events, [(future, result)])
        with self._lock:
            self._in_flight -= 1
        return future
