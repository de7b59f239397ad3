"""The front end's fewer round trips keep their guarantees (against a real Redis, no model):
- JobStore.succeed stores a result and the succeeded status in one call, both fenced by the
  attempt (a superseded attempt writes neither);
- JobStore.get(..., result_key=...) brings the result with the record;
- JobStore.wait blocks on the done stream and reads the record and result in one round trip;
  a long wait reads the record after every other block that ran out, and finds it gone;
- kombu's Redis channel reuses one client per pool (tasks/kombu_compat.py)."""

from __future__ import annotations

import threading
import time
import uuid

import redis

from tasks import jobs, keys
from tasks.jobs import DONE_RESULT, RESULT_RAW, JobStore
from tasks.schemas import JobSpec, JobStatus, SamplingParams
from tests.helpers import queued_job


def test_succeed_writes_result_and_status_only_for_the_current_attempt(store):
    job = queued_job(store)
    assert store.start(job, "w1", "t1").number == 1
    assert store.start(job, "w2", "t2").number == 2
    assert store.succeed(job, 1, '{"stale": true}') is False
    assert store.r.xlen(keys.done(job)) == 0
    rec = store.get(job)
    assert rec["status"] == JobStatus.running.value and "finished" not in rec
    assert store.succeed(job, 2, '{"result": 1}') is True
    rec = store.get(job)
    assert rec["status"] == JobStatus.succeeded.value and rec["finished"]
    # The result is in the done stream's one entry, beside the final record (not its spec).
    ((_, entry),) = store.r.xrange(keys.done(job))
    assert entry[DONE_RESULT] == '{"result": 1}' and 0 < store.r.ttl(keys.done(job)) <= 600
    assert {k: v for k, v in entry.items() if k != DONE_RESULT} == {k: v for k, v in rec.items() if k != "spec"}
    assert "spec" in rec and "spec" not in entry
    assert job not in store.r.hgetall(keys.inflight("w2"))
    # A final job's status stays; a late writer of the same attempt does not move it back.
    assert store.succeed(job, 2, '{"result": 2}') is False
    assert store.r.xrange(keys.done(job))[0][1][DONE_RESULT] == '{"result": 1}'


def test_get_with_result_key_reads_the_record_and_the_result_together(store):
    job = queued_job(store)
    result_key = f"celery-task-meta-{job}"
    rec = store.get(job, result_key)
    assert rec["status"] == JobStatus.queued.value and rec[RESULT_RAW] is None
    store.start(job, "w1", "t1")
    store.succeed(job, 1, '{"result": {"text": "x"}}')
    for rec in (store.wait(job, 1.0, exists=True, result_key=result_key), store.get(job, result_key)):
        assert rec["status"] == JobStatus.succeeded.value and rec[RESULT_RAW] == '{"result": {"text": "x"}}'
    assert store.get(str(uuid.uuid4()), result_key) is None
    # A job an older genqueue finished: its result under the result backend's own key.
    old = queued_job(store)
    store.r.hset(keys.job(old), "status", JobStatus.succeeded.value)
    store.r.set(f"celery-task-meta-{old}", '{"result": {"text": "old"}}', ex=60)
    assert store.get(old, f"celery-task-meta-{old}")[RESULT_RAW] == '{"result": {"text": "old"}}'


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
    finisher = threading.Timer(0.3, other.succeed, (job, 1, '{"result": {"text": "y"}}'))
    finisher.start()
    try:
        began = time.monotonic()
        rec = store.wait(job, 10.0, exists=True, result_key=result_key)
        waited = time.monotonic() - began
    finally:
        finisher.join()
    assert rec["status"] == JobStatus.succeeded.value and rec[RESULT_RAW] == '{"result": {"text": "y"}}'
    assert 0.2 < waited < 5  # woken by the done stream, not by the end of a block
    assert trips == ["XREAD"]  # the entry holds the record and the result: one command
    # A wait that runs out reads the record as it stands, with its result, in one more.
    job2 = queued_job(store)
    trips.clear()
    rec = store.wait(job2, 0.05, exists=True, result_key=result_key)
    assert rec["status"] == JobStatus.queued.value and trips == ["XREAD", "pipeline"]


