"""Submitting jobs and collecting their outcomes: what every route shares.

One instance per API process, created by the app factory. It talks to Redis directly for job
records and heartbeats and through Celery only to publish the job message.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import KombuError

from tasks import keys
from tasks.celery_app import GENERATE_TASK
from tasks.config import Settings, queue_for
from tasks.jobs import JobStore, decode_record
from tasks.registry import Registry, WorkerInfo
from tasks.schemas import JobSpec, JobStatus, SamplingParams
from tasks.streams import follow
from webapp.errors import APIError

log = logging.getLogger(__name__)

# How long the list of live workers is reused before Redis is asked again.
WORKERS_CACHE_S = 1.0

# HTTP status of a blocking call whose job ended with this error code; any other code is the
# server's fault (502).
OUTCOME_STATUS = {"prompt_too_long": 400, "invalid_request": 400, "cancelled": 409}


class JobService:
    def __init__(self, settings: Settings, client: redis.Redis, celery: Celery):
        self.settings = settings
        self.r = client
        self.celery = celery
        self.store = JobStore(client, settings.result_ttl)
        self.registry = Registry(client, settings.heartbeat_ttl)
        self._workers: tuple[float, list[WorkerInfo]] = (0.0, [])
        self._workers_lock = threading.Lock()

    # -- workers ---------------------------------------------------------------------------

    def live_workers(self, fresh: bool = False) -> list[WorkerInfo]:
        now = time.monotonic()
        with self._workers_lock:
            at, workers = self._workers
            if fresh or now - at > WORKERS_CACHE_S:
                workers = self.registry.live()
                self._workers = (now, workers)
            return workers

    def workers_for(self, model: str) -> list[WorkerInfo]:
        return [w for w in self.live_workers() if w.model == model]

    def resolve_model(self, requested: str | None) -> str:
        model = requested or self.settings.served_model
        if model != self.settings.served_model and not self.workers_for(model):
            served = sorted({w.model for w in self.live_workers()} | {self.settings.served_model})
            raise APIError(404, "model_not_found", f"no worker serves model {model!r}; served: {served}")
        return model

    def model_for_engine(self, engine: str) -> str:
        """The model some live worker of this engine serves (the default model if it does)."""
        models = {w.model for w in self.live_workers() if w.engine == engine}
        if not models:
            raise APIError(
                503, "no_worker", f"no live {engine} worker; start one with GENQ_ENGINE={engine}",
                {"Retry-After": "5"},
            )
        return self.settings.served_model if self.settings.served_model in models else min(models)

    def require_worker(self, model: str) -> None:
        """Blocking calls fail at once, instead of hanging, when nothing can serve them."""
        if not self.workers_for(model):
            raise APIError(
                503,
                "no_worker",
                f"no live worker serves model {model!r}; submit with POST /v1/jobs to queue it",
                {"Retry-After": "5"},
            )

    # -- submission ------------------------------------------------------------------------

    def validate(self, prompts: list[str], params: SamplingParams) -> None:
        """The limits that depend on this deployment's settings, not on the schema."""
        limit = self.settings.max_new_tokens_limit
        if params.max_new_tokens is not None and params.max_new_tokens > limit:
            raise APIError(400, "invalid_request", f"max_new_tokens: must be at most {limit}")
        longest = max((len(p) for p in prompts), default=0)
        if longest > self.settings.max_prompt_chars:
            raise APIError(
                400,
                "prompt_too_long",
                f"prompt: {longest} characters; the limit is {self.settings.max_prompt_chars}",
            )

    def submit(
        self, prompts: list[str], params: SamplingParams, model: str | None, stream: bool = True
    ) -> list[str]:
        """Record and enqueue one job per prompt; returns their ids in order. `stream=False`
        for jobs whose ids never reach a client: nobody could follow their token streams."""
        self.validate(prompts, params)
        model = self.resolve_model(model)
        queue = queue_for(model)
        specs = [
            JobSpec(id=str(uuid.uuid4()), model=model, prompt=p, params=params, stream=stream)
            for p in prompts
        ]
        created, depth = self.store.create(specs, queue, self.settings.max_queue_depth)
        if not created:
            raise APIError(
                429,
                "queue_full",
                f"{depth} jobs are waiting for {model!r}; try again shortly",
                {"Retry-After": "1"},
            )
        for spec in specs:
            self._publish(spec, queue)
        return [s.id for s in specs]

    def _publish(self, spec: JobSpec, queue: str) -> None:
        try:
            # argsrepr: logs and monitoring name the job, never its prompt (user data).
            self.celery.send_task(
                GENERATE_TASK,
                args=[spec.model_dump(mode="json")],
                task_id=spec.id,
                queue=queue,
                argsrepr=f"job {spec.id}",
            )
        except (KombuError, redis.RedisError, OSError) as exc:
            log.exception("could not enqueue job %s", spec.id)
            self.store.finish(
                spec.id, JobStatus.failed, {"code": "enqueue_failed", "message": str(exc)}
            )
            raise APIError(503, "broker_unavailable", "the job queue is unavailable") from exc

    # -- outcomes --------------------------------------------------------------------------

    def view(self, job_id: str, wait: float = 0.0, exists: bool = False) -> dict[str, Any]:
        rec = self.store.wait(job_id, wait, exists) if wait > 0 else self.store.get(job_id)
        if rec is None:
            raise APIError(404, "not_found", f"no job {job_id!r}")
        body = decode_record(rec)
        if body["status"] == JobStatus.succeeded.value:
            body["result"] = self.celery.AsyncResult(job_id).result
        return body

    def outcome(self, job_id: str, deadline: float) -> dict[str, Any]:
        """The result of a job this request submitted, or the error that ended it."""
        body = self.view(job_id, max(0.001, deadline - time.monotonic()), exists=True)
        status = body["status"]
        if status == JobStatus.succeeded.value:
            return body["result"]
        if status in (JobStatus.queued.value, JobStatus.running.value):
            raise APIError(
                504, "timeout", f"job {job_id} is still {status}; poll GET /v1/jobs/{job_id}"
            )
        error = body.get("error") or {"code": status, "message": f"job {status}"}
        raise APIError(OUTCOME_STATUS.get(error["code"], 502), error["code"], error["message"])

    def events(self, job_ids: list[str], after: dict[str, int] | None = None):
        """Token events of these jobs as they come (see tasks.streams.follow)."""
        return follow(self.r, job_ids, self.store.get, after)

    def require_job(self, job_id: str) -> None:
        if not self.r.exists(keys.job(job_id)):
            raise APIError(404, "not_found", f"no job {job_id!r}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        moved, prev = self.store.cancel(job_id)
        if prev is None:
            raise APIError(404, "not_found", f"no job {job_id!r}")
        if not moved:
            raise APIError(409, "already_final", f"job {job_id} is already {prev.value}")
        return self.view(job_id)
