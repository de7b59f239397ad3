"""Every use of kombu's and Celery's internals, written against kombu 5.7.0 and celery 5.7.0
(requirements.txt pins both): check each one here before moving either pin.

- `reuse_channel_clients`: kombu's Redis `Channel._create_client`, one client per channel and
  pool instead of one per publish and ack (the largest single cost of sending a job).
- `remember_connparams`, `remember_sentinels`: `Channel._connparams` and
  `SentinelChannel._sentinel_managed_pool`, so that a channel closed by a reconnect still
  reaches Redis (a job finishing after it acks on it; before, that stopped the worker).
- `guard_restores`: the virtual `QoS.restore_unacked` and the Redis `Channel._restore`, as a
  channel closes (without ack emulation: tasks/celery_app.py): keeps the messages of jobs still
  running here, and waits for Redis instead of failing.
- `build_message`: a task message built by hand (Celery's `amqp.as_task_v2`, kombu's Redis
  envelope and priority list, Celery's publish signals and task-sent event), so that the API
  pushes it in the Lua call that records the job (tasks/celery_app.py `job_message`).
- `unlane_restores`: `Channel._do_restore_message`, every restore's way back to a queue: a
  message restored from a worker's lane goes to the shared queue (tasks/placement.py).
- `priority_lists`: the channel's private `_q_for_pri`, for worker/recovery.py.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

import redis
from celery import Celery, signals
from kombu.transport import redis as kombu_redis

from tasks import keys

log = logging.getLogger(__name__)

KOMBU_VERSION = "5.7.0"
CELERY_VERSION = "5.7.0"

# kombu's own separator of a queue's name and its priority step (see tasks/celery_app.py).
BROKER_SEP = "\x06\x16"

# How long kombu's restore of a dropped channel's messages waits for Redis to come back.
RESTORE_WAIT_S = 60.0


# -- the broker channel's Redis clients -----------------------------------------------------


def reuse_channel_clients() -> None:
    """kombu's Redis channel builds a new `redis.Redis` object (over its one connection pool)
    for every publish and every ack: measurably the largest single cost of sending a job
    (docs/benchmarks.md, "front end cost per request"). A redis-py client is thread-safe and
    holds no connection of its own, so one per channel and pool does the same. The async
    client (the worker's BRPOP) is left as kombu makes it; a channel whose pool was replaced
    (after a connection error) gets a new client for the new pool."""
    if getattr(kombu_redis.Channel, "_genq_reuses_clients", False):
        return
    build = kombu_redis.Channel._create_client

    def _create_client(self, asynchronous=False):
        if asynchronous:
            return build(self, asynchronous=True)
        pool = self.pool
        cached = self.__dict__.get("_genq_client")
        if cached is None or cached.connection_pool is not pool:
            cached = self._genq_client = build(self)
        return cached

    kombu_redis.Channel._create_client = _create_client
    kombu_redis.Channel._genq_reuses_clients = True


def remember_connparams() -> None:
    """Let a closed kombu Redis channel still reach Redis. When the broker connection drops,
    Celery closes the connection: its transport loses `client` (kombu's Connection) and then
    the channel its `connection` (the transport), and the channel drops its connection pools.
    Whatever needs that channel's Redis afterwards rebuilds a pool from `_connparams`, which
    reads them, and raised AttributeError: the QoS giving the closed channel's received
    messages back (`'NoneType' object has no attribute 'hostname'`), and a task finishing
    after the reconnect that acknowledges its message on the channel it came from (`... no
    attribute 'client'`, in `ack`), which Celery took for an unrecoverable error and stopped
    the worker. Each channel now keeps the parameters it built its (synchronous) pool with
    and uses them once its connection is gone; the message is acknowledged in Redis (removed
    from `unacked`) as it would have been. The asynchronous pool (the BRPOP loop's, whose
    connections tell the closed transport's poller when they drop) is not rebuilt that way."""
    if getattr(kombu_redis.Channel, "_genq_remembers_connparams", False):
        return
    build = kombu_redis.Channel._connparams

    def _connparams(self, asynchronous=False):
        transport = self.connection
        if transport is None or getattr(transport, "client", None) is None:
            saved = self.__dict__.get("_genq_connparams")
            if asynchronous or saved is None:
                raise redis.ConnectionError("the broker channel is closed")
            return dict(saved)
        params = build(self, asynchronous=asynchronous)
        if not asynchronous:
            self._genq_connparams = dict(params)
        return params

    kombu_redis.Channel._connparams = _connparams
    kombu_redis.Channel._genq_remembers_connparams = True


def remember_sentinels() -> None:
    """A closed kombu sentinel channel rebuilds its pool from the Sentinel it was opened with.

    `remember_connparams` lets a closed Redis channel (after a reconnect) still reach Redis
    with the parameters it kept: a job finishing then acks its message on it, and the QoS
    gives back its received messages. kombu's `SentinelChannel` builds its pool in
    `_sentinel_managed_pool`, which reads the sentinels' addresses from the transport
    (`self.connection.client.alt`), gone once the channel is closed: the same AttributeError
    as before. Each sentinel channel now keeps the `Sentinel` it built its synchronous pool
    with (kombu closes that object's connections on close; it opens new ones when asked) and
    asks it for the master again once its transport is gone: after a failover, the new one."""
    channel = kombu_redis.SentinelChannel
    if getattr(channel, "_genq_remembers_sentinels", False):
        return
    build = channel._sentinel_managed_pool

    def _sentinel_managed_pool(self, asynchronous=False):
        transport = self.connection
        if transport is not None and getattr(transport, "client", None) is not None:
            pool = build(self, asynchronous)
            if not asynchronous:
                self._genq_sentinel = self._sentinel_manager
            return pool
        manager = self.__dict__.get("_genq_sentinel")
        if asynchronous or manager is None:
            raise redis.ConnectionError("the broker channel is closed")
        params = self._connparams(asynchronous)  # the remembered ones
        credentials = {k: params[k] for k in ("username", "password") if k in params}
        self._sentinel_manager = manager
        return manager.master_for(self.master_name, redis.Redis, **credentials).connection_pool

    channel._sentinel_managed_pool = _sentinel_managed_pool
    channel._genq_remembers_sentinels = True


# -- a closing channel's received messages (worker/recovery.py says why) ---------------------

_running_tags: Callable[[], Collection[str]] = frozenset


def guard_restores(running_tags: Callable[[], Collection[str]]) -> None:
    """genqueue runs kombu's Redis transport without its ack emulation (tasks/celery_app.py):
    a received message lives in the worker's memory only, and the job's record, its queue's
    queued set and the worker's in-flight hash are what recovery goes by. As a channel closes
    (a dropped connection, a warm shutdown), kombu gives the messages it received and nobody
    acknowledged back to their queues (`QoS.restore_unacked`, each through `Channel._restore`).
    Here that skips the messages of jobs still running in this process (they stay with it; if
    it dies, recovery publishes them again), and each restore waits for Redis instead of
    failing, and goes through `_do_restore_message` as every restore does (`unlane_restores`);
    and a closed channel still reaches Redis (`remember_connparams`)."""
    global _running_tags
    _running_tags = running_tags  # the latest caller's: the patches below are made once
    remember_connparams()
    unlane_restores()
    qos = kombu_redis.virtual.QoS
    if getattr(qos.restore_unacked, "genq_guarded", False):
        return
    original = qos.restore_unacked

    def restore_unacked(self):
        keep = set(_running_tags())
        for tag in [t for t in self._delivered if t in keep]:
            self._delivered.pop(tag, None)
        self.channel._genq_restore_by = time.monotonic() + RESTORE_WAIT_S  # one wait for them all
        try:
            return original(self)
        finally:
            self.channel._genq_restore_by = None

    def _restore(self, message, leftmost=False):
        delivery = message.delivery_info
        deadline = getattr(self, "_genq_restore_by", None) or time.monotonic() + RESTORE_WAIT_S
        while True:
            try:
                with self.conn_or_acquire() as client:
                    pipe = client.pipeline(transaction=False)
                    self._do_restore_message(
                        message._raw, delivery["exchange"], delivery["routing_key"], pipe, leftmost
                    )
                    pipe.execute()
                return
            except Exception as exc:  # noqa: BLE001 - whatever a half-closed client raises
                if time.monotonic() > deadline:
                    log.error(
                        "could not give a received job back to the broker: %s; the reconciler "
                        "publishes it again from its record",
                        exc,
                    )
                    return
                log.warning("giving a received job back to the broker failed (%s); retrying", exc)
                time.sleep(0.5)

    restore_unacked.genq_guarded = True
    qos.restore_unacked = restore_unacked
    kombu_redis.Channel._restore = _restore


def unlane_restores() -> None:
    """Every restore of a message (a closed channel's, recovery's) goes through kombu's
    `_do_restore_message`: one received from a worker's lane goes back to the shared queue
    instead, where any worker takes it (the lane's worker may be gone)."""
    if getattr(kombu_redis.Channel, "_genq_unlanes", False):
        return
    restore = kombu_redis.Channel._do_restore_message

    def _do_restore_message(self, payload, exchange, routing_key, pipe, leftmost=False):
        if routing_key and keys.LANE_SEP in routing_key:
            exchange, routing_key = "", keys.unlane(routing_key)  # the anonymous exchange: the queue itself
        return restore(self, payload, exchange, routing_key, pipe, leftmost)

    kombu_redis.Channel._do_restore_message = _do_restore_message
    kombu_redis.Channel._genq_unlanes = True


# -- the channel's internals worker/recovery.py reads ------------------------------------------


def priority_lists(channel, queue: str, steps: Iterable[int]) -> list[str]:
    """The Redis lists a channel keeps `queue`'s messages in, one per priority step."""
    return [channel._q_for_pri(queue, step) for step in steps]


# -- a task message built by hand ----------------------------------------------------------


def queue_key(queue: str, step: int) -> str:
    """The Redis list kombu's transport keeps a queue's messages of one priority step in."""
    return queue if step == 0 else f"{queue}{BROKER_SEP}{step}"


@dataclass
class TaskMessage:
    """A task's message as kombu's Redis transport stores it: `payload`, LPUSHed onto `key`."""

    key: str
    payload: str
    name: str
    queue: str
    headers: dict
    body: tuple
    sent_event: dict | None  # Celery's task-sent event, when `task_send_sent_event` is on

    def published(self) -> None:
        """Celery's `after_task_publish` signal, as `send_task` sends it once LPUSH is done."""
        signals.after_task_publish.send(
            sender=self.name, body=self.body, headers=self.headers, exchange="", routing_key=self.queue
        )


def build_message(
    app: Celery,
    name: str,
    task_id: str,
    args: list,
    queue: str,
    *,
    step: int,
    expires: datetime | None,
    argsrepr: str,
) -> TaskMessage:
    """The message `app.send_task(name, args, task_id=..., queue=..., priority=step, ...)`
    would LPUSH onto the queue's list, built without kombu's publish path (producer pool,
    `ensure` wrappers, declarations: a third of the API's CPU per job, docs/benchmarks.md).
    The headers come from Celery's own `as_task_v2`; the envelope is kombu's Redis transport
    format (tests/test_broker_message.py compares both with what `send_task` writes). Celery's
    `before_task_publish` signal is sent here, as `send_task` sends it; `after_task_publish`
    by `TaskMessage.published`, and the task-sent event by `send_sent_events`."""
    headers, properties, body, sent_event = app.amqp.as_task_v2(
        task_id,
        name,
        args=args,
        expires=expires,
        reply_to=app.thread_oid,
        argsrepr=argsrepr,
        ignore_result=None,
        create_sent_event=app.conf.task_send_sent_event,
    )
    properties["argsrepr"] = headers["argsrepr"]  # send_task passes it on as a property too
    signals.before_task_publish.send(
        sender=name,
        body=body,
        exchange="",
        routing_key=queue,
        declare=None,
        headers=headers,
        properties=properties,
        retry_policy=None,
    )
    properties["delivery_mode"] = 2
    if expires is not None:
        ttl = max(0.0, (expires - datetime.now(UTC)).total_seconds())
        properties["expiration"] = str(int(ttl * 1000))
    properties.update(
        delivery_info={"exchange": "", "routing_key": queue},
        priority=step,
        body_encoding="base64",
        delivery_tag=str(uuid.uuid4()),
    )
    message = {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": properties,
    }
    if sent_event is not None:  # send_task adds where the message went
        sent_event.update(queue=queue, exchange="", routing_key=queue)
    return TaskMessage(queue_key(queue, step), json.dumps(message), name, queue, headers, body, sent_event)


def send_sent_events(app: Celery, messages: Iterable[TaskMessage]) -> None:
    """Celery's task-sent event of each message that has one (what Flower learns a task from
    before a worker receives it), through the app's event dispatcher, as `send_task` sends it
    once the message is on its queue. Raises what kombu raises."""
    events = [m.sent_event for m in messages if m.sent_event is not None]
    if not events:
        return
    conf = app.conf
    with app.events.default_dispatcher() as dispatcher:
        for event in events:
            dispatcher.send(
                "task-sent", retry=conf.task_publish_retry, retry_policy=conf.task_publish_retry_policy, **event
            )
