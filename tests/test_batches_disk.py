"""The Batch API with GENQ_FILES_DIR on the real stack (the tiny hf model behind one worker,
driven by the official `openai` client): what tests/test_batches.py checks in Redis, for a
representative subset (a completions batch with error lines, cancel, expiry; and
tests/test_embeddings.py's embeddings batch, behind an all-MiniLM-L6-v2 worker), and that the
files are on disk while Redis holds at most GENQ_FILES_FLUSH_LINES output lines of a running
batch. (The whole of tests/test_batches.py also passes with GENQ_FILES_DIR in the environment:
every stack's processes inherit it.)"""

from __future__ import annotations

import os
import threading

import openai
import pytest
import redis

from tasks import keys
from tests.test_batches import BATCH_JOB_TTL, jsonl, line, prompt, read_lines, settled_jobs_expire_soon, wait_batch

KEY = "sk-batch-disk-0123456789"
FLUSH = 8  # GENQ_FILES_FLUSH_LINES


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("genq-files"))


@pytest.fixture(scope="module")
def dstack(make_module_stack, files_dir):
    s = make_module_stack(
        GENQ_API_KEYS=KEY,
        GENQ_MAX_BATCH_SIZE="16",
        GENQ_BATCH_WINDOW="32",
        GENQ_RESERVED_SLOTS="0",
        GENQ_FILES_DIR=files_dir,
        GENQ_FILES_FLUSH_LINES=str(FLUSH),
        GENQ_BATCH_JOB_TTL=str(BATCH_JOB_TTL),
    )
    s.start_api()
    s.start_worker()
    s.wait_ready(timeout=180)
    return s


@pytest.fixture(scope="module")
def r(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def oai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


class Longest:
    """The most lines the batch's `out` and `err` lists held, polled while it runs."""

    def __init__(self, r, batch_id: str):
        self.r, self.batch_id, self.most = r, batch_id, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.wait(0.01):
            for part in ("out", "err"):
                self.most = max(self.most, self.r.llen(keys.batch_part(self.batch_id, part)))

    def done(self) -> int:
        self.stop.set()
        self.thread.join(5)
        return self.most


def on_disk(r, files_dir: str, file_id: str, content: bytes) -> None:
    """The file's content is `<dir>/<id>.jsonl`, none of it in Redis."""
    with open(os.path.join(files_dir, f"{file_id}.jsonl"), "rb") as f:
        assert f.read() == content
    assert r.hget(keys.file(file_id), "dir") == files_dir and not r.exists(keys.file_lines(file_id))


def test_a_batch_with_error_lines_runs_with_its_files_on_disk(dstack, r, files_dir):
    client = oai(dstack)
    n, body = 60, {"model": dstack.name, "max_tokens": 3, "temperature": 0}
    lines = [line(i, {**body, "prompt": prompt(i)}) for i in range(n)]
    lines += [line(n + i, {**body, "prompt": "x"}, url="/v1/embeddings") for i in range(12)]  # error lines
    data = jsonl(lines)
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    on_disk(r, files_dir, f.id, data)
    assert client.files.content(f.id).content == data
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    longest = Longest(r, batch.id)
    batch = wait_batch(client, batch.id)
    assert longest.done() <= FLUSH  # the rest went to disk as the batch ran
    assert batch.status == "completed"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (n + 12, n, 12)
    out_bytes = client.files.content(batch.output_file_id).content
    err_bytes = client.files.content(batch.error_file_id).content
    on_disk(r, files_dir, batch.output_file_id, out_bytes)
    on_disk(r, files_dir, batch.error_file_id, err_bytes)
    out, err = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(n))
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"][0]["text"] for o in out)
    assert sorted(e["custom_id"] for e in err) == sorted(f"req-{n + i}" for i in range(12))
    assert all(e["response"]["body"]["error"]["code"] == "invalid_url" for e in err)
    meta = client.files.retrieve(batch.output_file_id)
    assert (meta.bytes, meta.purpose, meta.filename) == (len(out_bytes), "batch_output", f"{batch.id}_output.jsonl")
    assert batch.usage.output_tokens == 3 * n
    # No part file is left; a deleted file goes from the disk too.
    assert not [name for name in os.listdir(files_dir) if name.startswith(batch.id)]
    client.files.delete(batch.output_file_id)
    assert not os.path.exists(os.path.join(files_dir, f"{batch.output_file_id}.jsonl"))
    with pytest.raises(openai.NotFoundError):
        client.files.content(batch.output_file_id)


