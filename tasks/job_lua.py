"""The Lua of the job store (tasks/jobs.py): each script that creates or moves a job record,
with what it takes and returns. Every key a script names is in tasks/keys.py; the cost of each
in Redis commands is in docs/benchmarks.md, "Redis commands per job"."""

from tasks import keys

# Moves a job to a new status if its current one is allowed, and keeps what hangs off the
# status in step: the queued set (queue depth), the running worker's in-flight hash (where
# recovery finds that worker's jobs should it die), the done stream, and the attempt counter that
# fences a worker whose job was taken away from it.
# KEYS: record, done stream, token stream, the due callbacks. ARGV: to, allowed (comma list), TTL if final else '',
# '1' to start an attempt, the attempt the caller holds ('' = none: the API), worker (the one
# that starts the attempt; or the caller's own name, a worker ending its attempt), delivery
# tag, max attempts, then (9-11) what a used-up job fails with, the prefixes of the queued, the
# owner's queued and the in-flight keys (12-14: KEY_PREFIXES), then field/value pairs to set.
# Returns {moved, previous status, attempt, forgiven}; moved is 0 (not allowed or fenced), 1,
# or 2 (an attempt was due but the job had used up its attempts: it is now failed,
# worker_lost). Attempts its worker was lost on beside other jobs are `forgiven`
# (worker/recovery.py): they do not count against the maximum. A job with a `callback_url`
# that reaches a final status is due for its callback in the same call (webapp/callbacks.py).
# Each script that moves a job starts with RECORD (the fields it needs, in one HMGET) and
# changes the record in one HSET (docs/benchmarks.md, "Redis commands per job").
RECORD = """
local rec, done_extra = nil, {}
local cur, raw_attempts, raw_forgiven, id, worker, queue, owner, model, callback_url = unpack(redis.call('HMGET',
  KEYS[1], 'status', 'attempts', 'forgiven', 'id', 'worker', 'queue', 'owner', 'model', 'callback_url'))
"""
# RECORD for the scripts that end jobs: the whole record (`rec`), which the done stream's entry
# copies (all but the spec) once the job is final, so that a waiter reads the job from the
# stream alone (`JobStore.get`).
RECORD_ALL = """
local rec, done_extra = {}, {}
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do rec[flat[i]] = flat[i + 1] end
local cur, raw_attempts, raw_forgiven, id, worker, queue, owner, model, callback_url = rec.status, rec.attempts,
  rec.forgiven, rec.id, rec.worker, rec.queue, rec.owner, rec.model, rec.callback_url
"""
TRANSITION = """
if not cur then return false end
local allowed = string.find(',' .. ARGV[2] .. ',', ',' .. cur .. ',', 1, true) ~= nil
local attempts, forgiven = tonumber(raw_attempts or '0'), tonumber(raw_forgiven or '0')
if not allowed then return {0, cur, attempts, forgiven} end
if ARGV[5] ~= '' and tonumber(ARGV[5]) ~= attempts then return {0, cur, attempts, forgiven} end
local to, ttl, moved = ARGV[1], ARGV[3], 1
local set = {'status', to}
if ARGV[4] == '1' and cur == 'running' and attempts - forgiven >= tonumber(ARGV[8]) then
  to, ttl, moved = 'failed', ARGV[9], 2
  set = {'status', to, 'error', ARGV[10], 'finished', ARGV[11]}
end
if cur == 'queued' then
  redis.call('ZREM', ARGV[12] .. queue, id)
  if owner and owner ~= '' then redis.call('ZREM', ARGV[13] .. owner, id) end
end
-- The job leaves its worker's in-flight hash, unless that worker ends its own attempt (fenced,
-- ARGV[6] its name): it takes its ended jobs off its hash on its next heartbeat, in one HDEL
-- (JobStore.forget_ended); recovery skips an entry whose record is final.
if worker and not (ARGV[5] ~= '' and ARGV[4] ~= '1' and ARGV[6] == worker) then
  redis.call('HDEL', ARGV[14] .. worker, id)
end
if moved == 1 and ARGV[4] == '1' then
  attempts = attempts + 1
  set = {'status', to, 'attempts', tostring(attempts), 'worker', ARGV[6], 'tag', ARGV[7]}
end
if moved == 1 then for i = 15, #ARGV do set[#set + 1] = ARGV[i] end end
redis.call('HSET', KEYS[1], unpack(set))
if moved == 1 and ARGV[4] == '1' then
  redis.call('HSET', ARGV[14] .. ARGV[6], id, ARGV[7])
  if attempts > 1 and redis.call('EXISTS', KEYS[3]) == 1 then
    -- A new attempt's tokens replace the last one's; readers learn so from the marker. Trimmed,
    -- not deleted: the stream keeps its last id, so the marker's is above every reader's cursor.
    redis.call('XTRIM', KEYS[3], 'MAXLEN', 0)
    redis.call('XADD', KEYS[3], '*', 'restart', attempts)
    redis.call('EXPIRE', KEYS[3], ARGV[9])
  end
end
if ttl ~= '' then
  local entry = {'status', to}
  if rec then
    for i = 1, #set, 2 do rec[set[i]] = set[i + 1] end
    entry = {}
    for k, v in pairs(rec) do
      if k ~= 'spec' then entry[#entry + 1] = k; entry[#entry + 1] = v end
    end
  end
  for i = 1, #done_extra do entry[#entry + 1] = done_extra[i] end
  redis.call('XADD', KEYS[2], 'MAXLEN', '1', '*', unpack(entry))
  redis.call('EXPIRE', KEYS[2], ttl)
  if callback_url and callback_url ~= '' then redis.call('ZADD', KEYS[4], 'NX', ARGV[11], 'job:' .. id) end
end
return {moved, cur, attempts, forgiven}
"""

