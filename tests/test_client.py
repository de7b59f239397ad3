"""The Python client (genqueue.Client) against a real stack: Redis, the API under gunicorn, an
echo worker (fast) or the tiny hf model (for streams that take a while), and an API without
workers (jobs stay queued: cancel, wait timeouts) with API keys on.

Two parts are not against the real stack: `run_batch`'s edge cases (failed and expired
batches, progress, timeouts) run against an in-process fake of /v1/files and /v1/batches
(tests/fake_batch.py), quick and deterministic (tests/test_batches.py runs `run_batch` and
`genq batch` against the real server); and the stream's handling of `restart` and transient `error` events,
which a real stack gives only when a worker dies mid-job (tests/test_recovery.py covers the
server side), runs against canned SSE through an httpx.MockTransport.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from conftest import IDLE_STACK_KEY as KEY  # noqa: E402
from fake_batch import FakeBatchServer

from genqueue import (
    AuthError,
    BadRequest,
    BatchError,
    Client,
    Conflict,
    ConnectError,
    JobCancelled,
    JobError,
    NotFound,
    Restart,
    ServerError,
    WaitTimeout,
    result_text,
)


@pytest.fixture
def fake_batch():
    server = FakeBatchServer(step=3, api_key=KEY)
    yield server
    server.stop()


# -- jobs against the real stack ----------------------------------------------------------


def test_submit_get_wait_complete(echo_stack):
    with Client(echo_stack.base) as c:
        job_id = c.submit("one two three four", max_new_tokens=2, temperature=None)
        job = c.wait(job_id, timeout=30)
        assert job["id"] == job_id and job["status"] == "succeeded"
        assert job["result"]["text"] == " three four" == result_text(job)
        assert job["result"]["cached_tokens"] == 0  # the echo engine has no prefix cache
        assert c.get(job_id)["status"] == "succeeded"
        assert c.complete("alpha beta gamma", max_new_tokens=1) == " gamma"


def test_stream_joins_to_the_result(echo_stack):
    with Client(echo_stack.base) as c:
        job_id = c.submit("a b c d e", max_new_tokens=3)
        tokens = c.stream(job_id)
        assert list(tokens) == [" c", " d", " e"]
        assert tokens.finish_reason == "length" and tokens.usage["completion_tokens"] == 3
        assert tokens.usage["cached_tokens"] == tokens.cached_tokens == 0
        assert tokens.text == c.wait(job_id, 30)["result"]["text"]
        assert tokens.reconnects == 0 and tokens.restarts == 0
        # A finished job replays; Last-Event-ID skips what the caller has.
        assert c.stream(job_id, last_event_id=0).read() == " d e"


def test_errors_are_typed(echo_stack):
    with Client(echo_stack.base) as c:
        for call in (lambda: c.get("nope"), lambda: c.cancel("nope"), lambda: list(c.stream("nope"))):
            with pytest.raises(NotFound) as exc:
                call()
            assert exc.value.status == 404 and exc.value.code == "not_found" and "nope" in exc.value.message
        with pytest.raises(BadRequest) as exc:
            c.submit("hi", max_new_tokens=0)
        assert exc.value.status == 400 and exc.value.code == "invalid_request" and "max_new_tokens" in exc.value.message
        with pytest.raises(BadRequest, match="unknown field"):
            c.submit("hi", colour="blue")
        job_id = c.submit("x y", max_new_tokens=1)
        c.wait(job_id, 30)
        with pytest.raises(Conflict) as exc:
            c.cancel(job_id)
        assert exc.value.status == 409
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    with Client(f"http://127.0.0.1:{port}") as c:
        with pytest.raises(ConnectError) as exc:
            c.get("x")
        assert exc.value.status is None and exc.value.code == "connection_error"


def test_workers_and_env_defaults(echo_stack, monkeypatch):
    monkeypatch.setenv("GENQ_URL", echo_stack.base + "/v1")  # OpenAI's base URL works too
    monkeypatch.delenv("GENQ_API_KEY", raising=False)
    with Client() as c:
        assert c.base_url == echo_stack.base
        (w,) = c.workers()
        assert w["engine"] == "echo" and w["model"] == echo_stack.name and w["capacity"] >= 1 and w["name"]


def test_api_key_cancel_and_wait_timeout(idle_stack, monkeypatch):
    monkeypatch.delenv("GENQ_API_KEY", raising=False)
    with Client(idle_stack.base) as c:
        with pytest.raises(AuthError) as exc:
            c.submit("hi")
        assert exc.value.status == 401 and exc.value.code == "unauthorized"
        with pytest.raises(ServerError) as exc:  # /readyz needs no key: no worker is a 503
            c.workers()
        assert exc.value.status == 503 and exc.value.code == "not_ready"
    with Client(idle_stack.base, api_key="sk-wrong") as c, pytest.raises(AuthError):
        c.get("x")
    monkeypatch.setenv("GENQ_API_KEY", KEY)
    with Client(idle_stack.base) as c:
        job_id = c.submit("nobody serves this yet", max_new_tokens=4)
        with pytest.raises(WaitTimeout) as exc:
            c.wait(job_id, timeout=0.5)
        assert exc.value.job["status"] == "queued" and exc.value.job_id == job_id
        assert c.cancel(job_id)["status"] == "cancelled"
        with pytest.raises(Conflict):
            c.cancel(job_id)
        job = c.wait(job_id, timeout=5)
        assert job["status"] == "cancelled"
        with pytest.raises(JobCancelled) as exc:
            result_text(job)
        assert exc.value.status == 409
        with pytest.raises(JobCancelled):
            list(c.stream(job_id))
        # complete() cancels the job it gave up on.
        with pytest.raises(WaitTimeout) as exc:
            c.complete("nor this", timeout=0.5)
        assert c.get(exc.value.job_id)["status"] == "cancelled"


# -- streams: a dropped connection, a failed job ------------------------------------------


class DropProxy:
    """A TCP proxy in front of the API that can drop every open connection, as a network or a
    load balancer would; it keeps what clients sent, to see their Last-Event-ID. What the API
    sends goes on in small, paced pieces, as over a slow link: a stream whose job is already
    over would otherwise reach the client's buffer whole before a drop (seen in CI: the second
    drop came after the last byte, no reconnect)."""

    piece = 256  # bytes, every `pace` seconds downstream
    pace = 0.005

    def __init__(self, port: int):
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent = bytearray()
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            with self.lock:
                self.conns += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536 if record else self.piece):
                if record:
                    with self.lock:
                        self.sent += data
                else:
                    time.sleep(self.pace)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def drop(self) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()
        self.drop()


def test_stream_resumes_after_dropped_connections(hf_stack):
    proxy = DropProxy(hf_stack.port)
    try:
        with Client(f"http://127.0.0.1:{proxy.port}") as c:
            job_id = c.submit("Once upon a time", max_new_tokens=300, ignore_eos=True)
            tokens, ids_at_drop = [], []
            stream = c.stream(job_id)
            for token in stream:
                assert isinstance(token, str)
                tokens.append(token)
                if len(tokens) in (5, 60):  # drop the connection, keep reading
                    ids_at_drop.append(stream.last_event_id)
                    proxy.drop()
            job = c.wait(job_id, 60)
        assert job["status"] == "succeeded"
        assert "".join(tokens) == stream.text == job["result"]["text"]
        assert len(tokens) == job["result"]["completion_tokens"] == 300
        assert stream.reconnects == 2 and stream.finish_reason == "length"
        sent = proxy.sent.decode("latin-1").lower()
        resumed = [int(line.split(":", 1)[1]) for line in sent.splitlines() if line.startswith("last-event-id:")]
        assert len(resumed) == 2 and resumed[0] >= int(ids_at_drop[0]) and resumed[1] >= int(ids_at_drop[1])
    finally:
        proxy.close()


def test_stream_of_a_failing_job_raises(hf_stack):
    with Client(hf_stack.base) as c:
        # A token id outside the tiny model's vocabulary: only its worker can tell.
        job_id = c.submit("Hello", logit_bias={"999999": 1.0})
        with pytest.raises(JobError) as exc:
            list(c.stream(job_id))
        assert not isinstance(exc.value, JobCancelled)
        assert exc.value.code == "invalid_request" and exc.value.status == 400 and exc.value.job_id == job_id
        job = c.wait(job_id, 30)
        assert job["status"] == "failed"
        with pytest.raises(JobError, match="logit_bias"):
            result_text(job)


# -- restart and error events (canned SSE) ------------------------------------------------


def sse(*events: tuple[str, str | None, dict]) -> bytes:
    out = []
    for kind, event_id, data in events:
        head = (f"id: {event_id}\n" if event_id is not None else "") + f"event: {kind}\n"
        out.append(head + f"data: {json.dumps(data)}\n\n")
    return (": keep-alive\n\n" + "".join(out)).encode()


def canned(*bodies: bytes):
    """A transport answering the n-th stream request with the n-th body; it keeps the
    Last-Event-ID each request carried."""
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Last-Event-ID"))
        return httpx.Response(200, headers={"Content-Type": "text/event-stream"}, content=bodies[len(seen) - 1])

    return httpx.MockTransport(handler), seen


def test_stream_restart_marker_and_transient_errors():
    transport, seen = canned(
        sse(
            ("token", "0", {"index": 0, "text": "a"}),
            ("token", "1", {"index": 1, "text": "b"}),
            ("restart", None, {"attempt": 2, "message": "started over"}),
            ("token", "2:0", {"index": 0, "text": "x"}),
        ),
        # ended without `done`: reconnect; Redis briefly gone: reconnect
        sse(("error", None, {"error": {"code": "broker_unavailable", "message": "Redis is down"}})),
        sse(
            ("token", "2:1", {"index": 1, "text": "y"}),
            ("done", "2:2", {"text": "", "finish_reason": "stop", "usage": {"completion_tokens": 2}}),
        ),
    )
    with Client("http://genq.test", transport=transport) as c:
        stream = c.stream("job1")
        out = list(stream)
    assert out[:2] == ["a", "b"] and isinstance(out[2], Restart) and out[2].attempt == 2
    assert out[3:] == ["x", "y"]
    assert stream.text == "xy" and stream.restarts == 1 and stream.reconnects == 2
    assert stream.finish_reason == "stop" and stream.done
    assert stream.usage == {"completion_tokens": 2, "cached_tokens": 0} and stream.cached_tokens == 0  # an older server
    assert seen == [None, "2:0", "2:0"]


def test_stream_resumes_from_the_new_attempt_after_a_restart():
    transport, seen = canned(
        sse(("token", "0", {"index": 0, "text": "a"}), ("restart", None, {"attempt": 2})),
        sse(("token", "2:0", {"index": 0, "text": "z"}), ("done", "2:1", {"text": "!", "finish_reason": "length"})),
    )
    with Client("http://genq.test", transport=transport) as c:
        stream = c.stream("job1")
        out = list(stream)
    assert out[0] == "a" and isinstance(out[1], Restart) and out[2:] == ["z", "!"]
    assert stream.text == "z!"
    assert seen == [None, None]  # from the new attempt's first token


@pytest.mark.parametrize(
    "code, cls, status", [("cancelled", JobCancelled, 409), ("internal", JobError, 502), ("timeout", JobError, 504)]
)
def test_stream_error_event_raises(code, cls, status):
    transport, _ = canned(
        sse(("token", "0", {"index": 0, "text": "a"}), ("error", None, {"error": {"code": code, "message": "m"}}))
    )
    with Client("http://genq.test", transport=transport) as c:
        stream = c.stream("job1")
        assert next(stream) == "a"
        with pytest.raises(cls) as exc:
            next(stream)
    assert exc.value.code == code and exc.value.status == status and stream.done


def test_stream_gives_up_after_max_reconnects():
    seen = []

    def handler(request):  # every connection ends at once, without a token
        seen.append(request.headers.get("Last-Event-ID"))
        return httpx.Response(200, headers={"Content-Type": "text/event-stream"}, content=b": keep-alive\n\n")

    with Client("http://genq.test", transport=httpx.MockTransport(handler), max_reconnects=2) as c:
        with pytest.raises(ConnectError, match="ended before"):
            list(c.stream("job1"))
    assert len(seen) == 3


# -- run_batch against the fake Batch API -------------------------------------------------


def test_run_batch_rows_in_input_order_with_progress(fake_batch, capsys):
    rows = [f"prompt {i}" for i in range(8)]
    rows += [{"prompt": "a body", "max_tokens": 4}, {"custom_id": "mine", "body": {"prompt": "a line"}}]
    rows += [{"custom_id": "bad", "body": {"max_tokens": 2}}]  # refused by the endpoint: a failed line
    with Client(fake_batch.url, api_key=KEY) as c:
        results = c.run_batch(rows, model="tiny", poll_interval=0.01)
    assert [r["custom_id"] for r in results] == [f"request-{i}" for i in range(9)] + ["mine", "bad"]
    texts = [r["response"]["body"]["choices"][0]["text"] for r in results[:10]]
    assert texts == [f"PROMPT {i}" for i in range(8)] + ["A BODY", "A LINE"]
    assert results[-1]["response"]["status_code"] == 400 and results[-1]["error"] is None
    err = capsys.readouterr().err
    assert "11/11" in err and "failed=1" in err and "req" in err  # the tqdm bar
    assert all(auth == f"Bearer {KEY}" for _, _, auth in fake_batch.requests)
    (uploaded,) = [f for f in fake_batch.files.values() if f.get("purpose") == "batch"]
    assert uploaded["_lines"][0] == {
        "body": {"model": "tiny", "prompt": "prompt 0"},
        "custom_id": "request-0",
        "method": "POST",
        "url": "/v1/completions",
    }


def test_run_batch_from_a_file(fake_batch, tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": f"p{i}"}}
        for i in range(7)
    ]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    with Client(fake_batch.url, api_key=KEY) as c:
        results = c.run_batch(src, output=out, progress=False, poll_interval=0.01)
    assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(7)]
    assert [json.loads(line) for line in out.read_text().splitlines()] == results
    (uploaded,) = [f for f in fake_batch.files.values() if f.get("purpose") == "batch"]
    assert uploaded["_content"] == src.read_bytes() and uploaded["filename"] == "in.jsonl"


def test_run_batch_errors(fake_batch, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a", "body": {"prompt": "x"}}\n{oops\n')
    with Client(fake_batch.url, api_key=KEY) as c:
        with pytest.raises(BadRequest, match="line 2"):
            c.run_batch(bad, progress=False)
        with pytest.raises(WaitTimeout) as exc:
            c.run_batch(["a", "b", "c", "d", "e", "f", "g"], progress=False, poll_interval=0.2, timeout=0.3)
        batch = exc.value.batch
        assert batch["status"] == "in_progress"
        assert c.cancel_batch(batch["id"])["status"] == "cancelling"
        batch = c.get_batch(batch["id"])
        assert batch["status"] == "cancelled"
        partial = c.batch_results(batch)
        assert 0 < len(partial) < 7
    with Client(fake_batch.url) as c, pytest.raises(AuthError):
        c.run_batch(["a"], progress=False)


def test_run_batch_of_a_cancelled_batch_raises_with_partial_results(fake_batch, monkeypatch):
    with Client(fake_batch.url, api_key=KEY) as c:
        real_get = c.get_batch

        def get_then_cancel(batch_id):  # someone cancels it after its first lines
            batch = real_get(batch_id)
            if batch["request_counts"]["completed"] >= 3 and batch["status"] == "in_progress":
                c.cancel_batch(batch_id)
            return batch

        monkeypatch.setattr(c, "get_batch", get_then_cancel)
        with pytest.raises(BatchError) as exc:
            c.run_batch([f"p{i}" for i in range(9)], progress=False, poll_interval=0.01)
    assert exc.value.code == "cancelled" and exc.value.batch["status"] == "cancelled"
    assert [r["custom_id"] for r in exc.value.results] == ["request-0", "request-1", "request-2"]


def test_console_script_is_installed():
    """`make` installs the package editable, with the `genq` command beside the interpreter."""
    import sys
    from pathlib import Path

    assert (Path(sys.executable).parent / "genq").exists(), "run `make` (pip install -e .)"