def test_a_settled_lines_jobs_expire_soon_on_disk(dstack, r, files_dir):
    """tests/test_batches.py's check with the output on disk: the lines' jobs leave Redis after
    GENQ_BATCH_JOB_TTL, the output file stays whole on disk."""
    client = oai(dstack)
    batch = settled_jobs_expire_soon(dstack, r, client, {"Authorization": f"Bearer {KEY}"})
    on_disk(r, files_dir, batch.output_file_id, client.files.content(batch.output_file_id).content)


def test_cancel_on_disk(dstack, r, files_dir):
    client = oai(dstack)
    body = {"model": dstack.name, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    f = client.files.create(
        file=("in.jsonl", jsonl([line(i, {**body, "prompt": prompt(i)}) for i in range(150)])), purpose="batch"
    )
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    batch = wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= FLUSH + 2)
    batch = client.batches.cancel(batch.id)
    assert batch.status == "cancelling"
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.error_file_id is None
    counts = batch.request_counts
    assert counts.total == 150 and counts.failed == 0 and FLUSH + 2 <= counts.completed < 150
    out = read_lines(client, batch.output_file_id)
    assert len(out) == counts.completed and all(o["response"]["status_code"] == 200 for o in out)
    on_disk(r, files_dir, batch.output_file_id, client.files.content(batch.output_file_id).content)


def test_an_expired_batch_on_disk_writes_what_did_not_run_as_batch_expired(dstack, r, files_dir):
    client = oai(dstack)
    n, body = 150, {"model": dstack.name, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    f = client.files.create(
        file=("in.jsonl", jsonl([line(i, {**body, "prompt": prompt(i)}) for i in range(n)])), purpose="batch"
    )
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_batch(client, batch.id, until=lambda b: b.request_counts.completed >= 3)
    longest = Longest(r, batch.id)
    r.hset(keys.batch(batch.id), "expires_at", 1)  # its 24 h are up
    batch = wait_batch(client, batch.id)
    assert longest.done() <= FLUSH + 256  # the expired lines of one input chunk come at once
    assert batch.status == "expired" and batch.expired_at
    counts = batch.request_counts
    assert counts.total == n and counts.completed + counts.failed == n and 3 <= counts.completed < n
    out, err = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    assert len(out) == counts.completed and len(err) == counts.failed
    assert sorted(o["custom_id"] for o in out + err) == sorted(f"req-{i}" for i in range(n))
    assert all(e["response"] is None and e["error"]["code"] == "batch_expired" for e in err)
    on_disk(r, files_dir, batch.error_file_id, client.files.content(batch.error_file_id).content)


def test_an_embeddings_batch_on_disk(make_stack, r, files_dir):
    """tests/test_embeddings.py's batch (all-MiniLM-L6-v2 behind an embed worker) on disk: the
    output lines are OpenAI's, their vectors 384 floats, the refused lines error lines."""
    from scripts import embedmodels
    from scripts import stack as stackmod

    s = make_stack(GENQ_FILES_DIR=files_dir, GENQ_FILES_FLUSH_LINES=str(FLUSH), GENQ_API_KEYS=KEY)
    s.env["GENQ_MODEL"] = str(embedmodels.ensure("minilm"))
    s.env["GENQ_METRICS_PORT"] = str(stackmod.free_port())
    s.start_api()
    s.start_worker()
    s.wait_ready(timeout=180)
    client = oai(s)
    n = 40
    lines = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": s.name, "input": [f"line {i}", "the river"]},
        }
        for i in range(n)
    ]
    lines.append({"custom_id": "empty", "method": "POST", "url": "/v1/embeddings", "body": {"input": ""}})
    lines.append({"custom_id": "other", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}})
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    longest = Longest(r, batch.id)
    batch = wait_batch(client, batch.id, timeout=180)
    assert longest.done() <= FLUSH
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (n + 2, n, 2)
    out, err = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"e-{i}" for i in range(n))
    for o in out:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and o["error"] is None and body["object"] == "list"
        assert [len(d["embedding"]) for d in body["data"]] == [384, 384]
    assert batch.usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in out) > 0
    assert {e["custom_id"]: e["response"]["status_code"] for e in err} == {"empty": 400, "other": 400}
    on_disk(r, files_dir, batch.output_file_id, client.files.content(batch.output_file_id).content)
    on_disk(r, files_dir, batch.error_file_id, client.files.content(batch.error_file_id).content)
