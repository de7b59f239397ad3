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
- prefetch multiplier 1: the worker runs one thread per batch slot of its engine
  (concurrency == capacity), so it reserves exactly as many jobs as it can batch and leaves
  the rest in Redis for other workers, instead of Celery's default of four per thread.
- result_expires: results live as long as the job records that point at them.
- cancel_long_running_tasks_on_connection_loss: with acks_late those jobs are redelivered
  anyway; finishing them as well would run them twice.
- one result backend per process (`result_backend_thread_safe`): Celery's default is one per
  thread, and under the API's gevent workers every request is a thread of its own, so each
  would build a backend and open a Redis connection. redis-py's client is thread-safe, and
  nothing here uses the backend's (unsafe) pub/sub result consumer.
- events and rate limits off: nobody consumes the events, no task has a rate limit, and both
  cost time on every job.
"""

from __future__ import annotations

from celery import Celery

from tasks.backend import backend_url
from tasks.config import Settings, get_settings, queue_for

GENERATE_TASK = "genq.generate"


def make_celery(settings: Settings | None = None) -> Celery:
    s = settings or get_settings()
    visibility = s.redelivery_after
    app = Celery("genqueue", broker=s.redis_url, backend=backend_url(s.redis_url), set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        broker_transport_options={"visibility_timeout": visibility},
        result_backend_transport_options={"visibility_timeout": visibility},
        broker_connection_retry_on_startup=True,
        result_expires=s.result_ttl,
        task_default_queue=queue_for(s.served_model),
        task_ignore_result=False,
        result_backend_thread_safe=True,
        task_store_errors_even_if_ignored=True,
        task_track_started=False,
        worker_send_task_events=False,
        worker_disable_rate_limits=True,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
    )
    return app