# The keys TRANSITION names from the record's own queue, owner and worker, as ARGV 12-14.
KEY_PREFIXES = [keys.key_prefix(keys.queued), keys.key_prefix(keys.queued_by), keys.key_prefix(keys.inflight)]

# TRANSITION to succeeded, with the job's result (the result backend's encoded meta, as Celery
# would SET it under its own key) in the done stream's entry, as its DONE_RESULT field: written
# only as the job moves, so fenced like every transition (only while the writer's attempt,
# ARGV[5], is the job's current one). KEYS: as TRANSITION, then the usage rows. ARGV: as
# TRANSITION, then the encoded result. The result lives as long as the job's record does;
# the client woken by the entry finds it there (docs/benchmarks.md, "Redis commands per job").
SUCCEED = (
    """
done_extra = {'DONE_RESULT', table.remove(ARGV)}
"""
    + TRANSITION
)

# Creates the records of queued jobs unless their queue already holds `max_depth` of them, or
# their owner (an API key's name) already has `max_queued` waiting, over all queues.
# The depth is the queue's set of queued job ids, not the length of its Redis list: it counts
# jobs whose messages are not yet published and priority sub-queues, so the cap is exact. The
# owner's set counts the same way (TRANSITION removes a job from both when it leaves queued).
# With the jobs' broker messages (tasks/celery_app.py `job_message`), each is pushed (LPUSH; fair
# share: tasks/fair.py's PUSH_LUA) once every record is written: job and message exist together
# or not at all. KEYS: the queued set, the owner's queued set ('' for jobs without owner), one
# record key per job, then (with messages) one queue list per job, then `push`'s (PUSH_KEYS).
# ARGV: max depth, TTL, now, the number of fields per record, the owner's max queued ('' = no
# limit), the number of jobs, then each record's field/value pairs in order (the id first),
# then (with messages) each message, then `push`'s own. Returns {the queue's depth before, the
# owner's count before, 0 created | 1 queue full | 2 owner's quota exceeded}.
CREATE = """
local jobs = tonumber(ARGV[6])
local cutoff = tonumber(ARGV[3]) - tonumber(ARGV[2])
-- A set's count, less the ids of records that expired while queued (none left the set through
-- TRANSITION); those are only looked for when the count would refuse.
local function count(set, limit)
  local n = redis.call('ZCARD', set)
  if n + jobs > limit then
    redis.call('ZREMRANGEBYSCORE', set, '-inf', cutoff)
    n = redis.call('ZCARD', set)
  end
  return n
end
local depth = count(KEYS[1], tonumber(ARGV[1]))
local owned = 0
if KEYS[2] ~= '' then
  owned = count(KEYS[2], tonumber(ARGV[5] ~= '' and ARGV[5] or ARGV[1]))
  if ARGV[5] ~= '' and owned + jobs > tonumber(ARGV[5]) then return {depth, owned, 2} end
end
if depth + jobs > tonumber(ARGV[1]) then return {depth, owned, 1} end
local n = tonumber(ARGV[4]) * 2
for j = 1, jobs do
  local key, base = KEYS[2 + j], 6 + (j - 1) * n
  redis.call('HSET', key, unpack(ARGV, base + 1, base + n))
  redis.call('EXPIRE', key, ARGV[2])
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[base + 2])
  if KEYS[2] ~= '' then redis.call('ZADD', KEYS[2], ARGV[3], ARGV[base + 2]) end
end
-- With messages: each job's Celery message onto its queue's list, after the jobs are recorded.
for j = 1, #KEYS - 2 - jobs - PUSH_KEYS do push(KEYS[2 + jobs + j], ARGV[6 + jobs * n + j]) end
return {depth, owned, 0}
"""

# The field of a succeeded job's done-stream entry that holds its result (SUCCEED).
DONE_RESULT = "celery_meta"
SUCCEED = SUCCEED.replace("DONE_RESULT", DONE_RESULT)

# Forgives a job the attempt its worker was lost on beside other jobs (worker/recovery.py),
# once: only while that attempt is the job's current one, and not if it was forgiven already
# (recovery may publish a job again more than once for one loss). KEYS: the record. ARGV: the
# attempt. Returns 1 if it forgave.
FORGIVE = """
local attempts, forgave = unpack(redis.call('HMGET', KEYS[1], 'attempts', 'forgave'))
if attempts ~= ARGV[1] or forgave == ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'forgave', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'forgiven', 1)
return 1
"""

# Marks the attempt of a job that runs alone on its worker, once it is in the engine: a worker
# lost then was lost to it. KEYS: the record. ARGV: the attempt (only while it is the current).
SOLO = """
if redis.call('HGET', KEYS[1], 'attempts') == ARGV[1] then redis.call('HSET', KEYS[1], 'solo', ARGV[1]) end
"""
