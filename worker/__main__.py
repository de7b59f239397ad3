"""`python -m worker`: load the engine, then run a Celery worker that feeds it.

The model loads here, before Celery starts consuming, so no job is taken by a worker that
cannot serve it yet. The worker announces itself in Redis (tasks/registry.py) only once it is
ready to consume, and withdraws when it stops. Celery's threads pool runs one task thread per
batch slot of the engine; they all share the one engine.
"""

from __future__ import annotations

import logging
import logging.config
import os
import socket
import threading
import time

import redis
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down
from kombu.exceptions import KombuError
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from tasks import keys, logs, redis_conn
from tasks.celery_app import PRIORITY_STEPS, WORKER_REDIS_RETRY_S, make_celery
from tasks.config import get_settings, queue_for
from tasks.fair import FairLines
from tasks.jobs import JobStore
from tasks.kombu_compat import guard_restores
from tasks.placement import Placement
from tasks.registry import EmbeddingInfo, Registry, WorkerInfo
from worker import chatbound, gguf, metrics, tasks, tokenbound
from worker.asks import Answerers
from worker.chat import Chat
from worker.engines import create_engine
from worker.publisher import StreamPublisher
from worker.recovery import Reaper
from worker.tasks import WorkerTask

log = logging.getLogger("genq.worker")


class Heartbeat(threading.Thread):
    """Announces the worker every `interval` and, on the same beat, restores the jobs of
    workers whose heartbeats stopped; every `reconcile_every`, republishes jobs whose messages
    were lost (worker/recovery.py).

    Only a worker that has itself beaten without a break for a whole `ttl`, on Redis's clock,
    judges others: after a Redis outage or restart (a failed call, or a beat that found its own
    previous one more than `gap` old) every other worker gets a full ttl to beat again, however
    long the outage lasted. A beat that was held up for longer than `gap` records the outage
    for the API's readiness (tasks/registry.py)."""

    def __init__(self, registry: Registry, info: WorkerInfo, interval: float, reaper: Reaper, reconcile_every: float):
        super().__init__(name="genq-heartbeat", daemon=True)
        self.registry, self.info, self.interval, self.reaper = registry, info, interval, reaper
        self.reconcile_every = reconcile_every
        self.ttl = registry.ttl
        # A break in our own beats longer than this (a beat is due every interval) means Redis
        # did not serve us for a while; so long as it is under the ttl, the others' beats
        # fell due in it too.
        self.gap = max(self.ttl / 2, interval * 1.5)
        self.unbroken_since: float | None = None  # Redis's time of our first beat since a break
        self.stopped = threading.Event()

    def run(self) -> None:
        reconciled = time.monotonic()
        failed = False
        while not self.stopped.is_set():
            called = time.monotonic()
            try:
                now, prev = self.registry.announce(self.info)
                if prev is None:
                    self.reaper.announced()
                self.reaper.keep_lane()
                self.reaper.forget_ended()
                self.reaper.refill()
                held = time.monotonic() - called
                if failed or prev is None or now - prev > self.gap:
                    if prev is not None and (failed or held > self.gap):
                        self.registry.outage(prev, now)
                    self.unbroken_since = now
                    if prev is not None:
                        log.warning(
                            "Redis did not serve this worker for %.1f s; judging no other worker for the next %.0f s",
                            now - prev,
                            self.ttl,
                        )
                failed = False
                if self.judges(now):
                    # Redis may stall between the two calls: the sweep's own look must still
                    # find us unbroken.
                    self.reaper.sweep(lambda t, beat=now: t - beat <= self.gap and self.judges(t))
                    if time.monotonic() - reconciled >= self.reconcile_every:
                        reconciled = time.monotonic()
                        self.reaper.reconcile()
            except (redis.RedisError, KombuError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)
                failed = True
                self.unbroken_since = None
                self.reaper.reset()
            self.stopped.wait(self.interval)

    def judges(self, now: float) -> bool:
        """Whether, at `now` (Redis's time), this worker has beaten without a break for a ttl."""
        return self.unbroken_since is not None and now - self.unbroken_since >= self.ttl

    def drain(self) -> None:
        """Keep beating, but as a worker that takes no new calls."""
        self.info = self.info.model_copy(update={"draining": True})
        try:
            self.registry.announce(self.info)
        except redis.RedisError:
            pass

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join(timeout=5)
        try:
            self.registry.withdraw(self.info.name)
        except redis.RedisError:
            pass


def _embedding_info(engine) -> EmbeddingInfo | None:
    """What an embedding worker announces of its vectors (None: a worker that generates text)."""
    if engine.task != "embed":
        return None
    dims = engine.matryoshka
    return EmbeddingInfo(dimensions=engine.dimension, matryoshka=dims is not None, matryoshka_dimensions=dims or None)


