"""The sim engine (worker/engines/sim.py: no model, each decode step a sleep of a + b x batch
ms) through a real stack: the API under gunicorn, Redis, a Celery worker process. Its jobs end
with the deterministic tokens it promises, streamed like any engine's, and can be cancelled."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pydantic
import pytest

from tasks.config import Settings
from tests.helpers import joined, sse_events, stream, submit
from worker.engines.sim import sim_tokens, step_ms


@pytest.fixture(scope="module")
def sim_stack(make_module_stack):
    s = make_module_stack(GENQ_ENGINE="sim", GENQ_SIM_STEP_MS="2+0.5", GENQ_MAX_BATCH_SIZE="8")
    s.start_api()
    s.start_worker()
    s.wait_ready()
    return s


def test_step_setting():
    assert step_ms("5+0.5") == (5.0, 0.5) and step_ms(" 3 ") == (3.0, 0.0)
    assert Settings(sim_step_ms="12.5 + 1").sim_step_ms == "12.5 + 1"
    with pytest.raises(pydantic.ValidationError):
        Settings(sim_step_ms="fast")


def test_sim_jobs_end_to_end(sim_stack):
    prompts = [f"job {i} of the sim engine" for i in range(6)]

    def run(p: str) -> dict:
        job_id = submit(sim_stack, prompt=p, max_new_tokens=9)
        return sim_stack.get(f"/v1/jobs/{job_id}?wait=60").json()

    with ThreadPoolExecutor(6) as pool:
        jobs = list(pool.map(run, prompts))
    for i, (p, job) in enumerate(zip(prompts, jobs)):
        assert job["status"] == "succeeded", job
        assert job["result"]["text"] == "".join(sim_tokens(p, 9)) == f" {p} job {i} of"
        assert job["result"]["completion_tokens"] == 9 and job["result"]["finish_reason"] == "length"
        assert 1 <= job["result"]["batch_size"] <= 8


def test_sim_streams_its_tokens(sim_stack):
    job_id = submit(sim_stack, prompt="alpha beta", max_new_tokens=5)
    events = stream(sim_stack, job_id)
    tokens = [json.loads(e["data"])["text"] for e in events if e.get("event") == "token"]
    assert tokens == [" alpha", " beta", " alpha", " beta", " alpha"]
    assert joined(events) == sim_stack.get(f"/v1/jobs/{job_id}?wait=30").json()["result"]["text"]


def test_sim_job_can_be_cancelled(sim_stack):
    job_id = submit(sim_stack, prompt="a long one", max_new_tokens=1000)  # >= 2.5 s of steps
    with sim_stack.http.get(f"{sim_stack.base}/v1/jobs/{job_id}/stream", stream=True, timeout=60) as resp:
        assert sse_events(resp, limit=1)[0]["event"] == "token"  # it runs
    assert sim_stack.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
    job = sim_stack.get(f"/v1/jobs/{job_id}?wait=30").json()
    assert job["status"] == "cancelled", job
