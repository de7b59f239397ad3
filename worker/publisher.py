"""Writes engines' token events to Redis Streams from a thread of its own.

The engine's scheduler hands over each decode step's events for every job in the batch; this
thread writes everything that has accumulated in one pipelined round trip, so the model never
waits on Redis and a step costs one round trip, not one per token. A finished job's future is
resolved only after its finish event is written: by the time the job's result and final
status exist, its stream is complete.

Each job's events are written only while the attempt that produced them is the job's current
one (a fence, checked in the same Lua call that appends them): a worker that hung and was
given up for dead cannot add its tokens to the stream of the attempt that replaced it.
"""

from __future__ import annotations

import json
import logging
import queue
import threading

import redis

from tasks import keys
from tasks.streams import TokenEvent
from worker import metrics
from worker.engines.base import Resolved

log = logging.getLogger(__name__)


# KEYS: per event, its stream and its job record. ARGV: maxlen, TTL, then per event the
# attempt that wrote it ('' = unfenced), index, text, finish reason ('' = none), usage,
# logprobs ('' = none).
_APPEND = """
local ok = {}
for e = 1, #KEYS / 2 do
  local stream, job, b = KEYS[2 * e - 1], KEYS[2 * e], 2 + (e - 1) * 6
  local attempt = ARGV[b + 1]
  if ok[job] == nil then
    ok[job] = attempt == '' or redis.call('HGET', job, 'attempts') == attempt
  end
  if ok[job] then
    local fields = {'i', ARGV[b + 2], 't', ARGV[b + 3]}
    if ARGV[b + 4] ~= '' then
      table.insert(fields, 'finish'); table.insert(fields, ARGV[b + 4])
      table.insert(fields, 'usage'); table.insert(fields, ARGV[b + 5])
    end
    if ARGV[b + 6] ~= '' then
      table.insert(fields, 'lp'); table.insert(fields, ARGV[b + 6])
    end
    redis.call('XADD', stream, 'MAXLEN', '~', ARGV[1], '*', unpack(fields))
    if ARGV[b + 2] == '0' or ARGV[b + 4] ~= '' then redis.call('EXPIRE', stream, ARGV[2]) end
  end
end
"""


class StreamPublisher:
    def __init__(self, client: redis.Redis, ttl: int, maxlen: int):
        self.r = client
        self.ttl = ttl
        self.maxlen = maxlen
        self._append = client.register_script(_APPEND)
        # job id -> the attempt this process runs (set by the task thread around the job).
        self.attempts: dict[str, int] = {}
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="genq-publisher", daemon=True)
        self._thread.start()

    def emit(self, events: list[tuple[str, TokenEvent]], resolved: list[Resolved]) -> None:
        if events or resolved:
            # The attempt is taken now, in the engine's step: by the time the writer gets to
            # these events, the task thread may have dropped a superseded job's entry.
            fenced = [(job_id, ev, self.attempts.get(job_id, "")) for job_id, ev in events]
            self._q.put((fenced, resolved))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            batch = [item]
            while item is not None:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
            work = [b for b in batch if b is not None]
            try:
                self._write(work)
            except Exception:  # noqa: BLE001 - a dead writer would hang every job of the worker
                log.exception("the token writer failed on a batch; its jobs finish, streams may lack tokens")
                for _, resolved in work:
                    for future, result in resolved:
                        if not future.done():
                            future.set_result(result)
            if batch[-1] is None:
                return

    def _write(self, batch: list[tuple[list[tuple[str, TokenEvent, int | str]], list[Resolved]]]) -> None:
        stream_keys: list[str] = []
        args: list = [self.maxlen, self.ttl]
        for events, _ in batch:
            for job_id, ev, attempt in events:
                stream_keys += [keys.stream(job_id), keys.job(job_id)]
                usage = json.dumps(ev.usage or {}) if ev.finish else ""
                lp = json.dumps(ev.logprobs, ensure_ascii=False) if ev.logprobs else ""
                args += [attempt, ev.index, ev.text, ev.finish or "", usage, lp]
        if stream_keys:
            try:
                self._append(keys=stream_keys, args=args)
            except redis.RedisError:
                log.exception("could not write token events; their streams are incomplete")
            metrics.tokens_published(batch)
        for _, resolved in batch:
            for future, result in resolved:
                future.set_result(result)
