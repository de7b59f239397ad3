"""The front end's fewer round trips keep their guarantees (against a real Redis, no model):
- JobStore.succeed stores a result and the succeeded status in one call, both fenced by the
  attempt (a superseded attempt writes neither);
- JobStore.get(..., result_key=...) brings the result with the record;
- JobStore.wait blocks on the done stream and reads the record and result in one round trip;
- kombu's Redis channel reuses one client per pool (tasks/kombu_compat.py)."""

from __future__ import annotations

import threading
import time
import uuid

import redis

from tasks import keys
from tasks.jobs import RESULT_RAW, JobStore
from tasks.schemas import JobStatus
from tests.helpers import queued_job


def test_succeed_writes_result_and_status_only_for_the_current_attempt(store):
    job = queued_job(store)
    result_key = f"celery-task-meta-{job}"
    assert store.start(job, "w1", "t1").number == 1
    assert store.start(job, "w2", "t2").number == 2
    assert store.succeed(job, 1, result_key, '{"stale": true}', 600) is False
    assert store.r.get(result_key) is None
    rec = store.get(job)
    assert rec["status"] == JobStatus.running.value and "finished" not in rec
    assert store.succeed(job, 2, result_key, '{"result": 1}', 600) is True
    rec = store.get(job)
    assert rec["status"] == JobStatus.succeeded.value and rec["finished"]
    assert store.r.get(result_key) == '{"result": 1}' and 0 < store.r.ttl(result_key) <= 600
    assert store.r.hgetall(keys.inflight("w2")) == {}
    assert store.r.xlen(keys.done(job)) == 1
    # A final job's status stays; a late writer of the same attempt does not move it back.
    assert store.succeed(job, 2, result_key, '{"result": 2}', 0) is False


def test_get_with_result_key_reads_the_record_and_the_result_together(store):
    job = queued_job(store)
    result_key = f"celery-task-meta-{job}"
    rec = store.get(job, result_key)
    assert rec["status"] == JobStatus.queued.value and rec[RESULT_RAW] is None
    store.start(job, "w1", "t1")
    store.succeed(job, 1, result_key, '{"result": {"text": "x"}}', 600)
    rec = store.wait(job, 1.0, exists=True, result_key=result_key)
    assert rec["status"] == JobStatus.succeeded.value and rec[RESULT_RAW] == '{"result": {"text": "x"}}'
    assert store.get(str(uuid.uuid4()), result_key) is None


def test_wait_reads_the_final_record_in_the_round_trip_that_blocked(store, monkeypatch):
    job = queued_job(store)
    result_key = f"celery-task-meta-{job}"
    store.start(job, "w1", "t1")
    # Every round trip of `store.r`: a single command by name, or a whole pipeline.
    trips: list[str] = []
    real_command, real_execute = redis.Redis.execute_command, redis.client.Pipeline.execute

    def command(*args, **options):
        trips.append(args[0])
        return real_command(store.r, *args, **options)

    def execute(self, *args):
        trips.append("pipeline")
        return real_execute(self, *args)

    monkeypatch.setattr(store.r, "execute_command", command)
    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    other = JobStore(redis.Redis(connection_pool=store.r.connection_pool), ttl=600, max_attempts=3)
    finisher = threading.Timer(0.3, other.succeed, (job, 1, result_key, '{"result": {"text": "y"}}', 600))
    finisher.start()
    try:
        began = time.monotonic()
        rec = store.wait(job, 10.0, exists=True, result_key=result_key)
        waited = time.monotonic() - began
    finally:
        finisher.join()
    assert rec["status"] == JobStatus.succeeded.value and rec[RESULT_RAW] == '{"result": {"text": "y"}}'
    assert 0.2 < waited < 5  # woken by the done stream, not by the end of a block
    assert trips == ["pipeline"]
    # A wait that runs out returns the record as it stands, still in one round trip a block.
    job2 = queued_job(store)
    trips.clear()
    rec = store.wait(job2, 0.05, exists=True, result_key=result_key)
    assert rec["status"] == JobStatus.queued.value and trips == ["pipeline"]


def test_kombu_channels_reuse_their_redis_client(redis_url, monkeypatch):
    from tasks.celery_app import make_sender
    from tasks.config import Settings

    monkeypatch.setenv("REDIS_URL", redis_url)
    app = make_sender(Settings())
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        first = channel._create_client()
        assert channel._create_client() is first
        assert channel._create_client(asynchronous=True) is not first
        channel._pool = None  # kombu drops its pool after a connection error
        assert channel._create_client() is not first