def main() -> None:
    settings = get_settings()
    logs.configure(settings.log_format, os.environ.get("GENQ_LOG_LEVEL", "INFO"))
    if settings.log_format == "json":
        logs.libraries_as_json(os.environ.get("GENQ_LOG_LEVEL", "INFO"), transformers=settings.engine in ("hf", "vllm"))
        logs.native_stderr_as_json()
    host = socket.gethostname()
    name = f"genq-{settings.engine}-{os.getpid()}@{host}"
    queue = queue_for(settings.served_model)

    # Writes that finish a job must outlive a Redis restart: retry with backoff, then give up.
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=int(WORKER_REDIS_RETRY_S / 2))
    client = redis_conn.client(  # REDIS_URL, or the master the sentinels name (GENQ_REDIS_SENTINELS)
        settings, decode_responses=True, retry=retry, socket_connect_timeout=2, socket_timeout=10
    )
    publisher = StreamPublisher(client, settings.result_ttl, settings.max_new_tokens_limit + 16)

    if gguf.is_gguf(settings.model) and settings.engine in ("hf", "vllm"):
        # Served under the file's name, loaded from its conversion (once, cached).
        settings.model_name = settings.served_model
        settings.model = str(gguf.converted(settings.model, settings.gguf_cache))
    started = time.monotonic()
    log.info("loading %s engine for %s", settings.engine, settings.model)
    engine = create_engine(settings, publisher)
    log.info("engine loaded in %.1f s; capacity %d", time.monotonic() - started, engine.capacity)
    metrics_port = metrics.start(
        settings.metrics_port,
        settings.metrics_host,
        settings.served_model,
        engine.name,
        engine.max_model_len,
        engine.device,
    )
    store = JobStore(client, settings.result_ttl, settings.max_attempts, me=name)
    tok = getattr(engine, "tok", None)
    chat = Chat(tok, settings.chat_template, engine.max_model_len)
    # The API checks prompts against the context at submit by this bound (webapp/context.py).
    token_bound = tokenbound.bound_of(tok) if tok is not None and engine.max_model_len else None
    # ... and a conversation by this one on its template's tokens (without it, each is counted).
    chat_bound = chatbound.measure(chat) if token_bound is not None and token_bound.per_byte is not None else None
    # Jobs whose prefix this worker's cache holds may come through a lane of its own (tasks/placement.py).
    lane = settings.placement and engine.caches_prefixes
    placement = Placement(client, len(PRIORITY_STEPS), settings.placement_min_chars, settings.placement_max_waiting)
    # Fair share: refill the queue's lists from the keys' lines as each job is taken, and on every
    # heartbeat (there even with fair share off: lines left from a time it was on are drained).
    fair = FairLines(client, len(PRIORITY_STEPS), settings.fair_depth)
    WorkerTask.equip(
        engine=engine,
        store=store,
        worker_name=name,
        publisher=publisher,
        chat=chat,
        placement=placement if lane else None,
        queue=queue,
        fair=fair if settings.fair_share else None,
    )
    app = make_celery(settings)
    # A successful result and its job's status go to Redis in one call (tasks/backend.py).
    app.backend.job_store = store
    tasks.register(app)

    info = WorkerInfo(
        name=name,
        model=settings.served_model,
        engine=engine.name,
        capacity=engine.capacity,
        reserved=engine.reserved,
        host=host,
        pid=os.getpid(),
        started=time.time(),
        max_model_len=engine.max_model_len,
        token_bound=token_bound,
        chat_template=chat.available,
        chat_bound=chat_bound,
        answers_asks=True,
        device=engine.device,
        metrics_port=metrics_port,
        lane=lane,
        embedding=_embedding_info(engine),
    )
    registry = Registry(client, settings.heartbeat_ttl)
    running = WorkerTask.running
    reaper = Reaper(
        app,
        store,
        registry,
        name,
        queue,
        running=lambda: running.copy().keys(),
        placement=placement,
        lane=lane,
        fair=fair,
    )
    heartbeat = Heartbeat(registry, info, settings.heartbeat_interval, reaper, settings.reconcile_interval)
    # The API's questions (/tokenize, prompt counts at submit) on threads beside Celery's: never
    # behind the jobs that fill its threads (worker/asks.py).
    answerers = Answerers(client, chat, queue)
    guard_restores(lambda: running.copy().values())

    @worker_ready.connect(weak=False)
    def _announce(**_):
        # Two INFO lines per job (received; succeeded with its whole result) are noise at
        # hundreds of jobs a second, and the result is user data.
        for noisy in ("celery.app.trace", "celery.worker.strategy"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        answerers.start()
        heartbeat.start()
        WorkerTask.watch.start()
        log.info("worker %s ready on queue %s", name, queue)

    @worker_shutting_down.connect(weak=False)
    def _drain(**_):
        # Stop taking new blocking calls at once; running jobs still finish (warm shutdown),
        # watched over by the heartbeat until the worker is gone.
        heartbeat.drain()

    @worker_shutdown.connect(weak=False)
    def _close(**_):
        heartbeat.stop()
        try:  # the jobs ended since the last heartbeat leave our in-flight hash
            store.forget_ended()
        except redis.RedisError as exc:
            log.warning("could not take ended jobs off our in-flight hash: %s", exc)
        if lane:
            try:  # what still waits in our lane goes to the shared queue (the reconcilers also would)
                placement.drain(name)
            except redis.RedisError as exc:
                log.warning("could not give our lane's jobs to the shared queue: %s", exc)
        answerers.stop()
        WorkerTask.watch.stop()
        engine.close()
        publisher.close()

    # app.worker_main drops the worker's exit status: a worker whose consumer died of an
    # unrecoverable error (status 1) exited 0, and supervisors that restart on failure left it
    # dead. Exit with it, at once: a thread that does not end must not keep a dead worker up.
    status = app.start(
        [
            *(["--quiet"] if settings.log_format == "json" else []),  # no banner: JSON lines only
            "worker",
            "--pool=threads",
            f"--concurrency={engine.capacity + engine.reserved}",
            f"--queues={queue}" + (f",{keys.lane(queue, name)}" if lane else ""),
            f"--hostname={name}",
            f"--loglevel={os.environ.get('GENQ_LOG_LEVEL', 'INFO')}",
            "--without-gossip",
            "--without-mingle",
            # Flower needs the event heartbeat to see workers; nothing else reads it.
            *([] if settings.celery_events else ["--without-heartbeat"]),
        ]
    )
    if status:
        log.error("the Celery worker stopped with exit status %s; exiting", status)
        logging.shutdown()
        os._exit(status)


if __name__ == "__main__":
    main()
