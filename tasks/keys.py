"""Names of every Redis key genqueue owns, in one place."""

import hashlib
from collections.abc import Callable

PREFIX = "genq"


def key_prefix(key_of: Callable[[str], str]) -> str:
    """What every key that `key_of` (a function below) names begins with: `key_prefix(queued)`
    is `genq:queued:`. For Lua that builds such a key from a value it reads itself (a job
    record's queue, owner, worker: tasks/jobs.py), which gets the prefix as an argument."""
    return key_of("")


def job(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"


def recovering(job_id: str) -> str:
    """The lock of the one worker recovering a lost job (worker/recovery.py)."""
    return f"{job(job_id)}:recovering"


def republishing(job_id: str, attempt: int | str) -> str:
    """Which worker publishes a job's message again after its attempt `attempt` was lost (or,
    still queued, its message was: the attempts it has made), for 30 s (worker/recovery.py)."""
    return f"{job(job_id)}:republish:{attempt}"


def done(job_id: str) -> str:
    """A one-entry stream written when a job reaches a final status; waiters block on it."""
    return f"{PREFIX}:done:{job_id}"


def stream(job_id: str) -> str:
    """The job's token events, capped, expiring with the job (see tasks/streams.py)."""
    return f"{PREFIX}:stream:{job_id}"


def job_keys(job_id: str) -> list[str]:
    """The keys of one job that outlive it, each for GENQ_RESULT_TTL after it ends: its record,
    its done stream, its token stream. Besides them, only the result backend's key of a failed
    job (`celery.backend.get_key_for_task`), and seconds-long locks (`recovering`,
    `republishing`). A settled batch line's jobs keep them for GENQ_BATCH_JOB_TTL instead
    (webapp/batches/store.py `release_jobs`)."""
    return [job(job_id), done(job_id), stream(job_id)]


# A worker's answer to a /tokenize or /detokenize request (a list the API pops).
def reply(request_id: str) -> str:
    return f"{PREFIX}:reply:{request_id}"


def asks(queue: str) -> str:
    """The API's questions (/tokenize, /detokenize, prompt counts) to the workers of one Celery
    queue's model, which pop them on threads of their own (worker/asks.py)."""
    return f"{PREFIX}:asks:{queue}"


# Cache-aware placement (tasks/placement.py). A worker's own lane of its model's queue: the
# Celery queue (and kombu's lists) that only it consumes, beside the shared one.
LANE_SEP = "~"


def lane(queue: str, worker: str) -> str:
    return f"{queue}{LANE_SEP}{worker}"


def unlane(queue: str) -> str:
    """The shared queue of a lane (a shared queue is its own)."""
    return queue.split(LANE_SEP, 1)[0]


# worker name -> "<its shared queue>\t<Redis time of its last heartbeat>": the lanes that may
# hold messages, which recovery drains into the shared queue once their worker is gone.
LANES = f"{PREFIX}:lanes"


def placed(queue: str, digest: str) -> str:
    """Which worker of a queue last ran a job whose prompt starts with the text `digest` names."""
    return f"{PREFIX}:placed:{queue}:{digest}"


# A counter that every cancel and every job's second or later start adds to: a worker's cancel
# watch reads the records of the jobs it runs only when it moved (worker/cancels.py).
CANCELS = f"{PREFIX}:cancels"

WORKERS = f"{PREFIX}:workers"
WORKERS_SEEN = f"{PREFIX}:workers:seen"
# The last Redis outage a worker's heartbeat lived through (tasks/registry.py): start, end.
WORKERS_OUTAGE = f"{PREFIX}:workers:outage"


def lost(worker: str) -> str:
    """How many jobs a lost worker had in flight, as recovery first found them: whether an
    attempt was lost beside others does not change as its jobs start again (worker/recovery.py)."""
    return f"{PREFIX}:lost:{worker}"


def inflight(worker: str) -> str:
    """The jobs a worker is running: job id -> the broker delivery tag of its message."""
    return f"{PREFIX}:inflight:{worker}"


def queued(queue: str) -> str:
    """Ids of the jobs recorded as queued for one Celery queue (scored by creation time): the
    queue depth the API enforces, priority sub-queues and messages not yet published included."""
    return f"{PREFIX}:queued:{queue}"


def queued_by(owner: str) -> str:
    """Ids of an owner's (an API key's name) queued jobs over all queues, scored like
    `queued`: what its `max_queued` quota counts."""
    return f"{PREFIX}:queued-by:{owner}"


def file(file_id: str) -> str:
    """A /v1/files file's metadata (a hash); its lines are in `file_lines`."""
    return f"{PREFIX}:file:{file_id}"


def file_lines(file_id: str) -> str:
    """A file's content: a list of chunks, each whole lines ending in a newline."""
    return f"{PREFIX}:file:{file_id}:lines"


def batch(batch_id: str) -> str:
    """A batch's state (a hash): status, counts, timestamps, the feeding cursor."""
    return f"{PREFIX}:batch:{batch_id}"


def batch_part(batch_id: str, part: str) -> str:
    """A batch's working sets: `pending` (its lines on the queue), `out` and `err` (the output
    and error lines so far, which become its files), `lock` (held by the driver at work)."""
    return f"{PREFIX}:batch:{batch_id}:{part}"


BATCHES_ACTIVE = f"{PREFIX}:batches:active"
BATCHES_SEQ = f"{PREFIX}:batches:seq"


def batches_of(owner: str) -> str:
    """An owner's batches (its API key's name, or `-` on an open API), scored by creation."""
    return f"{PREFIX}:batches:of:{owner}"


# Usage per API key (tasks/usage.py): the set of rows `<owner>\t<model>` counted so far (owner ''
# for the jobs of an open API), and each row's counts (`usage_row`).
USAGE = f"{PREFIX}:usage:rows"


def usage_row(row: str) -> str:
    """One row's counts: jobs, prompt_tokens, completion_tokens, cached_tokens, as four signed
    64-bit integers of one string, which one BITFIELD adds to (tasks/usage.py)."""
    return f"{PREFIX}:usage:row:{row}"


def rate(kind: str, owner: str) -> str:
    """An owner's sliding window of `kind` (`rpm`: requests, `tpm`: tokens): a hash of the
    Unix second -> the count in that second, over the last minute (tasks/usage.py)."""
    return f"{PREFIX}:rate:{kind}:{owner}"


def idempotency(owner: str, key: str) -> str:
    """What an `Idempotency-Key` header of one owner (an API key's name, `""` on an open API)
    stands for, for 24 h (webapp/idempotency.py): the key itself hashed, so that any header
    value makes one key name."""
    return f"{PREFIX}:idem:{owner}:{hashlib.sha256(key.encode()).hexdigest()}"


# Completion callbacks due (webapp/callbacks.py): member `job:<id>` or `batch:<id>`, scored by
# when it is next due. A final status adds its job's entry in the Lua that writes it
# (tasks/jobs.py); a deliverer claims an entry by moving its score past its lease.
CALLBACKS_DUE = f"{PREFIX}:callbacks:due"
# The failed attempts at each due callback so far (member -> count), for its backoff.
CALLBACKS_ATTEMPTS = f"{PREFIX}:callbacks:attempts"


# Fair share between API keys (tasks/fair.py): per Celery queue and broker priority step, a
# zset of the owners whose lines hold messages (scored by their next turn's virtual time), each
# owner's line of waiting messages (a list), and the step's virtual clock.
def fair_owners(queue: str, step: int) -> str:
    return f"{PREFIX}:fair:{queue}:{step}"


def fair_line(queue: str, step: int, owner: str) -> str:
    """`fair_owners(...)` + ':' + owner: the Lua of tasks/fair.py builds it so."""
    return f"{fair_owners(queue, step)}:{owner}"


def fair_clock(queue: str, step: int) -> str:
    """`fair_owners(...)` + '/clock' (owner names have no '/')."""
    return f"{fair_owners(queue, step)}/clock"


# owner -> its weight, as its API key last said (the mover reads it).
FAIR_WEIGHTS = f"{PREFIX}:fair:weights"


def response(response_id: str) -> str:
    """A stored /v1/responses response: its request, conversation, job and, once ended, its
    answer (webapp/responses.py), for GENQ_RESPONSE_TTL."""
    return f"{PREFIX}:response:{response_id}"
