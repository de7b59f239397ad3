"""The Celery task: a thin wrapper that hands a job to this process's engine and waits. The
engine, the job store and the rest of what the tasks need from their process are held by their
base class, `WorkerTask`, which `python -m worker` equips once (worker/__main__.py).

The job record moves to `running` before the engine sees the job, and to its final status in
`task_postrun`, which Celery sends after it has stored the result in the result backend, so a
client woken by the final status always finds the result there.

A job the worker refuses or fails leaves the task as tasks/errors.py's JobFailed, its typed
error in plain args (nothing the JSON result backend cannot store); a refusal (JobRefused: the
client's bad input) is expected (`throws`): one INFO line, no traceback.

A job with a deadline travels with Celery's `expires`: a worker that receives its message too
late drops it unrun (on any pool) and says so with `task_revoked(expired=True)`, where the
record becomes `expired`; the task looks once more itself before it starts the job. Running
jobs are held to their deadline by the engine.
"""

from __future__ import annotations

import json
import logging
import time

import redis
from celery import Celery, Task
from celery.exceptions import Ignore
from celery.signals import task_postrun, task_revoked

from tasks import keys
from tasks.celery_app import GENERATE_TASK, TOKENIZE_TASK
from tasks.errors import JobError, JobFailed, JobRefused
from tasks.fair import FairLines
from tasks.jobs import ACTIVE, Attempt, JobStore
from tasks.placement import Placement
from tasks.schemas import GenerationResult, JobSpec, JobStatus
from tasks.usage import counts_of
from worker import metrics
from worker.cancels import CancelWatch
from worker.chat import Chat
from worker.engines import Engine, GenerationError
from worker.engines.base import JobCancelled
from worker.publisher import StreamPublisher
from worker.solo import Gate

log = logging.getLogger(__name__)

# How often the worker looks for cancellations of the jobs it runs (worker/cancels.py), and a
# job waiting at the solo gate for its own.
CANCEL_POLL_S = 0.5
# How long an answer to /tokenize waits for the API to pop it.
REPLY_TTL_S = 60


