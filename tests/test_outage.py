"""Redis going away and coming back, clients going away, requests too large for the queue.

While Redis is down every job endpoint answers 503 `broker_unavailable` (JSON, Retry-After) at
once, open streams end with an `error` event, and the API serves again, without a restart,
once Redis is back. A client that hangs up on a blocking call or a stream has its jobs
cancelled.
"""

from __future__ import annotations

import json
import socket
import time
import uuid

import redis
import requests

from scripts import stack as stackmod
from tasks.config import Settings
from tasks.schemas import JobStatus
from tests.helpers import KillableRedis, sse_events, submit
from webapp import create_app
from webapp.service import WORKERS_CACHE_S


def _error(resp: requests.Response) -> dict:
    assert resp.headers.get("Content-Type", "").startswith("application/json"), resp.text
    return resp.json()["error"]


def test_redis_outage_is_503_at_once_and_the_api_recovers(make_stack, tmp_path):
    db = KillableRedis(tmp_path)
    s = make_stack(REDIS_URL=db.url, GENQ_ENGINE="echo")
    try:
        s.start_api()
        worker = s.start_worker()
        s.wait_ready()
        assert s.post("/basic_generate", json={"prompt": "one two", "max_new_tokens": 1}).status_code == 200
        done = submit(s, prompt="one two", max_new_tokens=1)
        assert s.get(f"/v1/jobs/{done}?wait=30").json()["status"] == "succeeded"

        # No worker from here on (whether one survives an outage is the worker's business):
        # this job stays queued, its stream stays open, and both must outlive the outage.
        worker.stop()
        s.procs.remove(worker)  # stopped on purpose: readiness checks must not count it
        queued = submit(s, prompt="three four five", max_new_tokens=2)
        stream = s.http.get(f"{s.base}/v1/jobs/{queued}/stream", stream=True, timeout=30)
        assert stream.status_code == 200

        db.kill()
        killed = time.monotonic()
        events = sse_events(stream)
        stream.close()
        assert time.monotonic() - killed < 10
        assert events and events[-1]["event"] == "error", events
        assert json.loads(events[-1]["data"])["error"]["code"] == "broker_unavailable"

        time.sleep(WORKERS_CACHE_S)  # no answer from the API's cache of live workers
        resp = s.get("/readyz", timeout=5)
        assert resp.status_code == 503 and "Retry-After" in resp.headers
        err = _error(resp)
        assert err["code"] == "broker_unavailable" and "Redis" in err["message"], err

        body = {"prompt": "one two", "max_new_tokens": 1}
        calls = [
            ("POST", "/v1/jobs", body),
            ("GET", f"/v1/jobs/{done}", None),
            ("GET", f"/v1/jobs/{queued}?wait=10", None),
            ("POST", f"/v1/jobs/{queued}/cancel", None),
            ("GET", f"/v1/jobs/{queued}/stream", None),
            ("POST", "/basic_generate", body),
            ("POST", "/generate", {"prompts": ["one", "two"], "max_new_tokens": 1}),
            ("POST", "/generate_stream", body),
            ("POST", "/generate_vllm", {"prompts": ["one"], "max_new_tokens": 1}),
            ("POST", "/v1/completions", {"prompt": "one two", "max_tokens": 1}),
            ("POST", "/v1/completions", {"prompt": "one two", "max_tokens": 1, "stream": True}),
            ("GET", "/v1/models", None),
        ]
        for method, path, payload in calls:
            started = time.monotonic()
            resp = s.http.request(method, s.base + path, json=payload, timeout=5)
            took = time.monotonic() - started
            assert resp.status_code == 503, (method, path, resp.status_code, resp.text)
            assert _error(resp)["code"] == "broker_unavailable", (method, path, resp.text)
            assert int(resp.headers["Retry-After"]) >= 1, (method, path)
            assert took < 5, (method, path, took)

        # Back on the same port and data: the same API serves again, without a restart.
        db.start()
        back = time.monotonic()
        stackmod.wait_until(
            lambda: s.post("/v1/jobs", json=body, timeout=5).status_code == 202, 15, "the API to serve again"
        )
        assert time.monotonic() - back < 15
        assert s.get(f"/v1/jobs/{done}").json()["status"] == "succeeded"
        s.start_worker()
        s.wait_ready()
        job = s.get(f"/v1/jobs/{queued}?wait=30").json()
        assert job["status"] == "succeeded" and job["result"]["text"] == " four five", job
        resp = s.post("/basic_generate", json={"prompt": "six seven", "max_new_tokens": 1}, timeout=30)
        assert resp.status_code == 200 and resp.json() == {"generated_text": "six seven seven"}
    finally:
        s.stop()
        db.stop()


