"""Fixtures that start real components: Redis, Celery workers, the API under gunicorn.

Each stack gets a served-model name of its own, hence queues of its own, so tests never see
each other's jobs even on a shared Redis. Every process a fixture starts, it stops; the session
fails if any child process is still alive at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import redis
import requests

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts import stack  # noqa: E402

# The parity tests compare with float32 `model.generate`: every engine the tests start, in this
# process or in a stack, runs float32 unless a test asks otherwise (GENQ_DTYPE=auto would pick
# bfloat16 on a CPU with AMX). tests/test_dtype.py tests `auto` itself.
os.environ.setdefault("GENQ_DTYPE", "float32")


# Workers of the stacks below are forked from a server that imported these once (~4 s of each
# worker's start; scripts/processes.py, `Preloaded`): libraries only, none of ours, whose
# import reads none of genqueue's settings. Stopped at the session's end.
PRELOADED = stack.Preloaded(
    ["torch", "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto", "celery"]
)


@pytest.fixture(scope="session")
def preloaded() -> stack.Preloaded:
    return PRELOADED


@pytest.fixture(scope="session")
def redis_url():
    url = os.environ.get("REDIS_URL")
    if stack.redis_answers(url):
        yield url
        return
    server = stack.PrivateRedis()
    yield server.url
    server.stop()


@pytest.fixture
def store(redis_url):
    """A JobStore on the session's Redis (no model, no worker)."""
    from tasks.jobs import JobStore

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield JobStore(client, ttl=600, max_attempts=3)
    client.close()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from scripts import devmodels

    return devmodels.ensure("tiny", stack.TINY_MODEL_DIR)


class Stack:
    """One API and any number of workers serving one model name."""

    def __init__(self, redis_url: str, model: Path, logs: Path, **env: str):
        self.name = f"test-{uuid.uuid4().hex[:8]}"
        self.port = stack.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.logs = logs
        self.env = {
            "REDIS_URL": redis_url,
            "GENQ_MODEL": str(model),
            "GENQ_MODEL_NAME": self.name,
            "GENQ_PORT": str(self.port),
            "GENQ_HOST": "127.0.0.1",
            "GENQ_API_WORKERS": "1",
            "GENQ_HEARTBEAT_INTERVAL": "0.5",
            "GENQ_HEARTBEAT_TTL": "3",
            **env,
        }
        self.procs: list[stack.Proc] = []
        PRELOADED.warm()
        self.http = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=64)
        self.http.mount("http://", adapter)

    def start_api(self) -> stack.Proc:
        proc = stack.Proc("api", stack.api_argv(), self.env, self.logs / f"{self.name}-api.log")
        self.procs.append(proc)
        stack.wait_until(lambda: self.get("/healthz").status_code == 200, 30, "the API", [proc])
        return proc

    def start_worker(self, **env: str) -> stack.Proc:
        n = sum(p.name.startswith("worker") for p in self.procs)
        env = {**self.env, **env}
        argv = stack.worker_argv(env.get("GENQ_ENGINE", "hf"))
        proc = stack.Proc(f"worker{n}", argv, env, self.logs / f"{self.name}-worker{n}.log", PRELOADED)
        self.procs.append(proc)
        return proc

    def wait_ready(self, timeout: float = 60) -> None:
        stack.wait_until(lambda: self.get("/readyz").status_code == 200, timeout, "readiness", self.procs)

    def get(self, path: str, **kw) -> requests.Response:
        return self.http.get(self.base + path, timeout=kw.pop("timeout", 60), **kw)

    def post(self, path: str, json=None, **kw) -> requests.Response:
        return self.http.post(self.base + path, json=json, timeout=kw.pop("timeout", 120), **kw)

    def stop(self) -> None:
        # The client's idle keep-alive connections first: gunicorn waits for them (up to its
        # keepalive, 5 s) before its workers exit.
        self.http.close()
        # Everything at once: a worker's warm shutdown takes ~2 s (its engine, its threads'
        # last Redis polls, its withdrawal from the registry). The API gets gunicorn's quick
        # shutdown (SIGINT): its graceful one waited 2-5 s more for its own connections, per
        # stack, and an API keeps no state of a job's (a test of a graceful API restart signals
        # the process itself).
        for proc in self.procs:
            if proc.alive() and proc.name.startswith("worker"):
                proc.signal(signal.SIGTERM)
            elif proc.alive() and proc.name == "api":
                proc.signal(signal.SIGINT)
        for proc in reversed(self.procs):
            proc.stop()


class Stacks:
    """Makes stacks and stops them all at once: at the end of the test, module or session of
    the fixture that holds it. A stack left running past its test keeps a worker heartbeating,
    sweeping and reconciling, publishing other stacks' jobs again from the shared Redis: later
    tests would see it."""

    def __init__(self, redis_url: str, model: Path, logs: Path):
        self.redis_url, self.model, self.logs = redis_url, model, logs
        self.stacks: list[Stack] = []

    def __call__(self, **env: str) -> Stack:
        s = Stack(self.redis_url, self.model, self.logs, **env)
        self.stacks.append(s)
        return s

    def stop(self) -> None:
        for s in reversed(self.stacks):
            s.stop()


