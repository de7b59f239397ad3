"""Completion callbacks (webapp/callbacks.py): a job's `callback_url` gets its record, signed,
once it ends; a failing endpoint is retried until it answers 2xx; a callback survives the
worker running the job (SIGKILLed) and the API process holding it (SIGKILLed mid-delivery);
a URL that may not be called back is a 400 at submission. Real Redis, gunicorn, tiny-model
workers, and a receiver: an HTTP server on a thread of the test."""

from __future__ import annotations

import hashlib
import hmac
import json
import signal
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis

from scripts import stack as stackmod
from tasks import keys
from tasks.config import Settings
from webapp.callbacks import check_url, sign
from webapp.errors import APIError

SECRET = "callback-test-secret"
ENV = {
    "GENQ_CALLBACK_ALLOW": "127.0.0.1",
    "GENQ_WEBHOOK_SECRET": SECRET,
    "GENQ_CALLBACK_TIMEOUT": "2",
    "GENQ_MAX_BATCH_SIZE": "8",
}


class Receiver:
    """Records the callbacks POSTed to it; answers each with the next of `plan` (a status, or
    'hang': hold the request until `release` is set), then 200."""

    def __init__(self):
        self.received: list[tuple[dict, bytes]] = []  # (headers, body) of each request
        self.plan: list[int | str] = []
        self.release = threading.Event()
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.arrived:
                    receiver.received.append((dict(self.headers), body))
                    answer = receiver.plan.pop(0) if receiver.plan else 200
                    receiver.arrived.notify_all()
                if answer == "hang":
                    receiver.release.wait(60)
                    return
                self.send_response(answer)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", stackmod.free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, n: int, timeout: float = 60) -> list[tuple[dict, bytes]]:
        """The first `n` requests, once they have come."""
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.received) >= n, timeout), (
                f"{len(self.received)} callbacks arrived, expected {n}"
            )
            return list(self.received)

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def db():
    """A Redis of this module's own: every API process delivers the callbacks due in its Redis,
    with its own settings; the other tests' stacks (without GENQ_CALLBACK_ALLOW) would refuse to
    call this module's receivers back."""
    server = stackmod.PrivateRedis()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def make_module_stack(db, tiny_model, stack_logs):
    from conftest import Stacks

    stacks = Stacks(db.url, tiny_model, stack_logs)
    yield stacks
    stacks.stop()


@pytest.fixture
def make_stack(db, tiny_model, stack_logs):
    from conftest import Stacks

    stacks = Stacks(db.url, tiny_model, stack_logs)
    yield stacks
    stacks.stop()


@pytest.fixture
def redis_url(db):
    return db.url


@pytest.fixture
def store(db):
    from tasks.jobs import JobStore

    client = redis.Redis.from_url(db.url, decode_responses=True)
    yield JobStore(client, ttl=600, max_attempts=3)
    client.close()


@pytest.fixture(scope="module")
def s(make_module_stack):
    st = make_module_stack(**ENV)
    st.start_api()
    st.start_worker()
    st.wait_ready()
    return st


def _wait_final(s, job_id: str) -> dict:
    return s.get(f"/v1/jobs/{job_id}?wait=60").json()


def _check_signed(headers: dict, body: bytes) -> dict:
    expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(headers["X-Genq-Signature"], expected)
    assert headers["Content-Type"] == "application/json"
    return json.loads(body)


def test_a_job_calls_back_once_with_its_signed_record(s, receiver, redis_url):
    resp = s.post("/v1/jobs", json={"prompt": "call me back", "max_new_tokens": 4, "callback_url": receiver.url})
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    ((headers, body),) = receiver.wait_for(1)
    got = _check_signed(headers, body)
    assert got == _wait_final(s, job_id)  # the record as GET /v1/jobs/<id> shows it
    assert got["status"] == "succeeded" and got["result"]["text"]
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    stackmod.wait_until(lambda: r.zscore(keys.CALLBACKS_DUE, f"job:{job_id}") is None, 10, "the entry removed")
    assert len(receiver.received) == 1


def test_completions_and_chat_take_the_extension_field(s, receiver):
    body = {"model": s.name, "prompt": "ext", "max_tokens": 3, "n": 2, "callback_url": receiver.url}
    resp = s.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    got = [_check_signed(h, b) for h, b in receiver.wait_for(2)]
    ids = {g["id"] for g in got}
    assert len(ids) == 2 and resp.json()["id"].removeprefix("cmpl-") in ids  # one per job (n=2)
    assert all(g["status"] == "succeeded" for g in got)


