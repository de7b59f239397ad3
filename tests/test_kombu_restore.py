"""A worker's broker channel closing while Redis is down (kombu gives the received, unstarted
messages back to the queue as it closes): with tasks/kombu_compat.py `guard_restores` it waits for
Redis instead of raising (a raise there took the worker down: "Unrecoverable error:
AttributeError('NoneType' object has no attribute 'hostname')"), and it leaves the messages of
jobs still running in this process where they are; and without ack emulation, a received message
costs Redis nothing more than its pop. Real Redis, real kombu channel."""

from __future__ import annotations

import base64
import json
import threading
import time

import redis
from kombu import Connection, Exchange, Queue

from scripts import stack as stackmod
from tasks import keys, kombu_compat
from tests.helpers import KillableRedis


def test_a_channel_closed_during_an_outage_restores_its_unstarted_messages(tmp_path, monkeypatch):
    db = KillableRedis(tmp_path)
    running: set[str] = set()
    monkeypatch.setattr(kombu_compat, "RESTORE_WAIT_S", 30.0)
    kombu_compat.guard_restores(lambda: set(running))
    conn = Connection(db.url, transport_options={"ack_emulation": False})
    r = redis.Redis.from_url(db.url, decode_responses=True)
    try:
        queue = Queue("guarded", Exchange("guarded", "direct"), "guarded")
        producer = conn.Producer()
        for job in ("started", "waiting"):
            producer.publish({"job": job}, exchange=queue.exchange, routing_key="guarded", declare=[queue])
        channel = conn.channel()
        bound = queue(channel)
        received = {m.payload["job"]: m for m in (bound.get(no_ack=False), bound.get(no_ack=False))}
        assert set(received) == {"started", "waiting"} and r.llen("guarded") == 0
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
        # The unstarted message is back on its queue; the running job's is not (its worker
        # finishes it; recovery publishes it again if that worker dies).
        (back,) = r.lrange("guarded", 0, -1)
        assert json.loads(base64.b64decode(json.loads(back)["body"])) == {"job": "waiting"}
    finally:
        r.close()
        conn.release()
        db.stop()


def test_without_ack_emulation_a_received_message_costs_redis_nothing_and_a_restore_leaves_the_lane(tmp_path):
    """Without kombu's ack emulation (tasks/celery_app.py), receiving and acknowledging a message
    writes nothing to Redis (no `unacked` copy: recovery goes by genqueue's own records); a
    received message given back as its channel closes goes to its queue, and one taken from a
    worker's lane to the lane's shared queue (`unlane_restores`)."""
    kombu_compat.guard_restores(frozenset)
    db = stackmod.PrivateRedis()
    conn = Connection(db.url, transport_options={"ack_emulation": False})
    r = redis.Redis.from_url(db.url, decode_responses=True)
    lane = keys.lane("shared", "w1")
    try:
        exchange = Exchange("", "direct")
        queues = [Queue("shared", exchange, "shared"), Queue(lane, exchange, lane)]
        producer = conn.Producer()
        for q in queues:
            producer.publish({"job": q.name}, exchange=exchange, routing_key=q.name, declare=[q])
        channel = conn.channel()
        before = {k: v["calls"] for k, v in r.info("commandstats").items()}
        acked = queues[0](channel).get(no_ack=False)
        kept = queues[1](channel).get(no_ack=False)
        acked.ack()
        after = {k: v["calls"] for k, v in r.info("commandstats").items()}
        sent = {k.removeprefix("cmdstat_") for k, n in after.items() if n > before.get(k, 0)}
        assert sent - {"info", "hello", "ping"} == {"rpop"}, sent  # the two gets: nothing else
        assert not r.exists("unacked", "unacked_index") and r.llen("shared") == r.llen(lane) == 0
        channel.close()  # gives `kept` back: to the shared queue, not the lane
        (back,) = r.lrange("shared", 0, -1)
        assert json.loads(base64.b64decode(json.loads(back)["body"])) == {"job": kept.payload["job"]} == {"job": lane}
        assert r.llen(lane) == 0
    finally:
        r.close()
        conn.release()
        db.stop()
