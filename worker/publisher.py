"""Writes engines' token events to Redis Streams from a thread of its own.

The engine's scheduler hands over each decode step's events for every job in the batch; this
thread writes everything that has accumulated in one pipelined round trip, so the model never
waits on Redis and a step costs one round trip, not one per token. A finished job's future is
resolved only after its finish event is written: by the time the job's result and final
status exist, its stream is complete.
"""

from __future__ import annotations

import logging
import queue
import threading

import redis

from tasks import keys
from tasks.streams import TokenEvent
from worker.engines.base import Resolved

log = logging.getLogger(__name__)


class StreamPublisher:
    def __init__(self, client: redis.Redis, ttl: int, maxlen: int):
        self.r = client
        self.ttl = ttl
        self.maxlen = maxlen
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="genq-publisher", daemon=True)
        self._thread.start()

    def emit(self, events: list[tuple[str, TokenEvent]], resolved: list[Resolved]) -> None:
        if events or resolved:
            self._q.put((events, resolved))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            batch = [item]
            while item is not None:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
            self._write([b for b in batch if b is not None])
            if batch[-1] is None:
                return

    def _write(self, batch: list[tuple[list[tuple[str, TokenEvent]], list[Resolved]]]) -> None:
        if any(events for events, _ in batch):
            pipe = self.r.pipeline(transaction=False)
            for events, _ in batch:
                for job_id, event in events:
                    key = keys.stream(job_id)
                    pipe.xadd(key, event.fields(), maxlen=self.maxlen, approximate=True)
                    if event.index == 0 or event.finish:
                        pipe.expire(key, self.ttl)
            try:
                pipe.execute()
            except redis.RedisError:
                log.exception("could not write token events; their streams are incomplete")
        for _, resolved in batch:
            for future, result in resolved:
                future.set_result(result)
