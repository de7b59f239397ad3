"""Submitting jobs and collecting their outcomes: what every route shares.

One instance per API process, created by the app factory. It talks to Redis directly for job
records and heartbeats and through Celery only to publish the job message.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import redis
from celery import Celery
from flask import current_app
from kombu.exceptions import KombuError

from tasks import keys
from tasks.celery_app import PRIORITY_STEPS, broker_priority, job_message
from tasks.config import Settings, queue_for
from tasks.errors import JobError
from tasks.fair import FairLines
from tasks.jobs import PENDING, RESULT_RAW, JobStore, QuotaExceeded
from tasks.kombu_compat import send_sent_events
from tasks.placement import Placement
from tasks.records import decode_record, record_error
from tasks.registry import Registry, WorkerInfo
from tasks.schemas import ChatOptions, EmbedOptions, JobSpec, JobStatus, SamplingParams
from tasks.streams import StreamEnd, TokenEvent, follow
from webapp.auth import ApiKey
from webapp.errors import BROKER_ERRORS, BROKER_UNAVAILABLE, APIError, job_error_status, owned
from webapp.hangup import ClientGone, client_gone
from webapp.protocol.jobs import Scheduling

log = logging.getLogger(__name__)

# How long the list of live workers is reused before Redis is asked again.
WORKERS_CACHE_S = 1.0


# Where create_app keeps the app's JobService (app.extensions[EXTENSION]).
EXTENSION = "genq"


def current_service() -> JobService:
    """The JobService of the app handling this request."""
    return current_app.extensions[EXTENSION]


class JobService:
    def __init__(self, settings: Settings, client: redis.Redis, celery: Celery, blocking: redis.Redis | None = None):
        """`blocking`: the Redis client for blocking reads (XREAD BLOCK), whose socket timeout
        is above the longest block, where `client`'s is short (webapp/__init__.py)."""
        self.settings = settings
        self.r = client
        self.blocking = blocking or client
        self.celery = celery
        self.store = JobStore(client, settings.result_ttl, blocking=self.blocking)
        self.registry = Registry(client, settings.heartbeat_ttl)
        self.placement = Placement(
            client, len(PRIORITY_STEPS), settings.placement_min_chars, settings.placement_max_waiting
        )
        self.fair = FairLines(client, len(PRIORITY_STEPS), settings.fair_depth)
        self._workers: tuple[float, list[WorkerInfo]] = (0.0, [])
        self._workers_lock = threading.Lock()
        # The Redis outage this process saw itself (tasks/registry.py): Redis's time of the
        # last look before it, then of the first after it (None while it lasts).
        self._redis_seen: tuple[float, float] = (0.0, 0.0)  # Redis's time, ours, at the last look
        self._outage: tuple[float, float | None] | None = None

    # -- workers ---------------------------------------------------------------------------

    def live_workers(self, fresh: bool = False) -> list[WorkerInfo]:
        now = time.monotonic()
        with self._workers_lock:
            at, workers = self._workers
            if fresh or now - at > WORKERS_CACHE_S:
                workers = self._live()
                self._workers = (now, workers)
            return workers

    def _live(self) -> list[WorkerInfo]:
        """The live workers. Right after an outage this process saw (a look that failed),
        those alive when it began still count for a heartbeat TTL (tasks/registry.py): every
        heartbeat is old the moment Redis is back, and readiness must not wait for new ones."""
        try:
            redis_now, workers = self.registry.live_at(self._outage)
        except BROKER_ERRORS:
            self.redis_failed()
            raise
        if self._outage is not None and self._outage[1] is None:
            self._outage = (self._outage[0], redis_now)
        elif self._outage is not None and redis_now - self._outage[1] > self.settings.heartbeat_ttl:
            self._outage = None
        self._redis_seen = (redis_now, time.time())
        return workers

    def redis_failed(self) -> None:
        """A call to Redis failed: an outage began, no later than now and no earlier than
        the last look that succeeded (nor a TTL before now: an idle API looks seldom)."""
        if self._outage is not None and self._outage[1] is None:
            return
        redis_at, local_at = self._redis_seen
        if not redis_at:
            return
        now = redis_at + (time.time() - local_at)  # Redis's clock, as of our last look
        self._outage = (max(redis_at, now - self.settings.heartbeat_ttl), None)

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
                503,
                "no_worker",
                f"no live {engine} worker; start one with GENQ_ENGINE={engine}",
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

    def require_task(self, model: str, embed: bool) -> None:
        """400 at once when the model's live workers serve embeddings and the request asks for
        text (`embed` False), or the other way round (with no live worker: nothing to check)."""
        workers = self.workers_for(model)
        if not workers or any((w.embedding is not None) == embed for w in workers):
            return
        if embed:
            message = f"model {model!r} generates text, it serves no embeddings; use POST /v1/completions or /v1/chat/completions"
        else:
            message = f"model {model!r} serves embeddings (POST /v1/embeddings), not completions"
        raise APIError(400, "invalid_request", message, param="model")

    # -- submission ------------------------------------------------------------------------

    def enqueue(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        model: str,
        stream: bool = True,
        sched: Scheduling | None = None,
        owner: ApiKey | None = None,
        n: int = 1,
        chat: ChatOptions | None = None,
        callback_url: str | None = None,
        embed: EmbedOptions | None = None,
    ) -> list[str]:
        """Record and enqueue one job per prompt, for a request that has been checked against
        the limits and whose model is resolved (webapp.completions.CompletionService.submit
        does both); returns their ids in order. `stream=False` for jobs whose ids never reach a
        client: nobody could follow their token streams.
        `sched`: the jobs' priority and deadline. `owner`: the request's API key (None: the API
        is open); the jobs carry its name and count against its quota. `n`: jobs per prompt
        (OpenAI's `n`), in a row, the j-th with `params.for_choice(j)` (its own seed). `chat`: the
        conversation of chat jobs, which their worker renders into their prompts.
        `callback_url`: where each job's record is POSTed once it ends (webapp/callbacks.py).
        `embed`: an embedding job's inputs (its one prompt is empty: webapp/embeddings.py)."""
        prompts = [p for p in prompts for _ in range(n)]
        queue = queue_for(model)
        sched = sched or Scheduling()
        deadline = sched.deadline_from(time.time())
        specs = [
            JobSpec(
                id=str(uuid.uuid4()),
                model=model,
                prompt=p if isinstance(p, str) else "",
                prompt_token_ids=None if isinstance(p, str) else p,
                chat=chat,
                embed=embed,
                params=params.for_choice(k % n),
                stream=stream,
                priority=sched.priority,
                deadline=deadline,
                owner=owner.name if owner else None,
                weight=owner.weight if owner else 1,
                callback_url=callback_url,
            )
            for k, p in enumerate(prompts)
        ]
        # The jobs' messages go onto the queue (or a worker's lane) in the call that records them.
        lanes = self._lanes(specs, queue, model)
        messages = [job_message(self.celery, spec, lane) for spec, lane in zip(specs, lanes, strict=True)]
        try:
            created, depth = self.store.create(
                specs,
                queue,
                self.settings.max_queue_depth,
                owner.max_queued if owner else None,
                [(m.key, m.payload) for m in messages],
                # Fair share: a key's jobs wait in a line of their own (tasks/fair.py), each
                # costing its turn the tokens it asks for.
                fair=self.fair.push_args(
                    queue,
                    broker_priority(sched.priority),
                    owner.name,
                    owner.weight,
                    params.max_new_tokens or self.settings.default_max_new_tokens,
                )
                if owner and self.settings.fair_share
                else None,
            )
        except QuotaExceeded as exc:
            raise APIError(
                429,
                "quota_exceeded",
                f"this API key has {exc.queued} jobs waiting, its limit is {exc.limit}; "
                "try again once some have started",
                {"Retry-After": "1"},
            ) from None
        if not created:
            raise APIError(
                429,
                "queue_full",
                f"{depth} jobs are waiting for {model!r}; try again shortly",
                {"Retry-After": "1"},
            )
        for message in messages:
            message.published()
        if self.settings.celery_events:
            # Flower's task-sent events, as send_task sends them; the jobs are queued already.
            try:
                send_sent_events(self.celery, messages)
            except (KombuError, redis.RedisError, OSError) as exc:
                log.warning("could not send the task-sent events of %d jobs: %s", len(messages), exc)
        return [s.id for s in specs]

    def _lanes(self, specs: list[JobSpec], queue: str, model: str) -> list[str]:
        """Cache-aware placement (tasks/placement.py): the queue each job goes to, a worker's
        lane where that worker holds the job's prefix, else `queue`. Only with two or more
        workers that take placed jobs: with one, every job meets its cache."""
        lanes = [queue] * len(specs)
        if not self.settings.placement:
            return lanes
        names = [w.name for w in self.workers_for(model) if w.lane and not w.draining]
        if len(names) < 2:
            return lanes
        chosen: dict[object, str] = {}  # one look per distinct prompt (n > 1 siblings share one)
        for i, spec in enumerate(specs):
            prompt = spec.prompt if spec.prompt_token_ids is None else tuple(spec.prompt_token_ids)
            if prompt not in chosen:
                try:
                    worker = self.placement.choose(spec, queue, names)
                except BROKER_ERRORS as exc:  # a guess lost: the shared queue serves it
                    log.warning("placement lookup failed: %s", exc)
                    return lanes
                chosen[prompt] = keys.lane(queue, worker) if worker else queue
            lanes[i] = chosen[prompt]
        return lanes

    # -- outcomes --------------------------------------------------------------------------

    def view(self, job_id: str, wait: float = 0.0, exists: bool = False, owner: str | None = None) -> dict[str, Any]:
        """The job as the client sees it. With `owner` (an API key's name) another key's job
        is a 404 too, before any wait: a wait must not tell that the id exists."""
        return self._look(job_id, wait, exists, owner)[0]

    def _look(
        self,
        job_id: str,
        wait: float = 0.0,
        exists: bool = False,
        owner: str | None = None,
        gone: Callable[[], bool] | None = None,
    ) -> tuple[dict[str, Any], JobError | None]:
        """`view`, and the error that ended the job as its worker (or the store) typed it: with
        the request field it concerns, which the view leaves out. `gone`: the waiting client's
        check (`client_gone`), asked between blocks of the wait; ClientGone when it left."""
        if owner is not None and wait > 0 and not exists:
            self.require_job(job_id, owner)
        # The result (if any) comes with the record, in one round trip.
        result_key = self.celery.backend.get_key_for_task(job_id)
        if wait > 0:
            rec = self.store.wait(job_id, wait, exists, result_key, gone)
            if rec is PENDING:
                raise ClientGone()
        else:
            rec = self.store.get(job_id, result_key)
        owned(rec, owner, "job", job_id)
        raw = rec.pop(RESULT_RAW, None)
        rec = self.store.expire_if_due(rec)
        body = decode_record(rec)
        if body["status"] == JobStatus.succeeded.value:
            # What AsyncResult(job_id).result gives (None when the result is gone), without
            # its own round trip.
            body["result"] = None if raw is None else self.celery.backend.decode(raw).get("result")
        return body, record_error(rec)

    def collect(self, job_ids: list[str], environ: dict | None = None, abandon: bool = True) -> list[dict[str, Any]]:
        """The results of the jobs a blocking call submitted, in order. A client that closes
        its connection meanwhile has its jobs cancelled (a retrying client would otherwise
        double the load); `environ` is the request's WSGI environ, where that shows.
        `abandon=False`: they are not (a retry with its Idempotency-Key takes them up)."""
        deadline = time.monotonic() + self.settings.max_wait
        gone = client_gone(environ)
        results: list[dict[str, Any]] = []
        try:
            for job_id in job_ids:
                # Between jobs too: each may end within one slice of the wait (`outcome`) while
                # the call as a whole lasts long after its client left.
                if results and gone is not None and gone():
                    raise ClientGone()
                results.append(self.outcome(job_id, deadline, gone))
            return results
        except ClientGone:
            log.info("client went away: %s %d job(s)", "cancelling" if abandon else "keeping", len(job_ids))
            if abandon:
                self.abandon(job_ids)
            raise APIError(499, "client_closed_request", "the client closed the connection") from None

    def outcome(self, job_id: str, deadline: float, gone: Callable[[], bool] | None = None) -> dict[str, Any]:
        """The result of a job this request submitted, or the error that ended it. With
        `gone`, raises ClientGone once it says the client left (asked every 2 s at most:
        tasks.jobs.GONE_CHECK_S, between blocks of one wait, which reads the record seldom)."""
        body, error = self._look(job_id, max(0.001, deadline - time.monotonic()), exists=True, gone=gone)
        status = body["status"]
        if status == JobStatus.succeeded.value:
            return body["result"]
        if status in (JobStatus.queued.value, JobStatus.running.value):
            raise APIError(504, "timeout", f"job {job_id} is still {status}; poll GET /v1/jobs/{job_id}")
        # The request's field, where the worker named one (worker/engines/logits.py: check).
        error = error or JobError(status, f"job {status}")
        raise APIError(job_error_status(error.code), error.code, error.message, param=error.param)

    def events(
        self, job_ids: list[str], after: dict[str, str | int] | None = None, cancel_on_exit: bool = False
    ) -> Iterator:
        """Token events of these jobs as they come (see tasks.streams.follow). If Redis fails
        meanwhile, a last `(None, StreamEnd)` with code `broker_unavailable` ends them.
        `cancel_on_exit`: the jobs belong to this stream alone, so those that have not ended
        when it closes (its client went away) are cancelled."""
        ended: set[str] = set()
        try:
            for item in follow(self.blocking, job_ids, self.store.get, after):
                if item is not None:
                    job_id, ev = item
                    if isinstance(ev, StreamEnd) or (isinstance(ev, TokenEvent) and ev.finish):
                        ended.add(job_id)
                yield item
        except BROKER_ERRORS as exc:
            log.warning("Redis unavailable during a stream: %s", exc)
            yield None, StreamEnd(JobStatus.failed.value, dict(BROKER_UNAVAILABLE))
        finally:
            if cancel_on_exit and len(ended) < len(job_ids):
                self.abandon([j for j in job_ids if j not in ended])

    def abandon(self, job_ids: Iterable[str]) -> None:
        """Cancel those of these jobs that have not ended: nobody waits for them any more."""
        try:
            for job_id in job_ids:
                self.store.cancel(job_id)
        except BROKER_ERRORS as exc:
            log.warning("could not cancel abandoned jobs: %s", exc)

    def require_job(self, job_id: str, owner: str | None = None) -> None:
        """404 unless the job exists and, with `owner`, belongs to that API key's name."""
        if owner is None:
            found = self.r.exists(keys.job(job_id))
        else:
            found = self.r.hget(keys.job(job_id), "owner") == owner
        if not found:
            raise APIError(404, "not_found", f"no job {job_id!r}")

    def cancel(self, job_id: str, owner: str | None = None) -> dict[str, Any]:
        if owner is not None:
            self.require_job(job_id, owner)
        moved, prev = self.store.cancel(job_id)
        if prev is None:
            raise APIError(404, "not_found", f"no job {job_id!r}")
        if not moved:
            raise APIError(409, "already_final", f"job {job_id} is already {prev.value}")
        return self.view(job_id)
