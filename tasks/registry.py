"""Worker heartbeats: which workers are alive, what they serve and how much they can batch.

A worker announces itself once its model has loaded and refreshes that every
`heartbeat_interval` seconds; one whose last heartbeat is older than `heartbeat_ttl` counts as
gone (a draining worker keeps beating while it finishes its jobs). Heartbeats are timed on
Redis's clock (`TIME` inside the scripts below), never on a host's, and a worker's silence
counts only while Redis was serving: after an outage (`WORKERS_OUTAGE`) every worker gets a full
`ttl` to beat again. Why: docs/design.md, "Worker heartbeats".
"""

from __future__ import annotations

import redis
from pydantic import BaseModel, Field

from tasks import keys


class TokenBound(BaseModel):
    """How many tokens a worker's tokenizer can make of a text, at most: `per_byte` tokens per
    UTF-8 byte plus `extra` (its special tokens and prefixes), read from the tokenizer's
    structure (worker/tokenbound.py). None: no bound is known, a worker counts every prompt."""

    per_byte: int | None = Field(None, ge=1)
    extra: int = Field(0, ge=0)


class ChatBound(BaseModel):
    """How many tokens a worker's chat template adds to a conversation, at most, beyond its
    messages' own text: `base` once (the generation prompt, a default system prompt, BOS) and
    `per_message` for each message (its role's markers, separators), measured on the template
    and checked on conversations of several sizes at load (worker/chatbound.py). A
    conversation's prompt is then at most base + the sum over its messages of per_message plus
    the token bound (`TokenBound`) of its content and of its name."""

    base: int = Field(ge=0)
    per_message: int = Field(ge=0)


class EmbeddingInfo(BaseModel):
    """What an embedding worker (the embed engine) serves: vectors of `dimensions`, which a
    request may cut (`dimensions`) only where the model is a Matryoshka one: to any size up to
    its own (`matryoshka_dimensions` None) or to one of those listed."""

    dimensions: int = Field(ge=1)
    matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None

    def check(self, dims: int) -> str | None:
        """Why `dims` cannot be served (None: it can)."""
        if not self.matryoshka:
            return f"the model does not support cutting its vectors (not a Matryoshka model); its vectors have {self.dimensions}"
        if dims > self.dimensions or (self.matryoshka_dimensions and dims not in self.matryoshka_dimensions):
            return f"{dims}; the model takes {self.matryoshka_dimensions or f'1 to {self.dimensions}'}"
        return None


class WorkerInfo(BaseModel):
    name: str
    model: str
    engine: str
    capacity: int
    reserved: int = Field(
        0, description="Celery threads beyond its capacity, kept for foreground jobs (batch lines fill half at most)"
    )
    host: str
    pid: int
    started: float
    max_model_len: int | None = None
    token_bound: TokenBound | None = Field(
        None,
        description="its tokenizer's bound on a prompt's tokens, by which the API checks prompts against "
        "max_model_len at submit (webapp/context.py); None: it counts no prompts (no tokenizer, or an older worker)",
    )
    chat_template: bool = Field(False, description="it has a chat template (/v1/chat/completions)")
    chat_bound: ChatBound | None = Field(
        None,
        description="its chat template's bound on the tokens it adds to a conversation, by which the API "
        "checks a chat request against max_model_len without counting it (webapp/context.py); None: a worker "
        "counts every conversation (a template it could not bound, no template, or an older worker)",
    )
    answers_asks: bool = Field(
        False,
        description="it answers /tokenize, /detokenize and the API's prompt counts from its model's ask "
        "list (tasks/keys.py `asks`) on threads of its own, never behind its jobs (worker/asks.py); False: "
        "only as a Celery task (an older worker)",
    )
    device: str = Field("cpu", description="where its engine runs the model: cpu, cuda:N")
    metrics_port: int | None = Field(None, description="its Prometheus exporter's port (worker/metrics.py)")
    lane: bool = Field(
        False,
        description="it consumes a lane of its own beside the shared queue: the API may place jobs whose "
        "prefix it holds there (tasks/placement.py)",
    )
    draining: bool = Field(False, description="shutting down: finishes its jobs, takes no new calls")
    embedding: EmbeddingInfo | None = Field(
        None, description="it serves embeddings (/v1/embeddings), not completions; None: it generates text"
    )


# KEYS: seen zset, info hash. ARGV: name, info JSON.
# Returns Redis's time and the worker's previous heartbeat ('' if none), as strings.
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local prev = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], string.format('%.6f', now), ARGV[1])
return {string.format('%.6f', now), prev or ''}
"""

# KEYS: outage hash. ARGV: start, end (Redis times). Widens the recorded outage when the two
# overlap (several workers report one outage), replaces it when this one is newer.
_OUTAGE = """
local start, stop = tonumber(ARGV[1]), tonumber(ARGV[2])
local cur = redis.call('HMGET', KEYS[1], 'start', 'end')
local cs, ce = tonumber(cur[1]), tonumber(cur[2])
if ce and ce >= start then
  start = math.min(start, cs)
  stop = math.max(stop, ce)
