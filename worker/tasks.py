"""The Celery task: a thin wrapper that hands a job to this process's engine and waits.

The job record moves to `running` before the engine sees the job, and to its final status in
`task_postrun`, which Celery sends after it has stored the result in the result backend, so a
client woken by the final status always finds the result there.
"""

from __future__ import annotations

import logging
from concurrent.futures import TimeoutError as FutureTimeout

from celery import Celery
from celery.exceptions import Ignore
from celery.signals import task_postrun

from tasks import keys
from tasks.celery_app import GENERATE_TASK
from tasks.jobs import JobStore
from tasks.schemas import JobSpec, JobStatus
from worker.engines import Engine, GenerationError
from worker.engines.base import JobCancelled

log = logging.getLogger(__name__)

# How often a waiting task thread looks for a cancellation of its job.
CANCEL_POLL_S = 0.5


class Runtime:
    """What the task needs from its process: the engine, the job store, its own name."""

    engine: Engine
    store: JobStore
    worker_name: str


runtime = Runtime()


def register(app: Celery) -> None:
    @app.task(name=GENERATE_TASK, bind=True)
    def generate(self, job: dict) -> dict:
        spec = JobSpec.model_validate(job)
        moved, prev = runtime.store.mark_running(spec.id, runtime.worker_name)
        if not moved:
            # Cancelled while queued, already final, or its record expired: nothing to run.
            log.info("job %s skipped: status %s", spec.id, prev)
            raise Ignore()
        if prev is JobStatus.running:
            # Delivered again after its worker died: its token stream starts over.
            runtime.store.r.delete(keys.stream(spec.id))
        future = runtime.engine.submit(spec)
        while True:
            try:
                result = future.result(timeout=CANCEL_POLL_S)
                break
            except FutureTimeout:
                rec = runtime.store.get(spec.id)
                if rec is None or rec["status"] == JobStatus.cancelled.value:
                    runtime.engine.cancel(spec.id)
            except JobCancelled:
                raise Ignore() from None
        result.worker = runtime.worker_name
        return result.model_dump()

    task_postrun.connect(_record_outcome, weak=False)


def _record_outcome(task_id=None, task=None, retval=None, state=None, **_):
    if task is None or task.name != GENERATE_TASK:
        return
    if state == "SUCCESS":
        runtime.store.finish(task_id, JobStatus.succeeded)
    elif state == "FAILURE":
        if isinstance(retval, GenerationError):
            error = {"code": retval.code, "message": retval.message}
        else:
            error = {"code": "internal", "message": f"{type(retval).__name__}: {retval}"}
        runtime.store.finish(task_id, JobStatus.failed, error)
