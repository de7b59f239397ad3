"""Redis Sentinel: a real master, a replica and three sentinels on loopback
(scripts/redis_servers.py `SentinelRedis`), an API and an hf worker on the tiny model that know only the
sentinels (GENQ_REDIS_SENTINELS, GENQ_REDIS_MASTER; REDIS_URL points nowhere). The master is
SIGKILLed with jobs running and queued: the sentinels promote the replica, the API answers 503
`broker_unavailable` during the switch and serves after it, the worker reconnects by itself
(the same process), every job accepted before the kill succeeds or is named as lost, and none
runs twice. Once without and once with `min-replicas-to-write 1` on the master.
"""

from __future__ import annotations

import signal
import time

import pytest
import redis

from scripts import stack as stackmod
from tests.helpers import submit

BEAT = {"GENQ_HEARTBEAT_INTERVAL": "0.5", "GENQ_HEARTBEAT_TTL": "2"}
FINAL = ("succeeded", "failed", "cancelled")


def test_settings_name_the_sentinels_for_every_client():
    """The broker and result backend URLs and options kombu and Celery read, from the settings."""
    from tasks import redis_conn
    from tasks.backend import backend_url
    from tasks.celery_app import make_celery
    from tasks.config import Settings

    s = Settings(redis_sentinels="10.0.0.1:26379, sentinel-b:26380", redis_master="prod")
    assert s.sentinel_addresses == [("10.0.0.1", 26379), ("sentinel-b", 26380)]
    url = redis_conn.broker_url(s)
    assert url == "sentinel://10.0.0.1:26379/0;sentinel://sentinel-b:26380/0"
    assert backend_url(url).startswith("tasks.backend:NoSubscribeSentinelBackend+sentinel://")
    app = make_celery(s)
    assert app.conf.broker_url == url
    for opts in (app.conf.broker_transport_options, app.conf.result_backend_transport_options):
        assert opts["master_name"] == "prod"
        assert opts["sentinel_kwargs"]["socket_timeout"] <= 1
    assert type(app.backend).__name__ == "NoSubscribeSentinelBackend"
    plain = Settings(redis_url="redis://h:1/0")
    assert redis_conn.broker_url(plain) == "redis://h:1/0" and redis_conn.transport_options(plain) == {}
    for bad in ("h1", "h1:", "h1:26379,", ":1"):
        with pytest.raises(ValueError):
            Settings(redis_sentinels=bad)


def test_a_closed_sentinel_channel_still_acknowledges_its_messages():
    """As tests/test_stall.py's closed Redis channel, through kombu's sentinel transport: the
    channel is closed by a reconnect (its transport gone) and a job that finishes afterwards
    acknowledges its message on it (kombu's `_sentinel_managed_pool` read the closed
    transport's sentinel list: AttributeError)."""
    from kombu import Connection, Exchange, Queue

    import tasks.celery_app  # noqa: F401 - its kombu patches, as the worker has them
    from tasks.kombu_compat import guard_restores

    sen = stackmod.SentinelRedis(sentinels=1, quorum=1)
    running: set[str] = set()
    guard_restores(lambda: set(running))
    conn = Connection(
        f"sentinel://127.0.0.1:{sen.sentinels[0][0]}/0",
        transport_options={"master_name": "genq", "ack_emulation": False},
    )
    r = redis.Redis(port=sen.port("master"), decode_responses=True)
    try:
        chan = conn.channel()
        queue = Queue("genq.closed", Exchange("genq.closed"), "genq.closed")(chan)
        queue.declare()
        conn.Producer(chan).publish({"job": 1}, exchange=queue.exchange, routing_key="genq.closed")
        msg = queue.get(no_ack=False)
        running.add(msg.delivery_tag)
        conn.collect(socket_timeout=0.1)
        conn.close()
        chan._disconnect_pools()
        assert chan.connection is None
        msg.ack()
        assert r.llen("genq.closed") == 0
    finally:
        r.close()
        sen.stop()


