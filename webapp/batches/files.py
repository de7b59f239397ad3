"""The file store (`/v1/files`): a hash of metadata (`genq:file:<id>`), expiring after
GENQ_FILE_TTL, and the content: in Redis, a list of chunks of whole lines (`genq:file:<id>:lines`,
about CHUNK_BYTES each, expiring with it), or with GENQ_FILES_DIR a file `<dir>/<id>.jsonl`
(webapp/batches/disk.py; the hash's `dir` says which). An upload is checked line by line and
written under a temporary name, renamed into place once whole (docs/design.md, "Files")."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import IO

import redis

from tasks import keys
from tasks.config import Settings
from webapp import ids
from webapp.batches import disk
from webapp.batches.disk import CHUNK_BYTES
from webapp.errors import BROKER_ERRORS, APIError, owned
from webapp.protocol.batches import File, FileDeleted


class LineError(APIError):
    """A 400 about one line of an uploaded file (1-based `line`, also in the error body)."""

    def __init__(self, line: int, message: str):
        super().__init__(400, "invalid_file", f"line {line}: {message}", param="file")
        self.line = line

    def body(self) -> dict:
        body = super().body()
        body["error"]["line"] = self.line
        return body


def now() -> int:
    return int(time.time())


def new_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def chunk_lines(chunk: str) -> list[str]:
    """The lines of one stored chunk (every chunk ends with a newline)."""
    return chunk.split("\n")[:-1]


def _refuse_lone_surrogates(n: int, text: str, obj: dict) -> None:
    """LineError if a string of the line holds a `\\ud800`-`\\udfff` escape that is not half
    of a pair: valid JSON, but no Unicode text, which no job, Redis write or output line takes
    (a batch would retry the line forever). Only lines with a `\\u` escape are re-encoded."""
    if "\\u" not in text:
        return
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise LineError(n, "a string holds a lone surrogate (a \\ud800-\\udfff escape not part of a pair)") from None
    except RecursionError:
        raise LineError(n, "not valid JSON (nested too deeply)") from None


class FileStore:
    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings
        # Where new files' content goes ("": Redis); a file's own hash says where it is.
        self.dir = os.path.abspath(settings.files_dir) if settings.files_dir else ""
        if self.dir:
            os.makedirs(self.dir, exist_ok=True)

    def create(self, stream: IO[bytes], filename: str, owner: str) -> File:
        """Store an uploaded JSONL file: each non-blank line one JSON object, checked as it is
        read. Raises LineError (400) naming the first bad line, APIError 413 past the limit."""
        file_id = new_id()
        sink = _DiskSink(self.r, self.dir, file_id) if self.dir else _RedisSink(self.r, file_id)
        limit = self.settings.max_file_bytes
        size = count = 0
        try:
            for n, raw in enumerate(stream, 1):
                size += len(raw)
                if size > limit:
                    raise APIError(
                        413, "file_too_large", f"the file is over {limit} bytes (GENQ_MAX_FILE_BYTES)", param="file"
                    )
                try:
                    text = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError:
                    raise LineError(n, "not UTF-8 text") from None
                if text.strip():
                    try:
                        obj = json.loads(text)
                    except RecursionError:
                        raise LineError(n, "not valid JSON (nested too deeply)") from None
                    except ValueError as exc:
                        raise LineError(n, f"not valid JSON ({getattr(exc, 'msg', exc)})") from None
                    if not isinstance(obj, dict):
                        raise LineError(n, "not a JSON object")
                    _refuse_lone_surrogates(n, text, obj)
                    count += 1
                sink.write(text + "\n")
            meta = {
                "id": file_id,
                "bytes": size,
                "created_at": now(),
                "filename": filename or "upload.jsonl",
                "purpose": "batch",
                "owner": owner,
                "lines": count,
                "expires_at": now() + self.settings.file_ttl,
            }
            if self.dir:
                meta["dir"] = self.dir
            pipe = sink.finish(size > 0, self.settings.file_ttl)
            pipe.hset(keys.file(file_id), mapping=meta)
            pipe.expire(keys.file(file_id), self.settings.file_ttl)
            pipe.execute()
        except BaseException:
            sink.abandon()
            raise
        return File.from_record(meta)

    def meta(self, file_id: str, owner: str | None) -> dict:
        """The file's metadata; a 404 if it does not exist or, with `owner`, is not theirs."""
        ids.check("file", file_id)  # before Redis: `file-…:lines` names the content list
        return owned(self.r.hgetall(keys.file(file_id)), owner, "file", file_id)

    def exists(self, file_id: str) -> bool:
        return bool(self.r.exists(keys.file(file_id)))

    def _path(self, file_id: str) -> str | None:
        """The file's content file if it is on disk (None: in Redis, or gone)."""
        root = self.r.hget(keys.file(file_id), "dir")
        return disk.content_path(root, file_id) if root else None

    def chunk(self, file_id: str, i: int) -> str | None:
        """The file's `i`-th chunk; None past its end or once the file is gone."""
        path = self._path(file_id)
        if path:
            return disk.read_chunk(path, i)
        return self.r.lindex(keys.file_lines(file_id), i)

    def chunks(self, file_id: str, start: int = 0, step: int = 64) -> Iterator[str]:
        """The file's content as runs of whole lines: in Redis, chunk by chunk from `start`,
        `step` chunks per Redis call; on disk, about a MiB at a time (`start` 0 only)."""
        path = self._path(file_id)
        if path:
            yield from disk.read_lines(path)
            return
        key = keys.file_lines(file_id)
        while True:
            part = self.r.lrange(key, start, start + step - 1)
            yield from part
            if len(part) < step:
                return
            start += step

    def content(self, file_id: str) -> Iterator[str | bytes]:
        """The file's content for a download: Redis chunks, or the file's bytes as stored."""
        path = self._path(file_id)
        return disk.read_bytes(path) if path else self.chunks(file_id)

    def delete(self, file_id: str, owner: str) -> FileDeleted:
        meta = self.meta(file_id, owner)
        self.r.delete(keys.file(file_id), keys.file_lines(file_id))
        if meta.get("dir"):
            disk.remove(disk.content_path(meta["dir"], file_id))
        return FileDeleted(id=file_id)

    def sweep(self, grace: float = disk.SWEEP_GRACE_S) -> list[str]:
        """Remove the files in GENQ_FILES_DIR that belong to nothing alive (disk.sweep)."""
        return disk.sweep(self.r, self.dir, grace) if self.dir else []


