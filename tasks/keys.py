"""Names of every Redis key genqueue owns, in one place."""

PREFIX = "genq"


def job(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}"


def done(job_id: str) -> str:
    """A one-entry stream written when a job reaches a final status; waiters block on it."""
    return f"{PREFIX}:done:{job_id}"


def stream(job_id: str) -> str:
    """The job's token events, capped, expiring with the job (see tasks/streams.py)."""
    return f"{PREFIX}:stream:{job_id}"


WORKERS = f"{PREFIX}:workers"
WORKERS_SEEN = f"{PREFIX}:workers:seen"