@pytest.mark.timeout(60)
def test_a_command_retried_across_a_failover_reaches_the_new_master():
    """A worker's client retries a command that failed (its token writer, its job writes). A
    BLPOP blocked on the master when it is SIGKILLed is retried, and must reach the promoted
    replica: redis-py's own SentinelManagedConnection reconnected to the dead master's address
    on every retry (redis/redis-py#3874), so a worker's writes hung for minutes after a
    failover while its jobs waited."""
    import threading

    from redis.backoff import ConstantBackoff
    from redis.retry import Retry

    from tasks import redis_conn
    from tasks.config import Settings

    sen = stackmod.SentinelRedis()
    try:
        settings = Settings(redis_sentinels=sen.sentinels_env, redis_master=sen.master_name)
        c = redis_conn.client(
            settings,
            decode_responses=True,
            retry=Retry(ConstantBackoff(0.2), 100),
            socket_connect_timeout=1,
            socket_timeout=30,
        )
        got: list = []
        blocked = threading.Thread(target=lambda: got.append(c.blpop(["handover"], timeout=25)), daemon=True)
        blocked.start()
        stackmod.wait_until(
            lambda: redis.Redis(port=sen.port("master")).info("clients")["blocked_clients"] == 1,
            10,
            "the BLPOP to block on the master",
        )
        sen.proc("master").signal(signal.SIGKILL)
        replica = sen.port("replica")
        stackmod.wait_until(lambda: sen.master_port() == replica, 30, "the replica's promotion")
        new_master = redis.Redis(port=replica, socket_timeout=2)
        stackmod.wait_until(
            lambda: new_master.info("clients")["blocked_clients"] == 1,
            10,
            "the retried BLPOP to block on the new master",
        )
        new_master.rpush("handover", "done")
        blocked.join(10)
        assert got == [("handover", "done")]
        c.close()
        new_master.close()
    finally:
        sen.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("min_replicas", [0, 1], ids=["async", "min-replicas-to-write-1"])
def test_failover_under_load(make_stack, min_replicas):
    sen = stackmod.SentinelRedis(min_replicas_to_write=min_replicas)
    s = make_stack(
        REDIS_URL="redis://127.0.0.1:1/0",
        GENQ_REDIS_SENTINELS=sen.sentinels_env,
        GENQ_REDIS_MASTER=sen.master_name,
        GENQ_MAX_BATCH_SIZE="4",
        **BEAT,
    )
    try:
        s.start_api()
        worker = s.start_worker()
        s.wait_ready(90)
        (name,) = [w["name"] for w in s.get("/readyz").json()["workers"]]
        assert f"-{worker.pid}@" in name
        ids = [
            submit(s, prompt=f"Failover {i}: the quick brown fox", max_new_tokens=160, ignore_eos=True)
            for i in range(6)
        ]
        stackmod.wait_until(
            lambda: sum(s.get(f"/v1/jobs/{j}").json()["status"] == "running" for j in ids) >= 3,
            60,
            "jobs to run",
            s.procs,
        )
        master, replica = sen.port("master"), sen.port("replica")
        assert sen.master_port() == master

        sen.proc("master").signal(signal.SIGKILL)
        codes: list[tuple[int, str | None]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            resp = s.get(f"/v1/jobs/{ids[0]}", timeout=10)
            err = resp.json().get("error", {}).get("code") if resp.status_code != 200 else None
            codes.append((resp.status_code, err))
            if resp.status_code == 503:
                assert int(resp.headers["Retry-After"]) >= 1
            if resp.status_code == 200 and any(c == 503 for c, _ in codes):
                break
            time.sleep(0.1)
        assert (503, "broker_unavailable") in codes, codes
        assert codes[-1][0] == 200, codes
        assert {c for c, _ in codes} <= {200, 503}, codes
        assert sen.master_port() == replica  # promoted
        role = redis.Redis(port=replica, socket_timeout=2).info("replication")["role"]
        assert role == "master"

        # A job accepted after the switch runs on the same worker process.
        after = submit(s, prompt="after the failover", max_new_tokens=8)
        ids_final = ids + [after]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            recs = {j: s.get(f"/v1/jobs/{j}") for j in ids_final}
            if all(r.status_code == 404 or r.json()["status"] in FINAL for r in recs.values()):
                break
            time.sleep(0.5)
        lost = [j for j, r in recs.items() if r.status_code == 404]
        done = {j: r.json() for j, r in recs.items() if r.status_code == 200}
        print(f"min-replicas-to-write {min_replicas}: {len(lost)} of {len(ids)} jobs lost: {lost}")
        assert all(r["status"] == "succeeded" for r in done.values()), {
            j: (r["status"], r.get("error")) for j, r in done.items()
        }
        assert after in done
        # Nothing ran twice.
        assert all(r["attempts"] == 1 for r in done.values()), {j: r["attempts"] for j, r in done.items()}
        assert {r["worker"] for r in done.values()} == {name}
        assert all(r["result"]["completion_tokens"] == (8 if j == after else 160) for j, r in done.items())
        assert worker.alive, worker.tail()
        assert [w["name"] for w in s.get("/readyz").json()["workers"]] == [name]
        log = (s.logs / f"{s.name}-worker0.log").read_text()
        assert "Unrecoverable error" not in log
    finally:
        s.stop()
        sen.stop()
