"""Celery's Redis result backend, minus the subscription it opens for every task sent.

Celery's backend subscribes the sender to each task's result channel so that a later
`AsyncResult.get()` can wake up. genqueue never blocks that way (waiters block on the job's
`genq:done:<id>` stream, see tasks/jobs.py), and an API process that sends thousands of jobs
would otherwise hold one idle subscription per job whose messages nobody reads.
"""

from celery.backends.redis import RedisBackend


class NoSubscribeRedisBackend(RedisBackend):
    def on_task_call(self, producer, task_id):
        return None


def backend_url(redis_url: str) -> str:
    return f"{__name__}:NoSubscribeRedisBackend+{redis_url}"
