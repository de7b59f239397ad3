"""Job records in Redis: one hash per job id, written by the API and advanced by workers.

Celery calls every id it has never seen PENDING; this record is what makes an unknown id a
404, and it carries status, timings and errors. Status changes go through one Lua script so
that, for example, a job cancelled while queued is never marked running by the worker that
picks it up afterwards. A final status also writes a one-entry stream `genq:done:<id>`, which
any number of waiters block on with XREAD: its entry holds the final record (all but the spec)
and a succeeded job's result (the result backend's, tasks/backend.py), so one XREAD answers a
waiter.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from tasks import keys
from tasks.errors import CANCELLED, EXPIRED, JobError, QuotaExceeded, worker_lost
from tasks.fair import FILL_FIRST, FILL_OWNED, PLAIN_PUSH_LUA, PUSH_LUA
from tasks.job_lua import CREATE, DONE_RESULT, FORGIVE, KEY_PREFIXES, RECORD, RECORD_ALL, SOLO, SUCCEED, TRANSITION
from tasks.records import Attempt, queued_record
from tasks.schemas import JobSpec, JobStatus
from tasks.usage import COUNT, NONE, Counts, count_args

ACTIVE = (JobStatus.queued, JobStatus.running)

# Where `JobStore.get(..., result_key=...)` puts the result key's raw value (not a field).
RESULT_RAW = "\0result-raw"
Raw = str | bytes
MAX_BLOCK_S = 3.0
# A waiter whose done stream stays empty reads the job's record this often (JobStore.wait).
LOOK_S = 6.0
# How often a waiter with a `gone` check asks it (whether its client left).
GONE_CHECK_S = 2.0
# What `JobStore.get` answers for a block that ran out when it was not to read the record, and
# `JobStore.wait` for a waiter whose client left.
PENDING: dict[str, str] = {}

# A worker takes the jobs it ended off its in-flight hash (`JobStore.forget_ended`) once this
# many have ended, or on its next heartbeat: one HDEL for many jobs, and a hash that stays
# small (Redis keeps one of up to 128 fields as a compact list; at 400 jobs/s a heartbeat's
# worth, some 800, cost Redis 10 % more CPU a job than the HDEL it saved:
# docs/benchmarks.md, "Redis commands per job").
FORGET_BATCH = 32
# A job whose worker was lost beside other jobs this many times (forgiven attempts) runs alone
# from then on (worker/tasks.py), so that a worker lost while it runs is charged to it alone.
SOLO_AFTER_FORGIVEN = 2


class JobStore:
    def __init__(
        self,
        client: redis.Redis,
        ttl: int,
        max_attempts: int = 3,
        blocking: redis.Redis | None = None,
        me: str = "",
    ):
        """`blocking`: the client for blocking reads (its socket timeout above MAX_BLOCK_S),
        where `client`'s is shorter (the API's); `client` by default. `me`: the worker whose
        store this is (its registry name): a job it ends on its own attempt stays in its
        in-flight hash until `forget_ended` (docs/benchmarks.md, "Redis commands per job")."""
        self.r, self.blocking = client, blocking or client
        self.ttl, self.max_attempts, self.me = ttl, max_attempts, me
        self._ended: list[str] = []
        self._ended_lock = threading.Lock()
        self._transition = client.register_script(RECORD + TRANSITION)
        self._start_filling = client.register_script(FILL_FIRST + RECORD + FILL_OWNED + TRANSITION)  # tasks/fair.py
        self._create = client.register_script(PLAIN_PUSH_LUA + CREATE)
        self._create_fair = client.register_script(PUSH_LUA + CREATE)
        self._end = client.register_script(RECORD_ALL + TRANSITION)
        self._succeed = client.register_script(RECORD_ALL + COUNT + SUCCEED)
        self._counted = client.register_script(RECORD_ALL + COUNT + TRANSITION)  # counts tokens (tasks/usage.py)
        self._solo = client.register_script(SOLO)
        self._forgive = client.register_script(FORGIVE)

    def create(
        self,
        specs: list[JobSpec],
        queue: str,
        max_depth: int,
        max_queued: int | None = None,
        messages: list[tuple[str, str]] | None = None,
        fair: tuple[list[str], list] | None = None,
    ) -> tuple[bool, int]:
        """Record queued jobs, atomically with a look at their queue: unless it already holds
        too many waiting jobs. Returns (created, the queue's depth). All specs share one owner
        (`specs[0].owner`); past its `max_queued` waiting jobs this raises QuotaExceeded.
        `messages`: each job's broker message as (Redis list, payload)
        (tasks/celery_app.py `job_message`), pushed in the same call once the jobs are
        recorded; without them the caller publishes the jobs itself. `fair`: fair share's
        (tasks/fair.py `FairLines.push_args`)."""
        now = repr(time.time())
        owner = (specs[0].owner if specs else None) or ""
        records = [queued_record(spec, queue, now) for spec in specs]
        fields = len(records[0]) if records else 0
        args: list = [max_depth, self.ttl, now, fields, "" if max_queued is None else max_queued, len(specs)]
        for rec in records:
            args += [x for pair in rec.items() for x in pair]
        messages = messages or []
        args += [payload for _, payload in messages]
        owner_set = keys.queued_by(owner) if owner else ""
        fair_keys, fair_args = fair if fair and messages else ([], [])
        lists = [*(keys.job(s.id) for s in specs), *(k for k, _ in messages), *fair_keys]
        script = self._create_fair if fair_keys else self._create
        depth, owned, refused = script(keys=[keys.queued(queue), owner_set, *lists], args=args + fair_args)
        if refused == 2:
            raise QuotaExceeded(owner, owned, max_queued)
        return refused == 0, depth

    def spec(self, rec: dict[str, str]) -> JobSpec | None:
        """What the job's message carries (None for a record written before it was kept)."""
        return JobSpec.model_validate_json(rec["spec"]) if rec.get("spec") else None

    def depth(self, queue: str) -> int:
        return self.r.zcard(keys.queued(queue))

    def get(
        self, job_id: str, result_key: str | bytes | None = None, block_ms: int | None = None, look: bool = True
    ) -> dict[str, str] | None:
        """The job's record. With `result_key`, its result (the result backend's encoded meta)
        comes with it, under RESULT_RAW (None if there is none): from the job's done stream,
        read in the same round trip, after the record, so a record that says succeeded finds
        it there; `result_key` is where an older genqueue's result backend kept it (looked at
        only for a succeeded job whose done entry has none).

        `block_ms`: first wait up to that long for the job's done stream. Its entry holds the
        final record (all but the spec) and the result: one command answers a waiter. An
        entry without the record (a job failed at its start, out of attempts) or no entry
        (the block ran out) and the record is read; not with `look` False: then PENDING."""
        if block_ms is not None:
            reply = self.blocking.xread({keys.done(job_id): "0"}, block=block_ms, count=1)
            if reply and "id" in (fields := reply[0][1][-1][1]):
                rec = dict(fields)
                raw = rec.pop(DONE_RESULT, None)
                if result_key is not None:
                    rec[RESULT_RAW] = raw
                return rec
            if not reply and not look:
                return PENDING
        if result_key is None:
            return self.r.hgetall(keys.job(job_id)) or None
        if block_ms is not None and not reply:
            # The block ran out: most likely the job still runs, and then its record is all.
            rec = self.r.hgetall(keys.job(job_id))
            if not rec or rec.get("status") != JobStatus.succeeded.value:
                return rec or None
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.job(job_id))
        pipe.xrevrange(keys.done(job_id), count=1)
        rec, done = pipe.execute()
        if not rec:
            return None
        rec[RESULT_RAW] = done[0][1].get(DONE_RESULT) if done else None
        if rec[RESULT_RAW] is None and rec.get("status") == JobStatus.succeeded.value:
            rec[RESULT_RAW] = self.r.get(result_key)  # an older genqueue's result backend key
        return rec

    def _move(
        self,
        job_id: str,
        to: JobStatus,
        allowed: tuple[JobStatus, ...],
        fence: int | None = None,
        worker: str = "",
        tag: str = "",
        _result: Raw | None = None,
        _counts: Counts | None = None,
        _fill: list | None = None,
        **fields: Any,
    ) -> tuple[int, JobStatus | None, int, int]:
        flat: list[str] = []
        for k, v in fields.items():
            v = v.stored() if isinstance(v, JobError) else v
            flat += [k, v if isinstance(v, str) else json.dumps(v)]
        if not worker and fence is not None:
            worker = self.me  # a worker ending its own attempt leaves its entry (forget_ended)
        script, extra_keys = (self._end if to.terminal else self._transition), []
        if _result is not None:
            script, extra_keys = self._succeed, [keys.USAGE]
            flat += [_result, *count_args(*(_counts or NONE))]
        elif _counts is not None:
            script, extra_keys = self._counted, [keys.USAGE]
            flat += count_args(*_counts)
        elif _fill is not None:
            script = self._start_filling
            flat += _fill
        res = script(
            keys=[keys.job(job_id), keys.done(job_id), keys.stream(job_id), keys.CALLBACKS_DUE, *extra_keys],
            args=[
                to.value,
                ",".join(s.value for s in allowed),
                str(self.ttl) if to.terminal else "",
                "1" if to is JobStatus.running else "0",
                "" if fence is None else str(fence),
                worker,
                tag,
                self.max_attempts,
                self.ttl,
                json.dumps(worker_lost(self.max_attempts).stored()),
                repr(time.time()),
                *KEY_PREFIXES,
                *flat,
            ],
        )
        if res is None:
            return 0, None, 0, 0
        moved, prev, attempt, forgiven = res
        if int(moved) == 1 and to.terminal and worker and worker == self.me:
            with self._ended_lock:
                self._ended.append(job_id)
                due = len(self._ended) >= FORGET_BATCH
            if due:
                try:
                    self.forget_ended()
                except redis.RedisError:
                    pass  # they stay listed: the next heartbeat's call takes them off
        return int(moved), JobStatus(prev.decode() if isinstance(prev, bytes) else prev), int(attempt), int(forgiven)

    def transition(
        self, job_id: str, to: JobStatus, allowed: tuple[JobStatus, ...], fence: int | None = None, **fields: Any
    ) -> tuple[bool, JobStatus | None]:
        """Move a job to `to` if its status is one of `allowed` and, when `fence` is given, it
        is still on attempt `fence`; return (moved, previous)."""
        moved, prev, _, _ = self._move(job_id, to, allowed, fence, **fields)
        return moved == 1, prev

    def start(self, job_id: str, worker: str, tag: str, fill: list | None = None, fence: int | None = None) -> Attempt:
        """Begin a new attempt at a job on `worker`, which holds its message as `tag`.

        `running` is allowed as a source: the job is delivered again after its worker died.
        A job that already used up its attempts fails instead (a poison job must not take
        down one worker after another). `fill`: fair share's (tasks/fair.py
        `FairLines.fill_args`): if the job has an owner, the queue's lists are refilled from
        the keys' lines in the same call, whether or not the job starts. `fence`: the job's
        attempts that the message was published at (JobSpec.republished_after; 0 for the API's
        own): a copy of a message whose job has started since does not start it again."""
        moved, prev, number, forgiven = self._move(
            job_id, JobStatus.running, ACTIVE, fence, worker=worker, tag=tag, _fill=fill, started=repr(time.time())
        )
        if moved == 1 and number > 1:
            self.r.incr(keys.CANCELS)  # an earlier attempt may still run somewhere: it is superseded
        return Attempt(
            run=moved == 1, prev=prev, number=number, exhausted=moved == 2, solo=forgiven >= SOLO_AFTER_FORGIVEN
        )

    def forget_ended(self) -> int:
        """Take the jobs this worker ended since the last call off its in-flight hash, in one
        HDEL (once FORGET_BATCH have ended, on each heartbeat, and as the worker stops);
        returns how many. Until then their entries stay: recovery skips an entry whose job is
        final, and a job that has ended is never in flight again."""
        with self._ended_lock:
            ended, self._ended = self._ended, []
        if not ended or not self.me:
            return 0
        try:
            self.r.hdel(keys.inflight(self.me), *ended)
        except BaseException:
            with self._ended_lock:
                self._ended[:0] = ended
            raise
        return len(ended)

    def forgive(self, job_id: str, attempt: int) -> bool:
        """Forgive a job its attempt `attempt`, lost with its worker beside other jobs (it
        does not count against GENQ_MAX_ATTEMPTS), once, and only while it is the current one."""
        return bool(self._forgive(keys=[keys.job(job_id)], args=[attempt]))

    def mark_solo(self, job_id: str, attempt: int) -> None:
        """Record that `attempt`, which runs alone on its worker, is now in the engine."""
        self._solo(keys=[keys.job(job_id)], args=[attempt])

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        error: JobError | None = None,
        fence: int | None = None,
        result: dict[str, Any] | None = None,
        counts: Counts | None = None,
    ) -> tuple[bool, JobStatus | None]:
        """`error`: why it ended (stored with the field it concerns: tasks/errors.py).
        `result`: the partial result of a failed job (a timeout keeps its text); a succeeded
        job's result is in the result backend. `counts`: its tokens, for usage (tasks/usage.py)."""
        fields: dict[str, Any] = {"finished": repr(time.time())}
        if error:
            fields["error"] = error
        if result:
            fields["result"] = result
        return self.transition(job_id, status, ACTIVE, fence, _counts=counts, **fields)

    def succeed(self, job_id: str, attempt: int, value: Raw, counts: Counts = NONE) -> bool:
        """Mark the job succeeded with its result (the result backend's encoded meta), which
        goes into its done stream's entry (DONE_RESULT), only while `attempt` is the job's
        current one (and the status queued or running), and count the job's tokens to its
        owner's usage (tasks/usage.py), in one call. Returns whether it moved."""
        moved, _, _, _ = self._move(
            job_id, JobStatus.succeeded, ACTIVE, attempt, _result=value, _counts=counts, finished=repr(time.time())
        )
        return moved == 1

    def expire(self, job_id: str, allowed: tuple[JobStatus, ...] = (JobStatus.queued,)) -> bool:
        """End a job whose deadline passed before it started: it never runs."""
        moved, _ = self.transition(job_id, JobStatus.expired, allowed, finished=repr(time.time()), error=EXPIRED)
        return moved

    def expire_if_due(self, rec: dict[str, str]) -> dict[str, str] | None:
        """The record, expired first if it is still queued past its deadline. A worker drops
        such a job when it receives its message, but that may be late or never (no worker)."""
        deadline = rec.get("deadline")
        if rec.get("status") != JobStatus.queued.value or not deadline or float(deadline) > time.time():
            return rec
        self.expire(rec["id"])
        return self.get(rec["id"])

    def give_up(self, job_id: str, attempt: int, counted: int | None = None) -> bool:
        """Fail a running job whose worker died on its last allowed attempt (`attempt`, of
        which `counted` count against the maximum: all by default)."""
        error = worker_lost(attempt if counted is None else counted)
        moved, _ = self.finish(job_id, JobStatus.failed, error, fence=attempt)
        return moved

    def cancel(self, job_id: str) -> tuple[bool, JobStatus | None]:
        moved, prev = self.finish(job_id, JobStatus.cancelled, CANCELLED)
        if moved:
            self.r.incr(keys.CANCELS)  # the worker running it looks (worker/cancels.py)
        return moved, prev

    def wait(
        self,
        job_id: str,
        timeout: float,
        exists: bool = False,
        result_key: str | bytes | None = None,
        gone: Callable[[], bool] | None = None,
    ) -> dict[str, str] | None:
        """The job's record once it is final, or as it stands when `timeout` runs out.

        `exists`: the caller knows the job exists (it just created it), so the first look at
        the record can wait for the done stream instead of finding the job still running.
        `result_key`: as for `get`. `gone`: asked after every block (then of GONE_CHECK_S at
        most) whether the waiter's client left; when it says so, the wait ends with PENDING.
        """
        looked = time.monotonic()  # the last read of the record (or the job's creation)
        deadline = looked + timeout
        if not exists:
            rec = self.get(job_id, result_key)
            rec = rec and self.expire_if_due(rec)
            if rec is None or JobStatus(rec["status"]).terminal:
                return rec
        longest = MAX_BLOCK_S if gone is None else min(MAX_BLOCK_S, GONE_CHECK_S)
        while True:
            now = time.monotonic()
            left = deadline - now
            if left > 0:
                # An entry in the done stream means the record is final. Each block stays
                # below the client's socket timeout (redis-py's default is 5 s). After a block
                # that ran out, the record is read only every LOOK_S (it may be gone, or queued
                # past its deadline): a long job's waiter costs Redis one command per block, not
                # three (docs/benchmarks.md, "Redis commands per job").
                block_ms = max(1, int(min(left, longest) * 1000))
                look = now + block_ms / 1000 - looked >= LOOK_S
                rec = self.get(job_id, result_key, block_ms, look=look)
                if rec is PENDING:
                    if gone is not None and gone():
                        return PENDING
                    continue
                looked = time.monotonic()
            else:
                rec = self.get(job_id, result_key)
            rec = rec and self.expire_if_due(rec)
            if rec is None or JobStatus(rec["status"]).terminal or time.monotonic() >= deadline:
                return rec
