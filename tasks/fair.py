"""Fair share between API keys inside one priority: each key's jobs wait in a line of their own
and the workers take from the lines in weighted turns (start-time fair queueing), so one key's
flood does not make the others wait behind all of it (GENQ_FAIR_SHARE, GENQ_FAIR_DEPTH). How
the lines, the refill and recovery fit together: docs/design.md, "Fair share between keys"."""

from __future__ import annotations

import json

import redis

from tasks import keys
from tasks.kombu_compat import queue_key

# Refill `list` from the lines of the step whose active owners are `owners`, in weighted turns,
# until it holds `depth` messages or no line waits. Returns how many messages moved. A line's
# entry is "<cost> <message>": an owner's next turn comes cost / weight after its last (the
# cost: the tokens its job asks for), so a key of short jobs gets as many tokens as one of long
# ones, not as many jobs.
FILL_LUA = """
local function fill(list, owners, weights, depth)
  local moved = 0
  while redis.call('LLEN', list) < depth do
    local top = redis.call('ZRANGE', owners, 0, 0, 'WITHSCORES')
    if #top == 0 then break end
    local who, pass = top[1], tonumber(top[2])
    local line = owners .. ':' .. who
    local entry = redis.call('LPOP', line)
    local cost = 1
    if entry then
      local m = entry
      local sp = string.find(entry, ' ', 1, true)
      if string.sub(entry, 1, 1) ~= '{' and sp then  -- "<cost> <message>"; a bare message costs 1
        cost, m = tonumber(string.sub(entry, 1, sp - 1)) or 1, string.sub(entry, sp + 1)
      end
      redis.call('LPUSH', list, m)
      redis.call('SET', owners .. '/clock', top[2])
      moved = moved + 1
    end
    if redis.call('LLEN', line) == 0 then
      redis.call('ZREM', owners, who)
    else
      redis.call('ZADD', owners, pass + cost / (tonumber(redis.call('HGET', weights, who)) or 1), who)
    end
  end
  return moved
end
"""
# The mover on its own. KEYS: the weights hash. ARGV: the depth, then each step's list and
# active owners' zset, in priority order. A zset with no owner left is no key: one EXISTS says
# whether any line waits (a worker refills after every job it takes, mostly with none waiting).
_FILL = (
    FILL_LUA
    + """
local active = {}
for i = 3, #ARGV, 2 do active[#active + 1] = ARGV[i] end
if redis.call('EXISTS', unpack(active)) == 0 then return 0 end
local moved = 0
for i = 2, #ARGV, 2 do moved = moved + fill(ARGV[i], ARGV[i + 1], KEYS[1], tonumber(ARGV[1])) end
return moved
"""
)

# `_FILL` in another script (tasks/jobs.py's start of a job: a worker refills as it takes
# each job, in the same call), in two parts. FILL_FIRST, a prefix, takes its own arguments off
# the end of ARGV: the weights hash, the depth, then each step's list and active owners' zset,
# then their count. FILL_OWNED, after the script's RECORD, refills only if the job taken has an
# owner: lines hold only jobs with owners, so a job without one never waited behind a line, and
# an API without keys has none (one EXISTS a job saved; should jobs with and without owners
# share a queue, a heartbeat's refill, `FairLines.fill`, covers those taken without one).
FILL_FIRST = (
    FILL_LUA
    + """
local fill_spec = {}
do
  local n = tonumber(table.remove(ARGV))
  for i = n, 1, -1 do fill_spec[i] = table.remove(ARGV) end
end
"""
)
FILL_OWNED = """
if owner and owner ~= '' then
  local f = fill_spec
  local active = {}
  for i = 4, #f, 2 do active[#active + 1] = f[i] end
  if redis.call('EXISTS', unpack(active)) > 0 then
    for i = 3, #f, 2 do fill(f[i], f[i + 1], f[1], tonumber(f[2])) end
  end
end
"""

# The `push` tasks/job_lua.py's CREATE calls for each message it records, with fair share: it
# takes the last 3 KEYS (the step's shared list, its active owners, the weights hash) and the
# last 4 ARGV (depth, owner, weight, each job's cost). A message for another list (a worker's
# lane) is pushed as it is without fair share.
PUSH_LUA = (
    FILL_LUA
    + """
local PUSH_KEYS = 3
local F_LIST, F_OWNERS, F_WEIGHTS = KEYS[#KEYS - 2], KEYS[#KEYS - 1], KEYS[#KEYS]
local F_DEPTH, F_OWNER, F_WEIGHT, F_COST = tonumber(ARGV[#ARGV - 3]), ARGV[#ARGV - 2], ARGV[#ARGV - 1], ARGV[#ARGV]
local function push(k, v)
  if k ~= F_LIST or (redis.call('ZCARD', F_OWNERS) == 0 and redis.call('LLEN', k) < F_DEPTH) then
    redis.call('LPUSH', k, v)
    return
  end
  redis.call('RPUSH', F_OWNERS .. ':' .. F_OWNER, F_COST .. ' ' .. v)
  redis.call('HSET', F_WEIGHTS, F_OWNER, F_WEIGHT)
  if not redis.call('ZSCORE', F_OWNERS, F_OWNER) then
    redis.call('ZADD', F_OWNERS, redis.call('GET', F_OWNERS .. '/clock') or '0', F_OWNER)
  end
  fill(F_LIST, F_OWNERS, F_WEIGHTS, F_DEPTH)
end
"""
)

