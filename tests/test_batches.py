"""OpenAI's Batch API (/v1/files, /v1/batches) on the real stack: the tiny hf model behind one
worker and an API with two keys, driven by the official `openai` client, by genqueue's own
Client.run_batch and by `genq batch`. What it checks: the output of a 200-line batch is the
output of the same prompts run as single greedy jobs; a malformed file is refused or errors
per line as OpenAI documents; cancel stops what has not started; batch lines wait behind
interactive jobs (priority); a batch goes on after its API is SIGKILLed and restarted, and
after a worker running its lines is SIGKILLed (on a stack of two workers); another key sees
none of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import openai
import pytest
import redis
import requests

from genqueue import Client
from scripts import stack as stackmod
from tasks import keys

ROOT = Path(__file__).resolve().parent.parent
ALICE = "sk-batch-alice-0123456789"
BOB = "sk-batch-bob-0123456789"
CAPACITY = 16  # the worker's batch size: at most this many jobs run (or are prefetched) at once
WINDOW = 64  # lines of one batch on the queue at once (GENQ_BATCH_WINDOW)
MAX_FILE = 100_000  # GENQ_MAX_FILE_BYTES
# GENQ_BATCH_JOB_TTL of the module's stacks (here and tests/test_batches_disk.py): a settled line's
# jobs expire this long after it (the default, 60 s, in the other modules' stacks).
BATCH_JOB_TTL = 120
# The default heartbeat, as tests/test_recovery.py (the test stacks beat faster, to be quick).
DEFAULT_BEAT = {"GENQ_HEARTBEAT_INTERVAL": "2", "GENQ_HEARTBEAT_TTL": "10"}


@pytest.fixture(scope="module")
def bstack(make_module_stack):
    # No reserve: the driver then feeds each batch up to its window (with a reserve it holds no
    # more lines than the workers' rows and half their reserve, tests/test_batch_reserve.py), so
    # that lines wait on the queue for interactive jobs to overtake.
    s = make_module_stack(
        GENQ_API_KEYS=f"{ALICE},{BOB}",
        GENQ_MAX_BATCH_SIZE=str(CAPACITY),
        GENQ_BATCH_WINDOW=str(WINDOW),
        GENQ_API_WORKERS="2",
        GENQ_MAX_FILE_BYTES=str(MAX_FILE),
        GENQ_RESERVED_SLOTS="0",
        GENQ_BATCH_JOB_TTL=str(BATCH_JOB_TTL),
    )
    s.start_api()
    s.start_worker()
    s.wait_ready(timeout=180)  # a busy machine loads even the tiny model slowly
    return s


@pytest.fixture(scope="module")
def r(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def oai(stack, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base + "/v1", api_key=key, max_retries=0, timeout=60)


def auth(key: str = ALICE) -> dict:
    return {"Authorization": f"Bearer {key}"}


def line(i: int, body: dict, url: str = "/v1/completions", custom_id: str | None = None) -> dict:
    return {"custom_id": custom_id or f"req-{i}", "method": "POST", "url": url, "body": body}


def jsonl(lines: list) -> bytes:
    return "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines).encode()


def prompt(i: int) -> str:
    words = ["the", "river", "quiet", "number", "seven", "lamp", "under", "stone", "bright", "cold"]
    return f"{words[i % 10]} {words[(i * 3) % 10]} {words[(i * 7 + 1) % 10]} {i}"


def wait_batch(client: openai.OpenAI, batch_id: str, until=None, timeout: float = 240):
    """The batch once it is final (or once `until(batch)`), polled; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch) if until else batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status} {batch.request_counts}"
        time.sleep(0.2)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(ln) for ln in client.files.content(file_id).text.splitlines() if ln.strip()]


def run_batch(stack, lines: list, key: str = ALICE, **kw):
    client = oai(stack, key)
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", **kw)
    return client, batch


def job_keys_left(r, job_ids: set[str]) -> dict[str, int]:
    """Every key in Redis whose name holds one of these job ids -> its TTL in seconds."""
    names = [k for k in r.scan_iter(count=5000) if any(j in k for j in job_ids)]
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.ttl(name)
    return dict(zip(names, pipe.execute()))


