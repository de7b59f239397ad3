"""Recovery of a dead or hung worker's jobs, by the workers that are still alive.

Every live worker sweeps the registry each heartbeat: the in-flight messages of a worker whose
heartbeat is older than `heartbeat_ttl` (on Redis's clock) go back to the front of their queue
at once through kombu's own restore path, each once, with a fresh delivery tag, instead of
waiting for the visibility timeout (which stays as the last resort). A job that has used up
GENQ_MAX_ATTEMPTS fails (`worker_lost`); an attempt lost beside other jobs is forgiven, and a
job forgiven SOLO_AFTER_FORGIVEN times runs alone. Every GENQ_RECONCILE_INTERVAL each worker
also compares the job records with what the broker holds (`Reaper.reconcile`) and restores or
publishes again a job found adrift on two passes in a row. A gone worker's lane (cache-aware
placement) is drained into its shared queue.

How and why, case by case: docs/reliability.md, "How a lost worker's jobs are recovered".
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection

import redis
from celery import Celery
from kombu.utils.json import loads

from tasks import keys
from tasks.celery_app import PRIORITY_STEPS, publish_job
from tasks.fair import FairLines
from tasks.jobs import JobStore
from tasks.kombu_compat import forget_unacked, priority_lists, restore_message
from tasks.placement import Placement
from tasks.registry import Registry
from tasks.schemas import JobStatus

log = logging.getLogger(__name__)


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
        # Jobs found adrift on the last reconcile pass; acted on when found so again.
        self._adrift: set[str] = set()

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
        forgiven = self.forgive(inflight)
        restored = 0
        for job_id, tag in inflight.items():
            restored += self._recover_job(keys.inflight(worker), job_id, tag, job_id in forgiven)
        if inflight:
            log.warning(
                "worker %s stopped answering; %d of its %d jobs restored to their queues",
                worker,
                restored,
                len(inflight),
            )
        return restored

    def forgive(self, inflight: dict[str, str]) -> set[str]:
        """Which of a lost worker's in-flight jobs are not charged for it: none if it had one
        job in flight; if one of them was running alone (its `solo` attempt is the current
        one), the others (they waited for it); else all of them."""
        if len(inflight) <= 1:
            return set()
        pipe = self.store.r.pipeline(transaction=False)
        for job_id in inflight:
            pipe.hmget(keys.job(job_id), "attempts", "solo")
        alone = {job_id for job_id, (attempts, solo) in zip(inflight, pipe.execute()) if solo and solo == attempts}
        return set(inflight) - alone

    def _exhausted(self, rec: dict[str, str], forgive: bool) -> tuple[bool, int]:
        """Whether a running job whose worker was lost has used up its attempts, and how many
        of them count (this one not, if it is forgiven)."""
        counted = int(rec.get("attempts", 0)) - int(rec.get("forgiven") or 0) - forgive
        return counted >= self.store.max_attempts, counted

    def restore(self, job_id: str, tag: str, status: JobStatus = JobStatus.running, forgive: bool = False) -> bool:
        """Put one job's unacknowledged message back in its queue if the job is still `status`
        (running: its worker is lost; queued: its worker received it and never started it),
        or fail the job if it is out of attempts. `forgive`: this attempt does not count
        against them (`forgive`). False when there was nothing to restore."""
        rec = self.store.get(job_id)
        running = rec is not None and rec["status"] == status.value
        attempts = int(rec.get("attempts", 0)) if rec else 0
        forgive = forgive and status is JobStatus.running
        exhausted, counted = self._exhausted(rec, forgive) if running else (False, 0)
        exhausted = status is JobStatus.running and exhausted
        if exhausted and self.store.give_up(job_id, attempts, counted):
            log.warning("job %s failed: its worker was lost on %d of its attempts that count", job_id, counted)
        channel = self._channel()

        def move(pipe):
            raw = pipe.hget(channel.unacked_key, tag)
            pipe.multi()
            forget_unacked(channel, tag, pipe)
            if raw and running and not exhausted:
                payload, exchange, routing_key = loads(raw)
                payload["properties"]["delivery_tag"] = str(uuid.uuid4())
                restore_message(channel, payload, exchange, routing_key, pipe)
                if forgive:
                    pipe.hincrby(keys.job(job_id), "forgiven", 1)
            return bool(raw)

        with channel.conn_or_acquire() as client:
            found = client.transaction(move, channel.unacked_key, value_from_callable=True)
        return bool(found and running and not exhausted)

    # -- reconciling records with the broker ----------------------------------------------

    def reconcile(self) -> int:
        """One pass: publish again what is adrift on two passes in a row; returns how many."""
        adrift: dict[str, Callable[[], bool]] = {}
        live = set(self.registry.r.hkeys(keys.WORKERS))
        self.drain_lanes(live)
        for key in self.store.r.scan_iter(match=keys.inflight("*"), count=100):
            worker = key[len(keys.inflight("")) :]
            if worker == self.me:
                mine = set(self.running())
                for job_id, tag in self.store.r.hgetall(key).items():
                    if job_id not in mine:
                        adrift[job_id] = lambda j=job_id, t=tag, k=key: self._recover_one(k, j, t)
            elif worker not in live:
                inflight = self.store.r.hgetall(key)
                forgiven = self.forgive(inflight)
                for job_id, tag in inflight.items():
                    adrift[job_id] = lambda j=job_id, t=tag, k=key, f=job_id in forgiven: self._recover_one(k, j, t, f)
        if self.queue:
            for job_id, tag in self._stuck(self.queue).items():
                if tag is None:
                    adrift[job_id] = lambda j=job_id: self.republish(j, JobStatus.queued)
                else:
                    adrift[job_id] = lambda j=job_id, t=tag: self._restore_unstarted(j, t)
        done = 0
        for job_id, act in adrift.items():
            if job_id in self._adrift:
                done += bool(act())
        self._adrift = set(adrift)
        return done

    def _recover_one(self, inflight_key: str, job_id: str, tag: str, forgive: bool = False) -> bool:
        log.warning("job %s is in flight on no running worker; recovering it", job_id)
        return self._recover_job(inflight_key, job_id, tag, forgive)

    def _recover_job(self, inflight_key: str, job_id: str, tag: str, forgive: bool = False) -> bool:
        """Restore (or, if its message is gone, publish again) one job a lost worker had in
        flight, and take it off that worker's in-flight hash.

        Every live worker sweeps (several stacks may share a Redis): one of them recovers a
        given job, the one holding its recovery lock, and only while the job is still in the
        lost worker's hash. Without that, a second sweeper that read the hash before the first
        one cleared it would find the message gone from `unacked` (restored) and could publish
        it again while a consumer holds it between its BRPOP and its `unacked` write: the job
        would run three times."""
        lock = self.store.r.lock(keys.recovering(job_id), timeout=30, blocking=False)
        if not lock.acquire():
            return False  # another worker is on it; if it dies, the reconciler finds the entry
        try:
            if not self.store.r.hexists(inflight_key, job_id):
                return False
            found = self.restore(job_id, tag, forgive=forgive) or self.republish(job_id, JobStatus.running, forgive)
            self.store.r.hdel(inflight_key, job_id)
            return found
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:
                pass

    def _restore_unstarted(self, job_id: str, tag: str) -> bool:
        log.warning("job %s was received by a worker that never started it; restoring it", job_id)
        return self.restore(job_id, tag, JobStatus.queued)

    def _stuck(self, queue: str, grace: float = 5.0) -> dict[str, str | None]:
        """Jobs recorded as queued on `queue` (for `grace` seconds at least) whose message is
        in none of the queue's lists (nor lines): those in `unacked` for `grace` seconds, with their tags
        (a worker received them and did not start them: a live one starts what it receives
        at once, as it reserves no more than it has threads), and the rest, with None (their
        message is nowhere)."""
        now = time.time()
        waiting = self.store.r.zrangebyscore(keys.queued(queue), "-inf", now - grace)
        if not waiting:
            return {}
        listed, unacked = self._held(queue)
        stuck: dict[str, str | None] = {}
        for job_id in set(waiting) - listed:
            tag, delivered = unacked.get(job_id, (None, 0.0))
            if tag is None or delivered < now - grace:
                stuck[job_id] = tag
        return stuck

    def _held(self, queue: str) -> tuple[set[str], dict[str, tuple[str, float]]]:
        """What the broker holds for `queue`, in one atomic look: the ids of the jobs whose
        messages wait in one of its priority lists (its lanes' included), and those delivered
        and not acknowledged (any queue's), with their delivery tags and times. Messages in the
        keys' lines (tasks/fair.py) count as in the queue: read first, as they only move on."""
        lined = self.fair.waiting_ids(queue)
        channel = self._channel()
        lanes = [keys.lane(queue, w) for w, shared in self.placement.lanes().items() if shared == queue]
        lists = [name for q in (queue, *lanes) for name in priority_lists(channel, q, PRIORITY_STEPS)]
        with channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=True)
            for name in lists:
                pipe.lrange(name, 0, -1)
            pipe.hgetall(channel.unacked_key)
            pipe.zrange(channel.unacked_index_key, 0, -1, withscores=True)
            *queued, unacked, index = pipe.execute()
        listed = lined | {_message_id(loads(raw)) for msgs in queued for raw in msgs}
        times = {(t.decode() if isinstance(t, bytes) else t): score for t, score in index}
        held: dict[str, tuple[str, float]] = {}
        for tag, raw in unacked.items():
            tag = tag.decode() if isinstance(tag, bytes) else tag
            held[_message_id(loads(raw)[0])] = (tag, times.get(tag, 0.0))
        return listed, held

    def republish(self, job_id: str, status: JobStatus, forgive: bool = False) -> bool:
        """Publish a job's message again from its record, if the record is still `status`
        (and has attempts left, this one not counted if `forgive`) and its message is nowhere
        on its queue."""
        rec = self.store.get(job_id)
        if rec is None or rec["status"] != status.value:
            return False
        forgive = forgive and status is JobStatus.running
        exhausted, counted = self._exhausted(rec, forgive)
        if status is JobStatus.running and exhausted:
            if self.store.give_up(job_id, int(rec.get("attempts", 0)), counted):
                log.warning("job %s failed: its worker was lost on %d of its attempts that count", job_id, counted)
            return False
        spec = self.store.spec(rec)
        if spec is None:
            log.error("job %s has no message and no spec to publish it again from", job_id)
            return False
        # Every worker on the queue reconciles it: one of them publishes.
        if not self.store.r.set(keys.republishing(job_id), self.me, nx=True, ex=30):
            return False
        listed, unacked = self._held(rec["queue"])
        if job_id in listed or job_id in unacked:
            return False
        publish_job(self.app, spec, rec["queue"])
        if forgive:
            self.store.r.hincrby(keys.job(job_id), "forgiven", 1)
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
