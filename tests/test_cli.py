"""The `genq` command, run as a subprocess (the console script `make` installs beside the
interpreter), against a real stack (echo worker; an API with keys and no worker; the tiny hf
model for a failing job) and, for `genq batch`'s edge cases, against the in-process fake of
the Batch API in tests/fake_batch.py (tests/test_batches.py runs it against the real server
too). Exit codes:
0 ok, 1 job failed/cancelled, 2 usage or refused request, 3 server/connection error, 4 auth.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from fake_batch import FakeBatchServer

ROOT = Path(__file__).resolve().parent.parent
GENQ = Path(sys.executable).parent / "genq"
from conftest import IDLE_STACK_KEY as KEY  # noqa: E402


def genq(*args: str, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("GENQ_URL", "GENQ_API_KEY")}
    argv = [str(GENQ)] if GENQ.exists() else [sys.executable, "-m", "genqueue"]
    return subprocess.run(
        argv + list(args),
        env={**base, **(env or {})},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_console_script_exists():
    assert GENQ.exists(), "run `make` (pip install -e .) to install the genq command"


def test_help_and_usage_errors():
    out = genq("--help")
    assert out.returncode == 0
    for word in ("submit", "get", "cancel", "batch", "workers", "GENQ_URL", "GENQ_API_KEY", "exit codes"):
        assert word in out.stdout
    for cmd in ("submit", "get", "cancel", "batch", "workers"):
        out = genq(cmd, "--help")
        assert out.returncode == 0 and f"usage: genq {cmd}" in out.stdout, cmd
    usage_errors = [
        [],
        ["submit"],
        ["get"],
        ["frobnicate"],
        ["submit", "x", "--wait", "--stream"],
        ["submit", "x", "--max-new-tokens", "many"],
    ]
    for args in usage_errors:
        out = genq(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "usage: genq" in out.stderr


def test_submit_get_wait_stream(echo_stack):
    url = echo_stack.base
    out = genq("--url", url, "submit", "one two three", "--max-new-tokens", "2")
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip()
    out = genq("get", job_id, "--url", url, "--wait", "30")  # options after the command too
    assert out.returncode == 0
    job = json.loads(out.stdout)
    assert job["id"] == job_id and job["status"] == "succeeded" and job["result"]["text"] == " two three"

    out = genq("submit", "a b c d", "--max-new-tokens", "3", "--wait", env={"GENQ_URL": url})
    assert (out.returncode, out.stdout) == (0, " b c d\n")
    out = genq("submit", "a b c d", "--max-new-tokens", "2", "--stream", env={"GENQ_URL": url})
    assert (out.returncode, out.stdout) == (0, " c d\n")
    out = genq("submit", "-", "--param", "max_new_tokens=1", "--wait", "--json", env={"GENQ_URL": url}, stdin="x y z")
    assert out.returncode == 0 and json.loads(out.stdout)["result"]["text"] == " z"


def test_refused_requests_exit_2(echo_stack):
    out = genq("--url", echo_stack.base, "get", "unknown")
    assert out.returncode == 2 and out.stdout == ""
    assert "no job 'unknown'" in out.stderr and "404 not_found" in out.stderr
    out = genq("--url", echo_stack.base, "submit", "hi", "--max-new-tokens", "0")
    assert out.returncode == 2 and "max_new_tokens" in out.stderr
    job_id = genq("--url", echo_stack.base, "submit", "hi there", "--wait", "--json").stdout
    out = genq("--url", echo_stack.base, "cancel", json.loads(job_id)["id"])
    assert out.returncode == 2 and "409" in out.stderr


def test_workers(echo_stack, idle_stack):
    out = genq("--url", echo_stack.base, "workers")
    assert out.returncode == 0, out.stderr
    assert echo_stack.name in out.stdout and "echo" in out.stdout and "NAME" in out.stdout
    out = genq("--url", echo_stack.base, "workers", "--json")
    assert json.loads(out.stdout)["workers"][0]["engine"] == "echo"
    out = genq("--url", idle_stack.base, "workers")
    assert out.returncode == 3 and "not_ready" in out.stderr


def test_auth_cancel_and_timeouts(idle_stack):
    url = idle_stack.base
    out = genq("--url", url, "submit", "hi")
    assert out.returncode == 4 and "401 unauthorized" in out.stderr
    out = genq("--url", url, "--api-key", "sk-wrong", "get", "x")
    assert out.returncode == 4
    out = genq("--url", url, "submit", "nobody serves this", "--api-key", KEY)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip()
    env = {"GENQ_URL": url, "GENQ_API_KEY": KEY}
    assert genq("get", job_id, env=env).returncode == 0  # queued
    out = genq("get", job_id, "--wait", "0.5", env=env)
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "queued"
    out = genq("cancel", job_id, env=env)
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "cancelled"
    out = genq("get", job_id, env=env)
    assert out.returncode == 1 and json.loads(out.stdout)["status"] == "cancelled"
    out = genq("submit", "nor this", "--wait", "--max-wait", "0.5", env=env)
    assert out.returncode == 3 and "still queued" in out.stderr and "genq get" in out.stderr


def test_connection_error_exits_3():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = genq("--url", f"http://127.0.0.1:{port}", "submit", "hi")
    assert out.returncode == 3 and "cannot reach" in out.stderr


def test_failed_job_exits_1(hf_stack):
    for how in ("--wait", "--stream"):
        # A token id outside the tiny model's vocabulary: the job fails on its worker.
        out = genq("--url", hf_stack.base, "submit", "Hello", "--param", 'logit_bias={"999999": 1}', how)
        assert out.returncode == 1, (how, out.stderr)
        assert "invalid_request" in out.stderr and "logit_bias" in out.stderr
    # A prompt past the model's context is refused at submit: nothing to wait for.
    out = genq("--url", hf_stack.base, "submit", "word " * 600, "--wait")
    assert out.returncode == 2 and "prompt_too_long" in out.stderr, out.stderr


# -- genq batch against the fake Batch API ------------------------------------------------


def _batch_file(path: Path, prompts: list) -> Path:
    with path.open("w") as fh:
        for i, p in enumerate(prompts):
            body = {"model": "m", "max_tokens": 4} | ({"prompt": p} if p is not None else {})
            line = {"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions", "body": body}
            fh.write(json.dumps(line) + "\n")
    return path


def test_batch_writes_the_output_in_input_order(tmp_path):
    server = FakeBatchServer(step=4, api_key=KEY)
    try:
        src = _batch_file(tmp_path / "in.jsonl", [f"p{i}" for i in range(10)])
        out_path = tmp_path / "out.jsonl"
        env = {"GENQ_URL": server.url, "GENQ_API_KEY": KEY}
        out = genq("batch", str(src), "-o", str(out_path), "--poll", "0.05", env=env)
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out_path.read_text().splitlines()]
        assert [line["custom_id"] for line in lines] == [f"row-{i}" for i in range(10)]
        assert [line["response"]["body"]["choices"][0]["text"] for line in lines] == [f"P{i}" for i in range(10)]
        assert "10/10" in out.stderr and "failed=0" in out.stderr and "req/s" in out.stderr  # the bar
        assert "10 succeeded, 0 failed" in out.stderr

        # A line the endpoint refuses: the rest is written, exit 1. To stdout without -o.
        src = _batch_file(tmp_path / "in2.jsonl", ["a", None, "c"])
        out = genq("--url", server.url, "--api-key", KEY, "batch", str(src), "--poll", "0.05", "--no-progress")
        assert out.returncode == 1
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert [line["response"]["status_code"] for line in lines] == [200, 400, 200]
        assert "2 succeeded, 1 failed" in out.stderr and "req/s" not in out.stderr

        bad = tmp_path / "bad.jsonl"
        bad.write_text(src.read_text() + "{not json\n")
        out = genq("--url", server.url, "--api-key", KEY, "batch", str(bad))
        assert out.returncode == 2 and "line 4" in out.stderr
        out = genq("--url", server.url, "batch", str(src))
        assert out.returncode == 4
    finally:
        server.stop()


def test_stream_reattaches_to_a_running_job(hf_stack):
    """`genq stream ID` follows a job someone else submitted: the tokens so far, then the rest."""
    job_id = genq(
        "--url", hf_stack.base, "submit", "Once upon a time", "--max-new-tokens", "120", "--param", "ignore_eos=true"
    ).stdout.strip()
    out = genq("--url", hf_stack.base, "stream", job_id)
    assert out.returncode == 0, out.stderr
    job = hf_stack.get(f"/v1/jobs/{job_id}?wait=60").json()
    assert job["status"] == "succeeded" and out.stdout == job["result"]["text"] + "\n"
    out = genq("--url", hf_stack.base, "stream", "no-such-job")
    assert out.returncode == 2 and "404" in out.stderr


def test_batch_on_a_missing_file_is_a_usage_error(tmp_path):
    out = genq("--url", "http://127.0.0.1:9", "batch", str(tmp_path / "missing.jsonl"))
    assert out.returncode == 2, out.stderr
    assert "missing.jsonl: No such file or directory" in out.stderr and "Traceback" not in out.stderr
