"""Redis frozen (SIGSTOP) for longer than the heartbeat TTL, with two live workers running long
jobs: nobody is declared dead for Redis's silence, so every job succeeds at its first attempt;
while Redis is frozen the API answers 503 `broker_unavailable` at once, and it is ready again
as soon as Redis is back.

The Redis is the test's own (tests/helpers.py `KillableRedis`): the shared one is never frozen.
"""

from __future__ import annotations

import signal
import time

import pytest

from scripts import stack as stackmod
from tests.helpers import KillableRedis, submit
from tests.test_outage import _error

# A short TTL, to be quick: a stall of twice the TTL leaves every heartbeat stale.
BEAT = {"GENQ_HEARTBEAT_INTERVAL": "0.5", "GENQ_HEARTBEAT_TTL": "2"}
STALL_S = 5.0


class Frozen:
    """Redis stopped with SIGSTOP inside the block; always continued on the way out."""

    def __init__(self, db: KillableRedis):
        self.db = db

    def __enter__(self) -> Frozen:
        self.db.proc.signal(signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        self.db.proc.signal(signal.SIGCONT)


@pytest.mark.timeout(300)
def test_a_redis_stall_longer_than_the_ttl_loses_no_healthy_job(make_stack, tmp_path):
    db = KillableRedis(tmp_path)
    # The sim engine (a decode step sleeps 40 ms): jobs of 480 tokens last ~20 s on any machine,
    # longer than both stalls. The tiny model ran them in ~1 s on a fast one: they ended before
    # the first stall, and the 8 were never all running at once.
    s = make_stack(REDIS_URL=db.url, GENQ_MAX_BATCH_SIZE="4", GENQ_ENGINE="sim", GENQ_SIM_STEP_MS="40", **BEAT)
    try:
        s.start_api()
        workers = [s.start_worker() for _ in range(2)]
        stackmod.wait_until(lambda: len(s.get("/readyz").json().get("workers", [])) == 2, 90, "2 workers", s.procs)
        # Long jobs on both workers: still running when Redis comes back, and for a TTL after.
        ids = [
            submit(s, prompt=f"Stall {i}: the quick brown fox", max_new_tokens=480, ignore_eos=True) for i in range(8)
        ]
        stackmod.wait_until(
            lambda: sum(s.get(f"/v1/jobs/{j}").json()["status"] == "running" for j in ids) == 8,
            60,
            "the jobs to run on both workers",
            s.procs,
        )

        for _ in range(2):
            with Frozen(db):
                time.sleep(1.0)
                # 503 at once, not after the client gave up.
                for path in (f"/v1/jobs/{ids[0]}", "/readyz"):
                    resp = s.get(path, timeout=5)
                    assert resp.status_code == 503, (path, resp.status_code, resp.text)
                    assert _error(resp)["code"] == "broker_unavailable", (path, resp.text)
                    assert int(resp.headers["Retry-After"]) >= 1
                time.sleep(STALL_S - 1.0)
            # Ready as soon as Redis is back: not after the workers' next heartbeats.
            resp = s.get("/readyz", timeout=10)
            assert resp.status_code == 200, resp.text
            assert len(resp.json()["workers"]) == 2, resp.json()
            time.sleep(1.0)

        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            recs = [s.get(f"/v1/jobs/{j}").json() for j in ids]
            if all(r["status"] not in ("queued", "running") for r in recs):
                break
            time.sleep(1.0)
        assert [r["status"] for r in recs] == ["succeeded"] * len(ids), recs
        assert [r["attempts"] for r in recs] == [1] * len(ids), [(r["attempts"], r.get("error")) for r in recs]
        # Both workers ran jobs, and both are the processes that started.
        assert len({r["worker"] for r in recs}) == 2, [r["worker"] for r in recs]
        assert all(w.alive for w in workers)
    finally:
        try:
            db.proc.signal(signal.SIGCONT)
        except Exception:  # noqa: BLE001 - already gone
            pass
        s.stop()
        db.stop()


def test_a_closed_broker_channel_still_acknowledges_its_messages(tmp_path):
    """Celery closes the broker connection when it drops (kombu `collect`, then `close`): the
    transport loses its client, the channel its transport and its pools. A job still running
    then acknowledges its message on that channel once it finishes; that raised
    `AttributeError: 'NoneType' object has no attribute 'client'` (kombu's `_connparams`),
    which stopped the worker. Real Redis, real kombu connection and channel."""
    import redis
    from kombu import Connection, Exchange, Queue

    import tasks.celery_app  # noqa: F401 - its kombu patch, as the worker has it
    from tasks.kombu_compat import guard_restores

    db = KillableRedis(tmp_path)
    running: set[str] = set()
    guard_restores(lambda: set(running))
    conn = Connection(db.url, transport_options={"ack_emulation": False})  # as tasks/celery_app.py
    r = redis.Redis.from_url(db.url, decode_responses=True)
    try:
        chan = conn.channel()
        queue = Queue("genq.closed", Exchange("genq.closed"), "genq.closed")(chan)
        queue.declare()
        conn.Producer(chan).publish({"job": 1}, exchange=queue.exchange, routing_key="genq.closed")
        msg = queue.get(no_ack=False)
        running.add(msg.delivery_tag)  # a job running here: its message stays unacknowledged
        conn.collect(socket_timeout=0.1)
        conn.close()
        chan._disconnect_pools()  # as Channel.close leaves it when the restore ran first
        assert chan.connection is None
        msg.ack()  # the job finished
        assert r.llen("genq.closed") == 0  # acknowledged, not given back
    finally:
        r.close()
        db.stop()


@pytest.mark.timeout(300)
def test_the_worker_survives_redis_restarts_and_stalls_under_load(make_stack, tmp_path):
    """Redis killed and started again, and frozen, in turn, while a worker runs jobs: the same
    worker process serves throughout (its consumer reconnects instead of exiting), and every
    job succeeds, a new one after the faults too."""
    db = KillableRedis(tmp_path)
    # The sim engine (20 ms a step): 3 rounds of 240-token jobs take ~15 s on any machine, so the
    # faults come while the worker runs them (the tiny model ended them all before the first).
    s = make_stack(REDIS_URL=db.url, GENQ_MAX_BATCH_SIZE="4", GENQ_ENGINE="sim", GENQ_SIM_STEP_MS="20", **BEAT)
    try:
        s.start_api()
        worker = s.start_worker()
        s.wait_ready()
        (name,) = [w["name"] for w in s.get("/readyz").json()["workers"]]
        assert f"-{worker.pid}@" in name
        ids = [
            submit(s, prompt=f"Restart {i}: the quick brown fox", max_new_tokens=240, ignore_eos=True)
            for i in range(12)
        ]
        for _ in range(2):
            db.kill()
            time.sleep(1.5)
            db.start()
            time.sleep(2.0)
            with Frozen(db):
                time.sleep(3.0)
            time.sleep(2.0)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            recs = [s.get(f"/v1/jobs/{j}").json() for j in ids]
            if all(r["status"] not in ("queued", "running") for r in recs):
                break
            time.sleep(1.0)
        assert [r["status"] for r in recs] == ["succeeded"] * len(ids), [(r["status"], r.get("error")) for r in recs]
        assert worker.alive, worker.tail()
        assert {r["worker"] for r in recs} == {name}  # the one process, never another
        # Its consumer serves new jobs, and it is still the one worker that announces itself.
        resp = s.post("/basic_generate", json={"prompt": "after the faults", "max_new_tokens": 4}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert [w["name"] for w in s.get("/readyz").json()["workers"]] == [name]
        log = (s.logs / f"{s.name}-worker0.log").read_text()
        assert "Unrecoverable error" not in log
    finally:
        try:
            db.proc.signal(signal.SIGCONT)
        except Exception:  # noqa: BLE001 - already gone
            pass
        s.stop()
        db.stop()
