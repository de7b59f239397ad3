"""The Celery application both sides share, configured for long LLM jobs.

Why each setting:
- JSON only, both ways: a pickled message from the broker is remote code execution.
- acks_late + reject_on_worker_lost: a job is acknowledged when it has finished, so a worker
  that dies mid-job leaves its message unacknowledged and the broker delivers it again.
- acks_on_failure_or_timeout: a job that failed on its own (bad prompt, engine error) is
  acknowledged and recorded as failed instead of being redelivered forever.
- visibility_timeout above the longest job (set for the broker and the result backend, the two
  places Celery reads it): with Redis, an unacknowledged message becomes visible again after
  this long, so a shorter value would run a slow job twice.
- prefetch multiplier 1: the worker runs one thread per batch slot of its engine, plus the hf
  engine's GENQ_RESERVED_SLOTS (concurrency == capacity + reserve), so it reserves as many
  jobs as it can batch and a few for foreground jobs to preempt batch lines with, and leaves
  the rest in Redis for other workers, instead of Celery's default of four per thread.
- result_expires: results live as long as the job records that point at them.
- running jobs are not cancelled when the broker connection drops
  (`worker_cancel_long_running_tasks_on_connection_loss` off): the threads pool cannot cancel
  a thread anyway, the engine keeps generating through a short Redis outage, and the job's
  result, record and tokens are written once Redis is back (the worker's Redis client and the
  result backend retry for up to `WORKER_REDIS_RETRY_S`). Should the message be delivered
  again meanwhile, the attempt fence (worker/tasks.py) keeps exactly one result.
- one result backend per process (`result_backend_thread_safe`): Celery's default is one per
  thread, and under the API's gevent workers every request is a thread of its own, so each
  would build a backend and open a Redis connection. redis-py's client is thread-safe, and
  nothing here uses the backend's (unsafe) pub/sub result consumer.
- rate limits off, and task events unless `GENQ_CELERY_EVENTS` asks for them (for Flower):
  no task has a rate limit, events are read only by a monitor, and both cost time on every job
  (docs/benchmarks.md measures the events).
- priorities: kombu's Redis transport keeps one list per priority step and queue (the queue's
  name, `sep`, the step; step 0 is the queue's own name) and a worker pops the first non-empty
  one in step order: step 0 is served first. Priorities are clamped to 0-9; one step per
  priority makes every one distinct. The API's priorities (lower first, as vLLM's, default 0 in
  the middle) map onto steps in order, see `broker_priority`. A message without a priority
  lands in step 0, the most urgent: `task_default_priority` gives tasks sent through their task
  object (`apply_async`) the middle, and since `send_task` by name does not read it, the API
  passes each job's priority itself (webapp/service.py). `sep` stays kombu's
  own: it also separates the fields of the exchange's binding table in Redis, and a different
  one would misread the bindings a durable Redis kept from an earlier run.
  `queue_order_strategy` orders queues, not steps (a worker consumes one queue: it does not
  matter; "priority" keeps the order fixed). Prefetched messages have left Redis and bypass
  priorities: prefetch stays at the engine's capacity and reserve (above). The recovery path
  (worker/recovery.py) restores a message into the sub-queue its own priority names.
"""

from __future__ import annotations

from datetime import UTC, datetime

from celery import Celery

from tasks import kombu_compat, redis_conn
from tasks.backend import backend_url
from tasks.config import Settings, get_settings, queue_for
from tasks.kombu_compat import BROKER_SEP, TaskMessage
from tasks.schemas import PRIORITY_MAX, PRIORITY_MIN, JobSpec

GENERATE_TASK = "genq.generate"
# /tokenize and /detokenize, answered by a worker of the model (worker/tasks.py).
TOKENIZE_TASK = "genq.tokenize"


# kombu's Redis channel reuses one client per pool; through Redis Sentinel, a closed broker
# channel can still reach the master (tasks/kombu_compat.py).
kombu_compat.reuse_channel_clients()
kombu_compat.remember_sentinels()
kombu_compat.unlane_restores()

PRIORITY_STEPS = list(range(PRIORITY_MAX - PRIORITY_MIN + 1))


def broker_priority(priority: int) -> int:
    """The broker's priority step (0 is served first) for an API priority (lower first):
    -4 .. 4 become 0 .. 8, the default 0 becomes 4."""
    return min(max(priority, PRIORITY_MIN), PRIORITY_MAX) - PRIORITY_MIN


def _argsrepr(spec: JobSpec) -> str:
    # Logs and monitoring name the job, never its prompt (user data).
    return f"job {spec.id}" + (f" of {spec.owner}" if spec.owner else "")