class _RedisSink:
    """An upload's lines into Redis chunks under a temporary key, renamed into place at the end."""

    def __init__(self, client: redis.Redis, file_id: str):
        self.r = client
        self.target = keys.file_lines(file_id)
        self.tmp = f"{self.target}:upload"
        self.buf: list[str] = []
        self.buffered = 0
        self.pipe = client.pipeline(transaction=False)

    def write(self, line: str) -> None:
        self.buf.append(line)
        self.buffered += len(line)
        if self.buffered >= CHUNK_BYTES:
            self.pipe.rpush(self.tmp, "".join(self.buf))
            self.buf, self.buffered = [], 0
            if len(self.pipe) >= 16:
                self.pipe.expire(self.tmp, 3600)
                self.pipe.execute()

    def finish(self, content: bool, ttl: int):
        """The pipeline that, executed, puts the content in place (with the metadata after it)."""
        if self.buf:
            self.pipe.rpush(self.tmp, "".join(self.buf))
        if content:
            self.pipe.rename(self.tmp, self.target)
            self.pipe.expire(self.target, ttl)
        return self.pipe

    def abandon(self) -> None:
        try:
            self.pipe.reset()
            self.r.delete(self.tmp)
        except BROKER_ERRORS:
            pass


class _DiskSink:
    """An upload's lines into a temporary file in GENQ_FILES_DIR, fsynced and renamed into place
    before its metadata is written (a crash between leaves a file the sweep removes)."""

    def __init__(self, client: redis.Redis, root: str, file_id: str):
        self.r = client
        self.tmp = disk.upload_path(root, file_id)
        self.target = disk.content_path(root, file_id)
        self.f = open(self.tmp, "wb", buffering=1 << 20)

    def write(self, line: str) -> None:
        self.f.write(line.encode())

    def finish(self, content: bool, ttl: int):
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.target)
        disk.sync_dir(os.path.dirname(self.target) or ".")
        return self.r.pipeline(transaction=False)

    def abandon(self) -> None:
        self.f.close()
        disk.remove(self.tmp)
        disk.remove(self.target)
