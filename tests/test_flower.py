"""Flower against this Celery app: with task events on (GENQ_CELERY_EVENTS), a real Flower
process, behind basic auth, sees a job's task through its API and never its prompt or text."""

from __future__ import annotations

import json

import requests

from scripts import stack as stackmod
from tests.helpers import submit

PROMPT = "flower must not show this prompt"
AUTH = ("genq", "s3cret")


def test_flower_sees_a_task_when_events_are_on(make_stack):
    s = make_stack(GENQ_ENGINE="echo", GENQ_CELERY_EVENTS="true")
    s.start_api()
    s.start_worker()
    s.wait_ready()
    port = stackmod.free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [stackmod._bin("celery"), "-A", "tasks.flower_app", "flower", f"--port={port}", "--address=127.0.0.1"]
    flower = stackmod.Proc("flower", argv, {**s.env, "FLOWER_BASIC_AUTH": ":".join(AUTH)},
                           s.logs / f"{s.name}-flower.log")
    try:
        stackmod.wait_until(lambda: stackmod.http_get(base + "/healthcheck")[0] == 200, 60, "Flower", [flower])
        assert requests.get(base + "/api/tasks", timeout=10).status_code == 401
        # Task events are broadcast: Flower hears only those sent after it subscribed, which
        # may be a moment after its HTTP server answers, and may be in the middle of a task
        # (it then knows the task from its task-succeeded event alone, without the name that
        # task-received carries). Submit until it has seen one job whole.
        def seen(job_id):
            task = requests.get(f"{base}/api/task/info/{job_id}", auth=AUTH, timeout=10)
            if task.status_code != 200:
                return None
            info = task.json()
            return info if info.get("state") == "SUCCESS" and info.get("received") else None

        for _ in range(10):
            job_id = submit(s, prompt=PROMPT + " tail words", max_new_tokens=2)
            job = s.get(f"/v1/jobs/{job_id}?wait=30").json()
            assert job["status"] == "succeeded"
            try:
                stackmod.wait_until(lambda: seen(job_id), 3, "Flower to see the task", [flower])
                break
            except TimeoutError:
                continue
        task = seen(job_id)
        assert task, "Flower saw none of 10 jobs"
        assert task["name"] == "genq.generate"
        assert job_id in requests.get(base + "/api/tasks", auth=AUTH, timeout=10).json()
        shown = json.dumps(task)
        assert PROMPT not in shown and job["result"]["text"] not in shown
    finally:
        flower.stop()