# Without fair share: every message straight onto its list.
PLAIN_PUSH_LUA = """
local PUSH_KEYS = 0
local function push(k, v) redis.call('LPUSH', k, v) end
"""


def turns(
    weights: dict[str, int], backlog: dict[str, int], clock: float = 0.0, costs: dict[str, int] | None = None
) -> list[str]:
    """The order in which `FILL_LUA` serves owners whose lines hold `backlog` messages, all
    joining at `clock`, each of `owner`'s jobs costing `costs[owner]` (1 if not given): what it
    does, in Python (tests/test_fair.py holds the two together)."""
    costs = costs or {}
    score = {o: clock for o, n in backlog.items() if n > 0}
    left = dict(backlog)
    order: list[str] = []
    while score:
        who = min(score, key=lambda o: (score[o], o))
        order.append(who)
        left[who] -= 1
        if left[who]:
            score[who] += costs.get(who, 1) / weights.get(who, 1)
        else:
            del score[who]
    return order


class FairLines:
    """The lines of one Redis: `steps` kombu priority steps, lists kept to `depth` messages."""

    def __init__(self, client: redis.Redis, steps: int, depth: int):
        self.r, self.steps, self.depth = client, steps, depth
        self._fill = client.register_script(_FILL)

    def push_args(self, queue: str, step: int, owner: str, weight: int, cost: int = 1) -> tuple[list[str], list]:
        """The KEYS and ARGV that `PUSH_LUA` takes from the end of CREATE's, for jobs of
        `owner` at priority `step` on `queue`, each costing `cost` (the tokens it asks for)."""
        keys_ = [queue_key(queue, step), keys.fair_owners(queue, step), keys.FAIR_WEIGHTS]
        return keys_, [self.depth, owner, weight, max(1, int(cost))]

    def fill(self, queue: str) -> int:
        """Refill every priority step's list of `queue` from its lines; how many moved."""
        return int(self._fill(keys=[keys.FAIR_WEIGHTS], args=self._steps(queue)))

    def fill_args(self, queue: str) -> list:
        """What `FILL_FIRST` takes off the end of the ARGV of the script it prefixes, to refill
        `queue`'s lists in that script's call."""
        args = [keys.FAIR_WEIGHTS, *self._steps(queue)]
        return [*args, len(args)]

    def _steps(self, queue: str) -> list:
        args: list = [self.depth]
        for step in range(self.steps):
            args += [queue_key(queue, step), keys.fair_owners(queue, step)]
        return args

    def waiting_ids(self, queue: str) -> set[str]:
        """The ids of the jobs whose messages wait in `queue`'s lines. Messages only leave a
        line (onto a list), so one read before a look at the lists misses none of them."""
        pipe = self.r.pipeline(transaction=False)
        for step in range(self.steps):
            pipe.zrange(keys.fair_owners(queue, step), 0, -1)
        owners = pipe.execute()
        for step, names in enumerate(owners):
            for name in names:
                pipe.lrange(keys.fair_line(queue, step, _text(name)), 0, -1)
        return {
            (json.loads(message_of(raw)).get("headers") or {}).get("id", "") for msgs in pipe.execute() for raw in msgs
        }

    def waiting(self, queue: str) -> dict[str, int]:
        """How many messages wait in each owner's lines of `queue` (over all steps)."""
        pipe = self.r.pipeline(transaction=False)
        for step in range(self.steps):
            pipe.zrange(keys.fair_owners(queue, step), 0, -1)
        found = [(step, _text(n)) for step, names in enumerate(pipe.execute()) for n in names]
        for step, name in found:
            pipe.llen(keys.fair_line(queue, step, name))
        counts: dict[str, int] = {}
        for (_, name), n in zip(found, pipe.execute(), strict=True):
            counts[name] = counts.get(name, 0) + int(n)
        return counts


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def message_of(entry: str | bytes) -> str:
    """The message of a line's entry, "<cost> <message>" (a bare message from before costs)."""
    entry = _text(entry)
    return entry if entry.startswith("{") else entry.split(" ", 1)[1]