class WorkerTask(Task):
    """The base of this worker's tasks (Celery's custom task class): what they need from their
    process, set up once by `equip` before the worker consumes. Celery makes one instance of
    each task per process, and every task thread shares it."""

    # A job refused for its input: Celery logs it as expected (INFO, no traceback), below the
    # WARNING its trace logger is set to (worker/__main__.py); `_generate` says so in one line.
    throws = (JobRefused,)
    engine: Engine
    store: JobStore
    worker_name: str
    publisher: StreamPublisher | None
    chat: Chat | None
    placement: Placement | None = None
    fair: FairLines | None = None
    queue: str = ""
    watch: CancelWatch
    # The jobs this process is running (or about to start): job id -> delivery tag.
    # Recovery compares it with the in-flight hash Redis holds for this worker.
    running: dict[str, str]
    # Into the engine together, or a solo job alone (worker/solo.py).
    gate: Gate

    @classmethod
    def equip(
        cls,
        *,
        engine: Engine,
        store: JobStore,
        worker_name: str,
        publisher: StreamPublisher | None = None,
        chat: Chat | None = None,
        placement: Placement | None = None,
        queue: str = "",
        fair: FairLines | None = None,
    ) -> None:
        """`placement`: where this worker notes the prefixes of the jobs it runs, so that the
        API places later jobs with those prefixes in its lane (None: it has no lane). `fair`:
        the lines this worker refills its queue's lists from as it takes each job."""
        cls.engine, cls.store, cls.worker_name = engine, store, worker_name
        cls.publisher, cls.chat = publisher, chat
        cls.placement, cls.queue, cls.fair = placement, queue, fair
        cls.watch = CancelWatch(store, engine, CANCEL_POLL_S)
        cls.running = {}
        cls.gate = Gate()

    def _generate(self, spec: JobSpec, attempt: Attempt, since: str | None = None) -> GenerationResult:
        """Hand the job to the engine and wait for it; the worker's `CancelWatch` has the
        engine drop it if it is cancelled or superseded meanwhile. A job the engine (or the
        chat template) cannot serve raises JobFailed, or JobRefused for its bad input."""
        try:
            if spec.embed is not None and self.engine.task != "embed":
                raise GenerationError(
                    "invalid_request", f"model {spec.model!r} generates text, it serves no embeddings", param="model"
                )
            if self.chat is not None and spec.embed is None:
                spec = self.chat.prompt_of(spec)  # a chat job's prompt: its messages rendered
            future = self.engine.submit(spec)
            self.watch.watch(spec.id, attempt.number, since)
            try:
                return future.result()
            finally:
                self.watch.unwatch(spec.id)
        except JobCancelled:
            raise Ignore() from None
        except GenerationError as exc:
            partial = exc.partial and exc.partial.model_copy(update={"worker": self.worker_name}).model_dump()
            failed = JobFailed.of(exc.error, partial)
            if isinstance(failed, JobRefused):
                log.info("job %s attempt %d refused: %s: %s", spec.id, attempt.number, exc.code, exc.message)
            raise failed from exc

    def _place(self, spec: JobSpec) -> None:
        """Note that this worker holds the job's prefixes from now on (tasks/placement.py)."""
        if self.placement is None:
            return
        try:
            self.placement.record(spec, self.queue, self.worker_name)
        except redis.RedisError as exc:  # a guess lost, nothing more
            log.warning("could not note job %s's prefixes for placement: %s", spec.id, exc)

    def _refill(self) -> None:
        """A message left the queue's list and no job starts: refill it from the keys' lines
        (tasks/fair.py; a job that starts does so in its start's call). If this fails, the
        next job's or the heartbeat's refill does it."""
        if self.fair is None:
            return
        try:
            self.fair.fill(self.queue)
        except redis.RedisError as exc:
            log.warning("could not refill queue %s from its fair-share lines: %s", self.queue, exc)

    def _still_ours(self, job_id: str, attempt: int) -> bool:
        """Whether a job waiting to go into the engine should still run: neither cancelled nor
        given to another attempt meanwhile (True while Redis cannot say)."""
        try:
            rec = self.store.get(job_id)
        except redis.RedisError:
            return True
        return rec is not None and rec["status"] == JobStatus.running.value and int(rec.get("attempts", 0)) == attempt

    def _mark_solo(self, job_id: str, attempt: int) -> None:
        log.warning("job %s attempt %d runs alone: its workers were lost beside other jobs before", job_id, attempt)
        try:
            self.store.mark_solo(job_id, attempt)
        except redis.RedisError as exc:
            log.warning("could not mark job %s as running alone: %s", job_id, exc)


