"""The Celery application both sides share, configured for long LLM jobs (`make_celery`; the
API's `make_sender` adds short timeouts), and how a job's message is sent (`publish_job`,
`job_message`).

In short: JSON only; a job acknowledged once it has finished; no ack emulation (genqueue's own
records say where each job is, and its workers recover a dead one's); a worker reserving one message
per batch slot (and its engine's reserve); running jobs kept through a dropped broker
connection; one result backend per process; no rate limits, and task events only when asked
(Flower); one broker priority step per API priority (`broker_priority`, step 0 served first).
Why each setting is what it is: docs/design.md, "The Celery application".
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
# channel can still reach the master; a restore never goes to a lane (tasks/kombu_compat.py).
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
            # A received message is not copied to kombu's `unacked` hash (four Redis commands
            # a job) nor delivered again after a visibility timeout: the job's record, its
            # queue's queued set and the worker's in-flight hash say where every job is, and
            # the workers recover from them (worker/recovery.py, docs/reliability.md).
            "ack_emulation": False,
            "priority_steps": PRIORITY_STEPS,
            "sep": BROKER_SEP,
            "queue_order_strategy": "priority",
            **sentinel,
        },
        task_default_priority=broker_priority(0),
        result_backend_transport_options={
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
