"""Token streaming end to end: worker -> Redis Stream -> SSE, with resume, replay, the teaching
format, failures, and a job that waits for its worker."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import requests
from helpers import joined, sse_events, stream, submit


def test_stream_gives_every_token_then_done(hf_stack):
    job_id = submit(hf_stack, prompt="Hello, my name is", max_new_tokens=20, ignore_eos=True)
    events = stream(hf_stack, job_id)
    assert [e["event"] for e in events] == ["token"] * 20 + ["done"]
    assert [int(e["id"]) for e in events] == list(range(21))
    done = json.loads(events[-1]["data"])
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 20
    result = hf_stack.get(f"/v1/jobs/{job_id}?wait=30").json()["result"]
    assert joined(events) == result["text"]
    # A finished job replays its tokens.
    assert stream(hf_stack, job_id) == events


def test_resume_with_last_event_id_has_no_gap_and_no_duplicate(hf_stack):
    job_id = submit(hf_stack, prompt="The capital of France is", max_new_tokens=60, stop="never")
    with hf_stack.http.get(f"{hf_stack.base}/v1/jobs/{job_id}/stream", stream=True, timeout=60) as resp:
        first = sse_events(resp, limit=7)  # then the client drops the connection
    last = first[-1]["id"]
    rest = stream(hf_stack, job_id, **{"Last-Event-ID": last})
    ids = [int(e["id"]) for e in first + rest]
    assert ids == list(range(len(ids)))
    result = hf_stack.get(f"/v1/jobs/{job_id}?wait=30").json()["result"]
    assert joined(first + rest) == result["text"]


def test_teaching_generate_stream_concurrent(hf_stack, reference):
    prompts = ["Hello, my name is", "def fibonacci(n):"]

    def run(prompt):
        resp = hf_stack.http.post(
            f"{hf_stack.base}/generate_stream", json={"prompt": prompt, "max_new_tokens": 24}, stream=True, timeout=60
        )
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines(decode_unicode=True) if ln.startswith("data: ")]
        return [json.loads(ln[len("data: ") :]) for ln in lines]

    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(run, prompts))
    seq_ids = [{m["sequence_id"] for m in out} for out in outs]
    assert all(len(s) == 1 for s in seq_ids) and seq_ids[0] != seq_ids[1]
    texts = ["".join(m["token"] for m in out) for out in outs]
    assert texts == [reference(p, 24) for p in prompts]
    assert texts[0] != texts[1]
    assert all(set(m) == {"token", "sequence_id"} for out in outs for m in out)


def test_failed_job_streams_an_error(hf_stack):
    # A prompt past the context is refused at submit now; a bias on a token out of the
    # vocabulary passes the API and fails on the worker.
    job_id = submit(hf_stack, prompt="Hello", max_new_tokens=4, logit_bias={"99999": 5})
    events = stream(hf_stack, job_id)
    assert [e["event"] for e in events] == ["error"]
    assert json.loads(events[0]["data"])["error"]["code"] == "invalid_request"


def test_stream_of_unknown_job_is_404(hf_stack):
    resp = hf_stack.get("/v1/jobs/nope/stream")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    job_id = submit(hf_stack, prompt="Hello", max_new_tokens=2)
    resp = hf_stack.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": "x"})
    assert resp.status_code == 400


def test_a_disconnecting_client_does_not_disturb_the_job(hf_stack, reference):
    job_id = submit(hf_stack, prompt="Once upon a time", max_new_tokens=150, ignore_eos=True)
    with hf_stack.http.get(f"{hf_stack.base}/v1/jobs/{job_id}/stream", stream=True, timeout=60) as resp:
        sse_events(resp, limit=2)
    other = hf_stack.post("/basic_generate", json={"prompt": "Hello, my name is", "max_new_tokens": 10})
    assert other.json()["generated_text"] == "Hello, my name is" + reference("Hello, my name is", 10)
    job = hf_stack.get(f"/v1/jobs/{job_id}?wait=60").json()
    assert job["status"] == "succeeded" and job["result"]["completion_tokens"] == 150


def test_queued_job_streams_once_a_worker_starts_and_cancelled_one_ends(make_stack, reference):
    s = make_stack()
    s.start_api()
    job_id = submit(s, prompt="Hello, my name is", max_new_tokens=12)
    doomed = submit(s, prompt="Hello", max_new_tokens=12)
    out: dict[str, list] = {}

    def listen(jid):
        out[jid] = stream(s, jid)

    threads = [threading.Thread(target=listen, args=(j,)) for j in (job_id, doomed)]
    for t in threads:
        t.start()
    assert s.post(f"/v1/jobs/{doomed}/cancel").json()["status"] == "cancelled"
    threads[1].join(30)
    assert [e["event"] for e in out[doomed]] == ["error"]
    assert json.loads(out[doomed][0]["data"])["error"]["code"] == "cancelled"

    s.start_worker()
    threads[0].join(90)
    assert not threads[0].is_alive()
    assert out[job_id][-1]["event"] == "done"
    assert joined(out[job_id]) == reference("Hello, my name is", 12)


def test_two_hundred_concurrent_streams(make_stack):
    """The API's default server configuration holds 200 open streams at once."""
    s = make_stack(GENQ_API_WORKERS="2", GENQ_MAX_BATCH_SIZE="64")
    s.start_api()
    ids = [submit(s, prompt=f"stream {i}", max_new_tokens=8, ignore_eos=True) for i in range(200)]
    opened = threading.Barrier(201, timeout=60)
    results: dict[int, list] = {}

    def listen(i: int):
        with requests.get(f"{s.base}/v1/jobs/{ids[i]}/stream", stream=True, timeout=120) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines(decode_unicode=True)
            assert next(lines) == ": keep-alive"  # open, and waiting: no worker yet
            opened.wait()
            results[i] = [ln for ln in lines if ln.startswith("event: ")]

    with ThreadPoolExecutor(200) as pool:
        futures = [pool.submit(listen, i) for i in range(200)]
        opened.wait()  # all 200 streams are open at this moment
        s.start_worker()
        for f in futures:
            f.result(timeout=120)
    assert len(results) == 200
    assert all(r == ["event: token"] * 8 + ["event: done"] for r in results.values())
