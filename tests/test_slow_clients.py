"""No single client holds the API by sending request bodies slowly, and a body cut short is
refused (webapp/bodyguard.py, issue 33): the real API under gunicorn's gevent workers, the echo
engine behind it, raw sockets on the loopback address."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest
import redis

from tasks import keys
from tasks.config import queue_for

KEY = "sk-slow-client-test-0123456789"
OTHER = "sk-slow-client-other-987654321"  # another client's key ...
OTHER_ADDR = "127.0.0.2"  # ... and address (the loopback network is 127/8)


@pytest.fixture(scope="module")
def guarded(make_module_stack):
    s = make_module_stack(
        GENQ_ENGINE="echo",
        GENQ_API_KEYS=f"{KEY},{OTHER}",
        GENQ_BODY_TIMEOUT="2",
        GENQ_MAX_BODIES_PER_CLIENT="4",
        GENQ_API_CONNECTIONS="24",
    )
    s.start_api()
    s.start_worker()
    s.wait_ready()
    return s


def _head(path: str, length: int, key: str = KEY) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return status, json.loads(body)


def _queued(s) -> int:
    r = redis.Redis.from_url(s.env["REDIS_URL"])
    try:
        return r.zcard(keys.queued(queue_for(s.name)))
    finally:
        r.close()


def test_a_body_shorter_than_its_content_length_is_refused_and_nothing_is_queued(guarded):
    body = json.dumps({"prompt": "the whole text", "max_new_tokens": 2}).encode()
    before = _queued(guarded)
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=15) as sock:
        # What arrives is valid JSON on its own: before, it ran as the job.
        sock.sendall(_head("/v1/jobs", len(body) + 50) + body)
        sock.shutdown(socket.SHUT_WR)
        status, error = _response(sock)
    assert status == 400 and error["error"]["code"] == "invalid_body", error
    assert f"{len(body)} of its {len(body) + 50} bytes" in error["error"]["message"]
    assert _queued(guarded) == before
    assert guarded.get("/healthz").status_code == 200


def test_slow_bodies_neither_hold_the_api_nor_reach_a_route(guarded):
    """60 connections (more than the API process's 24) send a body a byte a second: beyond 4 at
    once they are refused at once (429), the 4 are cut at their deadline (408); health checks and
    another client's request are served meanwhile."""
    results: list[tuple[int, str]] = []
    lock = threading.Lock()

    def slow() -> None:
        with socket.create_connection(("127.0.0.1", guarded.port), timeout=20) as sock:
            sock.sendall(_head("/v1/jobs", 1000) + b"{")
            for _ in range(30):  # a byte a second, until the API answers
                if select.select([sock], [], [], 1.0)[0]:
                    break
                sock.sendall(b" ")
            status, error = _response(sock)
            with lock:
                results.append((status, error["error"]["code"]))

    flood = [threading.Thread(target=slow) for _ in range(60)]
    for t in flood:
        t.start()
    time.sleep(0.5)
    try:
        for _ in range(3):
            assert guarded.get("/healthz", timeout=10).status_code == 200
            body = json.dumps({"prompt": "a client of its own", "max_new_tokens": 2}).encode()
            address = ("127.0.0.1", guarded.port)
            with socket.create_connection(address, timeout=20, source_address=(OTHER_ADDR, 0)) as sock:
                sock.sendall(_head("/v1/jobs", len(body), OTHER) + body)
                status, job = _response(sock)
            assert status == 202, job
    finally:
        for t in flood:
            t.join(40)
    assert len(results) == 60, results
    codes = {code for _, code in results}
    assert codes == {"too_many_bodies", "body_timeout"}, results
    assert all((st, code) in ((429, "too_many_bodies"), (408, "body_timeout")) for st, code in results)


def test_blocking_requests_waiting_for_their_jobs_hold_no_body(guarded):
    """Twice GENQ_MAX_BODIES_PER_CLIENT blocking completions at once from one address and key
    (a proxy's many clients look so): their bodies arrived, they wait for their jobs (a sim
    worker: about a second each), and none is refused."""
    import requests

    sim = guarded.name + "-sim"
    guarded.start_worker(GENQ_ENGINE="sim", GENQ_MODEL_NAME=sim, GENQ_SIM_STEP_MS="40")
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": sim, "prompt": "a b c", "max_tokens": 24}
    stack_wait = time.monotonic() + 60
    while requests.post(guarded.base + "/v1/completions", json=body, headers=auth, timeout=60).status_code != 200:
        assert time.monotonic() < stack_wait, "the sim worker did not come up"
        time.sleep(0.5)
    statuses: list[int] = []

    def one() -> None:
        statuses.append(
            requests.post(guarded.base + "/v1/completions", json=body, headers=auth, timeout=120).status_code
        )

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert statuses == [200] * 8
