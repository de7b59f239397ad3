"""Priorities and deadlines through the real stack: urgent jobs overtake waiting ones, a job
whose deadline passes while it waits never runs (`expired`), one whose deadline passes while it
runs fails `timeout` and keeps its partial text, and the broker's priority sub-queues hold up
through recovery's restore path."""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from scripts import stack as stackmod
from tasks import keys
from tasks.celery_app import GENERATE_TASK, broker_priority, make_sender
from tasks.config import Settings, queue_for
from tasks.kombu_compat import BROKER_SEP
from tests.helpers import sse_events, submit, take_and_give_back

LONG = {"prompt": "Hello", "max_new_tokens": 500, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(make_module_stack):
    """One worker whose batch holds two jobs: a third waits in the queue."""
    s = make_module_stack(GENQ_MAX_BATCH_SIZE="2")
    s.start_api()
    s.start_worker()
    s.wait_ready()
    return s


def final(s, job_id: str) -> dict:
    job = s.get(f"/v1/jobs/{job_id}?wait=120").json()
    assert job["status"] not in ("queued", "running"), job
    return job


def fill_then_queue(s) -> tuple[list[str], list[str], list[str], float]:
    """Fill the batch with two long jobs, then queue 20 jobs at the lowest priority and 5 at
    the highest; returns their ids and when the last was queued."""
    fillers = [submit(s, **LONG) for _ in range(2)]
    stackmod.wait_until(
        lambda: all(s.get(f"/v1/jobs/{j}").json()["status"] == "running" for j in fillers),
        30,
        "a full batch",
    )
    with ThreadPoolExecutor(8) as pool:
        lows = list(pool.map(lambda i: submit(s, prompt=f"later {i}", max_new_tokens=4, priority=4), range(20)))
        urgent = list(pool.map(lambda i: submit(s, prompt=f"now {i}", max_new_tokens=4, priority=-4), range(5)))
    return fillers, lows, urgent, time.time()


def test_the_most_urgent_jobs_overtake_every_waiting_one(pair):
    for _ in range(3):
        fillers, lows, urgent, queued = fill_then_queue(pair)
        jobs = {j: final(pair, j) for j in fillers + lows + urgent}
        assert all(job["status"] == "succeeded" for job in jobs.values())
        # The batch had no room before a filler finished: every other job was still waiting
        # in Redis once all were queued, unless a filler finished first (a slow machine).
        if min(jobs[j]["timings"]["finished"] for j in fillers) > queued:
            break
    else:
        pytest.fail("the fillers never outlasted queueing 25 jobs")
    started = {j: job["timings"]["started"] for j, job in jobs.items()}
    assert max(started[j] for j in urgent) < min(started[j] for j in lows)
    assert {jobs[j]["priority"] for j in urgent} == {-4} and jobs[fillers[0]]["priority"] == 0


def test_completions_take_vllms_priority(pair):
    resp = pair.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "priority": -2})
    assert resp.status_code == 200, resp.text
    job_id = resp.json()["id"].removeprefix("cmpl-")
    assert pair.get(f"/v1/jobs/{job_id}").json()["priority"] == -2
    bad = pair.post("/v1/completions", json={"prompt": "Hello", "priority": 9})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"


