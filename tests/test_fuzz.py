"""Nothing a client sends gets a 5xx or a dropped connection: schemathesis fuzzes every
operation of the live API's /openapi.json (requests that fit the schemas and requests that
do not), and a hand list of nasty bodies follows. Each answer is a documented status with a
JSON body (an error's is `{"error": {...}}`), and the API keeps serving."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
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
        raise AssertionError(f"{response.status_code} without a JSON error body: {response.content[:300]!r}")
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
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
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
    ("integer past 2^63", b'{"prompt": "x", "seed": 9223372036854775808}', "application/json", 400,
     "invalid_request"),
    ("integer far past 2^63", b'{"prompt": "x", "max_new_tokens": 1' + b"0" * 100 + b"}", "application/json",
     400, "invalid_request"),
    ("priority past 2^63", b'{"prompt": "x", "priority": -99999999999999999999}', "application/json", 400,
     "invalid_request"),
    ("a 10,000-digit number", b'{"prompt": "x", "seed": 1' + b"0" * 10_000 + b"}", "application/json", 400,
     "invalid_json"),
    ("nested 100,000 deep", nested(100_000), "application/json", 400, "invalid_json"),
    ("nested objects", b'{"prompt": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}", "application/json",
     400, "invalid_json"),
    ("a 1 MiB prompt of one token", b'{"prompt": "' + b"a" * (1 << 20) + b'"}', "application/json", 413,
     "request_entity_too_large"),
    ("a prompt just under the body limit", b'{"prompt": "' + b"a" * ((1 << 20) - 100) + b'"}',
     "application/json", 400, "prompt_too_long"),
    ("NUL in the prompt", b'{"prompt": "a\\u0000b"}', "application/json", 400, "invalid_request"),
    ("NUL in a stop string", b'{"prompt": "ab", "stop": ["\\u0000"]}', "application/json", 400,
     "invalid_request"),
    ("duplicate keys", b'{"prompt": "a", "max_new_tokens": 2, "prompt": "b"}', "application/json", 400,
     "invalid_json"),
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
    ]
    for method, path, headers, status in cases:
        resp = echo_stack.http.request(method, echo_stack.base + path, headers=headers, timeout=60)
        assert resp.status_code == status, (method, path, resp.text[:300])
        assert resp.json()["error"]["message"], path
    assert echo_stack.get(f"/v1/jobs/{job_id}?wait=30").json()["status"] == "succeeded"


def test_garbage_on_the_socket_does_not_stop_the_server(echo_stack):
    """Bytes that are not HTTP at all, and a request cut off mid-body, on raw connections."""
    host, port = urlsplit(echo_stack.base).hostname, urlsplit(echo_stack.base).port
    for payload in (b"\x00\xff\x16\x03\x01garbage\r\n\r\n",
                    b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n{\"prompt\": "):  # fmt: skip
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            s.recv(65536)
    # Still serving, and a real job still runs.
    job_id = submit(echo_stack, prompt="still here", max_new_tokens=2)
    assert echo_stack.get(f"/v1/jobs/{job_id}?wait=30").json()["status"] == "succeeded"
