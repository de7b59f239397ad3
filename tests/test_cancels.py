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
