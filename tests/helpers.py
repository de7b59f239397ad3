"""Helpers the end-to-end tests share: submitting jobs, reading SSE, a Redis to kill."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import requests

from scripts import stack as stackmod

# Prompts of every shape the engine tests feed the tiny model: short, one character, long,
# code, repeated, non-ASCII.
ENGINE_PROMPTS = [
    "Hello, my name is",
    "a",
    "The quick brown fox jumps over the lazy dog, and then it jumps back over it again",
    "import os\nimport sys\n",
    "x" * 40,
    "Deep learning",
    "¿Dónde está la biblioteca? 图书馆在哪里",
    "1 2 3 4 5",
]


def sse_events(resp: requests.Response, limit: int | None = None) -> list[dict]:
    """Parse SSE events (id, event, data) until the stream ends or `limit` events arrived."""
    events, current = [], {}
    for line in resp.iter_lines(decode_unicode=True):
        if line == "":
            if "data" in current:
                events.append(current)
                if limit and len(events) >= limit:
                    break
            current = {}
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(": ")
            current[field] = value
    return events


def submit(stack, **body) -> str:
    resp = stack.post("/v1/jobs", json=body)
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def stream(stack, job_id: str, **headers) -> list[dict]:
    with stack.http.get(f"{stack.base}/v1/jobs/{job_id}/stream", headers=headers, stream=True, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return sse_events(resp)


def joined(events: list[dict]) -> str:
    return "".join(json.loads(e["data"])["text"] for e in events if e.get("event") in ("token", "done"))


class KillableRedis:
    """A redis-server on a fixed port and data dir (append-only file), to kill and start again."""

    def __init__(self, path: Path, fsync: str = "always"):
        self.fsync = fsync
        self.dir = path / "redis"
        self.dir.mkdir()
        self.port = stackmod.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: stackmod.Proc | None = None
        self.start()

    def start(self) -> None:
        argv = [
            stackmod.redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            self.fsync,
            "--daemonize",
            "no",
        ]
        self.proc = stackmod.Proc("redis", argv, log=self.dir / "redis.log")
        stackmod.wait_until(lambda: stackmod.redis_answers(self.url), 15, "redis-server", [self.proc])

    def kill(self) -> None:
        self.proc.signal(signal.SIGKILL)
        self.proc.popen.wait(10)

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the benchmark smoke tests ----------------------------------------------------------------


def run_bench(module: str, *args: str, timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`python -m <module> <args>` from the repository root, in a session of its own; returns
    its exit status, stdout and stderr. Past `timeout` it gets SIGTERM, so that it stops the
    stack it started, and a minute later its process group SIGKILL; the test then fails."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=stackmod.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    out, err, ran_over = stackmod.communicate_or_stop(proc, timeout=timeout)
    assert not ran_over, f"{module} ran over {timeout} s\n--- stderr\n{err[-5000:]}"
    return proc.returncode, out, err


def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def table_rows(doc: str, section: str) -> list[list[str]]:
    """The cells of the first Markdown table after `section` (a line that starts with it, or
    else the first place it occurs; none if a heading comes first), without its header and
    separator rows."""
    at = doc.find("\n" + section)
    at = at + 1 if at >= 0 else doc.index(section)
    table = []
    for line in doc[at + len(section) :].splitlines()[1:]:
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip("|").split("|")])
        elif table or line.startswith("#"):
            break
    return table[2:]


def queued_job(store, **params) -> str:
    """A new queued job's id in `store` (a JobStore), on a queue of its own."""
    import uuid

    from tasks.schemas import JobSpec, SamplingParams

    spec = JobSpec(id=str(uuid.uuid4()), model="m", prompt="p", params=SamplingParams(**params))
    assert store.create([spec], f"genq.test-{uuid.uuid4().hex[:6]}", 10)[0]
    return spec.id


def take_and_give_back(app, queue: str) -> str:
    """What a worker's broker channel does with a message of `queue` it took and never started
    a job for, as it closes (a dropped connection, a warm shutdown): kombu gives it back,
    through tasks/kombu_compat.py's `guard_restores`. Returns the job id of the message."""
    from kombu import Exchange, Queue

    from tasks.kombu_compat import guard_restores

    guard_restores(frozenset)  # as the worker has it; no job runs here
    with app.connection_for_write() as conn:
        channel = conn.channel()
        msg = Queue(queue, Exchange(queue), queue)(channel).get(no_ack=False)
        assert msg is not None, f"no message on {queue}"
        channel.close()
    return msg.headers["id"]