def settled_jobs_expire_soon(stack, r, client: openai.OpenAI, headers: dict):
    """A small batch (with an error line): once it completed, every key its lines' jobs left
    (record, done stream, result) expires within GENQ_BATCH_JOB_TTL (BATCH_JOB_TTL), not
    GENQ_RESULT_TTL (24 h), while the job still answers meanwhile and the output file is
    whole and kept as long as files are. Returns the batch."""
    n, body = 6, {"model": stack.name, "max_tokens": 3, "temperature": 0}
    lines = [line(i, {**body, "prompt": prompt(i)}) for i in range(n)]
    lines.append(line(n, {**body, "prompt": "x"}, url="/v1/embeddings"))  # an error line: no job
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (n + 1, n, 1)
    out = read_lines(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in out) == [f"req-{i}" for i in range(n)]
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"][0]["text"] for o in out)
    ids = {o["response"]["request_id"] for o in out}  # one job per line, its id
    left = job_keys_left(r, ids)
    assert {keys.job(j) for j in ids} | {keys.done(j) for j in ids} <= set(left), left
    assert all(0 < ttl <= BATCH_JOB_TTL for ttl in left.values()), left
    job = stack.get(f"/v1/jobs/{next(iter(ids))}", headers=headers).json()
    assert job["status"] == "succeeded", job
    assert read_lines(client, batch.output_file_id) == out
    assert r.ttl(keys.file(batch.output_file_id)) > BATCH_JOB_TTL
    return batch


def test_a_settled_lines_jobs_expire_soon(bstack, r):
    """Once a line is written, its jobs are no longer the batch's: they leave Redis after
    GENQ_BATCH_JOB_TTL, so that a batch of any size holds no more of its finished lines there
    than its last minutes' (webapp/batches/driver.py `collect`)."""
    batch = settled_jobs_expire_soon(bstack, r, oai(bstack), auth())
    assert r.ttl(keys.file_lines(batch.output_file_id)) > BATCH_JOB_TTL  # the output, in Redis here


def test_openai_client_end_to_end_matches_single_jobs(bstack):
    n, body = 200, {"model": bstack.name, "max_tokens": 3, "temperature": 0}
    prompts = [prompt(i) for i in range(n)]
    client = oai(bstack)
    data = jsonl([line(i, {**body, "prompt": p}) for i, p in enumerate(prompts)])
    f = client.files.create(file=("prompts.jsonl", data), purpose="batch")
    assert (f.object, f.purpose, f.bytes, f.filename) == ("file", "batch", len(data), "prompts.jsonl")
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == data  # stored as uploaded, streamed back

    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", metadata={"run": "e2e"}
    )
    assert batch.status == "validating" and batch.metadata == {"run": "e2e"}
    assert batch.expires_at == batch.created_at + 86_400
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (n, n, 0)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.error_file_id is None
    out = read_lines(client, batch.output_file_id)
    assert len(out) == n and {o["custom_id"] for o in out} == {f"req-{i}" for i in range(n)}
    for o in out:
        assert set(o) == {"id", "custom_id", "response", "error"} and o["error"] is None
        assert o["response"]["status_code"] == 200 and o["response"]["request_id"]
        assert o["response"]["body"]["object"] == "text_completion"
    assert batch.usage.output_tokens == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens > 0

    # The same prompts as single jobs (one per prompt) through /v1/completions: the same texts.
    single = client.completions.create(prompt=prompts, **body)
    expected = {f"req-{c.index}": c.text for c in single.choices}
    got = {o["custom_id"]: o["response"]["body"]["choices"][0]["text"] for o in out}
    assert got == expected

    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    meta = client.files.retrieve(batch.output_file_id)
    assert meta.purpose == "batch_output" and meta.bytes == len(client.files.content(meta.id).content)


def test_batch_usage_counts_prefix_cache_hits(bstack):
    """A long prompt sent once, then as two batch lines: each output line's usage has the
    prefix cache's hits (prompt_tokens_details.cached_tokens > 0), and the batch's
    usage.input_tokens_details.cached_tokens is their sum."""
    client = oai(bstack)
    text = f"[{uuid.uuid4().hex}] " + " ".join(["The quick brown fox jumps over the lazy dog."] * 4)
    body = {"model": bstack.name, "prompt": text, "max_tokens": 2, "temperature": 0}
    warm = client.completions.create(**body).usage
    assert warm.prompt_tokens > 64 and warm.prompt_tokens_details.cached_tokens == 0
    _, batch = run_batch(bstack, [line(i, body) for i in range(2)])
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    usages = [o["response"]["body"]["usage"] for o in read_lines(client, batch.output_file_id)]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert len(cached) == 2 and all(0 < c < warm.prompt_tokens for c in cached)
    assert batch.usage.input_tokens == 2 * warm.prompt_tokens
    assert batch.usage.input_tokens_details.cached_tokens == sum(cached)


