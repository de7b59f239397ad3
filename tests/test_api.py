"""The API's own behaviour, in process against a real Redis, with no worker serving its model:
validation, error format, 404s, backpressure, cancellation of queued jobs, readiness."""

from __future__ import annotations

import uuid

import pytest

from tasks.config import Settings, queue_for
from tasks.schemas import JobStatus, SamplingParams
from webapp import create_app
from webapp.completions import EXTENSION, Submitted
from webapp.errors import APIError
from webapp.protocol.jobs import Jobs


@pytest.fixture
def client(redis_url):
    settings = Settings(
        redis_url=redis_url,
        model=f"nobody-{uuid.uuid4().hex[:8]}",
        max_new_tokens_limit=256,
        max_prompt_chars=1000,
        max_body_bytes=4096,
        max_queue_depth=3,
    )
    app = create_app(settings)
    app.testing = True
    with app.test_client() as c:
        yield c
    # Nobody consumes this model's queue: drop what the test left in it.
    app.extensions["genq"].r.delete(queue_for(settings.served_model))


def assert_error(resp, status: int, code: str | None = None):
    assert resp.status_code == status, resp.get_data(as_text=True)
    assert resp.is_json
    err = resp.get_json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    if code:
        assert err["code"] == code
    return err


def test_healthz(client):
    assert client.get("/healthz").get_json() == {"status": "ok"}


def test_readyz_without_worker_is_503_with_reason(client):
    err = assert_error(client.get("/readyz"), 503, "not_ready")
    assert "no live worker" in err["message"]


def test_submit_returns_202_with_location_and_job_is_queued(client):
    resp = client.post("/v1/jobs", json={"prompt": "Hello", "max_new_tokens": 4})
    assert resp.status_code == 202
    body = resp.get_json()
    assert body["status"] == "queued"
    assert resp.headers["Location"] == f"/v1/jobs/{body['id']}"
    job = client.get(resp.headers["Location"]).get_json()
    assert job["id"] == body["id"] and job["status"] == "queued"
    assert job["timings"]["created"] > 0 and job["timings"]["started"] is None
    assert "result" not in job


def test_wait_on_a_queued_job_returns_it_still_queued(client):
    job_id = client.post("/v1/jobs", json={"prompt": "Hello"}).get_json()["id"]
    job = client.get(f"/v1/jobs/{job_id}?wait=0.3").get_json()
    assert job["status"] == "queued"


def test_unknown_job_is_404(client):
    assert_error(client.get(f"/v1/jobs/{uuid.uuid4()}"), 404, "not_found")
    assert_error(client.post(f"/v1/jobs/{uuid.uuid4()}/cancel"), 404, "not_found")


@pytest.mark.parametrize("wait", ["abc", "-1", "100000", "nan"])
def test_bad_wait_is_400(client, wait):
    job_id = client.post("/v1/jobs", json={"prompt": "Hello"}).get_json()["id"]
    assert_error(client.get(f"/v1/jobs/{job_id}?wait={wait}"), 400, "invalid_request")


BAD_JOB_BODIES = [
    ("{bad json", "invalid_json"),
    ("", "invalid_request"),
    ("[1, 2]", "invalid_request"),
    ("{}", "invalid_request"),
    ('{"prompt": ""}', "invalid_request"),
    ('{"prompt": 5}', "invalid_request"),
    ('{"prompt": null}', "invalid_request"),
    ('{"prompt": "x", "unknown": 1}', "invalid_request"),
    ('{"prompt": "x", "max_new_tokens": 0}', "invalid_request"),
    ('{"prompt": "x", "max_new_tokens": 257}', "invalid_request"),
    ('{"prompt": "x", "max_new_tokens": "5"}', "invalid_request"),
    ('{"prompt": "x", "max_new_tokens": 1.5}', "invalid_request"),
    ('{"prompt": "x", "temperature": -1}', "invalid_request"),
    ('{"prompt": "x", "temperature": "hot"}', "invalid_request"),
    ('{"prompt": "x", "top_p": 0}', "invalid_request"),
    ('{"prompt": "x", "top_k": -1}', "invalid_request"),
    ('{"prompt": "x", "seed": -9223372036854775809}', "invalid_request"),
    ('{"prompt": "x", "stop": [""]}', "invalid_request"),
    ('{"prompt": "x", "stop": 3}', "invalid_request"),
    ('{"prompt": "x", "model": ""}', "invalid_request"),
    ('{"prompt": "' + "y" * 1001 + '"}', "prompt_too_long"),
]