@contextlib.contextmanager
def private_stack(model: Path, logs: Path, **env: str):
    """One API and one worker on a Redis of their own, started and ready, stopped on exit: for
    settings that every API process on a Redis must share (another stack's API, on the shared
    Redis, would drive this one's batches and callbacks with its own)."""
    db = stack.PrivateRedis()
    stacks = Stacks(db.url, model, logs)
    try:
        s = stacks(**env)
        s.redis_url = db.url
        s.start_api()
        s.start_worker()
        s.wait_ready()
        yield s
    finally:
        stacks.stop()
        db.stop()


@pytest.fixture(scope="session")
def stack_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def make_session_stack(redis_url, tiny_model, stack_logs):
    """For session fixtures: the stacks live until the session ends."""
    stacks = Stacks(redis_url, tiny_model, stack_logs)
    yield stacks
    stacks.stop()


@pytest.fixture(scope="module")
def make_module_stack(redis_url, tiny_model, stack_logs):
    """For module fixtures: the stacks are stopped when the module's tests are done."""
    stacks = Stacks(redis_url, tiny_model, stack_logs)
    yield stacks
    stacks.stop()


@pytest.fixture
def make_stack(redis_url, tiny_model, stack_logs):
    """For a test: its stacks are stopped when it ends, passed or failed."""
    stacks = Stacks(redis_url, tiny_model, stack_logs)
    yield stacks
    stacks.stop()


# The key of `idle_stack`, for tests of clients that send one.
IDLE_STACK_KEY = "sk-client-test-0123456789"


@pytest.fixture(scope="session")
def echo_stack(make_session_stack) -> Stack:
    """The echo engine (no model) behind one worker and the API: the queue path alone."""
    s = make_session_stack(GENQ_ENGINE="echo")
    s.start_api()
    s.start_worker()
    s.wait_ready()
    return s


@pytest.fixture(scope="session")
def idle_stack(make_session_stack) -> Stack:
    """An API with a key (IDLE_STACK_KEY) and no worker: submitted jobs wait in the queue."""
    s = make_session_stack(GENQ_API_KEYS=IDLE_STACK_KEY)
    s.start_api()
    return s


@pytest.fixture(scope="session")
def hf_stack(make_session_stack) -> Stack:
    """The tiny model behind one hf worker and the API, shared by the end-to-end tests."""
    s = make_session_stack(GENQ_MAX_BATCH_SIZE="16")
    s.start_api()
    s.start_worker()
    s.wait_ready()
    return s


@pytest.fixture(scope="session")
def vllm_reference(tiny_model):
    """Greedy completions from vLLM's own `LLM.generate`, run in the vLLM environment."""
    import json
    import subprocess

    def complete(prompts: list[str], max_tokens: int) -> list[str]:
        out = subprocess.run(
            [stack.worker_argv("vllm")[0], str(ROOT / "tests" / "vllm_reference.py"), str(tiny_model), str(max_tokens)],
            input=json.dumps(prompts),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        return json.loads(line[len("RESULT ") :])

    return complete


# vllm_stack's GENQ_VLLM_MAX_MODEL_LEN: below the tiny model's 512, so a test sees it reach vLLM.
VLLM_MAX_MODEL_LEN = 384


@pytest.fixture(scope="session")
def vllm_stack(make_session_stack) -> Stack:
    """The tiny model behind one vLLM worker (and the API), its context cut to VLLM_MAX_MODEL_LEN."""
    s = make_session_stack(
        GENQ_ENGINE="vllm",
        GENQ_MAX_BATCH_SIZE="16",
        GENQ_VLLM_MAX_MODEL_LEN=str(VLLM_MAX_MODEL_LEN),
        GENQ_CHAT_TEMPLATE=str(ROOT / "tests" / "chat_template.jinja"),
    )
    s.start_api()
    s.start_worker()
    s.wait_ready(timeout=240)
    return s


@pytest.fixture(scope="session")
def reference(tiny_model):
    """Greedy completions from a direct `model.generate` call, one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()

    def complete(prompt: str, max_new_tokens: int) -> str:
        enc = tok(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        return tok.decode(out[0, enc.input_ids.shape[1] :], skip_special_tokens=True)

    return complete


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test (or fixture) shows the last lines of the logs of the stacks it used: on CI
    they are the only trace of what a worker or the API did."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    args = getattr(item, "funcargs", {}).values()
    stacks = [v for v in args if isinstance(v, Stack)] + [s for v in args if isinstance(v, Stacks) for s in v.stacks]
    for s in stacks:
        for proc in s.procs:
            if proc.log and proc.log.exists():
                lines = proc.log.read_text(errors="replace").splitlines()[-60:]
                report.sections.append((f"log of {s.name} {proc.name} (last 60 lines)", "\n".join(lines)))


def pytest_sessionfinish(session, exitstatus):
    PRELOADED.stop()
    left = [p for p in psutil.Process().children(recursive=True) if p.is_running()]
    if left:
        for p in left:
            try:
                print(f"\nleft running: {p.pid} {' '.join(p.cmdline())[:150]}", file=sys.stderr)
            except psutil.Error:
                pass
            p.kill()
        session.exitstatus = 1