def _expires(spec: JobSpec) -> datetime | None:
    # A worker that receives the message after the deadline drops it (the job ends expired,
    # worker/tasks.py), whatever its pool.
    return None if spec.deadline is None else datetime.fromtimestamp(spec.deadline, UTC)


def publish_job(app: Celery, spec: JobSpec, queue: str) -> None:
    """Put a job's message on its queue through Celery (`send_task`), as a worker does when it
    republishes a job whose message was lost (worker/recovery.py). Raises what kombu raises."""
    app.send_task(
        GENERATE_TASK,
        args=[spec.model_dump(mode="json")],
        task_id=spec.id,
        queue=queue,
        argsrepr=_argsrepr(spec),
        priority=broker_priority(spec.priority),
        expires=_expires(spec),
    )


def job_message(app: Celery, spec: JobSpec, queue: str) -> TaskMessage:
    """The message that `publish_job` would LPUSH onto the queue's list, built by hand
    (tasks/kombu_compat.py `build_message`) so that the API can push it in the Lua call that
    records the job (tasks/jobs.py `JobStore.create`): one round trip per request instead of
    two, the job and its message written atomically, and none of kombu's per-publish
    machinery."""
    return kombu_compat.build_message(
        app,
        GENERATE_TASK,
        spec.id,
        [spec.model_dump(mode="json")],
        queue,
        step=broker_priority(spec.priority),
        expires=_expires(spec),
        argsrepr=_argsrepr(spec),
    )


# How long a worker keeps retrying a write (a result, a job's status) while Redis is away.
WORKER_REDIS_RETRY_S = 300


def make_celery(settings: Settings | None = None) -> Celery:
    s = settings or get_settings()
    visibility = s.redelivery_after
    broker = redis_conn.broker_url(s)  # REDIS_URL, or the sentinels' (GENQ_REDIS_SENTINELS)
    sentinel = redis_conn.transport_options(s)
    app = Celery("genqueue", broker=broker, backend=backend_url(broker), set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_transport_options={
            "visibility_timeout": visibility,
            "priority_steps": PRIORITY_STEPS,
            "sep": BROKER_SEP,
            "queue_order_strategy": "priority",
            **sentinel,
        },
        task_default_priority=broker_priority(0),
        result_backend_transport_options={
            "visibility_timeout": visibility,
            "retry_policy": {
                "max_retries": None,
                "timeout": WORKER_REDIS_RETRY_S,
                "interval_start": 0,
                "interval_step": 0.5,
                "interval_max": 2,
            },
            **sentinel,
        },
        broker_connection_retry_on_startup=True,
        result_expires=s.result_ttl,
        task_default_queue=queue_for(s.served_model),
        task_ignore_result=False,
        result_backend_thread_safe=True,
        task_store_errors_even_if_ignored=True,
        task_track_started=False,
        worker_send_task_events=s.celery_events,
        worker_disable_rate_limits=True,
        task_send_sent_event=s.celery_events,
        # A task's result (the generated text: user data) stays out of its events, hence Flower.
        task_annotations={GENERATE_TASK: {"resultrepr_maxsize": 0}},
        worker_hijack_root_logger=False,
    )
    return app


# The API's side (the sender): while Redis is down or frozen, publishing a job or reading a
# result must fail within a second so that the route answers 503 at once, instead of waiting on
# a dead socket (kombu sets no socket timeout, the result backend 120 s) or retrying for long.
# One quick retry still rides over a pooled connection that went stale when Redis restarted.
# The API's blocking reads (XREAD BLOCK, up to 3 s) have a client of their own with the longer
# BLOCKING_SOCKET_TIMEOUT_S (webapp/__init__.py).
SENDER_CONNECT_TIMEOUT_S = 1.0
SENDER_SOCKET_TIMEOUT_S = 1.0
BLOCKING_SOCKET_TIMEOUT_S = 4.5


def make_sender(settings: Settings | None = None) -> Celery:
    app = make_celery(settings)
    timeouts = {"socket_timeout": SENDER_SOCKET_TIMEOUT_S, "socket_connect_timeout": SENDER_CONNECT_TIMEOUT_S}
    app.conf.update(
        broker_connection_timeout=SENDER_CONNECT_TIMEOUT_S,
        broker_transport_options={**app.conf.broker_transport_options, **timeouts},
        redis_socket_timeout=SENDER_SOCKET_TIMEOUT_S,
        redis_socket_connect_timeout=SENDER_CONNECT_TIMEOUT_S,
        task_publish_retry_policy={
            "max_retries": 1,
            "interval_start": 0,
            "interval_step": 0.2,
            "interval_max": 0.2,
        },
    )
    return app
