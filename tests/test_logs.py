"""GENQ_LOG_FORMAT=json: everything `make run` writes, from its first line, is one JSON object
per line: the launcher's own lines, gunicorn's, Celery's banner and its lines, the worker's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import requests

from scripts import stack as stackmod


def test_make_run_with_json_logs_writes_only_json_lines(tiny_model, redis_url, tmp_path):
    port = stackmod.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    env.update(
        REDIS_URL=redis_url,
        GENQ_PORT=str(port),
        GENQ_API_WORKERS="1",
        GENQ_ENGINE="echo",
        GENQ_LOG_FORMAT="json",
        GENQ_HOST="0.0.0.0",
        GENQ_DATA_DIR=str(tmp_path / "data"),
        GENQ_MODEL_NAME=f"logs-{port}",
    )
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-W", "always", "-m", "scripts.stack"],
            cwd=stackmod.ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        stackmod.wait_until(lambda: stackmod.http_get(base + "/readyz")[0] == 200, 240, "make run's stack")
        resp = requests.post(base + "/basic_generate", json={"prompt": "Hello there"}, timeout=60)
        assert resp.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = log.read_text().splitlines()
    bad = []
    records = []
    for n, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            bad.append(f"{n}: {line}")
    assert not bad, f"{len(bad)} of {len(lines)} lines are not JSON:\n" + "\n".join(bad[:40])
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    loggers = {r["logger"] for r in records}
    # The launcher's banner and warning, gunicorn's arbiter, Celery's banner, the job's line.
    text = " ".join(r["msg"] for r in records)
    assert "serving SmolLM2-135M-Instruct" in text and "opens the API to the network" in text
    assert any(name.startswith("gunicorn") for name in loggers), loggers
    assert any(name.startswith("celery") for name in loggers), loggers
    assert any(r.get("event") == "job.finished" for r in records)


def test_native_stderr_lines_become_json_records():
    """What C++ code writes to file descriptor 2 (xgrammar's warnings) is a record too, in a
    process with JSON logs; a child's own JSON line passes as it is."""
    code = (
        "import os, logging, subprocess, sys\n"
        "from tasks import logs\n"
        "logs.configure('json')\n"
        "logs.native_stderr_as_json()\n"
        "os.write(2, b'[12:00:00] xgrammar: a native warning\\n')\n"
        "subprocess.run([sys.executable, '-c', 'import sys; sys.stderr.write(\\'{\"msg\": \"child\"}\\\\n\\')'])\n"
        "logging.getLogger('x').info('python line')\n"
        "import threading; os.close(2)\n"  # the pipe's end: the reader writes what it holds, then stops
        "[t.join(30) for t in threading.enumerate() if t.name == 'genq-native-stderr']\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=stackmod.ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    records = [json.loads(line) for line in proc.stderr.splitlines()]
    native = [r for r in records if r.get("logger") == "native"]
    assert [r["msg"] for r in native] == ["[12:00:00] xgrammar: a native warning"] and native[0]["level"] == "WARNING"
    assert {"msg": "child"} in records and any(r.get("msg") == "python line" for r in records)
