"""The API builds each job's Celery message itself and pushes it in the Lua call that records
the job (tasks/celery_app.py `job_message`, tasks/jobs.py `JobStore.create`): the message must
be the one Celery's `send_task` would have written, and it must go onto the queue exactly when
the job is recorded. Real Redis, real Celery app; e2e tests run every job through this path."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis
from celery import signals

from tasks import keys
from tasks.celery_app import GENERATE_TASK, job_message, make_sender, publish_job
from tasks.config import Settings
from tasks.jobs import JobStore
from tasks.schemas import JobSpec, SamplingParams


@pytest.fixture
def sender(redis_url):
    return make_sender(Settings(redis_url=redis_url))


@pytest.fixture
def r(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def spec(priority=0, deadline=None, owner=None, **params) -> JobSpec:
    return JobSpec(
        id=str(uuid.uuid4()),
        model="m",
        prompt="Hello, I am",
        params=SamplingParams(**params),
        priority=priority,
        deadline=deadline,
        owner=owner,
    )


@pytest.mark.parametrize("kind", ["default", "urgent-owned", "background-deadline"])
def test_the_message_is_the_one_send_task_writes(sender, r, kind):
    job = {
        "default": lambda: spec(),
        "urgent-owned": lambda: spec(priority=-4, owner="alice", temperature=0.7, seed=3),
        "background-deadline": lambda: spec(priority=4, deadline=time.time() + 60, stop=["\n"]),
    }[kind]()
    queue = f"genq.test-{uuid.uuid4().hex[:8]}"
    publish_job(sender, job, queue)
    ours = job_message(sender, job, queue)
    lists = r.keys(f"{queue}*")
    assert lists == [ours.key], "the same list (priority step) as kombu's"
    theirs = json.loads(r.lpop(ours.key))
    mine = json.loads(ours.payload)
    # Per message: a fresh delivery tag; the TTL left until the deadline, in ms; the time the
    # API's before_task_publish receiver stamps (webapp/metrics.py, where the app is loaded).
    tags = theirs["properties"].pop("delivery_tag"), mine["properties"].pop("delivery_tag")
    assert len(set(tags)) == 2 and all(uuid.UUID(t) for t in tags)
    ttl = [int(m["properties"].pop("expiration", 0)) for m in (theirs, mine)]
    assert abs(ttl[0] - ttl[1]) < 2000 and (ttl[0] > 50_000) == (job.deadline is not None)
    stamps = [m["headers"].pop("genq_created", None) for m in (theirs, mine)]
    assert (stamps[0] is None) == (stamps[1] is None)
    assert mine == theirs


def test_publish_signals_are_sent_as_send_task_sends_them(sender):
    seen: list[tuple[str, dict]] = []

    def before(sender=None, headers=None, **kw):
        headers["stamped"] = "yes"  # what webapp/metrics.py does (genq_created)
        seen.append(("before", {"sender": sender, **kw}))

    def after(sender=None, body=None, **kw):
        seen.append(("after", {"sender": sender, "id": body[0][0]["id"], **kw}))

    signals.before_task_publish.connect(before, weak=False)
    signals.after_task_publish.connect(after, weak=False)
    try:
        job = spec()
        message = job_message(sender, job, "genq.q")
        assert [s for s, _ in seen] == ["before"] and seen[0][1]["sender"] == GENERATE_TASK
        assert json.loads(message.payload)["headers"]["stamped"] == "yes"
        message.published()
        assert seen[1] == (
            "after",
            {
                "sender": GENERATE_TASK,
                "id": job.id,
                "headers": message.headers,
                "exchange": "",
                "routing_key": "genq.q",
                "signal": signals.after_task_publish,
            },
        )
    finally:
        signals.before_task_publish.disconnect(before)
        signals.after_task_publish.disconnect(after)


def test_messages_go_onto_the_queue_with_their_jobs_or_not_at_all(sender, r):
    store = JobStore(r, ttl=600)
    queue = f"genq.test-{uuid.uuid4().hex[:8]}"
    jobs = [spec(), spec(priority=2)]
    messages = [job_message(sender, j, queue) for j in jobs]
    created, depth = store.create(jobs, queue, max_depth=2, messages=[(m.key, m.payload) for m in messages])
    assert created and depth == 0
    for job, message in zip(jobs, messages):
        assert r.hget(keys.job(job.id), "status") == "queued"
        assert r.lrange(message.key, 0, -1) == [message.payload]
    # The queue is full now: the job is refused, and neither recorded nor queued.
    late = spec()
    message = job_message(sender, late, queue)
    assert store.create([late], queue, max_depth=2, messages=[(message.key, message.payload)]) == (False, 2)
    assert not r.exists(keys.job(late.id)) and r.llen(message.key) == 1


def test_the_task_sent_event_is_the_one_send_task_sends(redis_url, monkeypatch):
    """With task events on (GENQ_CELERY_EVENTS, for Flower), the API still pushes the message
    itself and sends Celery's task-sent event beside it (tasks/kombu_compat.py
    `send_sent_events`): the event Celery's own `send_task` would have sent."""
    from celery.events.dispatcher import EventDispatcher

    from tasks.kombu_compat import send_sent_events

    sender = make_sender(Settings(redis_url=redis_url, celery_events=True))
    sent: list[dict] = []
    publish = EventDispatcher._publish

    def spy(self, event, producer, routing_key, **kw):
        sent.append({**event, "routing": routing_key})
        return publish(self, event, producer, routing_key, **kw)

    monkeypatch.setattr(EventDispatcher, "_publish", spy)
    job = spec(priority=3, deadline=time.time() + 60, owner="alice")
    queue = f"genq.test-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(redis_url)
    try:
        publish_job(sender, job, queue)
        message = job_message(sender, job, queue)
        assert message.sent_event is not None
        send_sent_events(sender, [message])
    finally:
        r.delete(*r.keys(f"{queue}*"))
        r.close()
    theirs, mine = ({k: v for k, v in e.items() if k not in ("timestamp", "clock")} for e in sent)
    assert theirs["type"] == "task-sent" and theirs["uuid"] == job.id and theirs["queue"] == queue
    assert mine == theirs
    # Without task events, the message carries none and nothing is sent.
    plain = job_message(make_sender(Settings(redis_url=redis_url)), job, queue)
    assert plain.sent_event is None
    send_sent_events(sender, [plain])
    assert len(sent) == 2
