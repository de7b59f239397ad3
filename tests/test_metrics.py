"""Prometheus metrics and job log lines, end to end: after a few jobs, what the workers' and the
API's /metrics say adds up to what the jobs did, over two API processes (multiprocess mode) and
two workers on one host (each on its own port, announced in its heartbeat)."""

from __future__ import annotations

import json
import logging

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from scripts import stack as stackmod
from tasks import logs
from tests.helpers import stream, submit

STREAMED, BLOCKING, TOKENS = 4, 3, 6
PROMPT = "a secret prompt that no log may show"


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    text = requests.get(url, timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def _echo_workers(s, body: dict) -> list[dict]:
    """This stack's echo worker among /readyz's other workers."""
    return [w for w in body.get("other_workers", []) if w["model"] == s.name + "-echo"]


@pytest.fixture(scope="module")
def metered(tiny_model, stack_logs):
    """A stack on a Redis of its own: the counts below must not see other modules' workers
    (the session's vLLM worker would answer this stack's /generate_vllm)."""
    from conftest import Stacks

    db = stackmod.PrivateRedis()
    stacks = Stacks(db.url, tiny_model, stack_logs)
    try:
        base = stackmod.free_port()
        s = stacks(GENQ_API_WORKERS="2", GENQ_METRICS_PORT=str(base), GENQ_LOG_FORMAT="json", GENQ_MAX_BATCH_SIZE="8")
        s.metrics_base = base
        s.start_api()
        s.start_worker()
        s.start_worker()
        # A second engine, as with GENQ_ENGINES=hf,echo (ports of its own: the hf ones are
        # checked below).
        echo_port = str(stackmod.free_port())
        s.start_worker(GENQ_ENGINE="echo", GENQ_MODEL_NAME=s.name + "-echo", GENQ_METRICS_PORT=echo_port)

        def ready():
            body = s.get("/readyz").json()
            return len(body.get("workers", [])) == 2 and len(_echo_workers(s, body)) == 1

        stackmod.wait_until(ready, 90, "three workers", s.procs)
        yield s
    finally:
        stacks.stop()
        db.stop()


@pytest.fixture(scope="module")
def outcome(metered):
    """Streamed jobs, a blocking call with several prompts, a refused call; their results."""
    body = {"prompt": PROMPT, "max_new_tokens": TOKENS, "ignore_eos": True}
    ids = [submit(metered, **body) for _ in range(STREAMED)]
    for job_id in ids:
        stream(metered, job_id)
    resp = metered.post(
        "/generate", json={"prompts": [PROMPT] * BLOCKING, "max_new_tokens": TOKENS, "ignore_eos": True}
    )
    assert resp.status_code == 200, resp.text
    # vLLM's finish reasons: a stop string is `stop`, a job the model cannot take an `error`.
    text = metered.get(f"/v1/jobs/{ids[0]}").json()["result"]["text"]
    stop = text.strip()[len(text.strip()) // 2 :][:2]
    resp = metered.post(
        "/generate", json={"prompts": [PROMPT], "max_new_tokens": TOKENS, "ignore_eos": True, "stop": [stop]}
    )
    assert resp.status_code == 200 and stop not in resp.json()["generated_texts"][0][len(PROMPT) :], resp.text
    # A token id outside the vocabulary: only the worker can tell (a failed job, counted there).
    resp = metered.post("/basic_generate", json={"prompt": "word", "max_new_tokens": 4, "logit_bias": {"999999": 1}})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request", resp.text
    # A prompt past the context: refused by the API, never queued.
    resp = metered.post("/basic_generate", json={"prompt": "word " * 600, "max_new_tokens": 4})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "prompt_too_long", resp.text
    refused = metered.post("/generate_vllm", json={"prompts": [PROMPT]})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_worker"
    for _ in range(10):
        assert metered.get("/healthz").status_code == 200
    jobs = [metered.get(f"/v1/jobs/{j}").json() for j in ids]
    assert all(j["status"] == "succeeded" for j in jobs)
    return ids, jobs


def test_workers_announce_their_own_ports(metered):
    ports = [w["metrics_port"] for w in metered.get("/readyz").json()["workers"]]
    first, second = sorted(ports)
    # The second took the next free port (usually base + 1, unless something else holds it).
    assert first == metered.metrics_base and metered.metrics_base < second < metered.metrics_base + 64


def test_readyz_has_every_metrics_port(metered):
    """A second engine's worker serves another model: its port is in /readyz too."""
    body = metered.get("/readyz").json()
    (other,) = _echo_workers(metered, body)
    assert other["engine"] == "echo"
    ports = {w["metrics_port"] for w in body["workers"] + [other]}
    assert len(ports) == 3 and None not in ports
    echo = scrape(f"http://127.0.0.1:{other['metrics_port']}/metrics")
    assert total(echo, "genq:request_success_total", model_name=other["model"], engine="0") == 0
    # Where each engine runs its model: the hf workers' devices in /readyz and their metrics.
    assert {w["device"] for w in body["workers"]} == {"cpu"}
    for w in body["workers"]:
        own = scrape(f"http://127.0.0.1:{w['metrics_port']}/metrics")
        assert total(own, "genq:engine_device_info", model_name=metered.name, device="cpu") == 1


def test_worker_counts_add_up(metered, outcome):
    ports = [w["metrics_port"] for w in metered.get("/readyz").json()["workers"]]
    per = [scrape(f"http://127.0.0.1:{p}/metrics") for p in ports]

    def summed(name, **labels):
        return sum(total(s, name, model_name=metered.name, **labels) for s in per)

    jobs = STREAMED + BLOCKING
    # vLLM's label values: `engine` is the engine's index, every finish reason exists from the start.
    for per_worker in per:
        reasons = {dict(ls)["finished_reason"] for n, ls in per_worker if n == "genq:request_success_total"}
        assert reasons == {"stop", "length", "abort", "error"}
        assert {dict(ls).get("engine") for n, ls in per_worker if n.startswith("genq:")} == {"0"}
    assert summed("genq:request_success_total", finished_reason="length", engine="0") == jobs
    assert summed("genq:request_success_total", finished_reason="stop") == 1
    assert summed("genq:request_success_total", finished_reason="error") == 1
    assert summed("genq:request_success_total", finished_reason="abort") == 0
    assert summed("genq:request_failure_total") == summed("genq:request_failure_total", reason="invalid_request") == 1
    # The stopped job succeeded too, with fewer tokens.
    assert jobs * TOKENS < summed("genq:generation_tokens_total") <= (jobs + 1) * TOKENS
    assert summed("genq:request_generation_tokens_sum") == summed("genq:generation_tokens_total")
    jobs += 1
    for name in (
        "genq:e2e_request_latency_seconds",
        "genq:request_queue_time_seconds",
        "genq:request_inference_time_seconds",
        "genq:request_generation_tokens",
    ):
        assert summed(name + "_count") == jobs + (name == "genq:request_queue_time_seconds"), name
    # Only streamed jobs publish token events: a first token each, then one gap per later token.
    assert summed("genq:time_to_first_token_seconds_count") == STREAMED
    assert summed("genq:inter_token_latency_seconds_count") == STREAMED * (TOKENS - 1)
    assert summed("genq:batch_size_count") >= TOKENS
    assert summed("genq:num_requests_running") == 0
    # The prefix cache's counts, under vLLM's names too (the hf worker; the echo one has none).
    queries = summed("genq:prefix_cache_queries_total")
    assert queries > 0 and summed("vllm:prefix_cache_queries_total") == queries
    assert summed("vllm:prefix_cache_hits_total") == summed("genq:prefix_cache_hits_total")
    # The slowest path a job can take is below its end-to-end latency.
    e2e = summed("genq:e2e_request_latency_seconds_sum")
    assert summed("genq:request_queue_time_seconds_sum") + summed(
        "genq:request_inference_time_seconds_sum"
    ) == pytest.approx(e2e, rel=0.05, abs=0.05)
    assert summed("genq:time_to_first_token_seconds_sum") < e2e


def test_api_counts_add_up_over_its_processes(metered, outcome):
    for _ in range(3):  # whichever of the two processes answers, it reports both
        api = scrape(metered.base + "/metrics")
        assert total(api, "genq:api_requests_total", route="/healthz", status="200") == 10 + 1  # + start_api's
        # Latency by route and method, whichever process served it.
        latency = "genq:api_request_duration_seconds"
        assert total(api, latency + "_count", route="/healthz", method="GET") == 10 + 1
        assert total(api, latency + "_bucket", route="/healthz", le="+Inf") == 10 + 1
        assert total(api, latency + "_count", route="/generate", method="POST") == 2
        assert total(api, "genq:api_requests_total", route="/v1/jobs", method="POST", status="202") == STREAMED
        assert total(api, "genq:api_jobs_submitted_total", model_name=metered.name) == STREAMED + BLOCKING + 2
        assert total(api, "genq:api_jobs_rejected_total", status="503", reason="no_worker") == 1
        assert total(api, "genq:workers_live", model_name=metered.name, engine="hf") == 2
        assert total(api, "genq:workers_live", model_name=metered.name + "-echo", engine="echo") == 1
        assert total(api, "genq:num_requests_waiting", model_name=metered.name) == 0
        assert total(api, "genq:api_open_streams") == 0


def test_one_json_log_line_per_job_event_and_never_the_prompt(metered, outcome):
    ids, _ = outcome
    events: dict[str, list[dict]] = {}
    for path in metered.logs.glob(f"{metered.name}-*.log"):
        text = path.read_text()
        assert PROMPT not in text
        for line in text.splitlines():  # every line, gunicorn's, Celery's and transformers' too
            rec = json.loads(line)
            if rec.get("event", "").startswith("job."):
                events.setdefault(rec["job_id"], []).append(rec)
    for job_id in ids:
        got = {e["event"]: e for e in events[job_id]}
        assert sorted(got) == ["job.finished", "job.queued", "job.running"], events[job_id]
        assert got["job.finished"]["model"] == metered.name
        assert got["job.finished"]["finish_reason"] == "length"
        assert got["job.finished"]["completion_tokens"] == TOKENS
        assert got["job.running"]["queue_s"] >= 0 and got["job.finished"]["total_s"] > 0


def test_text_log_lines(caplog):
    with caplog.at_level(logging.INFO, logger="genq.jobs"):
        logs.job_event("finished", "j-1", model="m", owner=None, queue_s=0.0123456789, completion_tokens=3)
    (rec,) = caplog.records
    line = logging.Formatter(logs.TEXT_FORMAT).format(rec)
    assert line.endswith("genq.jobs: job finished j-1 model=m queue_s=0.0123457 completion_tokens=3")
    as_json = json.loads(logs.JsonFormatter().format(rec))
    assert as_json["event"] == "job.finished" and as_json["job_id"] == "j-1" and "owner" not in as_json


def test_waiting_jobs_are_the_queue_depth_over_every_priority(make_stack):
    s = make_stack()  # an API and no worker: whatever is submitted waits
    s.start_api()
    ids = [submit(s, prompt="waits", priority=p) for p in (-4, 0, 0, 4)]
    try:
        api = scrape(s.base + "/metrics")
        assert total(api, "genq:num_requests_waiting", model_name=s.name) == len(ids)
        assert total(api, "genq:workers_live", model_name=s.name) == 0
    finally:
        for job_id in ids:
            s.post(f"/v1/jobs/{job_id}/cancel")
    assert total(scrape(s.base + "/metrics"), "genq:num_requests_waiting", model_name=s.name) == 0


def test_finish_reasons_are_vllms():
    """EOS and stop strings are vLLM's `stop`; a cancelled, timed-out or taken-over job `abort`."""
    from worker.engines.base import GenerationError
    from worker.metrics import finished_reason

    ok = {r: finished_reason("SUCCESS", {"finish_reason": r}) for r in ("eos", "stop", "length", "timeout")}
    assert ok == {"eos": "stop", "stop": "stop", "length": "length", "timeout": "abort"}
    assert finished_reason("FAILURE", GenerationError("timeout", "x")) == "abort"
    assert finished_reason("FAILURE", GenerationError("prompt_too_long", "x")) == "error"
    assert finished_reason("FAILURE", RuntimeError("boom")) == "error"
    assert finished_reason("IGNORED", None) == "abort"
