"""The small interface every engine offers to the Celery task threads, and the sink through
which engines hand out token events and finished results."""

from __future__ import annotations

import abc
import time
from concurrent.futures import Future
from typing import Protocol

from tasks.errors import JobError
from tasks.schemas import GenerationResult, JobSpec
from tasks.streams import TokenEvent


class GenerationError(Exception):
    """A job that cannot be served; `code` reaches the client in the job's error, with
    `param`, the request field it concerns (None: none in particular), and `partial` (a job
    that ran out of time: what it had generated) in its result. The Celery task hands it on as
    tasks/errors.py's JobFailed."""

    def __init__(self, code: str, message: str, partial: GenerationResult | None = None, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.partial = partial
        self.param = param

    @property
    def error(self) -> JobError:
        return JobError(self.code, self.message, self.param)


class InvalidField(ValueError):
    """A request field this engine cannot serve; its text is "field: why", as the client
    reads it (the engine fails the job with invalid_request naming `field`)."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field


class JobCancelled(Exception):
    """The job was cancelled while the engine held it."""


Resolved = tuple[Future, GenerationResult]


class Sink(Protocol):
    def emit(self, events: list[tuple[str, TokenEvent]], resolved: list[Resolved]) -> None:
        """Deliver one step's token events, then resolve the futures of the jobs that
        finished in it (their finish events are among `events`)."""


class DirectSink:
    """No stream: futures resolve at once and token events are dropped."""

    def emit(self, events: list[tuple[str, TokenEvent]], resolved: list[Resolved]) -> None:
        for future, result in resolved:
            future.set_result(result)


class Engine(abc.ABC):
    name: str
    capacity: int
    # Jobs taken beyond `capacity` (the hf engine's GENQ_RESERVED_SLOTS): the worker runs
    # capacity + reserved Celery threads, and the batch driver keeps batch lines out of
    # (half of) the extra ones, so that a foreground job can reach an engine whose rows batch
    # lines fill (the hf engine then preempts one).
    reserved: int = 0
    model: str
    max_model_len: int | None = None
    device: str = "cpu"  # where the model runs (vLLM's engine: as it chose)
    # Whether a prompt's prefix outlives its job here (a prefix cache): the worker then takes
    # jobs placed on it by their prefix (tasks/placement.py).
    caches_prefixes: bool = False
    # What its jobs ask of it: "generate" (completions, chat) or "embed" (/v1/embeddings: the
    # embed engine); workers announce it, and the API sends each model only the jobs it serves.
    task: str = "generate"
    job_timeout: float = 600.0

    def time_limit(self, spec: JobSpec) -> tuple[float, str]:
        """Seconds this job may still run, and why it fails once they are gone: its own
        deadline, never later than the worker's ceiling (GENQ_JOB_TIMEOUT) from now."""
        left = spec.deadline - time.time() if spec.deadline is not None else None
        if left is not None and left < self.job_timeout:
            return left, "the job's deadline passed while it ran"
        return self.job_timeout, f"the job ran longer than GENQ_JOB_TIMEOUT ({self.job_timeout:g} s)"

    def configure(self, settings, sink: Sink | None) -> None:
        """The attributes every engine takes from the settings (tasks.config.Settings)."""
        self.sink = sink or DirectSink()
        self.model = settings.served_model
        self.capacity = settings.max_batch_size
        self.default_max_new = settings.default_max_new_tokens
        self.job_timeout = settings.job_timeout

    @abc.abstractmethod
    def submit(self, spec: JobSpec) -> Future[GenerationResult]:
        """Queue one job; the future resolves with its result, or raises GenerationError,
        or JobCancelled after `cancel`. Raises GenerationError at once for a job that can
        never run (a prompt longer than the model allows)."""

    def cancel(self, job_id: str) -> None:
        """Stop a job between decode steps; its future raises JobCancelled."""

    def close(self) -> None:
        """Stop background threads; jobs still held fail."""
