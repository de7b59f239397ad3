"""`python -m worker`: load the engine, then run a Celery worker that feeds it.

The model loads here, before Celery starts consuming, so no job is taken by a worker that
cannot serve it yet. The worker announces itself in Redis (tasks/registry.py) only once it is
ready to consume, and withdraws when it stops. Celery's threads pool runs one task thread per
batch slot of the engine; they all share the one engine.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import redis
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down

from tasks.celery_app import make_celery
from tasks.config import get_settings, queue_for
from tasks.jobs import JobStore
from tasks.registry import Registry, WorkerInfo
from worker import tasks
from worker.engines import create_engine
from worker.publisher import StreamPublisher

log = logging.getLogger("genq.worker")


class Heartbeat(threading.Thread):
    def __init__(self, registry: Registry, info: WorkerInfo, interval: float):
        super().__init__(name="genq-heartbeat", daemon=True)
        self.registry, self.info, self.interval = registry, info, interval
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.registry.announce(self.info)
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            self.stopped.wait(self.interval)

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join(timeout=5)
        try:
            self.registry.withdraw(self.info.name)
        except redis.RedisError:
            pass


def main() -> None:
    settings = get_settings()
    logging.basicConfig(
        level=os.environ.get("GENQ_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    host = socket.gethostname()
    name = f"genq-{settings.engine}-{os.getpid()}@{host}"
    queue = queue_for(settings.served_model)

    client = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    publisher = StreamPublisher(client, settings.result_ttl, settings.max_new_tokens_limit + 16)

    started = time.monotonic()
    log.info("loading %s engine for %s", settings.engine, settings.model)
    engine = create_engine(settings, publisher)
    log.info("engine loaded in %.1f s; capacity %d", time.monotonic() - started, engine.capacity)
    tasks.runtime.engine = engine
    tasks.runtime.store = JobStore(client, settings.result_ttl)
    tasks.runtime.worker_name = name
    app = make_celery(settings)
    tasks.register(app)

    info = WorkerInfo(
        name=name,
        model=settings.served_model,
        engine=engine.name,
        capacity=engine.capacity,
        host=host,
        pid=os.getpid(),
        started=time.time(),
        max_model_len=engine.max_model_len,
    )
    heartbeat = Heartbeat(Registry(client, settings.heartbeat_ttl), info, settings.heartbeat_interval)

    @worker_ready.connect(weak=False)
    def _announce(**_):
        # Two INFO lines per job (received; succeeded with its whole result) are noise at
        # hundreds of jobs a second, and the result is user data.
        for name in ("celery.app.trace", "celery.worker.strategy"):
            logging.getLogger(name).setLevel(logging.WARNING)
        heartbeat.start()
        log.info("worker %s ready on queue %s", name, queue)

    @worker_shutting_down.connect(weak=False)
    def _withdraw(**_):
        # Stop taking new blocking calls at once; running jobs still finish (warm shutdown).
        heartbeat.stop()

    @worker_shutdown.connect(weak=False)
    def _close(**_):
        engine.close()
        publisher.close()

    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={engine.capacity}",
            f"--queues={queue}",
            f"--hostname={name}",
            f"--loglevel={os.environ.get('GENQ_LOG_LEVEL', 'INFO')}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )


if __name__ == "__main__":
    main()
