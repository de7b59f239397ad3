"""The small interface every engine offers to the Celery task threads, and the sink through
which engines hand out token events and finished results."""

from __future__ import annotations

import abc
from concurrent.futures import Future
from typing import Protocol

from tasks.schemas import GenerationResult, JobSpec
from tasks.streams import TokenEvent


class GenerationError(Exception):
    """A job that cannot be served; `code` reaches the client in the job's error."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


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
    model: str
    max_model_len: int | None = None

    @abc.abstractmethod
    def submit(self, spec: JobSpec) -> Future[GenerationResult]:
        """Queue one job; the future resolves with its result, or raises GenerationError,
        or JobCancelled after `cancel`. Raises GenerationError at once for a job that can
        never run (a prompt longer than the model allows)."""

    def cancel(self, job_id: str) -> None:
        """Stop a job between decode steps; its future raises JobCancelled."""

    def close(self) -> None:
        """Stop background threads; jobs still held fail."""
