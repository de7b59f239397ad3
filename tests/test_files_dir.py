"""GENQ_FILES_DIR on a real Redis without a stack: an upload's content and a batch's output on
disk, Redis holding their metadata and at most GENQ_FILES_FLUSH_LINES lines of a running
batch; a flush after a crash mid-append writes each line once; the sweep removes the files
whose records are gone and keeps the live ones (docs/design.md, "Files"). The stack runs in
tests/test_batches_disk.py."""

from __future__ import annotations

import io
import json
import os
import time

import pytest
import redis

from tasks import keys
from tasks.config import Settings
from webapp.batches import disk
from webapp.batches.files import FileStore, chunk_lines
from webapp.batches.store import BatchStore
from webapp.batches.validation import check_input
from webapp.protocol.batches import BatchRequest

LIMIT = 8  # GENQ_FILES_FLUSH_LINES here


@pytest.fixture
def stores(redis_url, tmp_path):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    settings = Settings(files_dir=str(tmp_path / "files"), files_flush_lines=LIMIT)
    files = FileStore(client, settings)
    yield files, BatchStore(client, settings, files)
    client.close()


def request_line(i: int) -> str:
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})


def new_batch(files: FileStore, store: BatchStore, n: int = 3) -> str:
    data = "".join(request_line(i) + "\n" for i in range(n)).encode()
    file_id = files.create(io.BytesIO(data), "in.jsonl", "").id
    req = BatchRequest(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    return store.create(req, None).id


def out_line(i: int) -> str:
    return json.dumps({"custom_id": f"c{i}", "response": {"body": "é" * (i % 5)}}, ensure_ascii=False) + "\n"


def test_an_upload_lives_on_disk_and_cuts_into_the_same_chunks(stores):
    files, _ = stores
    # Lines short and long, one longer than a chunk, and a CRLF one (stored as LF).
    lines = [request_line(i) for i in range(600)]
    lines[7] = json.dumps({"custom_id": "long", "pad": "y" * (3 * disk.CHUNK_BYTES)})
    lines[300] = ""
    data = ("\r\n".join(lines[:2]) + "\r\n" + "\n".join(lines[2:]) + "\n").encode()
    f = files.create(io.BytesIO(data), "in.jsonl", "alice")
    path = disk.content_path(files.dir, f.id)
    stored = "".join(line + "\n" for line in lines)
    assert open(path).read() == stored and f.bytes == len(data)
    assert files.r.hget(keys.file(f.id), "dir") == files.dir and not files.r.exists(keys.file_lines(f.id))
    assert os.listdir(files.dir) == [os.path.basename(path)]  # the temporary upload is gone
    # The chunks, read one by one as the driver does, hold every line once, in order.
    got, i = [], 0
    while (chunk := files.chunk(f.id, i)) is not None:
        assert chunk == "" or chunk.endswith("\n")
        got += chunk_lines(chunk)
        i += 1
    assert got == lines and i > 4 and files.chunk(f.id, i + 5) is None
    assert "".join(files.chunks(f.id)) == stored and b"".join(files.content(f.id)) == stored.encode()
    errors, total = check_input(files, f.id, None, 1.0)  # the long line is no request
    assert [e["line"] for e in errors] == [8] and total == 599
    # A process without GENQ_FILES_DIR reads it too: the file's record says where it is.
    assert "".join(FileStore(files.r, Settings()).chunks(f.id)) == stored
    files.delete(f.id, "alice")
    assert not os.path.exists(path) and files.chunk(f.id, 0) is None


def test_a_bad_upload_leaves_nothing_on_disk(stores):
    files, _ = stores
    with pytest.raises(Exception, match="line 2"):
        files.create(io.BytesIO(b'{"a": 1}\nnot json\n'), "in.jsonl", "")
    assert os.listdir(files.dir) == []


def test_the_out_list_never_holds_more_than_the_threshold(stores):
    files, store = stores
    n = 10 * LIMIT + 3
    batch_id = new_batch(files, store, n)
    out = keys.batch_part(batch_id, "out")
    longest = 0
    for i in range(n):
        # What the driver does with each line: fed, settled, tallied (one Spill per step).
        if i % 5 == 0:
            spill = store.spill(store.record(batch_id))
        entry = json.dumps({"custom_id": f"c{i}", "ids": [f"j{i}"]})
        assert store.advance(batch_id, (0, i), (0, i + 1), "pending", f"0:{i}", entry)
        assert store.settle(batch_id, f"0:{i}", "out", out_line(i), (1, 1, 0))
        spill.added("out")
        longest = max(longest, store.r.llen(out))
    assert longest == LIMIT - 1  # it reached LIMIT for a moment: flushed at once
    rec = store.record(batch_id)
    flushed = int(rec["out_flushed"])
    part = disk.part_path(files.dir, batch_id, "out")
    assert os.path.getsize(part) == flushed and flushed == len("".join(out_line(i) for i in range(n - 3)).encode())
    assert store.r.llen(out) == 3  # the tail, flushed at the end
    store.finalize(batch_id, "completed", "")
    rec = store.record(batch_id)
    assert rec["status"] == "completed" and not store.r.exists(out) and not os.path.exists(part)
    file_id = rec["output_file_id"]
    text = open(disk.content_path(files.dir, file_id), encoding="utf-8").read()
    assert text == "".join(out_line(i) for i in range(n)) == "".join(files.chunks(file_id))
    meta = files.meta(file_id, "")
    assert int(meta["bytes"]) == len(text.encode()) and meta["filename"] == f"{batch_id}_output.jsonl"
    assert not store.r.exists(keys.file_lines(file_id)) and "error_file_id" not in rec


def test_a_flush_after_a_crash_mid_append_writes_each_line_once(stores):
    files, store = stores
    batch_id = new_batch(files, store)
    out = keys.batch_part(batch_id, "out")
    part = disk.part_path(files.dir, batch_id, "out")
    lines = [out_line(i) for i in range(20)]
    store.r.rpush(out, *lines[:10])
    assert store.flush(batch_id, "out", files.dir, most=4) == 4
    assert store.r.llen(out) == 6 and store.record(batch_id)["out_flushed"] == str(os.path.getsize(part))

    # A process dies mid-append: half of the next lines and junk past the committed end.
    with open(part, "ab") as f:
        f.write(lines[4].encode() + lines[5].encode()[:7] + b"\x00junk" * 400)
    # Another writes the next lines whole but dies before its commit.
    committed = int(store.record(batch_id)["out_flushed"])
    disk.write_at(part, committed, "".join(lines[4:8]).encode())
    store.r.rpush(out, *lines[10:])
    # A late one commits what it read before another process committed: refused, nothing trimmed.
    assert store.flush(batch_id, "out", files.dir, most=3) == 3
    assert not store._flushed(keys=[keys.batch(batch_id), out], args=["out_flushed", committed, 3, committed + 1])
    assert store.r.llen(out) == 13

    store.finalize(batch_id, "completed", "")
    rec = store.record(batch_id)
    file_id = rec["output_file_id"]
    assert open(disk.content_path(files.dir, file_id), encoding="utf-8").read() == "".join(lines)
    assert not os.path.exists(part) and not store.r.exists(out)


def test_an_end_interrupted_after_the_rename_ends_with_the_same_file(stores, monkeypatch):
    files, store = stores
    batch_id = new_batch(files, store)
    store.r.rpush(keys.batch_part(batch_id, "err"), "e1\n", "e2\n")

    def crash(*a, **kw):
        raise ConnectionError("the process died")

    with monkeypatch.context() as m:
        m.setattr(store, "_end", crash)
        with pytest.raises(ConnectionError):
            store.finalize(batch_id, "expired", "")
    planned = store.record(batch_id)["err_file"]
    assert os.path.exists(disk.content_path(files.dir, planned))  # renamed, but not recorded
    assert store.record(batch_id)["status"] == "validating" and "error_file_id" not in store.record(batch_id)
    store.finalize(batch_id, "expired", "")
    rec = store.record(batch_id)
    assert rec["status"] == "expired" and rec["error_file_id"] == planned and "output_file_id" not in rec
    assert "".join(files.chunks(planned)) == "e1\ne2\n" and files.meta(planned, "")["purpose"] == "batch_output"


def test_the_sweep_removes_what_belongs_to_nothing_and_keeps_the_rest(stores):
    files, store = stores
    root, old = files.dir, time.time() - disk.SWEEP_GRACE_S - 10
    live = files.create(io.BytesIO(request_line(0).encode()), "a.jsonl", "").id
    expired = files.create(io.BytesIO(request_line(1).encode()), "b.jsonl", "").id
    store.r.delete(keys.file(expired))  # its metadata expired
    young = files.create(io.BytesIO(request_line(2).encode()), "c.jsonl", "").id
    store.r.delete(keys.file(young))
    running = new_batch(files, store)
    store.r.rpush(keys.batch_part(running, "out"), "o\n")
    store.flush(running, "out", root)
    paths = {
        "live": disk.content_path(root, live),
        "expired": disk.content_path(root, expired),
        "young": disk.content_path(root, young),
        "running": disk.part_path(root, running, "out"),
        "gone batch": disk.part_path(root, "batch_0123456789abcdef01234567", "err"),
        "upload": disk.upload_path(root, "file-0123456789abcdef01234567"),
        "other": os.path.join(root, "notes.txt"),
    }
    for name, path in paths.items():
        if not os.path.exists(path):
            open(path, "w").write("x\n")
        if name != "young":
            os.utime(path, (old, old))
    gone = files.sweep()
    assert sorted(gone) == sorted(paths[k] for k in ("expired", "gone batch", "upload"))
    kept = [os.path.basename(paths[k]) for k in ("live", "young", "running", "other")]
    kept.append(os.path.basename(disk.content_path(root, store.record(running)["input_file_id"])))
    assert sorted(os.listdir(root)) == sorted(kept)
    assert files.sweep() == []
