"""Celery's Redis result backend, with two changes for genqueue.

- It does not subscribe the sender to every task's result channel. Celery's backend does, so
  that a later `AsyncResult.get()` can wake up; genqueue never blocks that way (waiters block
  on the job's `genq:done:<id>` stream, see tasks/jobs.py), and an API process that sends
  thousands of jobs would otherwise hold one idle subscription per job.
- A succeeded job's result goes where the job's final status goes, in the same Lua call: into
  its done stream's entry (tasks/jobs.py `succeed`), which answers a waiter in one command;
  `AsyncResult` finds it there. Failures are stored as Celery stores them.
- A worker stores a result only while its attempt is the job's current one (a fence). A
  worker that hung, was given up for dead and whose job ran again elsewhere must not replace
  that result when it wakes up. The check and the write are one Lua call, which also replaces
  Celery's read-before-write and its PUBLISH (nobody subscribes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery import states
from celery.backends.redis import RedisBackend, SentinelBackend
from kombu.utils.encoding import bytes_to_str

from tasks import keys
from tasks.job_lua import DONE_RESULT
from tasks.usage import NONE, counts_of

if TYPE_CHECKING:
    from tasks.jobs import JobStore

# KEYS: result key, job record. ARGV: encoded meta, expiry in seconds, the writer's attempt.
_FENCED_SET = """
if redis.call('HGET', KEYS[2], 'attempts') ~= ARGV[3] then return 0 end
if ARGV[2] == '0' then redis.call('SET', KEYS[1], ARGV[1])
else redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end
return 1
"""


class NoSubscribeRedisBackend(RedisBackend):
    _fenced_set_script = None
    # A worker gives its backend its job store (worker/__main__.py): a successful result and
    # the job's succeeded status then go to Redis in one call (tasks/jobs.py JobStore.succeed),
    # and the task's request remembers (`genq_finished`) that it is done.
    job_store: JobStore | None = None

    def on_task_call(self, producer, task_id):
        return None

    def _store_result(self, task_id, result, state, traceback=None, request=None, **kwargs):
        attempt = getattr(request, "genq_attempt", None)
        if attempt is None:
            return super()._store_result(task_id, result, state, traceback, request, **kwargs)
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        expires = self.failure_expires if state == states.FAILURE else self.expires
        if state == states.SUCCESS and self.job_store is not None:
            counts = counts_of(result) or NONE  # its tokens, counted to its owner's usage
            self.ensure(self.job_store.succeed, (task_id, attempt, self.encode(meta), counts))
            request.genq_finished = True
            return result
        self.ensure(self._fenced_set, (task_id, self.encode(meta), expires, attempt))
        return result

    def _get_task_meta_for(self, task_id):
        """`AsyncResult(job_id)`'s look: a succeeded job's result is in its done stream's entry
        (tasks/jobs.py `succeed`); anything else under Celery's own key."""
        entries = self.client.xrevrange(keys.done(bytes_to_str(task_id)), count=1)
        fields = {bytes_to_str(k): v for k, v in entries[0][1].items()} if entries else {}
        if DONE_RESULT in fields:
            return self.decode_result(fields[DONE_RESULT])
        return super()._get_task_meta_for(task_id)

    def _fenced_set(self, task_id, value, expires, attempt) -> bool:
        if self._fenced_set_script is None:
            self._fenced_set_script = self.client.register_script(_FENCED_SET)
        key = bytes_to_str(self.get_key_for_task(task_id))
        return bool(self._fenced_set_script(keys=[key, keys.job(task_id)], args=[value, int(expires or 0), attempt]))


class NoSubscribeSentinelBackend(NoSubscribeRedisBackend, SentinelBackend):
    """The same through Redis Sentinel (`sentinel://` URLs, tasks/redis_conn.py): Celery's
    SentinelBackend finds the master's pool; the writes above are unchanged."""


def backend_url(redis_url: str) -> str:
    """`redis_url`: a `redis://` URL, or `sentinel://h1:p1;sentinel://h2:p2` (broker_url)."""
    cls = "NoSubscribeSentinelBackend" if redis_url.startswith("sentinel://") else "NoSubscribeRedisBackend"
    return f"{__name__}:{cls}+{redis_url}"