@pytest.mark.parametrize("body,code", BAD_JOB_BODIES)
def test_bad_job_bodies_are_4xx_json(client, body, code):
    resp = client.post("/v1/jobs", data=body, content_type="application/json")
    assert_error(resp, 400, code)
    # The server keeps serving after every bad request.
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    "path,body",
    [
        ("/basic_generate", "{"),
        ("/basic_generate", '{"prompt": ""}'),
        ("/basic_generate", '{"prompts": ["a"]}'),
        ("/basic_generate", '{"prompt": ["a"]}'),
        ("/generate", '{"prompts": "a"}'),
        ("/generate", '{"prompts": [1]}'),
        ("/generate", '{"prompts": [""]}'),
        ("/generate", '{"prompt": "a"}'),
        ("/generate", '{"prompts": ["a"], "max_new_tokens": 100000}'),
    ],
)
def test_bad_teaching_bodies_are_400(client, path, body):
    assert_error(client.post(path, data=body, content_type="application/json"), 400)


def test_body_too_large_is_413_json(client):
    resp = client.post("/v1/jobs", data='{"prompt": "' + "z" * 5000 + '"}', content_type="application/json")
    assert_error(resp, 413)


def test_wrong_method_and_unknown_path_are_json(client):
    assert_error(client.get("/v1/jobs"), 405)
    assert_error(client.get("/nowhere"), 404)


def test_blocking_call_without_worker_is_503_at_once(client):
    err = assert_error(client.post("/basic_generate", json={"prompt": "Hello"}), 503, "no_worker")
    assert "no live worker" in err["message"]
    assert_error(client.post("/generate", json={"prompts": ["a", "b"]}), 503, "no_worker")
    err = assert_error(client.post("/generate_vllm", json={"prompts": ["a"]}), 503, "no_worker")
    assert "vllm" in err["message"]


def test_empty_prompt_list_gives_empty_list(client):
    resp = client.post("/generate", json={"prompts": []})
    assert resp.status_code == 200 and resp.get_json() == {"generated_texts": []}


def test_unserved_model_is_404(client):
    resp = client.post("/v1/jobs", json={"prompt": "Hello", "model": "not-a-model"})
    assert_error(resp, 404, "model_not_found")


def test_full_queue_answers_429_with_retry_after(client):
    for _ in range(3):
        assert client.post("/v1/jobs", json={"prompt": "Hello"}).status_code == 202
    resp = client.post("/v1/jobs", json={"prompt": "Hello"})
    assert_error(resp, 429, "queue_full")
    assert int(resp.headers["Retry-After"]) >= 1


def test_cancel_a_queued_job(client):
    job_id = client.post("/v1/jobs", json={"prompt": "Hello"}).get_json()["id"]
    resp = client.post(f"/v1/jobs/{job_id}/cancel")
    assert resp.status_code == 200 and resp.get_json()["status"] == "cancelled"
    assert client.get(f"/v1/jobs/{job_id}").get_json()["status"] == "cancelled"
    assert_error(client.post(f"/v1/jobs/{job_id}/cancel"), 409, "already_final")


# -- vLLM's sampling parameters: bounds, and what is accepted only at its neutral value -------

BAD_PARAMS = [
    ({"n": 17}, "n", "invalid_request"),
    ({"n": 0}, "n", "invalid_request"),
    ({"logprobs": 6}, "logprobs", "invalid_request"),
    ({"logprobs": -1}, "logprobs", "invalid_request"),
    ({"logprobs": 1, "echo": True}, "logprobs", "unsupported_parameter"),
    ({"best_of": 2, "n": 3}, "best_of", "invalid_request"),
    ({"best_of": 3, "stream": True}, "best_of", "invalid_request"),
    ({"logit_bias": {"x": 5}}, "logit_bias", "invalid_request"),
    ({"suffix": "end"}, "suffix", "unsupported_parameter"),
    ({"use_beam_search": True}, "use_beam_search", "unsupported_parameter"),
    ({"min_p": 1.1}, "min_p", "invalid_request"),
    ({"seed": 2**63}, "seed", "invalid_request"),
    ({"prompt_embeds": "eA=="}, "prompt_embeds", "unsupported_parameter"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "invalid_request"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_request"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "invalid_request"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "unsupported_parameter"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs", "invalid_request"),
    ({"prompt": [10, -1]}, "prompt", "invalid_request"),
    ({"prompt": [[10], []]}, "prompt", "invalid_request"),
    ({"prompt": [10], "echo": True}, "echo", "unsupported_parameter"),
    ({"repetition_penalty": 0}, "repetition_penalty", "invalid_request"),
    ({"presence_penalty": 2.5}, "presence_penalty", "invalid_request"),
    ({"frequency_penalty": -3}, "frequency_penalty", "invalid_request"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "invalid_request"),
    ({"min_tokens": -1}, "min_tokens", "invalid_request"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "invalid_request"),
    ({"stop_token_ids": list(range(17))}, "stop_token_ids", "invalid_request"),
    ({"no_such_parameter": 1}, "no_such_parameter", "invalid_request"),
]


@pytest.mark.parametrize("params,param,code", BAD_PARAMS)
def test_completions_refuse_unsupported_values_naming_the_parameter(client, params, param, code):
    err = assert_error(client.post("/v1/completions", json={"prompt": "Hi", **params}), 400, code)
    assert err["param"] == param and param in err["message"]


