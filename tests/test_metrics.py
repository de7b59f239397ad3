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


@pytest.fixture(scope="module")
def metered(make_module_stack):
    base = stackmod.free_port()
    s = make_module_stack(GENQ_API_WORKERS="2", GENQ_METRICS_PORT=str(base), GENQ_LOG_FORMAT="json",
                   GENQ_MAX_BATCH_SIZE="8")
    s.metrics_base = base
    s.start_api()
    s.start_worker()
    s.start_worker()
    stackmod.wait_until(lambda: len(s.get("/readyz").json().get("workers", [])) == 2, 90, "two workers", s.procs)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def outcome(metered):
    """Streamed jobs, a blocking call with several prompts, a refused call; their results."""
    body = {"prompt": PROMPT, "max_new_tokens": TOKENS, "ignore_eos": True}
    ids = [submit(metered, **body) for _ in range(STREAMED)]
    for job_id in ids:
        stream(metered, job_id)
    resp = metered.post("/generate", json={"prompts": [PROMPT] * BLOCKING, "max_new_tokens": TOKENS,
                                           "ignore_eos": True})
    assert resp.status_code == 200, resp.text
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


def test_worker_counts_add_up(metered, outcome):
    ports = [w["metrics_port"] for w in metered.get("/readyz").json()["workers"]]
    per = [scrape(f"http://127.0.0.1:{p}/metrics") for p in ports]

    def summed(name, **labels):
        return sum(total(s, name, model_name=metered.name, **labels) for s in per)

    jobs = STREAMED + BLOCKING
    assert summed("genq:request_success_total") == jobs
    assert summed("genq:request_success_total", finished_reason="length", engine="hf") == jobs
    assert summed("genq:generation_tokens_total") == jobs * TOKENS
    for name in ("genq:e2e_request_latency_seconds", "genq:request_queue_time_seconds",
                 "genq:request_inference_time_seconds", "genq:request_generation_tokens"):
        assert summed(name + "_count") == jobs, name
    assert summed("genq:request_generation_tokens_sum") == jobs * TOKENS
    # Only streamed jobs publish token events: a first token each, then one gap per later token.
    assert summed("genq:time_to_first_token_seconds_count") == STREAMED
    assert summed("genq:inter_token_latency_seconds_count") == STREAMED * (TOKENS - 1)
    assert summed("genq:batch_size_count") >= TOKENS
    assert summed("genq:num_requests_running") == 0
    assert summed("genq:request_failure_total") == 0
    # The slowest path a job can take is below its end-to-end latency.
    e2e = summed("genq:e2e_request_latency_seconds_sum")
    assert summed("genq:request_queue_time_seconds_sum") + summed("genq:request_inference_time_seconds_sum") \
        == pytest.approx(e2e, rel=0.05, abs=0.05)
    assert summed("genq:time_to_first_token_seconds_sum") < e2e


def test_api_counts_add_up_over_its_processes(metered, outcome):
    for _ in range(3):  # whichever of the two processes answers, it reports both
        api = scrape(metered.base + "/metrics")
        assert total(api, "genq:api_requests_total", route="/healthz", status="200") == 10 + 1  # + start_api's
        assert total(api, "genq:api_requests_total", route="/v1/jobs", method="POST", status="202") == STREAMED
        assert total(api, "genq:api_jobs_submitted_total", model_name=metered.name) == STREAMED + BLOCKING
        assert total(api, "genq:api_jobs_rejected_total", status="503", reason="no_worker") == 1
        assert total(api, "genq:workers_live", model_name=metered.name, engine="hf") == 2
        assert total(api, "genq:num_requests_waiting", model_name=metered.name) == 0
        assert total(api, "genq:api_open_streams") == 0


def test_one_json_log_line_per_job_event_and_never_the_prompt(metered, outcome):
    ids, _ = outcome
    events: dict[str, list[dict]] = {}
    for path in metered.logs.glob(f"{metered.name}-*.log"):
        text = path.read_text()
        assert PROMPT not in text
        for line in text.splitlines():
            if line.startswith("{"):
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
