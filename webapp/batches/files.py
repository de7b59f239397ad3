"""The file store (`/v1/files`): a hash of metadata (`genq:file:<id>`) and the content as a
list of chunks of whole lines (`genq:file:<id>:lines`, about CHUNK_BYTES each), both expiring
after GENQ_FILE_TTL. An upload is checked line by line and written under a temporary key,
renamed into place once whole (docs/design.md, "Batches")."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import IO

import redis

from tasks import keys
from tasks.config import Settings
from webapp import ids
from webapp.errors import BROKER_ERRORS, APIError, owned
from webapp.protocol.batches import File, FileDeleted

CHUNK_BYTES = 16 * 1024


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

    def create(self, stream: IO[bytes], filename: str, owner: str) -> File:
        """Store an uploaded JSONL file: each non-blank line one JSON object, checked as it is
        read. Raises LineError (400) naming the first bad line, APIError 413 past the limit."""
        file_id = new_id()
        target = keys.file_lines(file_id)
        tmp = f"{target}:upload"
        limit = self.settings.max_file_bytes
        size = count = buffered = 0
        buf: list[str] = []
        pipe = self.r.pipeline(transaction=False)
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
                buf.append(text + "\n")
                buffered += len(text) + 1
                if buffered >= CHUNK_BYTES:
                    pipe.rpush(tmp, "".join(buf))
                    buf, buffered = [], 0
                    if len(pipe) >= 16:
                        pipe.expire(tmp, 3600)
                        pipe.execute()
            if buf:
                pipe.rpush(tmp, "".join(buf))
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
            if size:
                pipe.rename(tmp, target)
                pipe.expire(target, self.settings.file_ttl)
            pipe.hset(keys.file(file_id), mapping=meta)
            pipe.expire(keys.file(file_id), self.settings.file_ttl)
            pipe.execute()
        except BaseException:
            try:
                pipe.reset()
                self.r.delete(tmp)
            except BROKER_ERRORS:
                pass
            raise
        return File.from_record(meta)

    def meta(self, file_id: str, owner: str | None) -> dict:
        """The file's metadata; a 404 if it does not exist or, with `owner`, is not theirs."""
        ids.check("file", file_id)  # before Redis: `file-…:lines` names the content list
        return owned(self.r.hgetall(keys.file(file_id)), owner, "file", file_id)

    def exists(self, file_id: str) -> bool:
        return bool(self.r.exists(keys.file(file_id)))

    def chunk(self, file_id: str, i: int) -> str | None:
        """The file's `i`-th chunk; None past its end or once the file is gone."""
        return self.r.lindex(keys.file_lines(file_id), i)

    def chunks(self, file_id: str, start: int = 0, step: int = 64) -> Iterator[str]:
        """The file's content, chunk by chunk, `step` chunks per Redis call."""
        key = keys.file_lines(file_id)
        while True:
            part = self.r.lrange(key, start, start + step - 1)
            yield from part
            if len(part) < step:
                return
            start += step

    def delete(self, file_id: str, owner: str) -> FileDeleted:
        self.meta(file_id, owner)
        self.r.delete(keys.file(file_id), keys.file_lines(file_id))
        return FileDeleted(id=file_id)