def register(app: Celery) -> None:
    @app.task(name=GENERATE_TASK, base=WorkerTask, bind=True)
    def generate(self: WorkerTask, job: dict) -> dict:
        spec = JobSpec.model_validate(job)
        if spec.deadline is not None and time.time() >= spec.deadline:
            self._refill()
            self.store.expire(spec.id, allowed=ACTIVE)
            raise Ignore()
        tag = (self.request.properties or {}).get("delivery_tag", "")
        held = self.running.get(spec.id)  # a copy of a job this process runs already, if any
        self.running[spec.id] = tag  # before Redis says so: never in-flight and unknown here
        try:
            # A message left the queue's list: the same call refills it from the keys' lines.
            fill = self.fair.fill_args(self.queue) if self.fair is not None else None
            since = self.watch.mark()  # before the start: a cancel after it moves the counter
            # Only from the attempts the message was published at (JobSpec.republished_after).
            attempt = self.store.start(spec.id, self.worker_name, tag, fill, fence=spec.republished_after or 0)
        except BaseException:
            _not_running(self.running, spec.id, tag, held)
            raise
        if not attempt.run:
            _not_running(self.running, spec.id, tag, held)
            # Cancelled while queued, already final, expired, or out of attempts; or running:
            # this is a stale copy of its message (it started since it was published).
            why = " (out of attempts)" if attempt.exhausted else ""
            if attempt.prev is JobStatus.running and not attempt.exhausted:
                why = f" (a copy of its message from attempt {spec.republished_after or 0}; it is at {attempt.number})"
            log.info("job %s skipped: status %s%s", spec.id, attempt.prev, why)
            raise Ignore()
        self.request.genq_attempt = attempt.number
        metrics.job_started(spec, attempt.number, self.request)
        self._place(spec)
        publisher = self.publisher
        if publisher is not None and spec.stream:
            publisher.attempts[spec.id] = attempt.number
        try:
            if not self.gate.enter(attempt.solo, lambda: self._still_ours(spec.id, attempt.number), CANCEL_POLL_S):
                log.info("job %s attempt %d cancelled or superseded before it ran", spec.id, attempt.number)
                raise Ignore()
            try:
                if attempt.solo:
                    self._mark_solo(spec.id, attempt.number)
                result = self._generate(spec, attempt, since)
            finally:
                self.gate.leave(attempt.solo)
        finally:
            if publisher is not None:
                publisher.attempts.pop(spec.id, None)
        result.worker = self.worker_name
        return result.model_dump()

    @app.task(name=TOKENIZE_TASK, base=WorkerTask, bind=True, ignore_result=True)
    def tokenize(self: WorkerTask, req: dict) -> None:
        """/tokenize or /detokenize: the answer goes onto the request's reply list, which the
        API pops (webapp/tokens.py)."""
        chat = self.chat or Chat(None)
        answer = chat.answer(req)
        pipe = self.store.r.pipeline()
        pipe.rpush(keys.reply(req["id"]), json.dumps(answer))
        pipe.expire(keys.reply(req["id"]), REPLY_TTL_S)
        pipe.execute()

    task_postrun.connect(_record_outcome, weak=False)
    task_revoked.connect(_record_expiry, weak=False)


def _record_expiry(sender=None, request=None, expired=False, **_):
    """Celery dropped a job's message because its deadline had passed: it never runs. A job
    still `running` here was restored after its worker was lost; it expires as well."""
    if expired and request is not None and getattr(sender, "name", None) == GENERATE_TASK:
        sender._refill()
        sender.store.expire(request.id, allowed=ACTIVE)


def _record_outcome(task_id=None, task=None, retval=None, state=None, **_):
    if task is None or task.name != GENERATE_TASK:
        return
    try:
        _finish(task_id, task, retval, state)
    finally:
        # Only now, with the job's final status written (and its in-flight entry gone, or listed
        # to go: JobStore.forget_ended): the reconciler takes a job in flight here but not
        # running for one whose finish was lost.
        _not_running(task.running, task_id, (task.request.properties or {}).get("delivery_tag", ""))


def _not_running(running: dict[str, str], job_id: str, tag: str, held: str | None = None) -> None:
    """The attempt of `job_id` that came with message `tag` is over here. Only its own entry
    goes: a job published again (a message thought lost) may have a newer attempt running on
    this same worker, which superseded this one; popping its entry made the reconciler take
    that running attempt for lost and publish the job a third time (bench.reliability, Sentinel
    failover)."""
    if running.get(job_id) == tag:
        running.pop(job_id, None)
    if held is not None:  # the tag of a copy this process ran already, which goes on
        running.setdefault(job_id, held)


def _finish(task_id, task: WorkerTask, retval, state) -> None:
    attempt = getattr(task.request, "genq_attempt", None)
    if attempt is None:
        return
    metrics.job_finished(task_id, state, retval)
    if state == "SUCCESS":
        if not getattr(task.request, "genq_finished", False):
            task.store.finish(task_id, JobStatus.succeeded, fence=attempt, counts=counts_of(retval))
    elif state == "FAILURE":
        if isinstance(retval, JobFailed):
            error, partial = retval.error, retval.partial
        else:
            error, partial = JobError("internal", f"{type(retval).__name__}: {retval}"), None
        task.store.finish(task_id, JobStatus.failed, error, fence=attempt, result=partial, counts=counts_of(partial))
