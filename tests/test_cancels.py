"""The worker's one look for cancelled and superseded jobs (worker/cancels.py), against a real
Redis; the engine is a stand-in that records what it is told. Through the whole queue:
test_sim.py (a cancelled job), test_outage.py (a client that hangs up), test_recovery.py (a
hung worker's superseded jobs)."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import redis

from tasks import keys
from tasks.jobs import JobStore
from tests.helpers import queued_job
from worker.cancels import CancelWatch


class Engine:
    def __init__(self):
        self.cancelled: list[str] = []

    def cancel(self, job_id: str) -> None:
        self.cancelled.append(job_id)


def _running(store: JobStore) -> str:
    """A job running its first attempt on a worker of its own (other tests look at the
    in-flight hashes of the workers they name)."""
    job = queued_job(store)
    assert store.start(job, f"w-{uuid.uuid4().hex[:8]}", "tag").number == 1
    return job


def test_one_look_drops_the_cancelled_the_gone_and_the_superseded(store, caplog):
    engine = Engine()
    watch = CancelWatch(store, engine, interval=60)
    running, cancelled, superseded = (_running(store) for _ in range(3))
    gone = str(uuid.uuid4())  # no record (expired, or never there)
    for job in (running, cancelled, superseded, gone):
        watch.watch(job, 1)
    assert watch.look() == [gone] and engine.cancelled == [gone]  # no record: dropped at once
    store.cancel(cancelled)
    # Given up for dead: its next attempt runs elsewhere.
    assert store.start(superseded, f"w-{uuid.uuid4().hex[:8]}", "tag-2").number == 2
    with caplog.at_level(logging.WARNING, logger="worker.cancels"):
        assert sorted(watch.look()) == sorted([cancelled, superseded])
    assert sorted(engine.cancelled) == sorted([gone, cancelled, superseded])
    assert f"job {superseded} attempt 1 superseded" in caplog.text
    # Told once: they are watched no more; the running job stays watched until unwatched.
    assert watch.look() == [] and len(engine.cancelled) == 3
    store.cancel(running)
    watch.unwatch(running)
    assert watch.look() == [] and len(engine.cancelled) == 3


def test_the_watch_tells_the_engine_within_its_interval_and_stops(store):
    engine = Engine()
    watch = CancelWatch(store, engine, interval=0.05)
    job = _running(store)
    watch.watch(job, 1)
    watch.start()
    try:
        time.sleep(0.3)
        assert engine.cancelled == []
        store.cancel(job)
        deadline = time.monotonic() + 5
        while not engine.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.cancelled == [job]
    finally:
        watch.stop()
    assert not watch._thread.is_alive()


def test_the_watch_outlives_a_redis_it_cannot_reach():
    client = redis.Redis(port=1, socket_connect_timeout=0.2)  # nothing listens there
    watch = CancelWatch(JobStore(client, ttl=600, max_attempts=3), Engine(), interval=0.02)
    watch.watch("job", 1)
    with pytest.raises(redis.RedisError):
        watch.look()
    watch.start()
    try:
        time.sleep(0.3)
        assert watch._thread.is_alive()
    finally:
        watch.stop()
    assert not watch._thread.is_alive()


def test_a_look_reads_records_only_when_the_counter_moved(store):
    """Each look reads the counter; the records only of jobs it has not seen since the last
    cancel or restart: a worker running long jobs no longer reads every record twice a second."""
    engine = Engine()
    watch = CancelWatch(store, engine, interval=60, full_every=3600)
    jobs = [_running(store) for _ in range(3)]
    for job in jobs:
        watch.watch(job, 1)  # no mark: read at the first look
    assert watch.look() == [] and watch.reads == 3
    for _ in range(3):
        assert watch.look() == [] and watch.reads == 3  # nothing moved: the counter alone
    # A job started after that look, marked before its start: not read while nothing moves.
    since = watch.mark()
    late = _running(store)
    watch.watch(late, 1, since)
    assert watch.look() == [] and watch.reads == 3
    store.cancel(jobs[0])
    assert watch.look() == [jobs[0]] and engine.cancelled == [jobs[0]] and watch.reads == 7
    assert watch.look() == [] and watch.reads == 7
    # Given up for dead, started again elsewhere: the start moves the counter too.
    assert store.start(jobs[1], f"w-{uuid.uuid4().hex[:8]}", "tag-2").number == 2
    assert watch.look() == [jobs[1]] and watch.reads == 10


def test_a_cancel_between_the_start_and_the_watch_is_not_missed(store):
    engine = Engine()
    watch = CancelWatch(store, engine, interval=60, full_every=3600)
    other = _running(store)
    watch.watch(other, 1)
    watch.look()  # the counter is known
    since = watch.mark()
    job = _running(store)  # started ...
    store.cancel(job)  # ... cancelled at once ...
    watch.look()  # ... a look in between, before this job is watched ...
    watch.watch(job, 1, since)  # ... with the counter taken before its start
    assert watch.look() == [job] and engine.cancelled == [job]


def test_a_gone_record_is_found_by_the_periodic_full_look(store):
    """A record that expires or is deleted moves no counter: every `full_every` each job's is read."""
    engine = Engine()
    watch = CancelWatch(store, engine, interval=60, full_every=0.5)
    job = _running(store)
    watch.watch(job, 1)
    assert watch.look() == []
    store.r.delete(keys.job(job))
    looked = watch.look()
    if looked == []:  # the full look was not due yet (a fast machine): it is, shortly
        time.sleep(0.6)
        looked = watch.look()
    assert looked == [job] and engine.cancelled == [job]
