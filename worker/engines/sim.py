"""An engine that models a GPU without one: continuous batching of up to GENQ_MAX_BATCH_SIZE
jobs, where each decode step adds one token to every running job and takes
`GENQ_SIM_STEP_MS = a + b x batch` milliseconds of sleep, not CPU. Many such workers on one
machine behave, to the queue and the control plane, like GPU workers on other hosts: a
benchmark through them (bench/scaling.py) measures the API, Redis and Celery at scale.

Its tokens are deterministic: the prompt's words in turn (" w1", " w2", ..., then from the
first again), `max_new_tokens` of them, EOS never comes; streamed like the other engines'."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from tasks.config import Settings
from tasks.schemas import GenerationResult, JobSpec
from tasks.streams import TokenEvent
from worker.engines.base import Engine, GenerationError, JobCancelled, Resolved, Sink


def step_ms(spec: str) -> tuple[float, float]:
    """ "a+b" (or "a") -> (a, b): a decode step at batch n takes a + b x n ms."""
    a, _, b = spec.replace(" ", "").partition("+")
    return float(a), float(b or 0)


def sim_tokens(prompt: str, n: int) -> list[str]:
    """The `n` tokens the sim engine generates for `prompt`."""
    words = prompt.split() or ["sim"]
    return [" " + words[i % len(words)] for i in range(n)]


class _Job:
    __slots__ = ("spec", "future", "tokens", "done", "deadline", "why", "batch_peak", "prompt_tokens")

    def __init__(self, spec: JobSpec, n: int, deadline: float, why: str):
        self.spec, self.future = spec, Future()
        self.tokens = sim_tokens(spec.prompt, n)
        self.prompt_tokens = len(spec.prompt.split())
        self.done, self.deadline, self.why, self.batch_peak = 0, deadline, why, 0


class SimEngine(Engine):
    name = "sim"

    def __init__(self, settings: Settings, sink: Sink | None = None):
        self.configure(settings, sink)
        self.a_s, self.b_s = (x / 1000 for x in step_ms(settings.sim_step_ms))
        self._inbox: queue.Queue[_Job] = queue.Queue()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._jobs: list[_Job] = []
        self._thread = threading.Thread(target=self._run, name="genq-sim", daemon=True)
        self._thread.start()

    def submit(self, spec: JobSpec) -> Future[GenerationResult]:
        if self._closed.is_set():
            raise GenerationError("engine_closed", "the engine is shutting down")
        left, why = self.time_limit(spec)
        if left <= 0:
            raise GenerationError("timeout", why)
        job = _Job(spec, spec.params.max_new_tokens or self.default_max_new, time.monotonic() + left, why)
        self._inbox.put(job)
        return job.future

    def cancel(self, job_id: str) -> None:
        with self._lock:
            self._cancelled.add(job_id)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=30)

    # -- the scheduler thread --------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed.is_set():
            self._take()
            self._reap()
            if not self._jobs:
                continue
            batch = len(self._jobs)
            if self._closed.wait(self.a_s + self.b_s * batch):  # the modelled GPU step
                break
            events: list[tuple[str, TokenEvent]] = []
            resolved: list[Resolved] = []
            for job in self._jobs:
                job.batch_peak = max(job.batch_peak, batch)
                if job.spec.stream:
                    events.append((job.spec.id, TokenEvent(job.done, job.tokens[job.done])))
                job.done += 1
                if job.done == len(job.tokens):
                    result = self._result(job, "length")
                    if job.spec.stream:
                        usage = {
                            "prompt_tokens": result.prompt_tokens,
                            "completion_tokens": result.completion_tokens,
                            "cached_tokens": 0,
                        }
                        events.append((job.spec.id, TokenEvent(job.done, "", finish="length", usage=usage)))
                    resolved.append((job.future, result))
            self._jobs = [j for j in self._jobs if j.done < len(j.tokens)]
            self.sink.emit(events, resolved)
        for job in self._jobs:
            job.future.set_exception(GenerationError("engine_closed", "the worker stopped"))
        while True:
            try:
                self._inbox.get_nowait().future.set_exception(GenerationError("engine_closed", "the worker stopped"))
            except queue.Empty:
                return

    def _take(self) -> None:
        """Admit the jobs that arrived, up to capacity; block briefly only while idle."""
        if not self._jobs:
            try:
                self._jobs.append(self._inbox.get(timeout=0.5))
            except queue.Empty:
                return
        while len(self._jobs) < self.capacity:
            try:
                self._jobs.append(self._inbox.get_nowait())
            except queue.Empty:
                break

    def _reap(self) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        now, keep = time.monotonic(), []
        for job in self._jobs:
            if job.spec.id in cancelled:
                job.future.set_exception(JobCancelled(job.spec.id))
            elif now > job.deadline:
                job.future.set_exception(GenerationError("timeout", job.why, self._result(job, "timeout")))
            else:
                keep.append(job)
        self._jobs = keep

    def _result(self, job: _Job, reason: str) -> GenerationResult:
        return GenerationResult(
            text="".join(job.tokens[: job.done]),
            finish_reason=reason,
            prompt_tokens=job.prompt_tokens,
            completion_tokens=job.done,
            batch_size=max(job.batch_peak, 1),
            model=self.model,
        )
