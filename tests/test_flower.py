"""Flower against this Celery app: with task events on (GENQ_CELERY_EVENTS), a real Flower
process, behind basic auth, sees a job's task through its API and never its prompt or text;
`GENQ_FLOWER=1 make run` starts one against its own private Redis and stops it with the rest."""

from __future__ import annotations

import json

import psutil
import requests

from scripts import stack as stackmod
from tests.helpers import submit
from tests.test_lifecycle import Launcher

PROMPT = "flower must not show this prompt"
AUTH = ("genq", "s3cret")


def test_flower_sees_a_task_when_events_are_on(make_stack):
    s = make_stack(GENQ_ENGINE="echo", GENQ_CELERY_EVENTS="true")
    s.start_api()
    s.start_worker()
    s.wait_ready()
    port = stackmod.free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [*stackmod.flower_argv(), f"--port={port}", "--address=127.0.0.1"]
    flower = stackmod.Proc(
        "flower", argv, {**s.env, "FLOWER_BASIC_AUTH": ":".join(AUTH)}, s.logs / f"{s.name}-flower.log"
    )
    try:
        stackmod.wait_until(lambda: stackmod.http_get(base + "/healthcheck")[0] == 200, 60, "Flower", [flower])
        assert requests.get(base + "/api/tasks", timeout=10).status_code == 401
        job_id, job, task = _a_job_flower_sees(base, lambda body: submit(s, **body), s.get, [flower])
        assert task["name"] == "genq.generate"
        assert job_id in requests.get(base + "/api/tasks", auth=AUTH, timeout=10).json()
        shown = json.dumps(task)
        assert PROMPT not in shown and job["result"]["text"] not in shown
    finally:
        flower.stop()


def _a_job_flower_sees(base: str, submit_job, get, procs) -> tuple[str, dict, dict]:
    """(job id, job, Flower's task) of a job Flower saw whole. Task events are broadcast:
    Flower hears only those sent after it subscribed, which may be a moment after its HTTP
    server answers, and may be in the middle of a task (it then knows the task from its
    task-succeeded event alone, without the name that task-received carries). Submit until
    it has seen one job whole."""

    def seen(job_id):
        task = requests.get(f"{base}/api/task/info/{job_id}", auth=AUTH, timeout=10)
        if task.status_code != 200:
            return None
        info = task.json()
        # `sent`: the API's task-sent event (tasks/kombu_compat.py `send_sent_events`).
        return info if info.get("state") == "SUCCESS" and info.get("received") and info.get("sent") else None

    for _ in range(10):
        job_id = submit_job({"prompt": PROMPT + " tail words", "max_new_tokens": 2})
        job = get(f"/v1/jobs/{job_id}?wait=30").json()
        assert job["status"] == "succeeded"
        try:
            stackmod.wait_until(lambda: seen(job_id), 3, "Flower to see the task", procs)
            break
        except TimeoutError:
            continue
    task = seen(job_id)
    assert task, "Flower saw none of 10 jobs"
    return job_id, job, task


def test_make_run_starts_flower_on_its_redis_when_asked(tiny_model, tmp_path, monkeypatch):
    """GENQ_FLOWER=1: Flower beside the stack, on make run's private Redis (the test's
    REDIS_URL is not passed on), the workers' task events on without GENQ_CELERY_EVENTS."""
    port = stackmod.free_port()
    monkeypatch.setenv("FLOWER_PORT", str(port))
    monkeypatch.setenv("FLOWER_BASIC_AUTH", ":".join(AUTH))
    run = Launcher(tmp_path, tmp_path / "data", GENQ_FLOWER="1", GENQ_ENGINE="echo")
    base = f"http://127.0.0.1:{port}"
    flowers: list[psutil.Process] = []
    try:
        run.wait_ready()
        stackmod.wait_until(lambda: stackmod.http_get(base + "/healthcheck")[0] == 200, 60, "Flower")
        flowers = [p for p in run.descendants() if "tasks.flower_app" in " ".join(_cmdline(p))]
        assert flowers, "no Flower process under the launcher"

        def submit_job(body):
            resp = requests.post(run.base + "/v1/jobs", json=body, timeout=30)
            assert resp.status_code == 202, resp.text
            return resp.json()["id"]

        _, _, task = _a_job_flower_sees(base, submit_job, lambda path: requests.get(run.base + path, timeout=60), [])
        assert task["name"] == "genq.generate"
    finally:
        code = run.stop()
    assert code == 0, run.text()[-3000:]
    assert not [p for p in flowers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert f"flower   http://127.0.0.1:{port}" in run.text()


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_make_run_refuses_an_open_flower_on_the_network(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
    run = Launcher(tmp_path, tmp_path / "data", GENQ_FLOWER="1", FLOWER_ADDRESS="0.0.0.0")
    assert run.proc.wait(60) == 2
    assert "needs FLOWER_BASIC_AUTH" in run.text()
