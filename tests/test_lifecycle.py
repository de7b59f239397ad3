"""Processes coming and going: readiness follows the worker's model load, a job queued with no
worker is served once one starts, the echo engine, and `make run`'s launcher stopping all it
started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import requests

from scripts import stack as stackmod


def test_readiness_follows_the_worker_and_queued_jobs_wait_for_it(make_stack):
    s = make_stack()
    s.start_api()
    assert s.get("/readyz").status_code == 503

    # A job accepted while no worker serves the model waits in its queue...
    resp = s.post("/v1/jobs", json={"prompt": "Hello", "max_new_tokens": 4, "ignore_eos": True})
    assert resp.status_code == 202
    job_url = resp.headers["Location"]

    worker = s.start_worker()
    # The worker process is up but still loading its model: not ready yet.
    assert worker.alive()
    assert s.get("/readyz").status_code == 503
    s.wait_ready()

    # ...and is served once the worker has loaded.
    job = s.get(job_url + "?wait=60").json()
    assert job["status"] == "succeeded" and job["result"]["completion_tokens"] == 4

    # A worker that stops withdraws at once; readiness goes with it.
    worker.stop()
    assert worker.popen.returncode == 0
    stackmod.wait_until(lambda: s.get("/readyz").status_code == 503, 10, "not ready")
    assert s.post("/basic_generate", json={"prompt": "Hello"}).status_code == 503


def test_echo_engine_serves_jobs_without_a_model(make_stack):
    s = make_stack(GENQ_ENGINE="echo")
    s.start_api()
    s.start_worker()
    s.wait_ready()
    resp = s.post("/basic_generate", json={"prompt": "one two three", "max_new_tokens": 2})
    assert resp.json() == {"generated_text": "one two three two three"}
    assert s.get("/readyz").json()["workers"][0]["engine"] == "echo"


def test_the_api_never_imports_model_libraries(redis_url):
    code = (
        "import sys; from webapp import create_app; app = create_app(); "
        "c = app.test_client(); assert c.get('/healthz').status_code == 200; "
        "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=stackmod.ROOT,
        env={**os.environ, "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_make_run_launcher_serves_and_stops_everything_on_sigterm(tiny_model, tmp_path):
    port = stackmod.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_") and k != "REDIS_URL"}
    env.update(GENQ_PORT=str(port), GENQ_API_WORKERS="1")
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.stack"],
            cwd=stackmod.ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        stackmod.wait_until(
            lambda: stackmod.http_get(base + "/readyz")[0] == 200, 60, "make run's stack"
        )
        resp = requests.post(base + "/basic_generate", json={"prompt": "Hello"}, timeout=60)
        assert resp.status_code == 200 and resp.json()["generated_text"].startswith("Hello")
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and "worker" in names and "gunicorn" in names

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [c.pid for c in alive]
        text = log.read_text()
        assert "TINY RANDOM-WEIGHT" in text and "curl" in text and "stopped" in text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_job_whose_worker_dies_is_delivered_again(make_stack):
    # Redelivery waits for the visibility timeout; a short one keeps the test short.
    s = make_stack(GENQ_VISIBILITY_TIMEOUT="3")
    s.start_api()
    first = s.start_worker()
    s.wait_ready()
    resp = s.post("/v1/jobs", json={"prompt": "Hello", "max_new_tokens": 500, "ignore_eos": True})
    job_url = resp.headers["Location"]
    stackmod.wait_until(lambda: s.get(job_url).json()["status"] == "running", 30, "the job to start")

    first.signal(signal.SIGKILL)  # no warm shutdown, no acknowledgement
    first.popen.wait(10)
    assert s.get(job_url).json()["status"] == "running"

    s.start_worker()
    job = s.get(job_url + "?wait=60").json()
    while job["status"] == "running":
        job = s.get(job_url + "?wait=60").json()
    assert job["status"] == "succeeded", job
    assert job["attempts"] == 2
    assert job["result"]["completion_tokens"] == 500
