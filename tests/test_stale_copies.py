"""A stale copy of a job's message does not start the job twice (issue 45, item 3). Across a
Redis Sentinel failover a worker can hold messages it could not start while the reconciler
publishes their jobs again, and an asynchronous replica can undo a pop: two messages of one
job. Each message says at which of the job's attempts it was published (`JobSpec.
republished_after`: 0 for the API's own), and a worker starts the job only from that count
(tasks/jobs.py `JobStore.start`, its `fence`): whichever copy comes second is dropped. Store
level against a real Redis, then a real worker on the tiny model."""

from __future__ import annotations

import redis

from scripts import stack as stackmod
from tasks import keys
from tasks.celery_app import make_sender, publish_job
from tasks.config import Settings
from tasks.jobs import JobStore
from tasks.schemas import JobStatus
from tests.helpers import queued_job, submit


def test_a_start_is_fenced_by_the_attempts_its_message_was_published_at(store):
    job = queued_job(store)
    first = store.start(job, "w1", "t1", fence=0)
    assert first.run and first.number == 1
    # The API's message again (fence 0), on another worker or this one: not started again.
    for worker in ("w2", "w1"):
        copy = store.start(job, worker, "t1-copy", fence=0)
        assert not copy.run and copy.prev is JobStatus.running and copy.number == 1
    assert store.r.hget(keys.job(job), "worker") == "w1" and store.r.hget(keys.job(job), "attempts") == "1"
    # Recovery's message for attempt 1 (its worker lost): it starts attempt 2, once.
    second = store.start(job, "w2", "t2", fence=1)
    assert second.run and second.number == 2
    assert not store.start(job, "w3", "t2-copy", fence=1).run
    # No fence (a message of an older genqueue): started as before, whatever the count.
    assert store.start(job, "w3", "t3").number == 3


def test_a_queued_job_starts_from_its_first_message_or_recoverys(store):
    job = queued_job(store)
    assert store.start(job, "w1", "t1", fence=0).run
    other = queued_job(store)  # its message lost while queued: recovery publishes it at 0
    assert store.start(other, "w1", "t1", fence=0).number == 1


def test_a_worker_drops_a_stale_copy_of_a_running_jobs_message(make_stack, redis_url):
    s = make_stack(GENQ_MAX_BATCH_SIZE="4")
    s.start_api()
    worker = s.start_worker()
    s.wait_ready()
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    store = JobStore(r, ttl=600)
    job = submit(s, prompt="Once upon a time", max_new_tokens=300, ignore_eos=True)
    stackmod.wait_until(lambda: r.hget(keys.job(job), "status") == "running", 60, "the job to start", s.procs)
    rec = store.get(job)
    # The job's own message once more, as a worker that held it through a failover delivers it.
    publish_job(make_sender(Settings(redis_url=redis_url)), store.spec(rec), rec["queue"])
    stackmod.wait_until(
        lambda: "a copy of its message from attempt 0" in worker.log.read_text(), 60, "the copy dropped", s.procs
    )
    final = s.get(f"/v1/jobs/{job}?wait=60").json()
    assert final["status"] == "succeeded" and final["attempts"] == 1, final
    assert final["result"]["completion_tokens"] == 300
    r.close()