def test_a_job_past_its_deadline_while_it_runs_fails_with_its_partial_text(pair):
    # Calibrate: how long this machine takes for the whole job; the deadline comes a third of
    # the way in. A shared machine's pace varies: a job that finished in time, or expired
    # before it started, is tried again with a shorter or longer deadline.
    run_s = final(pair, submit(pair, **LONG))["timings"]["run_s"]
    timeout = run_s / 3
    for _ in range(4):
        job = final(pair, submit(pair, **LONG, timeout_s=timeout))
        if job["status"] == "succeeded":
            timeout /= 3
        elif job["status"] == "expired":
            timeout *= 3
        else:
            break
    assert job["status"] == "failed" and job["error"]["code"] == "timeout", job
    assert job["attempts"] == 1 and job["deadline"] is not None
    partial = job["result"]
    assert partial["finish_reason"] == "timeout"
    assert 0 < partial["completion_tokens"] < LONG["max_new_tokens"]
    assert partial["text"]

    # A blocking call whose job runs out of time (or expires first, should it start late): 504.
    resp = pair.post("/basic_generate", json={**LONG, "timeout_s": timeout / 3})
    assert resp.status_code == 504 and resp.json()["error"]["code"] in ("timeout", "expired"), resp.text


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/jobs", {"priority": 5}, "priority"),
        ("/v1/jobs", {"priority": -5}, "priority"),
        ("/v1/jobs", {"priority": 1.5}, "priority"),
        ("/v1/jobs", {"priority": "1"}, "priority"),
        ("/v1/jobs", {"timeout_s": 0}, "timeout_s"),
        ("/v1/jobs", {"timeout_s": -1}, "timeout_s"),
        ("/v1/jobs", {"timeout_s": 1e300}, "timeout_s"),
        ("/v1/jobs", {"deadline": 1_000_000}, "deadline"),
        ("/basic_generate", {"priority": 7}, "priority"),
        ("/generate", {"timeout_s": -2}, "timeout_s"),
    ],
)
def test_bad_priorities_and_deadlines_are_refused(pair, path, body, param):
    prompt = {"prompts": ["Hello"]} if path == "/generate" else {"prompt": "Hello"}
    resp = pair.post(path, json={**prompt, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_a_job_whose_deadline_passes_in_the_queue_never_runs(make_stack, redis_url):
    s = make_stack()
    s.start_api()
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    # No worker: both wait past their deadlines.
    by_worker = submit(s, prompt="Hello", max_new_tokens=4, timeout_s=0.5)
    lazily = submit(s, prompt="Hello", max_new_tokens=4, deadline=time.time() + 0.5)
    time.sleep(1.0)

    # Looked at, a queued job past its deadline is expired at once, worker or not.
    job = s.get(f"/v1/jobs/{lazily}").json()
    assert job["status"] == "expired" and job["attempts"] == 0, job
    assert job["error"]["code"] == "expired" and job["timings"]["started"] is None
    (event,) = sse_events(s.http.get(f"{s.base}/v1/jobs/{lazily}/stream", stream=True, timeout=30))
    assert event["event"] == "error" and json.loads(event["data"])["error"]["code"] == "expired"

    # The worker that receives the other one drops it (Celery's `expires`) and records why.
    s.start_worker()
    s.wait_ready()
    stackmod.wait_until(lambda: r.hget(keys.job(by_worker), "status") == "expired", 30, "the worker to drop it")
    assert r.hget(keys.job(by_worker), "attempts") == "0"
    assert json.loads(r.get(f"celery-task-meta-{by_worker}"))["status"] == "REVOKED"
    assert r.zcard(keys.queued(queue_for(s.name))) == 0

    # The worker serves the jobs after it.
    assert s.post("/basic_generate", json={"prompt": "Hello", "max_new_tokens": 2}).status_code == 200
    assert s.get(f"/v1/jobs/{by_worker}").json()["status"] == "expired"


def test_a_restored_message_goes_back_to_its_priority_sub_queue(redis_url, monkeypatch):
    """A closing channel gives a message it took back through kombu's `_do_restore_message`
    (tasks/kombu_compat.py `guard_restores`), which must find the sub-queue the message's own
    priority names, with the steps and separator configured here."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("GENQ_MODEL_NAME", f"test-{uuid.uuid4().hex[:8]}")
    settings = Settings()
    queue = queue_for(settings.served_model)
    sub = f"{queue}{BROKER_SEP}{broker_priority(-2)}"
    app = make_sender(settings)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        app.send_task(GENERATE_TASK, args=[{}], queue=queue, priority=broker_priority(-2))
        assert r.llen(sub) == 1 and r.llen(queue) == 0
        take_and_give_back(app, queue)
        assert r.llen(sub) == 1 and r.llen(queue) == 0
    finally:
        r.delete(sub, queue)
