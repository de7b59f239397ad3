"""The batch store's steps that keep a batch whole when the process driving it dies or loses
its lock (docs/design.md, "Batches"), on a real Redis without a stack: the feeding cursor moves
only from where its caller read it, a pending line settles once, a batch ends once, and the
input check names a gone or empty file."""

from __future__ import annotations

import io
import json

import pytest
import redis

from tasks import keys
from tasks.config import Settings
from tasks.errors import JobError
from tasks.schemas import JobStatus
from tests.helpers import queued_job
from webapp.batches.files import FileStore
from webapp.batches.store import BatchStore
from webapp.batches.validation import check_input
from webapp.protocol.batches import BatchRequest

LINES = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}} for i in range(3)]


@pytest.fixture(params=["redis", "disk"])
def stores(request, redis_url, tmp_path):
    """The stores with files in Redis, and with GENQ_FILES_DIR (tests/test_files_dir.py)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    settings = Settings(files_dir=str(tmp_path) if request.param == "disk" else None)
    files = FileStore(client, settings)
    yield files, BatchStore(client, settings, files)
    client.close()


def upload(files: FileStore, text: str) -> str:
    return files.create(io.BytesIO(text.encode()), "in.jsonl", "").id


def new_batch(files: FileStore, store: BatchStore) -> str:
    file_id = upload(files, "".join(json.dumps(line) + "\n" for line in LINES))
    req = BatchRequest(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    return store.create(req, None).id


def test_the_cursor_moves_only_from_where_its_caller_read_it(stores):
    files, store = stores
    batch_id = new_batch(files, store)
    assert not store.advance(batch_id, (0, 1), (0, 2))  # a stale cursor: nothing happens
    assert store.record(batch_id)["offset"] == "0"
    entry = {"custom_id": "c0", "ids": ["job-a"], "model": "m"}
    assert store.advance(batch_id, (0, 0), (0, 1), "pending", "0:0", json.dumps(entry))
    # The process that read (0, 0) too lost its lock meanwhile: its line is not recorded twice.
    assert not store.advance(batch_id, (0, 0), (0, 1), "pending", "0:0", json.dumps({**entry, "ids": ["job-b"]}))
    assert store.advance(batch_id, (0, 1), (0, 2), "error", "", "an error line\n")
    rec = store.record(batch_id)
    assert (rec["chunk"], rec["offset"], rec["fed"], rec["failed"], rec["err_bytes"]) == ("0", "2", "2", "1", "14")
    assert store.pending(batch_id) == {"0:0": entry}
    assert store.pending_count(batch_id) == 1 and store.pending_of([batch_id, "batch_gone"]) == [entry]
    assert store.job_statuses(["job-a"]) == [None] and store.job_records(["job-a"]) == {"job-a": {}}


def test_a_line_settles_once_and_a_batch_ends_once(stores):
    files, store = stores
    batch_id = new_batch(files, store)
    store.advance(batch_id, (0, 0), (0, 1), "pending", "0:0", json.dumps({"custom_id": "c0", "ids": ["j"]}))
    assert store.settle(batch_id, "0:0", "out", "an output line\n", (3, 4, 1))
    assert not store.settle(batch_id, "0:0", "out", "an output line\n", (3, 4, 1))
    store.write_expired(batch_id, ["expired 1\n", "expired 2\n"], 1)
    rec = store.record(batch_id)
    assert (rec["completed"], rec["prompt_tokens"], rec["completion_tokens"], rec["cached_tokens"]) == (
        "1",
        "3",
        "4",
        "1",
    )
    assert (rec["failed"], rec["fed"], rec["chunk"], rec["offset"], rec["err_bytes"]) == ("2", "3", "1", "0", "20")
    assert store.pending_count(batch_id) == 0

    store.finalize(batch_id, "expired", "")
    rec = store.record(batch_id)
    assert rec["status"] == "expired" and rec["expired_at"] and batch_id not in store.active()
    out, err = rec["output_file_id"], rec["error_file_id"]
    assert "".join(files.chunks(out)) == "an output line\n" and "".join(files.chunks(err)) == "expired 1\nexpired 2\n"
    meta = files.meta(err, "")
    assert (meta["purpose"], meta["bytes"], meta["filename"]) == ("batch_output", "20", f"{batch_id}_error.jsonl")
    assert 0 < store.r.ttl(keys.batch(batch_id)) <= Settings().file_ttl
    store.finalize(batch_id, "cancelled", "")  # a second process's late end changes nothing
    assert store.record(batch_id) == rec


def test_the_input_check_names_a_gone_or_empty_file(stores):
    files, store = stores
    assert check_input(files, "file-gone", None, 1.0) == (
        [{"code": "file_not_found", "message": "input file file-gone is gone", "param": "input_file_id", "line": None}],
        0,
    )
    errors, total = check_input(files, upload(files, "\n  \n"), None, 1.0)
    assert [e["code"] for e in errors] == ["empty_file"] and total == 0
    text = "".join(json.dumps(line) + "\n" for line in (LINES[0], {}, LINES[0]))
    errors, total = check_input(files, upload(files, text.replace("{}", "")), None, 1.0)
    assert [(e["code"], e["line"]) for e in errors] == [("duplicate_custom_id", 3)] and total == 2


def test_release_jobs_shortens_every_key_a_job_left_and_never_lengthens_one(stores, store):
    """A settled line's jobs (webapp/batches/driver.py `collect`): their record, done stream,
    token stream and result backend key expire after the seconds given, unless due sooner; a
    usage row (not a job's) and the keys of other jobs are left alone."""
    _, batches = stores
    r = batches.r
    ok, failed, other = queued_job(store), queued_job(store), queued_job(store)
    for job_id in (ok, failed, other):
        store.start(job_id, "w", "tag")
    assert store.succeed(ok, 1, '{"status": "SUCCESS"}', (3, 4, 0))
    store.finish(failed, JobStatus.failed, JobError("internal", "boom"), fence=1)
    store.finish(other, JobStatus.failed, JobError("internal", "boom"), fence=1)

    def result_key(job_id: str) -> str:
        return f"celery-task-meta-{job_id}"

    for job_id in (failed, other):
        r.set(result_key(job_id), "{}", ex=600)
    r.xadd(keys.stream(ok), {"i": "0"})  # a token stream, here without a TTL at all
    r.expire(keys.done(failed), 10)  # due sooner already: it stays so
    usage = r.smembers(keys.USAGE)
    rows = {row: r.ttl(keys.usage_row(row)) for row in usage}
    assert all(0 < r.ttl(k) <= 600 for k in (keys.job(ok), keys.done(ok), keys.job(failed)))

    # ok: record, done, stream (its result key does not exist); failed: record, result key.
    assert batches.release_jobs({ok: 30, failed: 100, "job-gone": 30}, result_key) == 5
    assert all(0 < r.ttl(k) <= 30 for k in (keys.job(ok), keys.done(ok), keys.stream(ok)))
    assert not r.exists(result_key(ok), result_key("job-gone"), keys.job("job-gone"))
    assert 30 < r.ttl(keys.job(failed)) <= 100 and 30 < r.ttl(result_key(failed)) <= 100
    assert 0 < r.ttl(keys.done(failed)) <= 10
    assert all(r.ttl(k) > 100 for k in (keys.job(other), keys.done(other), result_key(other)))
    assert r.smembers(keys.USAGE) == usage and {row: r.ttl(keys.usage_row(row)) for row in usage} == rows
    # Again, shorter than some: only those move; longer than all: none does.
    assert batches.release_jobs({failed: 50}, result_key) == 2
    assert batches.release_jobs({ok: 1000, failed: 1000}, result_key) == 0
    assert 0 < r.ttl(keys.job(ok)) <= 30 and 0 < r.ttl(keys.job(failed)) <= 50
    assert batches.release_jobs({}, result_key) == 0
    # 0: gone at once (GENQ_BATCH_JOB_TTL=0).
    assert batches.release_jobs({other: 0}, result_key) == 3
    assert not r.exists(keys.job(other), keys.done(other), result_key(other))


def test_a_batch_is_flushed_at_its_creators_threshold_whoever_drives_it(redis_url, tmp_path):
    """GENQ_FILES_DIR and GENQ_FILES_FLUSH_LINES are the creating process's, recorded with the
    batch: another API process on the same Redis (other settings) drives it by them."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    creator = Settings(files_dir=str(tmp_path), files_flush_lines=8)
    files = FileStore(client, creator)
    batch_id = new_batch(files, BatchStore(client, creator, files))
    other = Settings(files_flush_lines=256)  # no GENQ_FILES_DIR either
    driver = BatchStore(client, other, FileStore(client, other))
    spill = driver.spill(driver.record(batch_id))
    assert (spill.root, spill.limit) == (str(tmp_path), 8)
    client.close()
