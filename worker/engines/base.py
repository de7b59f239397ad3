"""The small interface every engine offers to the Celery task threads."""

from __future__ import annotations

import abc
from concurrent.futures import Future

from tasks.schemas import GenerationResult, JobSpec


class GenerationError(Exception):
    """A job that cannot be served; `code` reaches the client in the job's error."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class JobCancelled(Exception):
    """The job was cancelled while the engine held it."""


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
