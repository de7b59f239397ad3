"""OpenAI streams that clients written for vLLM can read, with tokens slower than the relay's
2 s read (tasks/streams.BLOCK_S): the sim engine's 2.3 s step makes every stream wait before
its first token and between tokens, as a long queue or a loaded machine does. vLLM's benchmark
client strips each network read before splitting on blank lines, so one SSE comment (a
keep-alive) on the stream left it reading nothing more of the response; the OpenAI routes send
none, and notice a client that went away by its socket instead."""

from __future__ import annotations

import codecs
import json
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import requests

from scripts import stack as stackmod
from tasks.schemas import JobStatus
from tests.helpers import submit
from worker.engines.sim import sim_tokens

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 3
PROMPTS = [f"slow stream {i} of the sim engine" for i in range(32)]


@pytest.fixture(scope="module")
def slow_stack(make_module_stack):
    s = make_module_stack(GENQ_ENGINE="sim", GENQ_SIM_STEP_MS="2300", GENQ_MAX_BATCH_SIZE="32")
    s.start_api()
    s.start_worker()
    s.wait_ready()
    return s


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def read_as_vllm_bench(resp: requests.Response) -> tuple[bool, str]:
    """What vLLM's benchmark client (vllm/benchmarks/lib/endpoint_request_func.py:
    async_request_openai_completions and its StreamedResponseHandler) makes of a stream: each
    network read stripped and added to a buffer, complete messages split off at blank lines,
    and a rest that starts with "data: " taken as a message once it is whole JSON or [DONE].
    Returns (a chunk with choices came, the texts joined)."""
    decoder, buffer = codecs.getincrementaldecoder("utf-8")(), ""
    got_choice, text = False, ""
    for raw in resp.iter_content(chunk_size=None):  # each chunk as it arrives
        raw = raw.strip()
        if not raw:
            continue
        buffer += decoder.decode(raw)
        messages = []
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            if message.strip():
                messages.append(message.strip())
        if buffer.startswith("data: "):
            rest = buffer.removeprefix("data: ").strip()
            if rest == "[DONE]" or (rest and _whole_json(rest)):
                messages.append(buffer.strip())
                buffer = ""
        for message in messages:
            data = message.removeprefix("data: ")
            if message.startswith(":") or data == "[DONE]":
                continue
            if choices := json.loads(data).get("choices"):
                got_choice = True
                text += choices[0].get("text") or ""
    return got_choice, text


def test_a_client_parsing_as_vllm_bench_reads_every_slow_stream(slow_stack):
    def one(prompt: str) -> tuple[bool, str]:
        body = {
            "model": slow_stack.name,
            "prompt": prompt,
            "max_tokens": TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with slow_stack.http.post(f"{slow_stack.base}/v1/completions", json=body, stream=True, timeout=120) as resp:
            assert resp.status_code == 200, resp.text
            return read_as_vllm_bench(resp)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    assert results == [(True, "".join(sim_tokens(p, TOKENS))) for p in PROMPTS]


def test_vllm_bench_client_completes_every_slow_stream(slow_stack):
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.skip("no vLLM environment (.venv-vllm)")
    argv = [
        str(python),
        str(ROOT / "tests" / "vllm_bench_client.py"),
        f"{slow_stack.base}/v1/completions",
        slow_stack.name,
        str(TOKENS),
        "32",
    ]
    out = subprocess.run(argv, input=json.dumps(PROMPTS), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    results = json.loads(line[len("RESULT ") :])
    assert [(r["success"], r["text"]) for r in results] == [(True, "".join(sim_tokens(p, TOKENS))) for p in PROMPTS], [
        r["error"][-300:] for r in results if not r["success"]
    ]


def test_a_client_gone_while_its_job_waits_has_it_cancelled(make_stack, redis_url):
    """No keep-alive write finds the closed connection: the relay looks at the socket. The one
    worker is busy with a long job, so the stream's job waits and no token is ever written."""
    s = make_stack(GENQ_ENGINE="sim", GENQ_SIM_STEP_MS="300", GENQ_MAX_BATCH_SIZE="1")
    r = redis.Redis.from_url(redis_url, decode_responses=True)

    def jobs() -> dict[str, str]:
        out = {}
        for key in r.scan_iter("genq:job:*", count=1000, _type="hash"):  # not a recovery lock or mark
            model, status = r.hmget(key, ["model", "status"])
            if model == s.name:
                out[key.rsplit(":", 1)[-1]] = status
        return out

    try:
        s.start_api()
        s.start_worker()
        s.wait_ready()
        blocker = submit(s, prompt="busy", max_new_tokens=1000)  # 300 s of steps
        body = json.dumps({"model": s.name, "prompt": "waits", "max_tokens": 4, "stream": True}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
            sock.sendall(head + body)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")  # the headers at once, no event

        def cancelled() -> bool:
            others = {k: v for k, v in jobs().items() if k != blocker}
            return list(others.values()) == [JobStatus.cancelled.value]

        stackmod.wait_until(cancelled, 30, "the departed client's job to be cancelled", s.procs)
        assert jobs()[blocker] == JobStatus.running.value  # it was waiting all along
        s.post(f"/v1/jobs/{blocker}/cancel")
    finally:
        r.close()