elseif ce and ce > stop then
  return 0
end
redis.call('HSET', KEYS[1], 'start', string.format('%.6f', start), 'end', string.format('%.6f', stop))
redis.call('EXPIRE', KEYS[1], 86400)
return 1
"""

# Who counts as alive now, on Redis's clock. KEYS: seen zset, info hash, outage hash.
# ARGV: ttl, and optionally the start and end of an outage the caller saw itself (end ''
# for "until now"). Alive: a heartbeat within the last ttl of serving, not counting an outage
# that ended less than a ttl ago. Returns Redis's time, then the infos of the workers alive.
_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local ttl = tonumber(ARGV[1])
local cutoff = now - ttl
local outages = {redis.call('HMGET', KEYS[3], 'start', 'end')}
if ARGV[2] and ARGV[2] ~= '' then
  outages[2] = {ARGV[2], ARGV[3] ~= '' and ARGV[3] or tostring(now)}
end
for _, o in ipairs(outages) do
  local s, e = tonumber(o[1]), tonumber(o[2])
  if s and e and s < e and now - e < ttl then
    cutoff = math.min(cutoff, s + (now - e) - ttl)
  end
end
local names = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. string.format('%.6f', cutoff), '+inf')
local out = {string.format('%.6f', now)}
if #names > 0 then
  for _, raw in ipairs(redis.call('HMGET', KEYS[2], unpack(names))) do
    if raw then table.insert(out, raw) end
  end
end
return out
"""

# KEYS: seen zset. ARGV: ttl. Returns Redis's time, then name, score pairs of the workers
# whose last heartbeat is more than ttl old.
_STALE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local out = {string.format('%.6f', now)}
for _, v in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.6f', now - tonumber(ARGV[1])), 'WITHSCORES')) do
  table.insert(out, v)
end
return out
"""

# KEYS: seen zset, info hash. ARGV: name, the heartbeat time the caller found stale.
_FORGET = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[2]) then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""


class Registry:
    def __init__(self, client: redis.Redis, ttl: float):
        self.r = client
        self.ttl = ttl
        self._beat = client.register_script(_BEAT)
        self._outage = client.register_script(_OUTAGE)
        self._live = client.register_script(_LIVE)
        self._stale = client.register_script(_STALE)
        self._forget = client.register_script(_FORGET)

    def announce(self, info: WorkerInfo) -> tuple[float, float | None]:
        """Record a heartbeat; returns Redis's time of it and of this worker's previous one
        (None if it had none)."""
        now, prev = self._beat(keys=[keys.WORKERS_SEEN, keys.WORKERS], args=[info.name, info.model_dump_json()])
        return float(now), (float(prev) if prev else None)

    def outage(self, start: float, end: float) -> None:
        """Record that Redis did not serve (this caller) from `start` to `end` (its times)."""
        self._outage(keys=[keys.WORKERS_OUTAGE], args=[repr(start), repr(end)])

    def withdraw(self, *names: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hdel(keys.WORKERS, *names)
        pipe.zrem(keys.WORKERS_SEEN, *names)
        pipe.execute()

    def live(self) -> list[WorkerInfo]:
        """Workers that are alive and take new jobs."""
        return self.live_at()[1]

    def live_at(self, outage: tuple[float, float | None] | None = None) -> tuple[float, list[WorkerInfo]]:
        """Redis's time and the workers alive and taking new jobs then. `outage`: one the
        caller saw itself (start, end; end None: it ended just now), counted as the outages
        workers record."""
        args: list[str] = [repr(self.ttl)]
        if outage is not None:
            args += [repr(outage[0]), "" if outage[1] is None else repr(outage[1])]
        now, *raws = self._live(keys=[keys.WORKERS_SEEN, keys.WORKERS, keys.WORKERS_OUTAGE], args=args)
        infos = (WorkerInfo.model_validate_json(raw) for raw in raws)
        return float(now), [w for w in infos if not w.draining]

    def stale(self) -> list[tuple[str, float]]:
        """Workers whose heartbeats stopped: (name, time of the last one)."""
        return self.stale_at()[1]

    def stale_at(self) -> tuple[float, list[tuple[str, float]]]:
        """Redis's time, and the workers whose last heartbeat is more than ttl older:
        (name, time of the last one)."""
        now, *flat = self._stale(keys=[keys.WORKERS_SEEN], args=[repr(self.ttl)])
        return float(now), [(flat[i], float(flat[i + 1])) for i in range(0, len(flat), 2)]

    def forget(self, name: str, seen: float) -> bool:
        """Withdraw a stale worker unless it announced itself again since `seen`."""
        return bool(self._forget(keys=[keys.WORKERS_SEEN, keys.WORKERS], args=[name, repr(seen)]))
