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
    """With GENQ_WORKERS=2: two worker processes serve the default model (SmolLM2), and all go
    at SIGTERM."""
    port = stackmod.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_") and k != "REDIS_URL"}
    env.update(GENQ_PORT=str(port), GENQ_API_WORKERS="1", GENQ_DATA_DIR=str(tmp_path / "data"), GENQ_WORKERS="2")
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
            lambda: (
                stackmod.http_get(base + "/readyz")[0] == 200
                and len(requests.get(base + "/readyz", timeout=5).json()["workers"]) == 2
            ),
            240,  # the first start builds the default model (scripts/realmodel.py, about a minute)
            "make run's stack with its two workers",
        )
        resp = requests.post(base + "/basic_generate", json={"prompt": "Hello"}, timeout=60)
        assert resp.status_code == 200 and resp.json()["generated_text"].startswith("Hello")
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and "worker" in names and "gunicorn" in names
        workers = [c for c in children if c.cmdline()[1:3] == ["-m", "worker"]]
        assert len(workers) == 2, names

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [c.pid for c in alive]
        text = log.read_text()
        assert "serving SmolLM2-135M-Instruct" in text and "curl" in text and "stopped" in text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_job_whose_worker_dies_is_delivered_again(make_stack):
    # The live worker publishes the dead one's job again once its heartbeat is stale. The sim
    # engine (10 ms a step): the job lasts 5 s on any machine, so it still runs at the kill (the
    # tiny model can end 500 tokens in half a second).
    s = make_stack(GENQ_ENGINE="sim", GENQ_SIM_STEP_MS="10")
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


# -- `make run`'s launcher: no orphans, durable data, workers restarted ------------------------


class Launcher:
    """`python -m scripts.stack` as `make run` starts it, on a port and data dir of its own."""

    def __init__(self, tmp_path, data_dir, name: str = "run", argv: list[str] | None = None, **extra_env: str):
        self.port = stackmod.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_") and k != "REDIS_URL"}
        env.update(GENQ_PORT=str(self.port), GENQ_API_WORKERS="1", GENQ_DATA_DIR=str(data_dir), **extra_env)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                argv or [sys.executable, "-m", "scripts.stack"],
                cwd=stackmod.ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, f"launcher exited {self.proc.returncode}:\n{self.text()[-3000:]}"
            return stackmod.http_get(self.base + "/readyz")[0] == 200

        stackmod.wait_until(ready, timeout, "make run's stack")

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL for the launcher's group; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return self.proc.returncode


def _living(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (an orphan's zombie, waiting for init to reap it, does not count)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _cmdlines(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(" ".join(p.cmdline()))
        except psutil.Error:
            pass
    return out


def test_a_killed_launcher_leaves_no_process_behind(tiny_model, tmp_path):
    run = Launcher(tmp_path, tmp_path / "data")
    descendants: list[psutil.Process] = []
    try:
        run.wait_ready()
        descendants = run.descendants()
        lines = _cmdlines(descendants)
        assert any("redis-server" in c for c in lines), lines
        assert any("-m worker" in c for c in lines), lines
        assert sum("gunicorn" in c for c in lines) >= 2, lines  # master and its worker

        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(10)
        deadline = time.monotonic() + 10
        while _living(descendants) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = _living(descendants)
        assert not survivors, _cmdlines(survivors)
    finally:
        run.stop()
        for p in _living(descendants):
            p.kill()


def test_a_make_killed_by_sigkill_takes_the_stack_with_it(tiny_model, tmp_path):
    """`make run` itself (its `model` step skipped: the fixture built the model), and SIGKILL
    to make alone, not to the launcher: the launcher notices and stops all it started."""
    run = Launcher(tmp_path, tmp_path / "data", argv=["make", "--no-print-directory", "-o", "model", "run"])
    descendants: list[psutil.Process] = []
    try:
        run.wait_ready(180)
        descendants = run.descendants()
        lines = _cmdlines(descendants)
        assert any("scripts.stack" in c for c in lines), lines
        assert any("redis-server" in c for c in lines) and any("-m worker" in c for c in lines), lines
        assert any("gunicorn" in c for c in lines), lines

        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(10)
        deadline = time.monotonic() + 90  # the launcher stops the API and the worker gracefully
        while _living(descendants) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = _living(descendants)
        assert not survivors, _cmdlines(survivors)
        assert "stopped" in run.text(), run.text()[-3000:]
    finally:
        run.stop()
        for p in _living(descendants):
            p.kill()


def test_make_run_keeps_jobs_across_a_restart(tiny_model, tmp_path):
    data = tmp_path / "data"
    first = Launcher(tmp_path, data, "first")
    try:
        first.wait_ready()
        resp = requests.post(first.base + "/v1/jobs", json={"prompt": "Hello", "max_new_tokens": 8}, timeout=30)
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["id"]
        done = requests.get(f"{first.base}/v1/jobs/{job_id}?wait=30", timeout=60).json()
        assert done["status"] == "succeeded", done
    finally:
        assert first.stop() == 0, first.text()[-3000:]
    assert (data / "redis" / "appendonlydir").is_dir()

    second = Launcher(tmp_path, data, "second")
    try:
        second.wait_ready()
        again = requests.get(f"{second.base}/v1/jobs/{job_id}", timeout=30).json()
        assert again["status"] == "succeeded" and again["result"] == done["result"], again
        # The private Redis came back on the port it had (when free; clients get the URL anyway).
        url = lambda text: text.split("private redis-server at ", 1)[1].split(",", 1)[0]  # noqa: E731
        assert url(second.text()) == url(first.text())
    finally:
        assert second.stop() == 0, second.text()[-3000:]


def test_make_run_restarts_a_worker_that_dies(tiny_model, tmp_path):
    run = Launcher(tmp_path, tmp_path / "data")
    try:
        run.wait_ready()
        (killed,) = [p for p in run.descendants() if "-m worker" in " ".join(p.cmdline())]
        killed.kill()

        def restarted() -> bool:
            workers = [p for p in run.descendants() if "-m worker" in " ".join(_cmdlines([p]))]
            return "restarting it in 1 s" in run.text() and any(p.pid != killed.pid for p in workers)

        stackmod.wait_until(restarted, 30, "the worker to be restarted")
        run.wait_ready(60)
        resp = requests.post(run.base + "/basic_generate", json={"prompt": "Hello"}, timeout=60)
        assert resp.status_code == 200 and resp.json()["generated_text"].startswith("Hello"), resp.text
        assert run.proc.poll() is None
        assert "worker exited (killed by SIGKILL)" in run.text()
    finally:
        assert run.stop() == 0, run.text()[-3000:]