# -- clients that hang up ------------------------------------------------------------------------

# Many long jobs on a worker that batches few of them: the call lasts long enough to hang up
# on, and a follow-up job is served soon after only if the abandoned jobs were cancelled.
PROMPTS = [f"prompt number {i}" for i in range(40)]
LONG = {"max_new_tokens": 480, "ignore_eos": True}


def _jobs_of(r: redis.Redis, model: str) -> dict[str, str]:
    """Status by job id of every job of this model."""
    out = {}
    for key in r.scan_iter("genq:job:*", count=1000, _type="hash"):  # not a recovery lock or mark
        rec = r.hmget(key, ["model", "status"])
        if rec[0] == model:
            out[key.rsplit(":", 1)[-1]] = rec[1]
    return out


def _assert_abandoned_jobs_cancelled(s, r: redis.Redis, earlier: set[str]) -> None:
    def new_jobs() -> dict[str, str]:
        return {k: v for k, v in _jobs_of(r, s.name).items() if k not in earlier}

    def all_ended() -> bool:
        jobs = new_jobs()
        active = {JobStatus.queued.value, JobStatus.running.value}
        return len(jobs) == len(PROMPTS) and not active & set(jobs.values())

    stackmod.wait_until(all_ended, 10, "the abandoned jobs to be cancelled", s.procs)
    statuses = list(new_jobs().values())
    # A few may have finished before the hang-up was noticed; the rest never ran to the end.
    assert statuses.count(JobStatus.cancelled.value) >= len(PROMPTS) // 2, statuses

    # The worker is free again: a short job is served at once, not after the abandoned ones.
    started = time.monotonic()
    resp = s.post("/basic_generate", json={"prompt": "Hello", "max_new_tokens": 4}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert time.monotonic() - started < 5


def _hang_up_after(port: int, path: str, body: dict, seconds: float) -> bytes:
    """Send a request on a raw socket, close the connection after `seconds`; what came back."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=seconds) as sock:
        sock.sendall(head.encode() + data)
        received = b""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
    return received


def test_a_client_that_hangs_up_has_its_jobs_cancelled(make_stack, redis_url):
    s = make_stack(GENQ_MAX_BATCH_SIZE="4")
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        s.start_api()
        s.start_worker()
        s.wait_ready()

        # A blocking call: nothing came back yet when the client hangs up.
        assert _hang_up_after(s.port, "/generate", {"prompts": PROMPTS, **LONG}, 1.0) == b""
        _assert_abandoned_jobs_cancelled(s, r, set())

        # A stream: the client reads its first tokens, then hangs up.
        body = {"prompt": PROMPTS, "max_tokens": LONG["max_new_tokens"], "ignore_eos": True, "stream": True}
        earlier = set(_jobs_of(r, s.name))
        got = _hang_up_after(s.port, "/v1/completions", body, 2.0)
        assert b"200 OK" in got and b"data: " in got, got[:300]
        _assert_abandoned_jobs_cancelled(s, r, earlier)
    finally:
        s.stop()
        r.close()


def test_more_prompts_than_the_queue_holds_is_413_not_429(redis_url):
    settings = Settings(redis_url=redis_url, model=f"nobody-{uuid.uuid4().hex[:8]}", max_queue_depth=5)
    app = create_app(settings)
    with app.test_client() as c:
        for path, body in (
            ("/generate", {"prompts": ["a"] * 6}),
            ("/generate_vllm", {"prompts": ["a"] * 6}),
            ("/v1/completions", {"prompt": ["a"] * 6}),
        ):
            resp = c.post(path, json=body)
            assert resp.status_code == 413, (path, resp.get_data(as_text=True))
            err = resp.get_json()["error"]
            assert err["code"] == "too_many_prompts" and "5" in err["message"], err
        # As many as fit are not refused for their number (no worker serves this model).
        resp = c.post("/generate", json={"prompts": ["a"] * 5})
        assert resp.status_code == 503 and resp.get_json()["error"]["code"] == "no_worker"