def test_a_cancelled_job_calls_back_too(s, receiver):
    sub = s.post("/v1/jobs", json={"prompt": "cancel me", "max_new_tokens": 480, "callback_url": receiver.url})
    job_id = sub.json()["id"]
    s.post(f"/v1/jobs/{job_id}/cancel")
    ((headers, body),) = receiver.wait_for(1)
    got = _check_signed(headers, body)
    assert got["id"] == job_id and got["status"] == "cancelled"


def test_a_failing_endpoint_is_retried_until_it_answers(s, receiver, redis_url):
    receiver.plan = [500, 503]
    resp = s.post("/v1/jobs", json={"prompt": "retry me", "max_new_tokens": 4, "callback_url": receiver.url})
    job_id = resp.json()["id"]
    got = receiver.wait_for(3)
    bodies = [_check_signed(h, b) for h, b in got]
    assert all(b["id"] == job_id and b["status"] == "succeeded" for b in bodies)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    stackmod.wait_until(lambda: r.zscore(keys.CALLBACKS_DUE, f"job:{job_id}") is None, 10, "the entry removed")
    assert r.hget(keys.CALLBACKS_ATTEMPTS, f"job:{job_id}") is None
    time.sleep(1.5)  # past the next backoff: delivered, it is not sent again
    assert len(receiver.received) == 3


def test_a_callback_survives_its_workers_death(make_stack, receiver, redis_url):
    st = make_stack(**ENV)
    st.start_api()
    worker = st.start_worker()
    st.wait_ready()
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    body = {"prompt": "a long one", "max_new_tokens": 480, "ignore_eos": True, "callback_url": receiver.url}
    job_id = st.post("/v1/jobs", json=body).json()["id"]
    stackmod.wait_until(lambda: r.xlen(keys.stream(job_id)) > 0, 60, "the job generating", st.procs)
    worker.signal(signal.SIGKILL)
    worker.popen.wait(10)
    st.procs.remove(worker)
    assert not receiver.received
    st.start_worker()
    ((headers, raw),) = receiver.wait_for(1, timeout=120)
    got = _check_signed(headers, raw)
    assert got["id"] == job_id and got["status"] == "succeeded" and got["attempts"] == 2
    assert got["result"]["completion_tokens"] == 480


def test_a_callback_held_by_a_killed_api_is_delivered_by_the_next(make_stack, receiver, redis_url):
    st = make_stack(**ENV)
    api = st.start_api()
    st.start_worker()
    st.wait_ready()
    receiver.plan = ["hang"]
    job_id = st.post("/v1/jobs", json={"prompt": "api dies", "max_new_tokens": 4, "callback_url": receiver.url})
    job_id = job_id.json()["id"]
    receiver.wait_for(1)  # the API is mid-delivery: the receiver holds its request
    api.signal(signal.SIGKILL)
    api.popen.wait(10)
    st.procs.remove(api)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    assert r.zscore(keys.CALLBACKS_DUE, f"job:{job_id}") is not None  # still due: never lost
    st.start_api()  # once the dead one's lease has passed, the new process delivers it
    _, (headers, raw) = receiver.wait_for(2, timeout=60)
    got = _check_signed(headers, raw)
    assert got["id"] == job_id and got["status"] == "succeeded"
    stackmod.wait_until(lambda: r.zscore(keys.CALLBACKS_DUE, f"job:{job_id}") is None, 10, "the entry removed")


def test_a_slow_receiver_holds_one_delivery_not_the_others(db, receiver, monkeypatch):
    """Deliveries run side by side (GENQ_CALLBACK_CONCURRENCY): while the receiver holds the
    first callback (it answers only after its 10 s timeout), the second one is delivered. A real
    Redis and HTTP; the entries' records are stubbed (`_record`: what the body says is not
    the point here)."""
    from webapp.callbacks import CallbackDeliverer

    settings = Settings(callback_allow="127.0.0.1", callback_timeout=10, callback_concurrency=2)
    client = redis.Redis.from_url(db.url, decode_responses=True)
    service = type("Service", (), {"r": client})()
    deliverer = CallbackDeliverer(service, settings)
    ids = [f"job:slow-{uuid.uuid4().hex[:8]}", f"job:next-{uuid.uuid4().hex[:8]}"]
    record = {"callback_url": receiver.url}
    monkeypatch.setattr(deliverer, "_record", lambda member: (record, {"id": member}, time.time()))
    receiver.plan = ["hang"]
    try:
        client.zadd(keys.CALLBACKS_DUE, {ids[0]: time.time() - 1})
        began = time.monotonic()
        assert deliverer.tick() == 1
        receiver.wait_for(1, timeout=10)
        assert time.monotonic() - began < 5  # tick does not wait for the delivery (10 s here)
        client.zadd(keys.CALLBACKS_DUE, {ids[1]: time.time() - 1})
        assert deliverer.tick() == 1
        got = receiver.wait_for(2, timeout=5)  # serially: only after the first one's 10 s
        assert [json.loads(b)["id"] for _, b in got] == ids
        stackmod.wait_until(lambda: client.zscore(keys.CALLBACKS_DUE, ids[1]) is None, 5, "the second delivered")
        assert client.zscore(keys.CALLBACKS_DUE, ids[0]) is not None  # still held
        deliverer.concurrency = 1  # full: nothing more is claimed while one is out
        client.zadd(keys.CALLBACKS_DUE, {"job:third": time.time() - 1})
        assert deliverer.tick() == 0
    finally:
        receiver.release.set()
        deliverer.stop()
        client.zrem(keys.CALLBACKS_DUE, *ids, "job:third")
        client.close()