def test_completions_accept_neutral_and_supported_values(client):
    """Everything here passes validation; without a worker the call then answers 503."""
    neutral = {
        "n": 1,
        "best_of": 1,
        "logprobs": None,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_tokens": 0,
        "stop_token_ids": [],
        "logit_bias": {},
        "top_k": -1,
        "min_p": 0,
        "use_beam_search": False,
        "length_penalty": 1.0,
        "skip_special_tokens": True,
        "response_format": {"type": "text"},
        "request_id": "abc",
        "seed": None,
        "echo": None,
    }
    supported = {
        "n": 3,
        "best_of": 3,
        "logprobs": 5,
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "repetition_penalty": 1.3,
        "min_tokens": 4,
        "stop_token_ids": [2, 50],
        "max_tokens": 8,
    }
    for body in (neutral, supported):
        assert_error(client.post("/v1/completions", json={"prompt": "Hi", **body}), 503, "no_worker")
    # n jobs per prompt count against the queue: 2 prompts x 2 > GENQ_MAX_QUEUE_DEPTH (3).
    assert_error(client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2}), 413, "too_many_prompts")


@pytest.mark.parametrize(
    "params",
    [
        {"logprobs": 6},
        {"repetition_penalty": 0},
        {"presence_penalty": "0.5"},
        {"min_tokens": 5, "max_new_tokens": 2},
        {"stop_token_ids": [2**31]},
        {"frequency_penalty": 2.01},
        {"stop_token_ids": ["2"]},
    ],
)
def test_bad_sampling_parameters_of_jobs(client, params):
    param = next(k for k in params if k != "max_new_tokens")
    err = assert_error(client.post("/v1/jobs", json={"prompt": "x", **params}), 400, "invalid_request")
    assert err["param"].startswith(param)


def test_jobs_take_the_sampling_parameters(client):
    params = {
        "repetition_penalty": 1.2,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "min_tokens": 2,
        "stop_token_ids": [5],
        "logprobs": 0,
        "max_new_tokens": 4,
    }
    resp = client.post("/v1/jobs", json={"prompt": "x", **params})
    assert resp.status_code == 202, resp.get_data(as_text=True)


def test_limit_errors_name_the_requests_own_field(client):
    """A request past max_tokens' limit hears of the field it sent: OpenAI's `max_tokens` (message
    and param, whichever of max_tokens and max_completion_tokens chat sent), the job API's
    `max_new_tokens` (in the message: its body's fields are the job's)."""
    for path, body in (
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 257}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 257}),
    ):
        err = assert_error(client.post(path, json=body), 400, "invalid_request")
        assert (err["message"], err["param"]) == ("max_tokens: must be at most 256", "max_tokens")
    err = assert_error(client.post("/v1/jobs", json={"prompt": "Hi", "max_new_tokens": 257}), 400, "invalid_request")
    assert (err["message"], err["param"]) == ("max_new_tokens: must be at most 256", None)


def test_a_failed_jobs_error_names_the_requests_own_field(client):
    """A worker words its errors in the job's terms (`max_new_tokens=`); the answer to an OpenAI
    request says `max_tokens`, as the request did, and a job's error stays as the worker wrote it."""
    completions = client.application.extensions[EXTENSION]
    service = completions.jobs
    said = "the prompt has 70 tokens; with max_new_tokens=10 that exceeds the model's context of 64 tokens"
    for field, expected in (("max_tokens", said.replace("max_new_tokens", "max_tokens")), (None, said)):
        jobs = Jobs(["Hello"], SamplingParams(max_new_tokens=10), max_tokens_field=field)
        (job_id,) = service.enqueue(jobs.prompts, jobs.params, service.settings.served_model, stream=False)
        error = {"code": "prompt_too_long", "message": said}
        assert service.store.transition(job_id, JobStatus.failed, (JobStatus.queued,), error=error)[0]
        with pytest.raises(APIError) as exc:
            completions.results(Submitted(jobs, [job_id], service.settings.served_model, 0))
        assert (exc.value.status, exc.value.code, exc.value.message) == (400, "prompt_too_long", expected)


COERCIONS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 1.0}, "n"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "4"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": "7"}, "seed"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {"tokens": ["1", "2"]}, "tokens.0"),
]


@pytest.mark.parametrize("path,body,field", COERCIONS, ids=[f"{p} {f}" for p, _, f in COERCIONS])
def test_openai_routes_take_no_coerced_types(client, path, body, field):
    """As /v1/jobs, and as vLLM's and OpenAI's servers: "4" is not a number, "yes" not a
    boolean; the 400 names the field."""
    err = assert_error(client.post(path, json=body), 400, "invalid_request")
    # /tokenize's body is one of two shapes: its error names the field within the shape.
    assert err["param"] is not None and field in (err["param"] if path != "/tokenize" else err["message"]), err
