"""How every genqueue process reaches Redis: at one address (`REDIS_URL`), or through Redis
Sentinel (`GENQ_REDIS_SENTINELS=host:port,...`, `GENQ_REDIS_MASTER`).

With sentinels, every new connection asks a sentinel for the master first, so after a failover
the next one reaches the promoted replica: the redis-py clients (`client()`, with the timeouts
and retries the caller gives a single Redis), the Celery broker (kombu's `sentinel://`
transport) and the result backend (Celery's `SentinelBackend`). The sentinels themselves are
asked with a short timeout and no retry. How and why: docs/design.md, "Reaching Redis: one address or
Sentinel"; a failover measured: docs/reliability.md, "Redis Sentinel failover".
"""

from __future__ import annotations

import redis
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

from tasks.config import Settings

SENTINEL_TIMEOUT_S = 1.0


def _sentinel_kwargs() -> dict:
    return {
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),
    }


class MasterConnection(redis.sentinel.SentinelManagedConnection):
    """A connection to the master that asks the sentinels where it is at every reconnect.

    redis-py 8.1's SentinelManagedConnection looks the master up only in `connect()`; a
    command that fails and is retried (the `retry` the workers give their client) reconnects
    through `connect_check_health`, to the address it had: after a failover, the dead master,
    until the retries run out (redis/redis-py#3874). A worker's token writer retried there for
    minutes while its jobs waited. Here every reconnect of a master connection asks first."""

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True):
        if not self._sock and self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        return super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)


def client(settings: Settings, **kwargs) -> redis.Redis:
    """A redis-py client of the master: `redis.Redis.from_url(REDIS_URL, **kwargs)`, or the
    same options on the master the sentinels name."""
    if not settings.sentinel_addresses:
        return redis.Redis.from_url(settings.redis_url, **kwargs)
    manager = redis.sentinel.Sentinel(settings.sentinel_addresses, sentinel_kwargs=_sentinel_kwargs())
    return manager.master_for(settings.redis_master, connection_class=MasterConnection, **kwargs)


def broker_url(settings: Settings) -> str:
    """The Celery broker's (and result backend's) URL."""
    if not settings.sentinel_addresses:
        return settings.redis_url
    return ";".join(f"sentinel://{host}:{port}/0" for host, port in settings.sentinel_addresses)


def transport_options(settings: Settings) -> dict:
    """What kombu's sentinel transport and Celery's sentinel backend need beyond the URL."""
    if not settings.sentinel_addresses:
        return {}
    return {"master_name": settings.redis_master, "sentinel_kwargs": _sentinel_kwargs()}


def describe(settings: Settings) -> str:
    if not settings.sentinel_addresses:
        return settings.redis_url
    sentinels = ",".join(f"{h}:{p}" for h, p in settings.sentinel_addresses)
    return f"master {settings.redis_master!r} of the sentinels {sentinels}"