@pytest.mark.parametrize(
    "url",
    [
        "http://10.1.2.3/hook",  # not the allowed host
        "http://127.0.0.1.example.com/hook",
        "ftp://127.0.0.1/hook",
        "http://user:pw@127.0.0.1/hook",
        "http:///hook",
        "http://127.0.0.1:99999/hook",
    ],
)
def test_a_forbidden_callback_url_is_refused_at_submission(s, url):
    for path, body in (
        ("/v1/jobs", {"prompt": "x", "callback_url": url}),
        ("/v1/completions", {"model": s.name, "prompt": "x", "callback_url": url}),
    ):
        resp = s.post(path, json=body)
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"]["param"] == "callback_url"


def test_without_an_allow_list_only_public_hosts_may_be_called_back():
    settings = Settings(callback_allow="")
    for url in (
        "http://127.0.0.1/x",
        "http://localhost:8000/x",
        "http://[::1]/x",
        "http://192.168.1.5/x",
        "http://169.254.169.254/latest/meta-data",
        "http://10.0.0.1/x",
        "http://0.0.0.0/x",
    ):
        with pytest.raises(APIError) as exc:
            check_url(url, settings)
        assert exc.value.param == "callback_url" and exc.value.status == 400, url
    check_url("https://93.184.216.34/hook", settings)  # a public address
    allow = Settings(callback_allow="127.0.0.1:9000,.internal.example")
    check_url("http://127.0.0.1:9000/x", allow)
    check_url("http://hooks.internal.example/x", allow)
    with pytest.raises(APIError):
        check_url("http://127.0.0.1:9001/x", allow)
    with pytest.raises(APIError):
        check_url("https://93.184.216.34/hook", allow)  # listed hosts only


def test_a_final_status_and_its_callback_are_written_together(store):
    """The entry is due in the call that ends the job, however it ends; none without a URL."""
    from tasks.schemas import JobSpec, JobStatus, SamplingParams

    r = store.r
    made = []
    for url in ("http://127.0.0.1:1/x", None):
        spec = JobSpec(id=str(uuid.uuid4()), model="m", prompt="p", params=SamplingParams(), callback_url=url)
        assert store.create([spec], f"genq.test-{uuid.uuid4().hex[:6]}", 10)[0]
        made.append(spec.id)
    with_url, without = made
    assert r.zscore(keys.CALLBACKS_DUE, f"job:{with_url}") is None  # not while it is queued
    store.start(with_url, "w", "tag")
    assert r.zscore(keys.CALLBACKS_DUE, f"job:{with_url}") is None  # nor while it runs
    assert store.finish(with_url, JobStatus.failed)[0]
    assert store.cancel(without)[0]
    assert r.zscore(keys.CALLBACKS_DUE, f"job:{with_url}") is not None
    assert r.zscore(keys.CALLBACKS_DUE, f"job:{without}") is None
    r.zrem(keys.CALLBACKS_DUE, f"job:{with_url}")


def test_the_signature_is_githubs_scheme():
    body = b'{"id":"x"}'
    assert sign(body, "k") == "sha256=" + hmac.new(b"k", body, hashlib.sha256).hexdigest()


def test_a_batch_calls_back_when_it_ends(s, receiver):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": s.name, "prompt": "b"}}
    up = s.http.post(
        f"{s.base}/v1/files",
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", (json.dumps(line) + "\n").encode())},
        timeout=60,
    )
    assert up.status_code == 200, up.text
    body = {
        "input_file_id": up.json()["id"],
        "endpoint": "/v1/completions",
        "completion_window": "24h",
        "callback_url": receiver.url,
    }
    batch = s.post("/v1/batches", json=body)
    assert batch.status_code == 200, batch.text
    ((headers, raw),) = receiver.wait_for(1)
    got = _check_signed(headers, raw)
    assert got["id"] == batch.json()["id"] and got["status"] == "completed"
    assert got == s.get(f"/v1/batches/{got['id']}").json()
    bad = s.post("/v1/batches", json={**body, "callback_url": "http://10.9.9.9/x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "callback_url"
