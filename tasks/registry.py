"""Worker heartbeats: which workers are alive, what they serve and how much they can batch.

A worker announces itself only after its model has loaded, then refreshes the announcement
every `heartbeat_interval` seconds. A worker whose last heartbeat is older than
`heartbeat_ttl` counts as gone, whether it exited cleanly (it withdraws) or was killed.
"""

from __future__ import annotations

import time

import redis
from pydantic import BaseModel

from tasks import keys


class WorkerInfo(BaseModel):
    name: str
    model: str
    engine: str
    capacity: int
    host: str
    pid: int
    started: float
    max_model_len: int | None = None


class Registry:
    def __init__(self, client: redis.Redis, ttl: float):
        self.r = client
        self.ttl = ttl

    def announce(self, info: WorkerInfo) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.WORKERS, info.name, info.model_dump_json())
        pipe.zadd(keys.WORKERS_SEEN, {info.name: time.time()})
        pipe.execute()

    def withdraw(self, *names: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hdel(keys.WORKERS, *names)
        pipe.zrem(keys.WORKERS_SEEN, *names)
        pipe.execute()

    def live(self) -> list[WorkerInfo]:
        now = time.time()
        names = self.r.zrangebyscore(keys.WORKERS_SEEN, now - self.ttl, "+inf")
        if not names:
            return []
        return [WorkerInfo.model_validate_json(raw) for raw in self.r.hmget(keys.WORKERS, names) if raw]

    def prune(self) -> int:
        """Forget workers whose heartbeats stopped; returns how many."""
        stale = self.r.zrangebyscore(keys.WORKERS_SEEN, "-inf", time.time() - self.ttl)
        if stale:
            self.withdraw(*stale)
        return len(stale)
