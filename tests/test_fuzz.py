"""Nothing a client sends gets a 5xx or a dropped connection: schemathesis fuzzes every
operation of the live API's /openapi.json (requests that fit the schemas and requests that
do not), and a hand list of nasty bodies follows. Each answer is a documented status with a
JSON body (an error's is `{"error": {...}}`), and the API keeps serving."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.helpers import submit

# Examples per operation and mode: ~16 operations x 2 modes x this, a few minutes' worth of
# requests at most on a small machine with the echo engine behind the API.
EXAMPLES = 20

# The only 5xx a request may get from this stack, each the API telling the truth: no vLLM
# worker serves /generate_vllm here, and a job whose own deadline (timeout_s, deadline) passed.
EXPECTED_5XX = {(503, "no_worker"), (504, "timeout"), (504, "expired")}


def no_server_fault(ctx, response, case):
    """Every error is a JSON error body; a 5xx only one of EXPECTED_5XX (never a 500)."""
    if response.status_code < 400:
        return None
    try:
        error = json.loads(response.content)["error"]
        code = error["code"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"{response.status_code} without a JSON error body: {response.content[:300]!r}") from None
    if response.status_code >= 500 and (response.status_code, code) not in EXPECTED_5XX:
        raise AssertionError(f"server error {response.status_code} {code}: {error.get('message')}")
    return None


CHECKS = [no_server_fault, status_code_conformance, content_type_conformance, response_schema_conformance]
MODES = {GenerationMode.POSITIVE: CHECKS, GenerationMode.NEGATIVE: [*CHECKS, negative_data_rejection]}


def fuzz(schema, base: str, mode: GenerationMode) -> list[str]:
    """Runs every operation with EXAMPLES generated requests; returns the failures."""
    failures: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        def run(case):
            case.call_and_validate(base_url=base, checks=MODES[mode], timeout=60)

        try:
            run()
        except Unsatisfiable:
            # Negative mode, and nothing of the operation can be wrong (no body, no query,
            # only free-form path strings): there is no invalid request to send.
            assert mode is GenerationMode.NEGATIVE, op.path
        except Exception as exc:  # schemathesis' failure group, or a dropped connection
            failures.append(f"{mode.value} {op.method.upper()} {op.path}: {exc}")
    return failures


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.value)
def test_fuzzer_finds_no_server_error(echo_stack, mode):
    schema = schemathesis.openapi.from_url(echo_stack.base + "/openapi.json")
    failures = fuzz(schema, echo_stack.base, mode)
    assert not failures, "\n\n".join(failures)
    assert echo_stack.get("/healthz").status_code == 200


def raw_post(stack, path: str, body: bytes, content_type: str | None = "application/json"):
    headers = {} if content_type is None else {"Content-Type": content_type}
    # requests adds no Content-Type of its own to bytes.
    return stack.http.post(stack.base + path, data=body, headers=headers, timeout=60)


def nested(depth: int) -> bytes:
    return b'{"prompt": "x", "stop": ' + b"[" * depth + b"]" * depth + b"}"


# (name, body, Content-Type, status, code): each an error with that status and code.
NASTY = [
    ("invalid UTF-8", b'{"prompt": "caf\xc3\x28 \xff\xfe"}', "application/json", 400, "invalid_json"),
    ("NaN", b'{"prompt": "x", "temperature": NaN}', "application/json", 400, "invalid_json"),
    ("Infinity", b'{"prompt": "x", "timeout_s": Infinity}', "application/json", 400, "invalid_json"),
    ("-Infinity", b'{"prompt": "x", "deadline": -Infinity}', "application/json", 400, "invalid_json"),
    ("integer past 2^63", b'{"prompt": "x", "seed": 9223372036854775808}', "application/json", 400, "invalid_request"),
    (
        "integer far past 2^63",
        b'{"prompt": "x", "max_new_tokens": 1' + b"0" * 100 + b"}",
        "application/json",
        400,
        "invalid_request",
    ),
    (
        "priority past 2^63",
        b'{"prompt": "x", "priority": -99999999999999999999}',
        "application/json",
        400,
        "invalid_request",
    ),
    (
        "a 10,000-digit number",
        b'{"prompt": "x", "seed": 1' + b"0" * 10_000 + b"}",
        "application/json",
        400,
        "invalid_json",
    ),
    ("nested 100,000 deep", nested(100_000), "application/json", 400, "invalid_json"),
    (
        "nested objects",
        b'{"prompt": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}",
        "application/json",
        400,
        "invalid_json",
    ),
    (
        "a 1 MiB prompt of one token",
        b'{"prompt": "' + b"a" * (1 << 20) + b'"}',
        "application/json",
        413,
        "request_entity_too_large",
    ),
    (
        "a prompt just under the body limit",
        b'{"prompt": "' + b"a" * ((1 << 20) - 100) + b'"}',
        "application/json",
        400,
        "prompt_too_long",
    ),
    ("NUL in the prompt", b'{"prompt": "a\\u0000b"}', "application/json", 400, "invalid_request"),
    ("NUL in a stop string", b'{"prompt": "ab", "stop": ["\\u0000"]}', "application/json", 400, "invalid_request"),
    ("duplicate keys", b'{"prompt": "a", "max_new_tokens": 2, "prompt": "b"}', "application/json", 400, "invalid_json"),
    ("no Content-Type", b'{"prompt": "x"}', None, 415, "unsupported_media_type"),
    ("text/plain", b'{"prompt": "x"}', "text/plain", 415, "unsupported_media_type"),
    ("a form", b"prompt=x", "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    ("empty body", b"", "application/json", 400, "invalid_request"),
    ("whitespace body", b" \n\t ", "application/json", 400, "invalid_request"),
    ("a JSON array", b'[{"prompt": "x"}]', "application/json", 400, "invalid_request"),
    ("a JSON string", b'"x"', "application/json", 400, "invalid_request"),
    ("null", b"null", "application/json", 400, "invalid_request"),
    ("truncated", b'{"prompt": "x"', "application/json", 400, "invalid_json"),
    ("trailing garbage", b'{"prompt": "x"} {}', "application/json", 400, "invalid_json"),
    ("UTF-16", json.dumps({"prompt": "x"}).encode("utf-16"), "application/json", 400, "invalid_json"),
]
# The routes whose body has a `prompt` (/generate's `prompts` list gets the fuzzer alone).
PATHS = ["/v1/jobs", "/v1/completions", "/basic_generate", "/generate_stream"]


@pytest.mark.parametrize("name,body,content_type,status,code", NASTY, ids=[n[0] for n in NASTY])
def test_nasty_bodies_are_4xx_json_errors(echo_stack, name, body, content_type, status, code):
    for path in PATHS:
        resp = raw_post(echo_stack, path, body, content_type)
        assert resp.status_code == status, (path, resp.status_code, resp.text[:300])
        assert resp.headers["Content-Type"].startswith("application/json"), path
        err = resp.json()["error"]
        assert err["code"] == code and err["message"] and err["type"] == "invalid_request_error", (path, err)
    assert echo_stack.get("/healthz").status_code == 200


def test_nasty_urls_and_headers_are_4xx_json(echo_stack):
    job_id = submit(echo_stack, prompt="one two", max_new_tokens=2)
    cases = [
        ("GET", "/v1/jobs/%ff%fe%00", {}, 404),
        ("GET", f"/v1/jobs/{job_id}?wait=NaN", {}, 400),
        ("GET", f"/v1/jobs/{job_id}?wait=1e309", {}, 400),
        ("GET", f"/v1/jobs/{job_id}?wait=%ff", {}, 400),
        ("GET", f"/v1/jobs/{job_id}/stream", {"Last-Event-ID": "9" * 5000}, 400),
        ("GET", f"/v1/jobs/{job_id}/stream", {"Last-Event-ID": "1:2:3"}, 400),
        ("GET", f"/v1/jobs/{job_id}/stream?last_event_id=-", {}, 400),
        ("POST", "/v1/jobs/" + "x" * 3000 + "/cancel", {}, 404),
        ("DELETE", "/v1/jobs", {}, 405),
        # str.isdigit() takes these; int() fails on the first, reads the second as 3.
        ("GET", "/v1/batches?limit=%C2%B2", {}, 400),
        ("GET", "/v1/batches?limit=%D9%A3", {}, 400),
        ("GET", "/v1/batches?limit=" + "0" * 1000 + "1", {}, 400),
        ("GET", "/v1/batches?limit=1" + "0" * 5000, {}, 414),  # gunicorn refuses it (JSON too)
        ("GET", "/v1/batches?after=batch_x:pending", {}, 404),
        # Ids with another key's suffix (webapp/ids.py): never sent to Redis.
        ("GET", f"/v1/jobs/{job_id}:x", {}, 404),
        ("GET", f"/v1/jobs/{job_id.upper()}", {}, 404),
        ("GET", "/v1/batches/batch_0123456789abcdef01234567:pending", {}, 404),
        ("POST", "/v1/batches/batch_0123456789abcdef01234567:out/cancel", {}, 404),
        ("GET", "/v1/files/file-0123456789abcdef01234567:lines", {}, 404),
    ]
    for method, path, headers, status in cases:
        resp = echo_stack.http.request(method, echo_stack.base + path, headers=headers, timeout=60)
        assert resp.status_code == status, (method, path, resp.text[:300])
        assert resp.json()["error"]["message"], path
    assert echo_stack.get(f"/v1/jobs/{job_id}?wait=30").json()["status"] == "succeeded"


def test_garbage_on_the_socket_does_not_stop_the_server(echo_stack):
    """Bytes that are not HTTP at all, and a request cut off mid-body, on raw connections."""
    host, port = urlsplit(echo_stack.base).hostname, urlsplit(echo_stack.base).port
    for payload in (
        b"\x00\xff\x16\x03\x01garbage\r\n\r\n",
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"prompt": ',
    ):
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            s.recv(65536)
    # Still serving, and a real job still runs.
    job_id = submit(echo_stack, prompt="still here", max_new_tokens=2)
    assert echo_stack.get(f"/v1/jobs/{job_id}?wait=30").json()["status"] == "succeeded"


def raw_http(stack, payload: bytes, half_close: bool = False) -> list[tuple[int, dict, bytes]]:
    """Sends `payload` on a connection of its own; the responses read back until the server
    closes it: (status, headers lower-cased, body) each."""
    host, port = urlsplit(stack.base).hostname, urlsplit(stack.base).port
    data = b""
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(payload)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        while chunk := s.recv(65536):
            data += chunk
    responses = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        n = int(headers.get("content-length", len(data)))
        responses.append((int(status_line.split()[1]), headers, data[:n]))
        data = data[n:]
    return responses


def json_error(status: int, headers: dict, body: bytes) -> dict:
    assert 400 <= status < 500, (status, body[:300])
    assert headers["content-type"].startswith("application/json"), (headers, body[:300])
    error = json.loads(body)["error"]
    assert error["message"] and error["type"] == "invalid_request_error", error
    return error


def chunked(path: str, body: bytes, content_type: str = "application/json") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode() + body


# Chunked bodies framed wrongly (gunicorn's reader raises as the app reads them).
BAD_CHUNKS = [
    ("a chunk size that is not hex", b"zz\r\nabc\r\n0\r\n\r\n"),
    ("a negative chunk size", b"-3\r\nabc\r\n0\r\n\r\n"),
    ("a chunk size with a 0x", b"0x3\r\nabc\r\n0\r\n\r\n"),
    ("a chunk without its CRLF", b"3\r\nabcdef\r\n0\r\n\r\n"),
    ("a bad chunk extension", b"3;\x01\r\nabc\r\n0\r\n\r\n"),
]
# The routes that read a body: JSON ones and the multipart upload.
BODY_PATHS = [
    ("/v1/jobs", "application/json"),
    ("/v1/completions", "application/json"),
    ("/v1/batches", "application/json"),
    ("/v1/files", "multipart/form-data; boundary=b"),
]


@pytest.mark.parametrize("name,body", BAD_CHUNKS, ids=[n for n, _ in BAD_CHUNKS])
def test_a_malformed_chunked_body_is_a_4xx_json_error(echo_stack, name, body):
    for path, content_type in BODY_PATHS:
        (first, *_) = raw_http(echo_stack, chunked(path, body, content_type))
        error = json_error(*first)
        assert first[0] == 400 and error["code"] == "invalid_body", (path, error)
    # Cut off mid-chunk: the client half-closes, and still reads a 400.
    (first, *_) = raw_http(echo_stack, chunked("/v1/jobs", b"10\r\nabc"), half_close=True)
    assert first[0] == 400 and json_error(*first)["code"] == "invalid_body"
    # A route that does not read the body answers; gunicorn, draining it, answers a JSON 400 too.
    ok, refused = raw_http(echo_stack, b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    assert ok[0] == 200 and json_error(*refused)["code"] == "bad_request"
    job_id = submit(echo_stack, prompt="after a bad chunk", max_new_tokens=2)
    assert echo_stack.get(f"/v1/jobs/{job_id}?wait=30").json()["status"] == "succeeded"


def test_requests_gunicorn_refuses_are_json_errors(echo_stack):
    for payload in (b"\x00\xff\x16\x03\x01garbage\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"):
        (first,) = raw_http(echo_stack, payload)
        json_error(*first)
    assert echo_stack.get("/healthz").status_code == 200


def upload(stack, data: bytes):
    files = {"file": ("in.jsonl", data)}
    return stack.http.post(stack.base + "/v1/files", data={"purpose": "batch"}, files=files, timeout=60)


def batch_line(body: str, custom_id: str = "a") -> bytes:
    return (f'{{"custom_id": "{custom_id}", "method": "POST", "url": "/v1/completions", "body": {body}}}\n').encode()


# Batch input lines that are valid JSON but that no job could take: refused at upload, the
# line named (a lone surrogate used to wedge its batch `in_progress`, deep nesting a 500).
BAD_LINES = [
    ("a lone high surrogate in the prompt", batch_line('{"prompt": "a\\ud800b"}')),
    ("a lone low surrogate in a stop string", batch_line('{"prompt": "a", "stop": ["\\udfff"]}')),
    ("a lone surrogate in the custom_id", batch_line('{"prompt": "a"}', custom_id="\\udbff")),
    ("a line nested 100,000 deep", batch_line('{"prompt": "a", "stop": ' + "[" * 100_000 + "]" * 100_000 + "}")),
    ("a line of nested objects", batch_line('{"prompt": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}")),
]


@pytest.mark.parametrize("name,bad", BAD_LINES, ids=[n for n, _ in BAD_LINES])
def test_batch_lines_no_job_could_take_are_refused_at_upload(echo_stack, name, bad):
    good = batch_line(f'{{"model": "{echo_stack.name}", "prompt": "a", "max_tokens": 2}}', "ok")
    resp = upload(echo_stack, good + bad)
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert (error["code"], error["line"]) == ("invalid_file", 2), error
    # A surrogate pair, and an escaped backslash before `ud800`, are text: taken, and run.
    fine = batch_line(
        f'{{"model": "{echo_stack.name}", "prompt": "\\ud83d\\ude00 \\\\ud800", "max_tokens": 2}}', "pair"
    )
    resp = upload(echo_stack, good + fine)
    assert resp.status_code == 200, resp.text[:300]
    batch = echo_stack.post(
        "/v1/batches",
        json={"input_file_id": resp.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
    ).json()
    deadline = time.monotonic() + 60
    while batch["status"] not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = echo_stack.get(f"/v1/batches/{batch['id']}").json()
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 2, batch


def test_a_file_id_with_a_suffix_is_the_404_of_an_unknown_id(echo_stack):
    """`<id>:lines` names the file's content list in Redis: it used to answer a 500 (WRONGTYPE)
    for a file that exists and a 404 for one that does not, telling which ids exist."""
    resp = upload(echo_stack, batch_line('{"prompt": "a"}'))
    assert resp.status_code == 200, resp.text
    real, unknown = resp.json()["id"], "file-" + "0" * 24
    for suffix in (":lines", ":lines:upload", ":x"):
        for path in ("/v1/files/{}", "/v1/files/{}/content"):
            answers = [echo_stack.get(path.format(file_id + suffix)) for file_id in (real, unknown)]
            assert [a.status_code for a in answers] == [404, 404], [a.text[:200] for a in answers]
            assert {a.json()["error"]["code"] for a in answers} == {"not_found"}
        resp = echo_stack.http.delete(f"{echo_stack.base}/v1/files/{real}{suffix}", timeout=30)
        assert resp.status_code == 404, resp.text
        resp = echo_stack.post(
            "/v1/batches",
            json={"input_file_id": real + suffix, "endpoint": "/v1/completions", "completion_window": "24h"},
        )
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found", resp.text
    assert echo_stack.get(f"/v1/files/{real}").status_code == 200


def test_invented_methods_and_paths_add_no_metric_series(echo_stack):
    """/metrics needs no key: what a client sends must not pick its label values."""

    def series() -> set[tuple]:
        text = echo_stack.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items())))
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("genq:api_")
        }

    def invent(tag: str) -> None:
        for i in range(25):
            for path in ("/healthz", f"/no/such/{tag}{i}", f"/v1/jobs/{tag}{i}"):
                resp = echo_stack.http.request(f"X{tag.upper()}{i}", echo_stack.base + path, timeout=30)
                assert resp.status_code in (404, 405) and resp.json()["error"], (path, resp.text[:200])
            assert echo_stack.get(f"/no/such/path/{tag}{i}").status_code == 404

    invent("a")
    series()  # the scrape counts itself once
    before = series()
    methods = {dict(labels).get("method") for _, labels in before} - {None}
    assert methods <= {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}, methods
    routes = {dict(labels).get("route") for _, labels in before} - {None}
    assert not {r for r in routes if "such" in r or r.startswith("/v1/jobs/a")}, routes
    invent("b")
    assert series() == before
    assert echo_stack.get("/healthz").status_code == 200
