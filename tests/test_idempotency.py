"""Safe retries (webapp/idempotency.py): a request retried with its `Idempotency-Key` gets the
jobs (file, batch) the first one created, never new ones; the key with another body is a 409;
concurrent requests with one key create one job. Real Redis, gunicorn and a tiny-model worker."""

from __future__ import annotations

import io
import json
import threading
import uuid

import pytest
import redis
import requests

from tasks import keys
from tests.helpers import sse_events
from webapp.errors import APIError
from webapp.idempotency import IdempotencyStore


@pytest.fixture(scope="module")
def s(make_module_stack):
    st = make_module_stack(GENQ_MAX_BATCH_SIZE="8")
    st.start_api()
    st.start_worker()
    st.wait_ready()
    return st


def key() -> dict[str, str]:
    return {"Idempotency-Key": f"retry-{uuid.uuid4().hex}"}


def _jobs_with_prompt(redis_url: str, prompt: str) -> list[str]:
    """The ids of the job records whose prompt is `prompt` (each test's prompts are its own)."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    found = []
    for k in r.scan_iter(match=keys.job("*"), count=1000):
        if k.count(":") != 2:
            continue
        spec = r.hget(k, "spec")
        if spec and json.loads(spec)["prompt"] == prompt:
            found.append(k.rsplit(":", 1)[1])
    r.close()
    return found


def test_a_retry_without_the_header_creates_a_second_job(s, redis_url):
    body = {"prompt": f"no key {uuid.uuid4().hex[:6]}", "max_new_tokens": 4}
    a = s.post("/v1/jobs", json=body)
    b = s.post("/v1/jobs", json=body)
    assert a.status_code == b.status_code == 202
    assert a.json()["id"] != b.json()["id"]
    assert len(_jobs_with_prompt(redis_url, body["prompt"])) == 2


def test_the_python_client_sends_the_key(s, redis_url):
    from genqueue import Client

    prompt = f"client {uuid.uuid4().hex[:6]}"
    k = uuid.uuid4().hex
    with Client(s.base) as client:
        first = client.submit(prompt, idempotency_key=k, max_new_tokens=2)
        assert client.submit(prompt, idempotency_key=k, max_new_tokens=2) == first
    assert _jobs_with_prompt(redis_url, prompt) == [first]


def test_a_retry_with_the_header_gets_the_same_job(s, redis_url):
    h = key()
    body = {"prompt": f"one job {uuid.uuid4().hex[:6]}", "max_new_tokens": 4}
    a = s.post("/v1/jobs", json=body, headers=h)
    # The same body in another key order and spacing is the same request.
    raw = json.dumps(dict(reversed(list(body.items()))), indent=2)
    b = s.post("/v1/jobs", data=raw, headers={**h, "Content-Type": "application/json"})
    assert a.status_code == b.status_code == 202, b.text
    assert a.json()["id"] == b.json()["id"]
    assert b.headers["Location"].endswith(a.json()["id"])
    assert _jobs_with_prompt(redis_url, body["prompt"]) == [a.json()["id"]]


def test_a_blocking_retry_gets_the_first_requests_result(s, redis_url):
    h = key()
    body = {"model": s.name, "prompt": f"blocking {uuid.uuid4().hex[:6]}", "max_tokens": 8, "temperature": 1.0}
    a = s.post("/v1/completions", json=body, headers=h)
    b = s.post("/v1/completions", json=body, headers=h)
    assert a.status_code == b.status_code == 200, b.text
    # Sampled (temperature 1, no seed): a second job would almost surely differ; one job it is.
    assert a.json()["id"] == b.json()["id"]
    assert a.json()["choices"] == b.json()["choices"]
    assert len(_jobs_with_prompt(redis_url, body["prompt"])) == 1
    # Without the key, the same body runs again.
    c = s.post("/v1/completions", json=body)
    assert c.status_code == 200 and c.json()["id"] != a.json()["id"]


def test_a_client_that_gives_up_and_retries_gets_the_same_jobs_result(s, redis_url):
    """The first call's client times out while its job runs: the job is kept (not cancelled as
    a key-less call's would be), and the retry gets its result."""
    h = key()
    prompt = f"gave up {uuid.uuid4().hex[:6]}"
    body = {"model": s.name, "prompt": prompt, "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(requests.Timeout):
        s.post("/v1/completions", json=body, headers=h, timeout=0.3)
    again = s.post("/v1/completions", json=body, headers=h)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["completion_tokens"] == 480
    (job_id,) = _jobs_with_prompt(redis_url, prompt)
    assert again.json()["id"] == f"cmpl-{job_id}"


def test_a_teaching_route_retry_gets_the_same_completion(s, redis_url):
    h = key()
    prompt = f"teaching {uuid.uuid4().hex[:6]}"
    body = {"prompts": [prompt], "max_new_tokens": 6, "temperature": 1.0}
    a = s.post("/generate", json=body, headers=h)
    b = s.post("/generate", json=body, headers=h)
    assert a.status_code == b.status_code == 200
    assert a.json() == b.json()
    assert len(_jobs_with_prompt(redis_url, prompt)) == 1


def test_a_streamed_retry_follows_the_same_jobs(s, redis_url):
    h = key()
    body = {"model": s.name, "prompt": f"stream {uuid.uuid4().hex[:6]}", "max_tokens": 8, "stream": True}

    def run() -> tuple[set[str], str]:
        with s.http.post(f"{s.base}/v1/completions", json=body, headers=h, stream=True, timeout=60) as resp:
            assert resp.status_code == 200
            chunks = [json.loads(e["data"]) for e in sse_events(resp) if e["data"] != "[DONE]"]
        return {c["id"] for c in chunks}, "".join(c["choices"][0]["text"] for c in chunks if c["choices"])

    ids_a, text_a = run()
    ids_b, text_b = run()
    assert len(ids_a) == 1 and ids_a == ids_b
    assert text_a == text_b and text_a
    assert len(_jobs_with_prompt(redis_url, body["prompt"])) == 1


def test_the_same_key_with_another_body_or_route_is_a_409(s):
    h = key()
    assert s.post("/v1/jobs", json={"prompt": "first body", "max_new_tokens": 2}, headers=h).status_code == 202
    resp = s.post("/v1/jobs", json={"prompt": "other body", "max_new_tokens": 2}, headers=h)
    assert resp.status_code == 409
    err = resp.json()["error"]
    assert err["code"] == "idempotency_key_reused" and err["param"] == "Idempotency-Key"
    other_route = s.post("/v1/completions", json={"model": s.name, "prompt": "first body", "max_tokens": 2}, headers=h)
    assert other_route.status_code == 409
    assert other_route.json()["error"]["code"] == "idempotency_key_reused"


@pytest.mark.parametrize("bad", ["", "x" * 256])
def test_a_bad_key_is_a_400(s, bad):
    resp = s.post("/v1/jobs", json={"prompt": "bad key", "max_new_tokens": 2}, headers={"Idempotency-Key": bad})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "Idempotency-Key"
    # Also where the request would queue nothing (the fuzzer's find: /generate with no prompts).
    resp = s.post("/generate", json={"prompts": []}, headers={"Idempotency-Key": bad})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "Idempotency-Key"


def test_concurrent_requests_with_one_key_create_one_job(s, redis_url):
    h = key()
    body = {"prompt": f"concurrent {uuid.uuid4().hex[:6]}", "max_new_tokens": 2}
    replies: list = []
    start = threading.Barrier(8)

    def post() -> None:
        start.wait()
        replies.append(s.post("/v1/jobs", json=body, headers=h))

    threads = [threading.Thread(target=post) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    created = {r.json()["id"] for r in replies if r.status_code == 202}
    # Each either got the job or was told the key is still being created: none made another.
    assert all(r.status_code == 202 or r.json()["error"]["code"] == "idempotency_key_in_use" for r in replies)
    assert len(created) == 1
    assert _jobs_with_prompt(redis_url, body["prompt"]) == list(created)


def test_file_and_batch_retries_get_the_same_ids(s):
    h = key()
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": s.name, "prompt": "b"}}
    content = (json.dumps(line) + "\n").encode()

    def upload(data: bytes):
        files = {"file": ("in.jsonl", io.BytesIO(data))}
        return s.http.post(f"{s.base}/v1/files", data={"purpose": "batch"}, files=files, headers=h, timeout=60)

    a, b = upload(content), upload(content)
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["id"] == b.json()["id"]
    assert upload(content + content).status_code == 409  # another file under the same key
    hb = key()
    body = {"input_file_id": a.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    x = s.post("/v1/batches", json=body, headers=hb)
    y = s.post("/v1/batches", json=body, headers=hb)
    assert x.status_code == y.status_code == 200, y.text
    assert x.json()["id"] == y.json()["id"]


def test_claims_are_per_owner_and_a_failed_request_frees_its_key(redis_url):
    store = IdempotencyStore(redis.Redis.from_url(redis_url, decode_responses=True), wait_s=0.1)
    k = uuid.uuid4().hex
    rkey, mine, found = store.claim("alice", k, "fp1")
    assert found is None
    # Bob's key of the same name is his own.
    assert store.claim("bob", k, "fp2")[2] is None
    # Alice's is held (no result yet): another request waits, then is told so.
    with pytest.raises(APIError) as exc:
        store.claim("alice", k, "fp1")
    assert exc.value.code == "idempotency_key_in_use"
    store.release(rkey, mine)
    rkey, mine, found = store.claim("alice", k, "fp1")
    assert found is None
    store.done(rkey, "fp1", {"ids": ["j1"]})
    assert store.claim("alice", k, "fp1")[2] == {"ids": ["j1"]}
    with pytest.raises(APIError) as exc:
        store.claim("alice", k, "fp3")
    assert exc.value.code == "idempotency_key_reused"
