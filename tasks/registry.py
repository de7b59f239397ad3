"""Worker heartbeats: which workers are alive, what they serve and how much they can batch.

A worker announces itself only after its model has loaded, then refreshes the announcement
every `heartbeat_interval` seconds. A worker whose last heartbeat is older than
`heartbeat_ttl` counts as gone, whether it exited cleanly (it withdraws) or was killed; a
worker that is shutting down keeps its heartbeat while it finishes its jobs, marked
`draining`, so that it takes no new blocking calls yet its jobs are still looked after.
"""

from __future__ import annotations

import time

import redis
from pydantic import BaseModel, Field

from tasks import keys


class WorkerInfo(BaseModel):
    name: str
    model: str
    engine: str
    capacity: int
    reserved: int = Field(0, description="Celery threads beyond its capacity, kept for foreground jobs (batch lines fill half at most)")
    host: str
    pid: int
    started: float
    max_model_len: int | None = None
    metrics_port: int | None = Field(None, description="its Prometheus exporter's port (worker/metrics.py)")
    draining: bool = Field(False, description="shutting down: finishes its jobs, takes no new calls")


# KEYS: seen zset, info hash. ARGV: name, the heartbeat time the caller found stale.
_FORGET = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[2]) then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""


class Registry:
    def __init__(self, client: redis.Redis, ttl: float):
        self.r = client
        self.ttl = ttl
        self._forget = client.register_script(_FORGET)

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
        """Workers that are alive and take new jobs."""
        now = time.time()
        names = self.r.zrangebyscore(keys.WORKERS_SEEN, now - self.ttl, "+inf")
        if not names:
            return []
        infos = (WorkerInfo.model_validate_json(raw) for raw in self.r.hmget(keys.WORKERS, names) if raw)
        return [w for w in infos if not w.draining]

    def stale(self) -> list[tuple[str, float]]:
        """Workers whose heartbeats stopped: (name, time of the last one)."""
        return self.r.zrangebyscore(keys.WORKERS_SEEN, "-inf", time.time() - self.ttl, withscores=True)

    def forget(self, name: str, seen: float) -> bool:
        """Withdraw a stale worker unless it announced itself again since `seen`."""
        return bool(self._forget(keys=[keys.WORKERS_SEEN, keys.WORKERS], args=[name, repr(seen)]))