def _trips(store, monkeypatch) -> list[str]:
    """Every command `store.r` sends, by name."""
    trips: list[str] = []
    real_command = redis.Redis.execute_command

    def command(*args, **options):
        trips.append(args[0])
        return real_command(store.r, *args, **options)

    monkeypatch.setattr(store.r, "execute_command", command)
    return trips


def test_a_long_wait_reads_the_record_after_every_other_block(store, monkeypatch):
    """A job that runs for minutes costs its waiter one XREAD per block, and an HGETALL every
    other one (it was XREAD, HGETALL and XREVRANGE each time: a 20 s job's waiter sent 21)."""
    monkeypatch.setattr(jobs, "MAX_BLOCK_S", 0.2)
    monkeypatch.setattr(jobs, "LOOK_S", 0.4)
    job = queued_job(store)
    store.start(job, "w1", "t1")
    trips = _trips(store, monkeypatch)
    rec = store.wait(job, 2.0, exists=True)
    assert rec["status"] == JobStatus.running.value
    blocks, reads = trips.count("XREAD"), trips.count("HGETALL")
    assert blocks >= 3 and set(trips) == {"XREAD", "HGETALL"}, trips
    assert blocks // 2 <= reads <= blocks // 2 + 1, trips  # every other block, and at the end


def test_a_wait_finds_the_record_gone(store, monkeypatch):
    monkeypatch.setattr(jobs, "MAX_BLOCK_S", 0.2)
    monkeypatch.setattr(jobs, "LOOK_S", 0.4)
    job = queued_job(store)
    store.start(job, "w1", "t1")
    threading.Timer(0.3, store.r.delete, (keys.job(job),)).start()
    began = time.monotonic()
    assert store.wait(job, 30.0, exists=True, result_key=f"celery-task-meta-{job}") is None
    assert time.monotonic() - began < 10  # noticed within two blocks, not at the timeout


def test_a_wait_ends_when_its_client_left(store, monkeypatch):
    """A blocking call asks whether its client left between blocks of one wait (a second at
    most apart), without reading the record each time."""
    monkeypatch.setattr(jobs, "GONE_CHECK_S", 0.2)
    job = queued_job(store)
    store.start(job, "w1", "t1")
    asked: list[float] = []
    trips = _trips(store, monkeypatch)
    rec = store.wait(job, 30.0, exists=True, gone=lambda: asked.append(time.monotonic()) or len(asked) >= 3)
    assert rec is jobs.PENDING and len(asked) == 3
    assert trips == ["XREAD"] * 3  # three blocks of 0.2 s, no record read


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


def test_a_record_that_expired_while_queued_stops_counting_once_the_cap_is_near(store):
    """The create counts a queue's (and an owner's) queued set with ZCARD alone, and looks for
    ids whose records expired while queued (older than the TTL) only when the count would
    refuse: such an id then does not hold a place."""
    queue, owner = f"genq.test-{uuid.uuid4().hex[:6]}", f"owner-{uuid.uuid4().hex[:6]}"
    spec = lambda: JobSpec(id=str(uuid.uuid4()), model="m", prompt="p", params=SamplingParams(), owner=owner)  # noqa: E731
    owner_set = keys.queued_by(owner)
    for key in (keys.queued(queue), owner_set):
        store.r.zadd(key, {"expired-long-ago": time.time() - 2 * store.ttl})
    try:
        assert store.create([spec()], queue, 2, max_queued=2)[0]
        assert store.r.zscore(keys.queued(queue), "expired-long-ago") is not None  # not at the cap: not looked for
        # Now one more fits only without the expired id, in the queue and in the owner's count.
        assert store.create([spec()], queue, 2, max_queued=2) == (True, 1)
        assert store.r.zscore(keys.queued(queue), "expired-long-ago") is None
        assert store.r.zscore(owner_set, "expired-long-ago") is None
        assert store.create([spec()], queue, 2, max_queued=5) == (False, 2)  # full: two real jobs
    finally:
        store.r.delete(owner_set, keys.queued(queue))
