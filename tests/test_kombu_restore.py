"""A worker's broker channel closing while Redis is down (kombu gives the received, unstarted
messages back to the queue as it closes): with tasks/kombu_compat.py `guard_restores` it waits for
Redis instead of raising (a raise there took the worker down: "Unrecoverable error:
AttributeError('NoneType' object has no attribute 'hostname')"), and it leaves the messages of
jobs still running in this process where they are; and its `unacked` writes without MULTI/EXEC
(`lean_acks`). Real Redis, real kombu channel."""

from __future__ import annotations

import base64
import json
import threading
import time

import redis
from kombu import Connection, Exchange, Queue

from scripts import stack as stackmod
from tasks import kombu_compat
from tests.helpers import KillableRedis


def test_a_channel_closed_during_an_outage_restores_its_unstarted_messages(tmp_path, monkeypatch):
    db = KillableRedis(tmp_path)
    running: set[str] = set()
    monkeypatch.setattr(kombu_compat, "RESTORE_WAIT_S", 30.0)
    kombu_compat.guard_restores(lambda: set(running))
    conn = Connection(db.url)
    r = redis.Redis.from_url(db.url, decode_responses=True)
    try:
        queue = Queue("guarded", Exchange("guarded", "direct"), "guarded")
        producer = conn.Producer()
        for job in ("started", "waiting"):
            producer.publish({"job": job}, exchange=queue.exchange, routing_key="guarded", declare=[queue])
        channel = conn.channel()
        bound = queue(channel)
        received = {m.payload["job"]: m for m in (bound.get(no_ack=False), bound.get(no_ack=False))}
        assert set(received) == {"started", "waiting"} and r.hlen("unacked") == 2 and r.llen("guarded") == 0
        running.add(received["started"].delivery_tag)

        db.kill()
        errors: list[BaseException] = []

        def close():
            try:
                channel.close()
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

        closer = threading.Thread(target=close)
        closer.start()
        time.sleep(2)
        assert closer.is_alive(), f"the close gave up while Redis was down: {errors}"
        db.start()
        closer.join(40)
        assert not closer.is_alive() and errors == []
        # The unstarted message is back on its queue; the running job's stays unacknowledged
        # (its worker acknowledges it when the job ends; recovery restores it if that worker dies).
        (back,) = r.lrange("guarded", 0, -1)
        assert json.loads(base64.b64decode(json.loads(back)["body"])) == {"job": "waiting"}
        assert list(r.hkeys("unacked")) == [received["started"].delivery_tag]
    finally:
        r.close()
        conn.release()
        db.stop()


def test_lean_acks_keep_unacked_without_multi_and_restore_after_the_visibility_timeout(tmp_path):
    """tasks/kombu_compat.py `lean_acks`: a received message is in `unacked` and its index, an
    acknowledged one in neither, a message left unacknowledged past the visibility timeout goes
    back to its queue; and none of it costs a MULTI/EXEC."""
    kombu_compat.lean_acks()
    db = stackmod.PrivateRedis()
    conn = Connection(db.url, transport_options={"visibility_timeout": 1})
    r = redis.Redis.from_url(db.url, decode_responses=True)
    try:
        queue = Queue("lean", Exchange("lean", "direct"), "lean")
        producer = conn.Producer()
        for job in ("acked", "lost"):
            producer.publish({"job": job}, exchange=queue.exchange, routing_key="lean", declare=[queue])
        channel = conn.channel()
        bound = queue(channel)
        before = {k: v["calls"] for k, v in r.info("commandstats").items()}
        received = {m.payload["job"]: m for m in (bound.get(no_ack=False), bound.get(no_ack=False))}
        tags = {job: m.delivery_tag for job, m in received.items()}
        assert set(r.hkeys("unacked")) == set(tags.values()) == set(r.zrange("unacked_index", 0, -1))
        received["acked"].ack()
        assert r.hkeys("unacked") == [tags["lost"]] and r.zrange("unacked_index", 0, -1) == [tags["lost"]]
        after = {k: v["calls"] for k, v in r.info("commandstats").items()}
        assert after.get("cmdstat_multi", 0) == before.get("cmdstat_multi", 0)
        assert after.get("cmdstat_zadd", 0) - before.get("cmdstat_zadd", 0) == 2
        time.sleep(1.5)
        channel.qos.restore_visible(interval=1)
        (back,) = r.lrange("lean", 0, -1)
        assert json.loads(base64.b64decode(json.loads(back)["body"])) == {"job": "lost"}
        assert r.hlen("unacked") == 0 and r.zcard("unacked_index") == 0
    finally:
        r.close()
        conn.release()
        db.stop()
