"""Recovery of a dead or hung worker's jobs, by the workers that are still alive.

kombu's ack emulation is off (tasks/celery_app.py): a message a worker has taken is in its
memory only, and a job is found by its record, its queue's queued set (while it waits) and its
worker's in-flight hash (from its start until it ends or its next attempt starts). Every live
worker sweeps the registry each heartbeat: the in-flight jobs of a worker whose heartbeat is
older than `heartbeat_ttl` (on Redis's clock) are published again at once from their records.
A job that has used up GENQ_MAX_ATTEMPTS fails (`worker_lost`); an attempt lost beside other
jobs is forgiven, and a job forgiven SOLO_AFTER_FORGIVEN times runs alone. Every
GENQ_RECONCILE_INTERVAL each worker also compares the job records with what the broker holds
(`Reaper.reconcile`) and publishes again a job found adrift on two passes in a row. A gone
worker's lane (cache-aware placement) is drained into its shared queue.

How and why, case by case: docs/reliability.md, "How a lost worker's jobs are recovered".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

import redis
from celery import Celery
from kombu.utils.json import loads

from tasks import keys
from tasks.celery_app import PRIORITY_STEPS, publish_job
from tasks.fair import FairLines
from tasks.jobs import JobStore
from tasks.kombu_compat import priority_lists
from tasks.placement import Placement
from tasks.registry import Registry
from tasks.schemas import JobStatus

log = logging.getLogger(__name__)

# A job's message is published again at most once in this long for one lost attempt (or, for
# a queued job whose message was lost, for the attempts it has made).
REPUBLISH_CLAIM_S = 30
# Where `Reaper.reconcile` found a job recorded queued whose message is nowhere.
QUEUED = "queued"
# How long the count of a lost worker's jobs (`Reaper.forgive`) is kept.
LOST_TTL_S = 24 * 3600


class Reaper:
    def __init__(
        self,
        app: Celery,
        store: JobStore,
        registry: Registry,
        me: str,
        queue: str = "",
        running: Callable[[], Collection[str]] = tuple,
        placement: Placement | None = None,
        lane: bool = False,
        fair: FairLines | None = None,
    ):
        """`queue`: the queue this worker consumes, whose queued jobs it reconciles;
        `running`: the ids of the jobs this process is running; `lane`: it also consumes a
        lane of its own (tasks/placement.py), kept registered by `keep_lane`; `fair`: the
        keys' lines of its queue (tasks/fair.py), which `refill` moves onto its lists."""
        self.app, self.store, self.registry, self.me = app, store, registry, me
        self.queue, self.running = queue, running
        self.placement = placement or Placement(store.r, len(PRIORITY_STEPS))
        self.lane = lane
        self.fair = fair or FairLines(store.r, len(PRIORITY_STEPS), 1)  # without: only read (_held)
        self._conn = None
        # Jobs found adrift on the last reconcile pass, with where (an in-flight hash, or
        # QUEUED: recorded queued, message nowhere); acted on when found so again, there.
        self._adrift: set[tuple[str, str]] = set()
        # During a reconcile pass: what each queue held when the pass first looked (`_held`).
        self._pass_held: dict[str, set[str]] | None = None

    def sweep(self, judges: Callable[[float], bool] | None = None) -> int:
        """Restore the jobs of every worker whose heartbeat went stale; returns how many.
        `judges(t)`: whether this worker may judge others at Redis's time `t` of the look
        (see worker/__main__.py `Heartbeat`); it sweeps nothing otherwise."""
        now, stale = self.registry.stale_at()
        if judges is not None and not judges(now):
            return 0
        restored = 0
        for name, seen in stale:
            if name == self.me:
                continue
            restored += self.recover(name)
            self.placement.drain(name)  # after recover: nothing restores into a lane
            self.registry.forget(name, seen)
        return restored

    def keep_lane(self) -> None:
        """On each heartbeat: this worker's lane is registered, and alive."""
        if self.lane and self.queue:
            self.placement.keep_lane(self.me, self.queue)

    def forget_ended(self) -> int:
        """On each heartbeat: the jobs this worker ended since leave its in-flight hash."""
        return self.store.forget_ended()

    def announced(self) -> None:
        """This worker beat for the first time, or again after it was taken for lost: a
        count recorded at its loss (`forgive`) is not of its next one."""
        self.store.r.delete(keys.lost(self.me))

    def refill(self) -> int:
        """On each heartbeat: refill the queue's lists from the keys' lines, should the workers
        that take its jobs (which refill as they do) be gone or have failed to."""
        return self.fair.fill(self.queue) if self.queue else 0

    def drain_lanes(self, live: Collection[str]) -> int:
        """Give the jobs waiting in the lanes of workers not in `live` to their shared queues."""
        moved = 0
        for worker in self.placement.lanes():
            if worker not in live and worker != self.me:
                n = self.placement.drain(worker)
                if n:
                    log.warning("worker %s is gone; %d jobs waiting in its lane moved to the shared queue", worker, n)
                moved += n
        return moved

    def recover(self, worker: str) -> int:
        inflight = self.store.r.hgetall(keys.inflight(worker))
        forgiven = self.forgive(worker, inflight)
        restored = 0
        for job_id, tag in inflight.items():
            restored += self._recover_job(keys.inflight(worker), job_id, tag, job_id in forgiven)
        if inflight:
            log.warning(
                "worker %s stopped answering; %d of its %d jobs published again",
                worker,
                restored,
                len(inflight),
            )
        return restored

    def forgive(self, worker: str, inflight: dict[str, str]) -> set[str]:
        """Which of a lost worker's in-flight jobs are not charged for it: none if it had one
        job in flight; if one of them was running alone (its `solo` attempt is the current
        one), the others (they waited for it); else all of them. How many it had is taken
        once, at recovery's first look (keys.lost): its jobs leave the hash as they start
        again, and a later look must not find one job left and charge it. Entries of jobs
        already final (ended there, not yet taken off: `JobStore.forget_ended`) do not count."""
        if not inflight:
            return set()
        pipe = self.store.r.pipeline(transaction=False)
        for job_id in inflight:
            pipe.hmget(keys.job(job_id), "attempts", "solo", "status")
        rows = dict(zip(inflight, pipe.execute()))
        live = {j for j, (_, _, status) in rows.items() if status and not JobStatus(status).terminal}
        pipe.set(keys.lost(worker), len(live), nx=True, ex=LOST_TTL_S)
        pipe.get(keys.lost(worker))
        _, had = pipe.execute()
        if int(had or len(live)) <= 1:
            return set()
        alone = {j for j in live if rows[j][1] and rows[j][1] == rows[j][0]}
        return live - alone

    def _exhausted(self, rec: dict[str, str], forgive: bool) -> tuple[bool, int]:
        """Whether a running job whose worker was lost has used up its attempts, and how many
        of them count (this one not, if it is forgiven)."""
        counted = int(rec.get("attempts", 0)) - int(rec.get("forgiven") or 0) - forgive
        return counted >= self.store.max_attempts, counted

    # -- reconciling records with the broker ----------------------------------------------

    def reconcile(self) -> int:
        """One pass: publish again what is adrift on two passes in a row; returns how many."""
        adrift: dict[tuple[str, str], Callable[[], bool]] = {}
        live = set(self.registry.r.hkeys(keys.WORKERS))
        self.drain_lanes(live)
        self.store.forget_ended()  # our own hash: only jobs not ended here
        for key in self.store.r.scan_iter(match=keys.inflight("*"), count=100):
            worker = key[len(keys.inflight("")) :]
            if worker == self.me:
                mine = set(self.running())
                for job_id, tag in self.store.r.hgetall(key).items():
                    if job_id not in mine:
                        adrift[job_id, key] = lambda j=job_id, t=tag, k=key: self._recover_one(k, j, t)
            elif worker not in live:
                inflight = self.store.r.hgetall(key)
                forgiven = self.forgive(worker, inflight)
                for job_id, tag in inflight.items():
                    adrift[job_id, key] = lambda j=job_id, t=tag, k=key, f=job_id in forgiven: self._recover_one(
                        k, j, t, f
                    )
        if self.queue:
            for job_id in self._stuck(self.queue):
                adrift[job_id, QUEUED] = lambda j=job_id: self.republish(j, JobStatus.queued)
        done = 0
        # One look at each queue's messages for the whole pass: a recovered job's entry stays
        # until its next start, so a backlog of them is looked at on every pass.
        self._pass_held = {}
        try:
            for found, act in adrift.items():
                if found in self._adrift:
                    done += bool(act())
        finally:
            self._pass_held = None
        self._adrift = set(adrift)
        return done

    def _recover_one(self, inflight_key: str, job_id: str, tag: str, forgive: bool = False) -> bool:
        """A job in flight on no running worker: published again unless its message waits on
        its queue (`republish` says so when it publishes), or, in our own hash, this process
        runs it now (the pass's look is up to an interval old)."""
        if inflight_key == keys.inflight(self.me) and job_id in self.running():
            return False
        return self._recover_job(inflight_key, job_id, tag, forgive)

    def _recover_job(self, inflight_key: str, job_id: str, tag: str, forgive: bool = False) -> bool:
        """Publish again one job a lost worker had in flight (or fail it, out of attempts).

        Its entry stays in the lost worker's in-flight hash until its next attempt starts
        (tasks/jobs.py: a start takes the job off its last worker's hash) or it ends: should the
        worker that takes the new message die before it starts the job, the entry is still
        there, and the reconciler publishes the job again. Every live worker sweeps (several
        stacks may share a Redis): one of them recovers a given job, the one holding its
        recovery lock, and only while the job is still in the lost worker's hash; `republish`
        publishes one message per lost attempt per REPUBLISH_CLAIM_S at most, and none while one
        waits on its queue."""
        lock = self.store.r.lock(keys.recovering(job_id), timeout=30, blocking=False)
        if not lock.acquire():
            return False  # another worker is on it; if it dies, the reconciler finds the entry
        try:
            if not self.store.r.hexists(inflight_key, job_id):
                return False
            rec = self.store.get(job_id)
            if rec is None or JobStatus(rec["status"]).terminal:
                self.store.r.hdel(inflight_key, job_id)  # it ended meanwhile
                return False
            return self.republish(job_id, JobStatus.running, forgive)
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:
                pass

    def _stuck(self, queue: str, grace: float = 5.0) -> set[str]:
        """Jobs recorded as queued on `queue` (for `grace` seconds at least) whose message is
        in none of the queue's lists (nor lines): lost, or taken by a worker that never started
        them (a live one starts what it receives at once, as it reserves no more than it has
        threads)."""
        waiting = self.store.r.zrangebyscore(keys.queued(queue), "-inf", time.time() - grace)
        if not waiting:
            return set()
        return set(waiting) - self._held(queue)

    def _held(self, queue: str) -> set[str]:
        """The ids of the jobs whose messages wait on `queue`, in one atomic look at its
        priority lists (its lanes' included). Messages in the keys' lines (tasks/fair.py)
        count as on the queue: read first, as they only move on."""
        lined = self.fair.waiting_ids(queue)
        channel = self._channel()
        lanes = [keys.lane(queue, w) for w, shared in self.placement.lanes().items() if shared == queue]
        lists = [name for q in (queue, *lanes) for name in priority_lists(channel, q, PRIORITY_STEPS)]
        with channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=True)
            for name in lists:
                pipe.lrange(name, 0, -1)
            queued = pipe.execute()
        return lined | {_message_id(loads(raw)) for msgs in queued for raw in msgs}

    def republish(self, job_id: str, status: JobStatus, forgive: bool = False) -> bool:
        """Publish a job's message again from its record, if the record is still `status`
        (and has attempts left, this one not counted if `forgive`) and its message is nowhere
        on its queue."""
        rec = self.store.get(job_id)
        if rec is None or rec["status"] != status.value:
            return False
        attempt = int(rec.get("attempts", 0))
        # Forgiven once per lost attempt, however often its job is published again for it.
        forgive = forgive and status is JobStatus.running and rec.get("forgave") != str(attempt)
        exhausted, counted = self._exhausted(rec, forgive)
        if status is JobStatus.running and exhausted:
            if self.store.give_up(job_id, attempt, counted):
                log.warning("job %s failed: its worker was lost on %d of its attempts that count", job_id, counted)
            return False
        spec = self.store.spec(rec)
        if spec is None:
            log.error("job %s has no message and no spec to publish it again from", job_id)
            return False
        # A reconcile pass's look at the queue first (its message waits: nothing to do), then
        # the claim: every worker on the queue reconciles it, one of them publishes.
        passing = self._pass_held is not None
        if passing:
            if rec["queue"] not in self._pass_held:
                self._pass_held[rec["queue"]] = self._held(rec["queue"])
            if job_id in self._pass_held[rec["queue"]]:
                return False
        # Claimed per lost attempt: a job lost again, on its next attempt, is not held back.
        if not self.store.r.set(keys.republishing(job_id, attempt), self.me, nx=True, ex=REPUBLISH_CLAIM_S):
            return False
        if not passing and job_id in self._held(rec["queue"]):
            return False
        if forgive:  # before the message: the start that follows reads it (solo)
            self.store.forgive(job_id, attempt)
        # At the attempts it has now: a start from any other count is a stale copy's.
        publish_job(self.app, spec.model_copy(update={"republished_after": attempt}), rec["queue"])
        log.warning("job %s (%s) had lost its message; published it again", job_id, status.value)
        return True

    def _channel(self):
        if self._conn is None:
            self._conn = self.app.connection_for_write()
        return self._conn.default_channel

    def reset(self) -> None:
        """Drop the broker connection after an error; the next sweep opens a new one."""
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except (redis.RedisError, OSError):
                pass


def _message_id(message: dict) -> str:
    """The task id (our job id) in a kombu message as Celery's protocol 2 writes it."""
    return (message.get("headers") or {}).get("id", "")
