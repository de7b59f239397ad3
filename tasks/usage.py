"""Usage and rate limits per API key, in Redis.

Usage: every job that ends with tokens is counted once, per owner (its API key's name; '' for
the jobs of an open API, reported as ANONYMOUS) and model: `jobs`, `prompt_tokens`,
`completion_tokens`, `cached_tokens`, exactly as its result says (the numbers a response's
`usage` sums). The count is taken by the job store's own Lua call that moves the job to its
final status (tasks/jobs.py: `succeed`, and `finish` of a failed job that kept a partial
result), and only when that call moves it: fenced by the job's attempt, so a job retried
after its worker was lost, or finished twice, is counted once. Cancelled jobs count nothing.

Rate limits: an owner's requests (counted by `RateLimiter.admit` as they are admitted) and
tokens (prompt and completion of its jobs, counted as they end, by the same call as usage)
in sliding windows of one minute, in buckets of one second (keys.rate). `admit` looks at both
windows and counts the request in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from tasks import keys

# How the jobs of an open API (no owner) are reported.
ANONYMOUS = "anonymous"
COUNTS = ("jobs", "prompt_tokens", "completion_tokens", "cached_tokens")
WINDOW_S = 60
RPM, TPM = "rpm", "tpm"
# A job's (prompt, completion, cached) tokens.
Counts = tuple[int, int, int]
NONE: Counts = (0, 0, 0)

# A prefix to tasks/job_lua.py's TRANSITION (or SUCCEED, itself a prefix to it), after its
# RECORD (the record's fields, read once: `cur`, `raw_attempts`, `owner`, `model`): counts a
# job's tokens when that call will move the job, i.e. its status is one of ARGV[2] and, with a
# fence (ARGV[5]), the fence is its current attempt (ARGV[4] is '0': no attempt starts). It
# takes its own arguments off the end of ARGV first: the counts ("<prompt> <completion>
# <cached>"), the prefix of the owners' token windows (keys.rate) and that of the usage rows
# (keys.usage_row). KEYS[#KEYS]: the set of usage rows (keys.USAGE). One BITFIELD adds a job's
# four counts to its row (docs/benchmarks.md, "Redis commands per job"); a row's first job
# adds the row to the set.
COUNT = """
local row_prefix = table.remove(ARGV)
local tpm_prefix = table.remove(ARGV)
local counts = table.remove(ARGV)
local ok = false
for s in string.gmatch(ARGV[2], '[^,]+') do
  if s == cur then ok = true end
