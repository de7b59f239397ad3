"""File contents on disk, in GENQ_FILES_DIR (unset: all in Redis): an upload's lines, a batch's
output and error lines as it runs (its part files, appended to by the driver) and the output and
error files they become, so that Redis keeps only metadata and a bounded tail of each batch's
output, whatever its size. The paths, the reads by chunk, the exactly-once append and the sweep
of files whose metadata expired (docs/design.md, "Files")."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from tasks import keys

CHUNK_BYTES = 16 * 1024
# A file with no metadata (expired, or a crash between its write and its record) is removed
# once it is this old; an upload's temporary file likewise (an upload takes minutes at most).
SWEEP_GRACE_S = 3600
FINAL = ("completed", "failed", "expired", "cancelled")


class PartLost(OSError):
    """A batch's part file is shorter than the bytes Redis says were committed to it: it was
    removed or truncated behind the driver's back (the batch cannot end whole)."""


def content_path(root: str, file_id: str) -> str:
    return os.path.join(root, f"{file_id}.jsonl")


def upload_path(root: str, file_id: str) -> str:
    return os.path.join(root, f".{file_id}.upload")


def part_path(root: str, batch_id: str, part: str) -> str:
    return os.path.join(root, f"{batch_id}.{part}.part")


def sync_dir(root: str) -> None:
    """Make a create, rename or unlink in `root` durable."""
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_chunk(path: str, i: int) -> str | None:
    """Chunk `i` of a content file: the lines that start in bytes [i, i+1) * CHUNK_BYTES (""
    when a longer line spans the whole range); None past the end or if the file is gone. The
    same file always cuts the same, so the driver's cursor (chunk, line) means one line."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        start = i * CHUNK_BYTES
        if start >= os.fstat(f.fileno()).st_size:
            return None
        if start:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the end of a line that started in an earlier chunk
        end, lines = start + CHUNK_BYTES, []
        while f.tell() < end:
            line = f.readline()
            if not line:
                break
            lines.append(line)
        return b"".join(lines).decode()


def read_lines(path: str, block: int = 1 << 20) -> Iterator[str]:
    """A content file as runs of whole lines (about `block` bytes each); nothing if it is gone."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        rest = b""
        while data := f.read(block):
            data = rest + data
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]
            if cut:
                yield data[:cut].decode()
        if rest:
            yield rest.decode()


def read_bytes(path: str, block: int = 64 * 1024) -> Iterator[bytes]:
    """A content file as it is stored, `block` bytes at a time (for a download); the file is
    opened at once, so that a delete meanwhile does not cut the download short."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return iter(())

    def gen():
        with f:
            while data := f.read(block):
                yield data

    return gen()


def write_at(path: str, offset: int, data: bytes) -> None:
    """Write `data` at byte `offset` of a part file (created if need be) and fsync it. The bytes
    at `offset` of a part file are only ever the same lines (docs/design.md, "Files"), so that
    a write a dead or late process left there is overwritten with the same bytes, or with the
    next ones where it was junk. PartLost if the file holds less than `offset` bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size < offset:
            raise PartLost(f"{path} holds {size} bytes, {offset} were committed")
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
        os.fsync(fd)
    finally:
        os.close(fd)
    if offset == 0:
        sync_dir(os.path.dirname(path) or ".")


def seal(path: str, size: int, target: str) -> None:
    """A part file cut to its `size` committed bytes (dropping what a crashed flush wrote past
    them) and renamed to the content file `target`; again after a crash, `target` is cut
    alike. PartLost if neither is there, or holds less."""
    for name in (path, target):
        try:
            fd = os.open(name, os.O_WRONLY)
        except FileNotFoundError:
            continue
        try:
            if os.fstat(fd).st_size < size:
                raise PartLost(f"{name} holds less than the {size} bytes committed")
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
        if name == path:
            os.replace(path, target)
        sync_dir(os.path.dirname(target) or ".")
        return
    raise PartLost(f"neither {path} nor {target} is there")


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sweep(r, root: str, grace: float = SWEEP_GRACE_S, now: float | None = None) -> list[str]:
    """Remove what is older than `grace` seconds and belongs to nothing alive: a content file
    whose metadata hash is gone (expired, deleted), a part file whose batch ended or is gone, a
    temporary upload. One directory listing and one Redis round trip; returns what went."""
    now = time.time() if now is None else now
    found: list[tuple[str, str, str]] = []  # (path, kind, id)
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        name = entry.name
        if name.startswith("file-") and name.endswith(".jsonl"):
            kind, ident = "file", name[: -len(".jsonl")]
        elif name.startswith("batch_") and name.endswith(".part"):
            kind, ident = "part", name.split(".", 1)[0]
        elif name.startswith(".file-") and name.endswith(".upload"):
            kind, ident = "upload", ""
        else:
            continue
        try:
            if now - entry.stat().st_mtime < grace:
                continue
        except FileNotFoundError:
            continue
        found.append((entry.path, kind, ident))
    if not found:
        return []
    pipe = r.pipeline(transaction=False)
    for _, kind, ident in found:
        if kind == "file":
            pipe.exists(keys.file(ident))
        elif kind == "part":
            pipe.hget(keys.batch(ident), "status")
        else:
            pipe.echo("")
    gone = []
    for (path, kind, _), answer in zip(found, pipe.execute()):
        if kind == "upload" or (kind == "file" and not answer) or (kind == "part" and answer in (None, *FINAL)):
            remove(path)
            gone.append(path)
    return gone
