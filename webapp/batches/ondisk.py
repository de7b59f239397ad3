"""A batch's output on disk (GENQ_FILES_DIR): the `out` and `err` lists flushed to part files
as the batch runs, exactly once across crashes, and sealed into its output and error files at
the end (docs/design.md, "Files"). `OnDisk` is the part of `BatchStore` that does it; `Spill`
the driver's tally that calls a flush when a list reaches its threshold."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tasks import keys
from webapp.batches import disk
from webapp.batches.disk import FINAL
from webapp.batches.files import new_id as new_file_id
from webapp.batches.files import now

if TYPE_CHECKING:
    import redis

    from tasks.config import Settings

# A flush's commit: the first `n` lines of a batch's `out` or `err` list are now in its part
# file, which holds `size` committed bytes; refused (0) if the committed size is no longer the
# one the flush read with them (another process committed meanwhile: it wrote the same lines).
# KEYS: batch, the list. ARGV: field (`out_flushed` | `err_flushed`), committed as read, n, size.
FLUSHED = """
if (redis.call('HGET', KEYS[1], ARGV[1]) or '0') ~= ARGV[2] then return 0 end
redis.call('LTRIM', KEYS[2], ARGV[3], -1)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[4])
return 1
"""

# The most lines one flush writes (a flush loops until the list is empty).
FLUSH_MAX = 4096
PARTS = (("out", "output", "out_bytes"), ("err", "error", "err_bytes"))


class OnDisk:
    """BatchStore's flush and seal, mixed into it: BatchStore has the client, the settings, the
    registered FLUSHED script, and the `_file_meta` and `_end` that a seal shares with the end
    of a batch kept in Redis."""

    r: redis.Redis
    settings: Settings
    _flushed: Any

    def spill(self, rec: dict) -> Spill:
        """The driver's tally of the lines one step adds to a batch's `out` and `err`, which
        flushes a list to disk once it holds GENQ_FILES_FLUSH_LINES (a batch in Redis: none)."""
        limit = int(rec.get("files_flush_lines") or self.settings.files_flush_lines)
        return Spill(self, rec["id"], rec.get("files_dir") or "", limit)

    def list_lengths(self, batch_id: str) -> dict[str, int]:
        pipe = self.r.pipeline(transaction=False)
        for part in ("out", "err"):
            pipe.llen(keys.batch_part(batch_id, part))
        return dict(zip(("out", "err"), pipe.execute()))

    def flush(self, batch_id: str, part: str, root: str, most: int = FLUSH_MAX) -> int:
        """Move the first lines (at most `most`) of the batch's `part` list (`out`, `err`) to the
        end of its part file, once: read with the committed size in one transaction, written at
        that offset and fsynced, then trimmed off the list with the new size in one script
        (FLUSHED). A crash anywhere leaves the list and the size as they were, or both moved
        (docs/design.md, "Files"). Returns how many lines moved (0: none, or another process
        committed them first)."""
        key, field = keys.batch_part(batch_id, part), f"{part}_flushed"
        pipe = self.r.pipeline()
        pipe.hget(keys.batch(batch_id), field)
        pipe.lrange(key, 0, most - 1)
        committed, lines = pipe.execute()
        if not lines:
            return 0
        committed = int(committed or 0)
        data = "".join(lines).encode()
        disk.write_at(disk.part_path(root, batch_id, part), committed, data)
        ok = self._flushed(keys=[keys.batch(batch_id), key], args=[field, committed, len(lines), committed + len(data)])
        return len(lines) if ok else 0

    def flush_all(self, batch_id: str, part: str, root: str) -> None:
        """Flush until the list is empty (the driver holds the lock: nobody else adds to it)."""
        while self.flush(batch_id, part, root):
            pass

    def _finalize_on_disk(self, batch_id: str, final: str, owner: str, root: str) -> None:
        """finalize for a batch whose output is on disk: the rest flushed, then each part file
        that got a line cut to its committed size and renamed to its file (`<dir>/<id>.jsonl`,
        the id first recorded in the batch, `out_file`/`err_file`, so that a crash after the
        rename finds it again), then the records written as in Redis, in one transaction."""
        key, at = keys.batch(batch_id), now()
        current = self.r.hgetall(key)
        if not current or current["status"] in FINAL:
            return
        for part, _, _ in PARTS:
            self.flush_all(batch_id, part, root)
        current = self.r.hgetall(key)
        planned = {f"{p}_file": new_file_id() for p, _, _ in PARTS if not current.get(f"{p}_file")}
        if planned:
            pipe = self.r.pipeline()
            for name, file_id in planned.items():
                pipe.hsetnx(key, name, file_id)
            pipe.hgetall(key)
            current = pipe.execute()[-1]
        files = {}
        for part, purpose, size in PARTS:
            committed = int(current.get(f"{part}_flushed") or 0)
            if committed:
                file_id = current[f"{part}_file"]
                disk.seal(disk.part_path(root, batch_id, part), committed, disk.content_path(root, file_id))
                files[part] = (file_id, purpose, int(current.get(size) or 0))

        def end(pipe):
            now_rec = pipe.hgetall(key)
            if not now_rec or now_rec["status"] in FINAL:
                return
            if any(pipe.llen(keys.batch_part(batch_id, part)) for part in ("out", "err")):
                return  # a line came meanwhile (not from this lock's holder): the next tick ends it
            pipe.multi()
            fields: dict[str, Any] = {"status": final, f"{final}_at": at}
            for file_id, purpose, size in files.values():
                fields[f"{purpose}_file_id"] = file_id
                self._file_meta(pipe, file_id, batch_id, purpose, size, owner, at, root)
            self._end(pipe, batch_id, now_rec, fields)

        self.r.transaction(end, key, keys.batch_part(batch_id, "out"), keys.batch_part(batch_id, "err"))


class Spill:
    """One driver step's tally of the lines it added to a batch's `out` and `err` lists (their
    lengths read at the first one): a list that reaches `limit` lines is flushed to disk, so
    that it never holds more. Nothing for a batch kept in Redis (`root` "")."""

    def __init__(self, store: OnDisk, batch_id: str, root: str, limit: int):
        self.store, self.batch_id, self.root, self.limit = store, batch_id, root, limit
        self.lengths: dict[str, int] | None = None

    def added(self, part: str, n: int = 1) -> None:
        if not self.root or n <= 0:
            return
        if self.lengths is None:
            self.lengths = self.store.list_lengths(self.batch_id)
        else:
            self.lengths[part] += n
        if self.lengths[part] >= self.limit:
            self.store.flush_all(self.batch_id, part, self.root)
            self.lengths[part] = 0
