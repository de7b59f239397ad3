"""A job's error travels typed (tasks/errors.py): code, message and the request field it
concerns, from where the worker raises it, through the job's record and Celery's result
backend, to the API, which names the field without reading it out of the message. A job
refused for its request is one INFO line on the worker, without a traceback."""

from __future__ import annotations

import json
import pickle

import redis
from celery import Celery
from helpers import queued_job, stream, submit

from tasks.errors import JobError, JobFailed, JobRefused
from tasks.records import decode_record, record_error
from tasks.schemas import JobStatus
from tasks.streams import StreamEnd, follow

# The tiny model's vocabulary is 4,096 tokens: the worker refuses a bias on a token beyond it.
BIAS_MESSAGE = "logit_bias: token id 99999 is out of the vocabulary (0 to 4095)"


def test_the_record_keeps_the_field_and_the_views_show_code_and_message(store):
    job = queued_job(store)
    assert store.start(job, "w1", "t1").number == 1
    assert store.start(job, "w2", "t2").number == 2  # the first worker was given up for dead
    error = JobError("invalid_request", BIAS_MESSAGE, "logit_bias")
    # The failure is recorded once, by the attempt that holds the job.
    assert store.finish(job, JobStatus.failed, error, fence=1) == (False, JobStatus.running)
    assert store.finish(job, JobStatus.failed, error, fence=2) == (True, JobStatus.running)
    rec = store.get(job)
    assert record_error(rec) == error
    # A job's view and its stream's end say what they always said: code and message.
    assert decode_record(rec)["error"] == {"code": "invalid_request", "message": BIAS_MESSAGE}
    (end,) = [e for _, e in (item for item in follow(store.r, [job], store.get) if item is not None)]
    assert isinstance(end, StreamEnd) and end.error == {"code": "invalid_request", "message": BIAS_MESSAGE}
    # Errors without a field are stored as before.
    other = queued_job(store)
    assert store.cancel(other)[0]
    assert json.loads(store.get(other)["error"]) == {"code": "cancelled", "message": "cancelled by the client"}


def test_a_failure_crosses_celery_as_plain_typed_args():
    refused = JobFailed.of(JobError("invalid_request", BIAS_MESSAGE, "logit_bias"), partial={"text": "x"})
    timeout = JobFailed.of(JobError("timeout", "the job ran longer than GENQ_JOB_TIMEOUT (1 s)"))
    assert type(refused) is JobRefused and type(timeout) is JobFailed
    assert (refused.code, refused.message, str(refused)) == ("invalid_request", BIAS_MESSAGE, BIAS_MESSAGE)
    # Pickle round-trips the args (the partial result stays in the worker).
    back = pickle.loads(pickle.dumps(refused))
    assert type(back) is JobRefused and back.error == refused.error and back.partial is None
    # What Celery's JSON result backend stores, and reads back.
    backend = Celery(backend="cache+memory://", result_serializer="json").backend
    stored = json.loads(json.dumps(backend.prepare_exception(refused, "json")))
    assert stored == {
        "exc_type": "JobRefused",
        "exc_module": "tasks.errors",
        "exc_message": ["invalid_request", BIAS_MESSAGE, "logit_bias"],
    }
    assert backend.exception_to_python(stored).error == refused.error


def test_a_refused_job_is_one_log_line_and_its_error_names_the_field(hf_stack, redis_url):
    log = hf_stack.logs / f"{hf_stack.name}-worker0.log"
    start = log.stat().st_size
    job_id = submit(hf_stack, prompt="Hello", max_new_tokens=4, logit_bias={"99999": 5})
    rec = hf_stack.get(f"/v1/jobs/{job_id}?wait=60").json()
    assert (rec["status"], rec["attempts"]) == ("failed", 1)
    assert rec["error"] == {"code": "invalid_request", "message": BIAS_MESSAGE}
    (event,) = stream(hf_stack, job_id)
    assert event["event"] == "error"
    assert json.loads(event["data"])["error"]["message"] == BIAS_MESSAGE

    # The result backend holds the typed error as JSON (it held an UnpickleableExceptionWrapper).
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        meta = json.loads(client.get(f"celery-task-meta-{job_id}"))
    finally:
        client.close()
    assert meta["status"] == "FAILURE"
    assert meta["result"] == {
        "exc_type": "JobRefused",
        "exc_module": "tasks.errors",
        "exc_message": ["invalid_request", BIAS_MESSAGE, "logit_bias"],
    }

    # The blocking routes answer 400 naming the field the worker named.
    bad = {"model": hf_stack.name, "max_tokens": 4}
    for path, body, param, message in [
        ("/v1/completions", {"prompt": "Hello", "logit_bias": {"99999": 5}}, "logit_bias", BIAS_MESSAGE),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"99999": 5}},
            "logit_bias",
            BIAS_MESSAGE,
        ),
        (
            "/v1/completions",
            {"prompt": [5000]},
            "prompt",
            "prompt: token id 5000 is out of the vocabulary (0 to 4095)",
        ),
        (
            "/v1/completions",
            {"prompt": "Hello", "structured_outputs": {"regex": "(?=a)b"}},
            "structured_outputs.regex",
            "structured_outputs.regex: Regex parsing error at position 3: Lookahead is not supported yet.",
        ),
    ]:
        resp = hf_stack.post(path, json={**bad, **body})
        assert resp.status_code == 400, resp.text
        assert resp.json() == {
            "error": {"code": "invalid_request", "message": message, "type": "invalid_request_error", "param": param}
        }

    # One INFO line about the refusal, no traceback, nothing unpicklable.
    text = log.read_bytes()[start:].decode()
    refused = [ln for ln in text.splitlines() if job_id in ln and BIAS_MESSAGE in ln]
    assert len(refused) == 1 and " INFO " in refused[0] and "refused" in refused[0], refused
    assert not [ln for ln in text.splitlines() if job_id in ln and (" ERROR " in ln or " WARNING " in ln)]
    assert "Traceback" not in text and "UnpickleableExceptionWrapper" not in text
