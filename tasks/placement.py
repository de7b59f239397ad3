"""Cache-aware placement across the workers of one model: a job whose prompt starts like one a
worker ran lately goes to that worker's own lane, where the prefix is likely still cached,
instead of the shared queue. How lanes, digests and recovery work: docs/design.md, "Placement
across workers"."""

from __future__ import annotations

import hashlib
import json
from array import array

import redis

from tasks import keys
from tasks.kombu_compat import BROKER_SEP
from tasks.schemas import ChatOptions, JobSpec

# How long a worker's record of a prefix is believed; each job it runs with that prefix renews it.
PLACED_TTL_S = 600
# A lane of a worker gone longer than this, and empty, is forgotten.
LANE_KEEP_S = 3600
# The longest prefixes looked up for one prompt.
MAX_DIGESTS = 12


def digests(spec: JobSpec, min_chars: int) -> list[str]:
    """The digests of a job's prompt prefixes worth placing by, longest first."""
    seed = hashlib.blake2b(digest_size=16)
    seed.update(spec.model.encode() + b"\0")
    if spec.chat is not None:
        return _chat(seed, spec.chat, min_chars)
    if spec.prompt_token_ids is not None:
        seed.update(b"ids\0")
        ids = array("q", spec.prompt_token_ids)
        return _levels(seed, ids.tobytes(), max(1, min_chars // 4) * ids.itemsize if ids else 0)
    seed.update(b"text\0")
    return _levels(seed, spec.prompt.encode(), min_chars, text=spec.prompt)


def _levels(seed, data: bytes, first: int, text: str | None = None) -> list[str]:
    """Digests of `data`'s leading `first`, 2 x `first`, ... bytes (of `text`'s characters,
    encoded, when given: a prefix is cut on a character)."""
    out: list[str] = []
    size = len(text) if text is not None else len(data)
    level = first
    while first and level <= size:
        part = text[:level].encode() if text is not None else data[:level]
        h = seed.copy()
        h.update(part)
        out.append(h.hexdigest())
        level *= 2
    return out[::-1][:MAX_DIGESTS]


def _chat(seed, chat: ChatOptions, min_chars: int) -> list[str]:
    seed.update(b"chat\0" + json.dumps(chat.chat_template_kwargs, sort_keys=True).encode())
    # The tools are part of every prefix (templates write them first, in the system prompt).
    tools = json.dumps(chat.tools, sort_keys=True) if chat.tools else ""
    if tools:
        seed.update(b"tools\0" + tools.encode() + b"\0")
    out: list[str] = []
    size = len(tools)
    for message in chat.messages:
        seed.update(json.dumps(message.model_dump(), sort_keys=True).encode() + b"\0")
        size += len(message.content or "") + len(json.dumps(message.tool_calls) if message.tool_calls else "")
        if size >= min_chars:
            out.append(seed.hexdigest())
    return out[::-1][:MAX_DIGESTS]


# KEYS: the placement keys, longest prefix first. ARGV: the shared queue, the lane separator,
# kombu's priority separator, the number of priority steps, the most jobs a lane may have
# waiting, then the names of the workers that may be chosen. Returns a worker's name or nil.
_CHOOSE = """
local live = {}
for i = 6, #ARGV do live[ARGV[i]] = true end
local most = tonumber(ARGV[5])
for _, key in ipairs(KEYS) do
  local w = redis.call('GET', key)
  if w and live[w] then
    local lane = ARGV[1] .. ARGV[2] .. w
    local n = redis.call('LLEN', lane)
    for s = 1, tonumber(ARGV[4]) - 1 do n = n + redis.call('LLEN', lane .. ARGV[3] .. s) end
    if n < most then return w end
    return false
  end
end
return false
"""

# KEYS: the lanes hash. ARGV: worker, its shared queue.
_KEEP = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '\\t' .. t[1])
return 1
"""

# Moves everything in a worker's lane to the front of its shared queue, one priority step into
# the same step, in the lane's order. KEYS: the lanes hash. ARGV: the worker, the lane
# separator, kombu's priority separator, the number of priority steps, LANE_KEEP_S. Forgets the
# lane once its worker has not beaten for LANE_KEEP_S. Returns how many messages moved.
_DRAIN = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local tab = string.find(v, '\\t', 1, true)
local queue = string.sub(v, 1, tab - 1)
local beat = tonumber(string.sub(v, tab + 1))
local lane = queue .. ARGV[2] .. ARGV[1]
local moved = 0
for s = 0, tonumber(ARGV[4]) - 1 do
  local src, dst = lane, queue
  if s > 0 then
    src = lane .. ARGV[3] .. s
    dst = queue .. ARGV[3] .. s
  end
  while true do
    local m = redis.call('LPOP', src)
    if not m then break end
    redis.call('RPUSH', dst, m)
    moved = moved + 1
  end
end
local t = redis.call('TIME')
if tonumber(t[1]) - beat > tonumber(ARGV[5]) then redis.call('HDEL', KEYS[1], ARGV[1]) end
return moved
"""


class Placement:
    """The placement records and lanes of one Redis (`steps`: kombu's priority steps)."""

    def __init__(self, client: redis.Redis, steps: int, min_chars: int = 1024, max_waiting: int = 4):
        self.r, self.steps = client, steps
        self.min_chars, self.max_waiting = min_chars, max_waiting
        self._choose = client.register_script(_CHOOSE)
        self._keep = client.register_script(_KEEP)
        self._drain = client.register_script(_DRAIN)

    # -- the API ---------------------------------------------------------------------------

    def choose(self, spec: JobSpec, queue: str, workers: list[str]) -> str | None:
        """The worker of `workers` whose lane should take `spec`, or None: the shared queue."""
        found = digests(spec, self.min_chars)
        if not found or not workers:
            return None
        name = self._choose(
            keys=[keys.placed(queue, d) for d in found],
            args=[queue, keys.LANE_SEP, BROKER_SEP, self.steps, self.max_waiting, *workers],
        )
        if isinstance(name, bytes):
            name = name.decode()
        return name or None

    # -- a worker --------------------------------------------------------------------------

    def record(self, spec: JobSpec, queue: str, worker: str) -> int:
        """Note that `worker` runs `spec` (whose prefixes it will hold); returns how many
        prefixes were noted."""
        found = digests(spec, self.min_chars)
        if found:
            pipe = self.r.pipeline(transaction=False)
            for d in found:
                pipe.set(keys.placed(queue, d), worker, ex=PLACED_TTL_S)
            pipe.execute()
        return len(found)

    def keep_lane(self, worker: str, queue: str) -> None:
        """Register (again) a worker's lane, as alive now: called on each heartbeat."""
        self._keep(keys=[keys.LANES], args=[worker, queue])

    # -- recovery --------------------------------------------------------------------------

    def lanes(self) -> dict[str, str]:
        """Every registered lane's worker -> its shared queue."""
        return {w: v.split("\t", 1)[0] for w, v in _text(self.r.hgetall(keys.LANES)).items()}

    def drain(self, worker: str) -> int:
        """Give everything waiting in a gone worker's lane to its shared queue; how many moved."""
        return int(self._drain(keys=[keys.LANES], args=[worker, keys.LANE_SEP, BROKER_SEP, self.steps, LANE_KEEP_S]))


def _text(raw: dict) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in raw.items()
    }
