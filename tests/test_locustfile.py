"""Static and offline checks of locustfile.py (no network, no running stack).

Importing locust monkey-patches the standard library with gevent (sockets, threads,
ssl, ...), which would leak into every other test in this pytest process.  So the
locustfile is imported and exercised in a child interpreter: it instantiates the user
classes with a fake HTTP client, runs each task once against scripted responses and
prints what happened as JSON for the assertions here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO_ROOT / "locustfile.py"


DRIVER = r'''
import json, sys
sys.path.insert(0, sys.argv[1])

import locustfile
from locust import HttpUser, User
from locust.env import Environment


class FakeResponse:
    def __init__(self, status, body=None, headers=None):
        self.status_code = status
        self._body = body
        self.headers = headers or {}
        self.text = "" if body is None else json.dumps(body)
        self.outcome = None

    def json(self):
        if self._body is None:
            raise ValueError("no json")
        return self._body

    def success(self):
        self.outcome = "success"

    def failure(self, exc):
        self.outcome = "failure: " + str(exc)

    def iter_lines(self, decode_unicode=False):
        yield from (self._body or {}).get("__sse__", [])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.outcome is None:
            self.outcome = "success" if self.status_code < 400 else "failure: http %d" % self.status_code
        return False


class FakeClient:
    """Answers each request with the next scripted response; `reply` may be a callable."""

    def __init__(self, script):
        self.script = list(script)
        self.calls = []
        self.headers = {}

    def _request(self, method, path, **kw):
        reply = self.script.pop(0)
        if callable(reply):
            reply = reply(method, path, kw)
        resp = FakeResponse(*reply)
        self.calls.append({
            "method": method,
            "path": path,
            "name": kw.get("name"),
            "params": kw.get("params"),
            "json": kw.get("json"),
            "catch_response": kw.get("catch_response"),
            "timeout": kw.get("timeout"),
            "authorization": self.headers.get("Authorization"),
            "resp": resp,
        })
        return resp

    def post(self, path, **kw):
        return self._request("POST", path, **kw)

    def get(self, path, **kw):
        return self._request("GET", path, **kw)


def run(cls, script):
    env = Environment(user_classes=[cls], host="http://genq.test")
    events = []
    env.events.request.add_listener(lambda **kw: events.append(
        {"type": kw["request_type"], "name": kw["name"], "ms": kw["response_time"],
         "exception": None if kw.get("exception") is None else str(kw["exception"])}))
    sleeps = []
    locustfile._sleep = sleeps.append
    # locust's runner copies --host onto the class; do the same on a throwaway subclass
    user = type(cls.__name__, (cls,), {"host": env.host})(env)
    user.client = FakeClient(script)
    user.on_start()
    tasks = cls.tasks
    assert len(tasks) == 1, tasks
    tasks[0](user)
    calls = [{k: v for k, v in c.items() if k != "resp"} | {"outcome": c["resp"].outcome}
             for c in user.client.calls]
    return {"calls": calls, "events": events, "sleeps": sleeps,
            "unused_replies": len(user.client.script)}


def echo_prompt(method, path, kw):
    return (200, {"generated_text": kw["json"]["prompt"] + " and more"})


def echo_prompts(method, path, kw):
    return (200, {"generated_texts": [p + " more" for p in kw["json"]["prompts"]]})


classes = {}
for name in dir(locustfile):
    obj = getattr(locustfile, name)
    if isinstance(obj, type) and issubclass(obj, User) and obj.__module__ == "locustfile":
        probe = obj.__new__(obj)
        classes[name] = {
            "abstract": bool(obj.__dict__.get("abstract", False)),
            "http": issubclass(obj, HttpUser),
            "host": obj.host,
            "ntasks": len(obj.tasks or []),
            "wait": obj.wait_time(probe) if getattr(obj, "wait_time", None) else None,
            "weight": getattr(obj, "weight", 1),
        }

JOB = "j-1"
queued = (202, {"id": JOB, "status": "queued"}, {"Location": "/v1/jobs/" + JOB})
out = {
    "classes": classes,
    "max_new_tokens": locustfile.MAX_NEW_TOKENS,
    "terminal": sorted(locustfile.TERMINAL_STATUSES),
    "completions_ok": run(locustfile.CompletionsUser, [
        (200, {"choices": [{"index": 0, "text": " more", "finish_reason": "length"}]})]),
    "completions_bad": run(locustfile.CompletionsUser, [(200, {"choices": []})]),
    "chat_ok": run(locustfile.ChatCompletionsUser, [
        (200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]})]),
    "chat_bad": run(locustfile.ChatCompletionsUser, [(200, {"choices": [{"index": 0, "text": "hi"}]})]),
    "jobs_ok": run(locustfile.JobsUser, [
        queued,
        (200, {"id": JOB, "status": "queued"}),
        (200, {"id": JOB, "status": "running"}),
        (200, {"id": JOB, "status": "succeeded", "result": {"text": " world"}, "timings": {}}),
    ]),
    "jobs_failed": run(locustfile.JobsUser, [
        queued,
        (200, {"id": JOB, "status": "failed", "error": "boom", "timings": {}}),
    ]),
    "jobs_cancelled": run(locustfile.JobsUser, [
        queued,
        (200, {"id": JOB, "status": "cancelled", "timings": {}}),
    ]),
    "jobs_429": run(locustfile.JobsUser, [
        (429, {"detail": "queue full"}, {"Retry-After": "3"}),
    ]),
    "basic_ok": run(locustfile.BasicGenerateUser, [echo_prompt]),
    "basic_bad": run(locustfile.BasicGenerateUser, [(200, {"generated_text": "unrelated text"})]),
    "basic_429": run(locustfile.BasicGenerateUser, [(429, {"detail": "full"}, {"Retry-After": "2"})]),
    "basic_500": run(locustfile.BasicGenerateUser, [(500, {"error": "x"})]),
}
def sse(*events):
    lines = []
    for event, data in events:
        lines += ["id: 0", "event: " + event, "data: " + json.dumps(data), ""]
    return {"__sse__": [": keep-alive", ""] + lines}


if hasattr(locustfile, "StreamingUser"):
    tokens = [("token", {"index": i, "text": " w"}) for i in range(3)]
    done = ("done", {"text": "", "finish_reason": "length", "usage": {}})
    out["stream_ok"] = run(locustfile.StreamingUser, [
        queued,
        (200, sse(*tokens, done)),
        (200, {"id": JOB, "status": "succeeded", "timings": {"queued_s": 0.25}}),
    ])
    out["stream_error"] = run(locustfile.StreamingUser, [
        queued,
        (200, sse(tokens[0], ("error", {"error": {"code": "timeout"}}))),
    ])
    out["jobs_queue"] = run(locustfile.JobsUser, [
        queued,
        (200, {"id": JOB, "status": "succeeded", "result": {"text": " w"}, "timings": {"queued_s": 0.5}}),
    ])
if hasattr(locustfile, "BatchGenerateUser"):
    out["batch_ok"] = run(locustfile.BatchGenerateUser, [echo_prompts])
    out["batch_short"] = run(locustfile.BatchGenerateUser, [(200, {"generated_texts": ["x"]})])
print("RESULT " + json.dumps(out))
'''


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GENQ_LOCUST_", "LOCUST_")) and k != "GENQ_API_KEY"}
    env.update(extra)
    return env


def _drive(**extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(REPO_ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env=_child_env(**extra),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def result() -> dict:
    assert LOCUSTFILE.is_file(), "locustfile.py is missing"
    return _drive()


def _users(result) -> dict:
    return {name: info for name, info in result["classes"].items() if not info["abstract"]}


def test_user_classes_exist_and_are_host_agnostic(result):
    users = _users(result)
    assert {"JobsUser", "BasicGenerateUser"} <= set(users), users
    for name, info in users.items():
        assert info["http"], f"{name} should be an HttpUser"
        assert info["host"] in (None, ""), f"{name} hard-codes host {info['host']!r}; use --host"
        assert info["ntasks"] >= 1, f"{name} has no tasks"
        assert info["wait"] is not None and 0 <= info["wait"] <= 0.1, f"{name} is not closed-loop"
        assert info["weight"] >= 1


def test_max_new_tokens_and_api_key_from_env(result):
    out = _drive(GENQ_LOCUST_MAX_NEW_TOKENS="7", GENQ_API_KEY="sk-locust")
    assert out["max_new_tokens"] == 7
    assert out["jobs_ok"]["calls"][0]["json"]["max_new_tokens"] == 7
    assert out["completions_ok"]["calls"][0]["json"]["max_tokens"] == 7
    for case in ("jobs_ok", "basic_ok", "completions_ok", "chat_ok", "stream_ok"):
        assert {c["authorization"] for c in out[case]["calls"]} == {"Bearer sk-locust"}, case
        assert {c["authorization"] for c in result[case]["calls"]} == {None}, case


def test_openai_users_send_openai_bodies(result):
    (call,) = result["completions_ok"]["calls"]
    assert (call["method"], call["path"]) == ("POST", "/v1/completions") and call["outcome"] == "success"
    assert isinstance(call["json"]["prompt"], str) and call["json"]["max_tokens"] == result["max_new_tokens"]
    (call,) = result["chat_ok"]["calls"]
    assert (call["method"], call["path"]) == ("POST", "/v1/chat/completions") and call["outcome"] == "success"
    (message,) = call["json"]["messages"]
    assert message["role"] == "user" and isinstance(message["content"], str)
    assert call["json"]["max_tokens"] == result["max_new_tokens"]
    for case in ("completions_bad", "chat_bad"):
        assert result[case]["calls"][0]["outcome"].startswith("failure"), case


def test_jobs_user_submits_then_long_polls_until_succeeded(result):
    run = result["jobs_ok"]
    calls = run["calls"]
    assert run["unused_replies"] == 0, "stopped polling before the terminal status"
    submit, polls = calls[0], calls[1:]
    assert (submit["method"], submit["path"]) == ("POST", "/v1/jobs")
    assert isinstance(submit["json"]["prompt"], str) and submit["json"]["prompt"]
    assert len(polls) == 3
    assert {p["method"] for p in polls} == {"GET"}
    assert {p["path"] for p in polls} == {"/v1/jobs/j-1"}
    assert len({p["name"] for p in polls}) == 1 and polls[0]["name"], "polls must share one name="
    assert "j-1" not in polls[0]["name"], "the poll name must not contain the job id"
    assert all(float(p["params"]["wait"]) == 30 for p in polls)
    assert all(p["timeout"] is None or p["timeout"] > 30 for p in polls), "timeout must exceed wait"
    assert all(c["catch_response"] for c in calls)
    assert all(c["outcome"] == "success" for c in calls), calls
    # the whole job is reported once, as a success
    assert [e["exception"] for e in run["events"]] == [None]


@pytest.mark.parametrize("case", ["jobs_failed", "jobs_cancelled"])
def test_jobs_user_fails_on_non_succeeded_terminal_status(result, case):
    run = result[case]
    assert run["unused_replies"] == 0
    last = run["calls"][-1]
    assert last["outcome"].startswith("failure"), last
    assert run["events"] and all(e["exception"] for e in run["events"])


def test_terminal_statuses_are_the_jobs(result):
    from tasks.schemas import JobStatus

    assert set(result["terminal"]) == {s.value for s in JobStatus if s.terminal}


@pytest.mark.parametrize("case,retry_after", [("jobs_429", 3), ("basic_429", 2)])
def test_429_is_a_named_failure_and_honours_retry_after(result, case, retry_after):
    run = result[case]
    assert len(run["calls"]) == 1, "no polling after a rejected submit"
    outcome = run["calls"][0]["outcome"]
    assert outcome.startswith("failure") and "429" in outcome, outcome
    assert run["sleeps"] == [retry_after]


def test_basic_generate_checks_prompt_prefix(result):
    ok = result["basic_ok"]["calls"]
    assert [(c["method"], c["path"]) for c in ok] == [("POST", "/basic_generate")]
    assert set(ok[0]["json"]) == {"prompt"}
    assert ok[0]["outcome"] == "success"
    assert result["basic_bad"]["calls"][0]["outcome"].startswith("failure")
    assert result["basic_500"]["calls"][0]["outcome"].startswith("failure")


def test_batch_generate(result):
    ok = result["batch_ok"]["calls"]
    assert [(c["method"], c["path"]) for c in ok] == [("POST", "/generate")]
    assert isinstance(ok[0]["json"]["prompts"], list) and ok[0]["json"]["prompts"]
    assert ok[0]["outcome"] == "success"
    assert result["batch_short"]["calls"][0]["outcome"].startswith("failure")


def test_locust_cli_lists_the_user_classes():
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--list"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env=_child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    listed = proc.stdout + proc.stderr
    for name in ("JobsUser", "BasicGenerateUser", "CompletionsUser", "ChatCompletionsUser"):
        assert name in listed, listed
    assert "_GenqUser" not in listed


def test_streaming_user_reports_ttft_itl_and_queue_time(result):
    run = result["stream_ok"]
    assert run["unused_replies"] == 0
    submit, stream, record = run["calls"]
    assert (submit["method"], submit["path"]) == ("POST", "/v1/jobs")
    assert (stream["method"], stream["path"], stream["name"]) == ("GET", "/v1/jobs/j-1/stream", "/v1/jobs/[id]/stream")
    assert stream["outcome"] == "success" and record["path"] == "/v1/jobs/j-1"
    assert [e["type"] for e in run["events"]] == ["TTFT", "ITL", "ITL", "QUEUE"]
    assert all(e["exception"] is None for e in run["events"])
    assert run["events"][-1]["ms"] == 250.0
    assert result["jobs_queue"]["events"][-1] == {
        "type": "QUEUE",
        "name": "queue time (job record)",
        "ms": 500.0,
        "exception": None,
    }


def test_streaming_user_fails_a_stream_that_ends_in_an_error(result):
    run = result["stream_error"]
    assert run["calls"][1]["outcome"].startswith("failure") and "error" in run["calls"][1]["outcome"]
    assert [e["type"] for e in run["events"]] == ["TTFT"], "no queue time for a failed job"


def test_headless_run_against_a_real_stack_writes_ttft_rows(hf_stack, tmp_path):
    """locust --headless for ~15 s against the tiny model: TTFT and ITL entries in its CSV."""
    import csv

    from scripts.stack import communicate_or_stop

    prefix = tmp_path / "genq"
    popen = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(LOCUSTFILE),
            "--headless",
            "-u",
            "4",
            "-r",
            "4",
            "-t",
            "15s",
            "--host",
            hf_stack.base,
            "--csv",
            str(prefix),
            "--only-summary",
            "StreamingUser",
        ],
        cwd=REPO_ROOT,
        env=_child_env(GENQ_LOCUST_MAX_NEW_TOKENS="8"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out, err, overran = communicate_or_stop(popen, timeout=90)
    assert not overran, err[-3000:]
    with open(f"{prefix}_stats.csv", newline="") as fh:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(fh)}
    ttft = rows[("TTFT", "/v1/jobs/[id]/stream")]
    assert int(ttft["Request Count"]) >= 4 and int(ttft["Failure Count"]) == 0, ttft
    assert int(rows[("ITL", "/v1/jobs/[id]/stream")]["Request Count"]) >= 7 * int(ttft["Request Count"]) - 7 * 4
    assert int(rows[("QUEUE", "queue time (job record)")]["Request Count"]) >= 1
    assert int(rows[("GET", "/v1/jobs/[id]/stream")]["Failure Count"]) == 0, err[-3000:]


def test_headless_completions_against_a_stack_with_api_keys(make_stack, tmp_path):
    """GENQ_API_KEY reaches a keyed stack as a Bearer token: CompletionsUser's requests succeed
    (each would be a 401 without it)."""
    import csv

    from scripts.stack import communicate_or_stop

    key = "sk-locust-0123456789"
    s = make_stack(GENQ_ENGINE="echo", GENQ_API_KEYS=key)
    s.start_api()
    s.start_worker()
    s.wait_ready()
    prefix = tmp_path / "genq"
    popen = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(LOCUSTFILE),
            "--headless",
            "-u",
            "2",
            "-r",
            "2",
            "-t",
            "4s",
            "--host",
            s.base,
            "--csv",
            str(prefix),
            "--only-summary",
            "CompletionsUser",
        ],
        cwd=REPO_ROOT,
        env=_child_env(GENQ_API_KEY=key, GENQ_LOCUST_MAX_NEW_TOKENS="4"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out, err, overran = communicate_or_stop(popen, timeout=60)
    assert not overran, err[-3000:]
    with open(f"{prefix}_stats.csv", newline="") as fh:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(fh)}
    row = rows[("POST", "/v1/completions")]
    assert int(row["Request Count"]) >= 1 and int(row["Failure Count"]) == 0, (row, err[-3000:])