def test_malformed_files_fail_or_error_per_line(bstack):
    client = oai(bstack)
    good = {"model": bstack.name, "prompt": "hello there", "max_tokens": 2, "temperature": 0}

    # Bad JSON on line 7: the upload is refused, naming the line.
    rows = [jsonl([line(i, good)]).decode().strip() for i in range(10)]
    rows[6] = '{"custom_id": "req-6", "method": "POST",'
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=("bad.jsonl", "\n".join(rows).encode()), purpose="batch")
    assert exc.value.status_code == 400 and exc.value.body["line"] == 7 and "line 7" in exc.value.body["message"]

    # Lines that are JSON but not batch requests: the batch fails validation, each error with
    # its line, and runs nothing.
    bad_shape = [
        line(0, good),
        {"method": "POST", "url": "/v1/completions", "body": good},
        line(2, good),
        line(3, good, custom_id="req-0"),
        {**line(4, good), "method": "GET"},
    ]
    _, batch = run_batch(bstack, bad_shape)
    batch = wait_batch(client, batch.id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    errors = {(e.line, e.code) for e in batch.errors.data}
    assert errors == {(2, "invalid_request"), (4, "duplicate_custom_id"), (5, "invalid_request")}
    assert batch.request_counts.completed == 0

    # An unknown url and bodies /v1/completions refuses: error lines, the rest runs.
    lines = [
        line(0, good),
        line(1, good, url="/v1/chat/completions"),
        line(2, {**good, "max_tokens": 0}),
        line(3, {**good, "suffix": "!"}),
        line(4, {**good, "frobnicate": True}),
        line(5, {**good, "model": "no-such-model"}),
        "",  # blank lines are skipped
        line(6, good),
    ]
    _, batch = run_batch(bstack, lines)
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 2, 5)
    assert {o["custom_id"] for o in read_lines(client, batch.output_file_id)} == {"req-0", "req-6"}
    errs = {e["custom_id"]: e["response"] for e in read_lines(client, batch.error_file_id)}
    codes = {cid: (resp["status_code"], resp["body"]["error"]["code"]) for cid, resp in errs.items()}
    assert codes == {
        "req-1": (400, "invalid_url"),
        "req-2": (400, "invalid_request"),
        "req-3": (400, "unsupported_parameter"),
        "req-4": (400, "invalid_request"),
        "req-5": (404, "model_not_found"),
    }
    # What the completions route itself says to the same bodies.
    for body, (status, code) in [
        ({**good, "suffix": "!"}, codes["req-3"]),
        ({**good, "max_tokens": 0}, codes["req-2"]),
    ]:
        resp = requests.post(bstack.base + "/v1/completions", json=body, headers=auth(), timeout=60)
        assert (resp.status_code, resp.json()["error"]["code"]) == (status, code)

    # Requests that are wrong as a whole are 4xx with a JSON error.
    for bad, status in [
        ({"input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"}, 404),
        ({"input_file_id": "x", "endpoint": "/v1/responses", "completion_window": "24h"}, 400),
        ({"input_file_id": "x", "endpoint": "/v1/completions", "completion_window": "1h"}, 400),
    ]:
        resp = requests.post(bstack.base + "/v1/batches", json=bad, headers=auth(), timeout=30)
        assert resp.status_code == status and resp.json()["error"]["code"], resp.text
    resp = requests.post(
        bstack.base + "/v1/files", data={"purpose": "fine-tune"}, files={"file": b"{}\n"}, headers=auth(), timeout=30
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "purpose"
    # Past GENQ_MAX_FILE_BYTES: just past it (seen while reading), and far past it (the body).
    row = json.dumps(line(0, good)) + "\n"
    for size in (MAX_FILE + len(row), 3 * MAX_FILE):
        big = (row * (size // len(row) + 1)).encode()
        with pytest.raises(openai.APIStatusError) as exc:
            client.files.create(file=("big.jsonl", big), purpose="batch")
        assert exc.value.status_code == 413 and exc.value.body["code"] == "file_too_large"


def test_cancel_stops_what_has_not_started(bstack, r):
    client = oai(bstack)
    body = {"model": bstack.name, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    _, batch = run_batch(bstack, [line(i, {**body, "prompt": prompt(i)}) for i in range(150)])
    batch = wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 3)
    batch = client.batches.cancel(batch.id)
    assert batch.status == "cancelling" and batch.cancelling_at
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    counts = batch.request_counts
    assert counts.total == 150 and counts.failed == 0 and 3 <= counts.completed < 150
    out = read_lines(client, batch.output_file_id)
    assert len(out) == counts.completed and all(o["response"]["status_code"] == 200 for o in out)
    assert r.zcard(f"genq:queued:genq.{bstack.name}") == 0  # nothing of it left waiting
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_an_expired_batch_writes_what_did_not_run_as_batch_expired(bstack, r):
    client = oai(bstack)
    n, body = 150, {"model": bstack.name, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    _, batch = run_batch(bstack, [line(i, {**body, "prompt": prompt(i)}) for i in range(n)])
    wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 3)
    r.hset(f"genq:batch:{batch.id}", "expires_at", int(time.time()) - 1)  # its 24 h are up
    batch = wait_batch(client, batch.id)
    assert batch.status == "expired" and batch.expired_at
    counts = batch.request_counts
    assert counts.total == n and counts.completed + counts.failed == n and 3 <= counts.completed < n
    out, err = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    assert len(out) == counts.completed and len(err) == counts.failed
    assert sorted(o["custom_id"] for o in out + err) == sorted(f"req-{i}" for i in range(n))
    assert all(e["response"] is None and e["error"]["code"] == "batch_expired" for e in err)
    assert r.zcard(f"genq:queued:genq.{bstack.name}") == 0


def test_interactive_jobs_overtake_waiting_batch_lines(bstack, r):
    client = oai(bstack)
    # Lines long enough that the worker's 16 rows cannot keep up with the driver: 16-token
    # lines on a quiet machine ran as fast as they were fed, and none waited on the queue.
    body = {"model": bstack.name, "max_tokens": 128, "temperature": 0, "ignore_eos": True}
    _, batch = run_batch(bstack, [line(i, {**body, "prompt": prompt(i)}) for i in range(120)])
    queued_key = f"genq:queued:genq.{bstack.name}"
    deadline = time.monotonic() + 120
    while r.zcard(queued_key) < WINDOW - 2 * CAPACITY:
        assert time.monotonic() < deadline, "the batch never filled its window"
        time.sleep(0.05)
    waiting = r.zrange(queued_key, 0, -1)  # batch lines on the queue, not started
    resp = requests.post(
        bstack.base + "/v1/jobs", json={"prompt": "urgent", "max_new_tokens": 4}, headers=auth(), timeout=30
    )
    job_id = resp.json()["id"]
    job = requests.get(bstack.base + f"/v1/jobs/{job_id}?wait=120", headers=auth(), timeout=150).json()
    assert job["status"] == "succeeded"
    client.batches.cancel(batch.id)
    started = job["timings"]["started"]
    before = [j for j in waiting if float(r.hget(f"genq:job:{j}", "started") or "inf") < started]
    # Without priority, every waiting line (>= 32) would start first; with it, at most the
    # ones a worker slot had already taken from the broker when the job arrived.
    assert len(waiting) >= WINDOW - 2 * CAPACITY and len(before) <= CAPACITY, (len(waiting), len(before))
    assert {r.hget(f"genq:job:{j}", "priority") for j in waiting} == {"4"}
    wait_batch(client, batch.id)


def test_a_batch_survives_an_api_kill(bstack):
    client = oai(bstack)
    n, body = 48, {"model": bstack.name, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    _, batch = run_batch(bstack, [line(i, {**body, "prompt": prompt(i)}) for i in range(n)])
    wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 5)
    # Every API process dies at once (the lock it held on the batch expires by itself).
    api = next(p for p in bstack.procs if p.name == "api" and p.alive())
    api.signal(signal.SIGKILL)
    api.popen.wait(10)
    bstack.procs.remove(api)  # reaped: wait_ready checks that the stack's procs live
    bstack.start_api()
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (n, n, 0)
    out = read_lines(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(n))  # each once
    assert all(o["response"]["body"]["choices"][0]["finish_reason"] == "length" for o in out)


def test_a_batch_survives_a_worker_kill(make_stack, reference, r):
    """Two workers; the one running most of a batch's lines is SIGKILLed mid-run. Its lines'
    jobs are ordinary jobs: the workers' recovery (worker/recovery.py) runs them again on the
    survivor, and the batch completes with every line once, as if no worker had died."""
    n, tokens = 80, 32
    s = make_stack(
        GENQ_API_KEYS=ALICE, GENQ_MAX_BATCH_SIZE=str(CAPACITY), GENQ_BATCH_WINDOW=str(WINDOW), **DEFAULT_BEAT
    )
    try:
        s.start_api()
        workers = [s.start_worker() for _ in range(2)]
        stackmod.wait_until(lambda: len(s.get("/readyz").json().get("workers", [])) == 2, 180, "2 workers", s.procs)
        body = {"model": s.name, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        prompts = [prompt(i) for i in range(n)]
        client, batch = run_batch(s, [line(i, {**body, "prompt": p}) for i, p in enumerate(prompts)])

        running: dict[str, set[str]] = {}  # worker name -> the batch's jobs it runs

        def lines_running() -> bool:
            running.clear()
            ids = [j for v in r.hvals(keys.batch_part(batch.id, "pending")) for j in json.loads(v)["ids"]]
            pipe = r.pipeline(transaction=False)
            for job_id in ids:
                pipe.hmget(keys.job(job_id), "status", "worker")
            for job_id, (status, worker) in zip(ids, pipe.execute()):
                if status == "running":
                    running.setdefault(worker, set()).add(job_id)
            return bool(running)

        stackmod.wait_until(lines_running, 120, "the batch's lines to run", s.procs)
        name = max(running, key=lambda w: len(running[w]))
        moved = running[name]
        (victim,) = [w for w in workers if f"-{w.pid}@" in name]
        victim.signal(signal.SIGKILL)
        victim.popen.wait(10)
        s.procs.remove(victim)  # reaped: wait_until checks that the stack's procs live
        (survivor,) = [w for w in workers if w is not victim]

        batch = wait_batch(client, batch.id, timeout=240)
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (n, n, 0)
        assert batch.error_file_id is None
        out = read_lines(client, batch.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(n))  # each once
        assert batch.usage.output_tokens == n * tokens  # no line's tokens counted twice
        assert all(o["response"]["body"]["choices"][0]["finish_reason"] == "length" for o in out)
        # Greedy: every line's text is its prompt's run alone, the killed worker's lines (run
        # again) included. One torch thread: 2-4x faster on a shared 2-core machine
        # (docs/benchmarks.md), where 80 references with two took ~50 s.
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for o in out:
                text = o["response"]["body"]["choices"][0]["text"]
                assert text == reference(prompts[int(o["custom_id"][4:])], tokens), o["custom_id"]
        finally:
            torch.set_num_threads(threads)
        assert {o["response"]["request_id"] for o in out} >= moved  # one job per line, its id
        # The kill hit lines that had not finished: their jobs ran again, on the survivor.
        recs = {j: r.hgetall(keys.job(j)) for j in moved}
        again = [rec for rec in recs.values() if rec.get("attempts") == "2"]
        assert again, f"no line of the killed worker was run again: {recs}"
        assert all(f"-{survivor.pid}@" in rec["worker"] and rec["status"] == "succeeded" for rec in again), again
    finally:
        s.stop()


def test_files_and_batches_belong_to_their_key(bstack):
    alice, bob = oai(bstack, ALICE), oai(bstack, BOB)
    body = {"model": bstack.name, "prompt": "mine", "max_tokens": 2}
    _, batch = run_batch(bstack, [line(0, body)], key=ALICE)
    f = batch.input_file_id
    for call in (
        lambda: bob.files.retrieve(f),
        lambda: bob.files.content(f),
        lambda: bob.files.delete(f),
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.batches.cancel(batch.id),
        lambda: bob.batches.create(input_file_id=f, endpoint="/v1/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in bob.batches.list().data]
    assert requests.get(bstack.base + f"/v1/batches/{batch.id}", timeout=30).status_code == 401
    batch = wait_batch(alice, batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(batch.output_file_id)
    assert read_lines(alice, batch.output_file_id)[0]["custom_id"] == "req-0"

    # Listing pages newest first with after/limit/has_more.
    ids = [run_batch(bstack, [line(0, body)], key=BOB)[1].id for _ in range(3)]
    page = bob.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    page = bob.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in page.data] == [ids[0]] and not page.has_more
    # Deleting a file: gone for its owner too.
    assert alice.files.delete(f).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(f)


def test_genq_client_and_cli_against_the_real_server(bstack, tmp_path):
    prompts = [prompt(i) for i in range(12)]
    with Client(bstack.base, api_key=ALICE) as c:
        results = c.run_batch(
            [{"prompt": p, "max_tokens": 4, "temperature": 0} for p in prompts],
            model=bstack.name,
            progress=False,
            poll_interval=0.2,
            timeout=240,
        )
    assert [x["custom_id"] for x in results] == [f"request-{i}" for i in range(12)]
    texts = [x["response"]["body"]["choices"][0]["text"] for x in results]
    single = oai(bstack).completions.create(model=bstack.name, prompt=prompts, max_tokens=4, temperature=0)
    assert texts == [ch.text for ch in single.choices]

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(
        jsonl(
            [
                line(i, {"model": bstack.name, "prompt": p, "max_tokens": 4, "temperature": 0})
                for i, p in enumerate(prompts[:5])
            ]
        )
    )
    genq = Path(sys.executable).parent / "genq"
    argv = [str(genq)] if genq.exists() else [sys.executable, "-m", "genqueue"]
    env = {**os.environ, "GENQ_URL": bstack.base, "GENQ_API_KEY": ALICE}
    out = subprocess.run(
        argv + ["batch", str(src), "-o", str(dst), "--poll", "0.2", "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    got = [json.loads(ln) for ln in dst.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [f"req-{i}" for i in range(5)]
    assert [g["response"]["body"]["choices"][0]["text"] for g in got] == texts[:5]


def test_the_window_leaves_room_for_interactive_jobs():
    from types import SimpleNamespace

    from tasks.config import Settings
    from webapp.auth import ApiKey
    from webapp.batches.driver import BatchDriver

    def window(key=None, **settings):
        return BatchDriver.window(SimpleNamespace(settings=Settings(**settings)), key)

    assert window(batch_window=256, max_queue_depth=1000) == 256
    assert window(batch_window=256, max_queue_depth=100) == 50  # half the queue's depth
    assert window(ApiKey("k", b"", max_queued=10), batch_window=256, max_queue_depth=1000) == 5
    assert window(ApiKey("k", b"", max_queued=1), batch_window=256, max_queue_depth=1) == 1


def test_batch_lines_take_n_and_logprobs_as_the_completions_route(bstack):
    body = {
        "model": bstack.name,
        "prompt": ["the river", "cold stone"],
        "max_tokens": 4,
        "temperature": 0,
        "n": 2,
        "logprobs": 1,
    }
    echo = {**body, "logprobs": None, "echo": True}
    client, batch = run_batch(bstack, [line(0, body), line(1, echo)])
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    out = {o["custom_id"]: o["response"]["body"] for o in read_lines(client, batch.output_file_id)}
    for cid, req in (("req-0", body), ("req-1", echo)):
        direct = requests.post(bstack.base + "/v1/completions", json=req, headers=auth(), timeout=120).json()
        got, want = out[cid]["choices"], direct["choices"]
        assert [(c["index"], c["text"]) for c in got] == [(c["index"], c["text"]) for c in want] and len(got) == 4
        for g, w in zip(got, want):
            assert (g["logprobs"] is None) == (w["logprobs"] is None) == (req["logprobs"] is None)
            if g["logprobs"]:
                assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
                assert g["logprobs"]["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-4)


def test_batch_line_errors_name_the_request_fields_as_the_route(bstack):
    """A line's error says `max_tokens` (message and param), as /v1/completions says it, not
    the job's `max_new_tokens`."""
    body = {"model": bstack.name, "prompt": "the river", "max_tokens": 10**6}
    client, batch = run_batch(bstack, [line(0, body)])
    batch = wait_batch(client, batch.id)
    (err,) = read_lines(client, batch.error_file_id)
    direct = requests.post(bstack.base + "/v1/completions", json=body, headers=auth(), timeout=60).json()
    assert err["response"]["body"] == direct
    assert direct["error"]["param"] == "max_tokens" and "max_new_tokens" not in json.dumps(err)