end
if ok and ARGV[5] ~= '' and raw_attempts ~= ARGV[5] then ok = false end
if ok then
  local who = owner or ''
  local row = who .. '\\t' .. (model or '')
  local p, c, k = string.match(counts, '^(%d+) (%d+) (%d+)$')
  p, c, k = tonumber(p), tonumber(c), tonumber(k)
  local jobs = redis.call('BITFIELD', row_prefix .. row, 'INCRBY', 'i64', '#0', 1, 'INCRBY', 'i64', '#1', p,
    'INCRBY', 'i64', '#2', c, 'INCRBY', 'i64', '#3', k)[1]
  if jobs == 1 then redis.call('SADD', KEYS[#KEYS], row) end
  if who ~= '' and p + c > 0 then
    local w = tpm_prefix .. who
    redis.call('HINCRBY', w, redis.call('TIME')[1], p + c)
    redis.call('EXPIRE', w, WINDOW_EXPIRY_S)
  end
end
""".replace("WINDOW_EXPIRY_S", str(2 * WINDOW_S))


def count_args(prompt: int, completion: int, cached: int) -> list[str]:
    """What COUNT takes off the end of ARGV."""
    return [
        f"{int(prompt)} {int(completion)} {int(cached)}",
        keys.key_prefix(lambda o: keys.rate(TPM, o)),
        keys.key_prefix(keys.usage_row),
    ]


def counts_of(result: dict | None) -> Counts | None:
    """A job's (or a failed job's partial) result's token counts, if it has them."""
    if not isinstance(result, dict) or "prompt_tokens" not in result or "completion_tokens" not in result:
        return None
    return int(result["prompt_tokens"]), int(result["completion_tokens"]), int(result.get("cached_tokens") or 0)


# Admits a request of an owner unless its requests (KEYS[1]) or tokens (KEYS[2]) in the last
# ARGV[3] seconds reach their limit (ARGV[1], ARGV[2]: '' = none), and counts it in KEYS[1]
# (only when it has a limit). The windows are hashes of Unix second -> count; seconds that have
# left the window are dropped here. Returns {0 admitted | 1 rpm | 2 tpm, seconds until the
# window that refused frees, requests, tokens in the window}.
_ADMIT = """
local now = tonumber(redis.call('TIME')[1])
local span = tonumber(ARGV[3])
local function load(key)
  local flat = redis.call('HGETALL', key)
  local total, buckets, old = 0, {}, {}
  for i = 1, #flat, 2 do
    local s, n = tonumber(flat[i]), tonumber(flat[i + 1])
    if s <= now - span then table.insert(old, flat[i])
    else total = total + n; table.insert(buckets, {s, n}) end
  end
  if #old > 0 then redis.call('HDEL', key, unpack(old)) end
  table.sort(buckets, function(a, b) return a[1] < b[1] end)
  return total, buckets
end
local function frees(total, buckets, limit)
  for _, b in ipairs(buckets) do
    total = total - b[2]
    if total < limit then return b[1] + span - now end
  end
  return 1
end
local requests, rb = load(KEYS[1])
local tokens, tb = load(KEYS[2])
if ARGV[1] ~= '' and requests >= tonumber(ARGV[1]) then
  return {1, frees(requests, rb, tonumber(ARGV[1])), requests, tokens}
end
if ARGV[2] ~= '' and tokens >= tonumber(ARGV[2]) then
  return {2, frees(tokens, tb, tonumber(ARGV[2])), requests, tokens}
end
if ARGV[1] ~= '' then
  redis.call('HINCRBY', KEYS[1], now, 1)
  redis.call('EXPIRE', KEYS[1], 2 * span)
  requests = requests + 1
end
return {0, 0, requests, tokens}
"""


@dataclass(frozen=True)
class Admission:
    """What `RateLimiter.admit` found: `refused` by `rpm` or `tpm` (None: admitted), the seconds
    until that window frees, and the owner's requests and tokens in the window."""

    refused: str | None
    retry_after: int
    requests: int
    tokens: int


class RateLimiter:
    def __init__(self, client: redis.Redis, window_s: int = WINDOW_S):
        self.window_s = window_s
        self._admit = client.register_script(_ADMIT)

    def admit(self, owner: str, rpm: int | None, tpm: int | None) -> Admission:
        """Admit (and count) one request of `owner` within its limits, or say which refused."""
        code, wait, requests, tokens = self._admit(
            keys=[keys.rate(RPM, owner), keys.rate(TPM, owner)],
            args=["" if rpm is None else rpm, "" if tpm is None else tpm, self.window_s],
        )
        refused = {0: None, 1: RPM, 2: TPM}[int(code)]
        return Admission(refused, int(wait), int(requests), int(tokens))


@dataclass
class Usage:
    """One owner's counts for one model."""

    key: str
    model: str
    jobs: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def view(self) -> dict:
        out = {name: getattr(self, name) for name in ("key", "model", *COUNTS)}
        out["total_tokens"] = self.prompt_tokens + self.completion_tokens
        return out


def read_usage(client: redis.Redis) -> list[Usage]:
    """The counts of every owner, by owner and model; an open API's jobs under ANONYMOUS."""
    names = sorted(n.decode() if isinstance(n, bytes) else n for n in client.smembers(keys.USAGE))
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.execute_command("BITFIELD", keys.usage_row(name), *_GET_COUNTS)
    rows = []
    for name, counts in zip(names, pipe.execute() if names else [], strict=True):
        who, _, model = name.partition("\t")
        rows.append(Usage(who or ANONYMOUS, model, *(int(n or 0) for n in counts)))
    return rows


# BITFIELD's reads of a usage row's four counts, in COUNTS' order.
_GET_COUNTS = [x for i in range(len(COUNTS)) for x in ("GET", "i64", f"#{i}")]
