"""GET /openapi.json: a valid OpenAPI 3.1 document of every route the app has, whose schemas
accept the requests the API accepts and describe the responses it sends."""

from __future__ import annotations

import json
import re
import time
import uuid

import jsonschema
import pytest
from flask import Blueprint
from openapi_spec_validator import validate

from tasks.config import Settings
from webapp import create_app


def app_for(**kw):
    app = create_app(Settings(model=f"nobody-{uuid.uuid4().hex[:8]}", **kw))
    app.testing = True
    return app


def operations(spec: dict) -> set[tuple[str, str]]:
    return {(path, method) for path, ops in spec["paths"].items() for method in ops}


def routes(app) -> set[tuple[str, str]]:
    """Every (path, method) the app serves, from its URL map, in OpenAPI's path syntax."""
    found = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[^:<>]*:)?([^<>]+)>", r"{\1}", rule.rule)
        found |= {(path, m.lower()) for m in rule.methods - {"HEAD", "OPTIONS"}}
    return found


def check(spec: dict, ref_or_schema: dict, instance) -> None:
    """Validate `instance` against a schema of the document (its $refs resolved in it)."""
    jsonschema.Draft202012Validator({**ref_or_schema, "components": spec["components"]}).validate(instance)


def body_schema(spec: dict, path: str) -> dict:
    return spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def response_schema(spec: dict, path: str, method: str, status: int) -> dict:
    return spec["paths"][path][method]["responses"][str(status)]["content"]["application/json"]["schema"]


def test_document_is_valid_openapi_31_and_lists_every_route(redis_url):
    app = app_for(redis_url=redis_url)
    spec = app.test_client().get("/openapi.json").get_json()
    validate(spec)
    assert spec["openapi"].startswith("3.1")
    assert operations(spec) == routes(app)
    # The job routes are documented from their models, not left generic.
    job = spec["paths"]["/v1/jobs"]["post"]
    assert body_schema(spec, "/v1/jobs") == {"$ref": "#/components/schemas/JobRequest"}
    assert set(job["responses"]) >= {"202", "400", "413", "415", "429", "503"}
    props = spec["components"]["schemas"]["JobRequest"]["properties"]
    assert {"prompt", "model", "max_new_tokens", "priority", "timeout_s", "deadline"} <= set(props)
    assert "text/event-stream" in spec["paths"]["/v1/jobs/{job_id}/stream"]["get"]["responses"]["200"]["content"]
    # Without keys nothing asks for one.
    assert "securitySchemes" not in spec["components"] and "401" not in job["responses"]


def test_a_route_registered_later_is_in_the_document(redis_url):
    """The document is built from the URL map when first asked for, so a blueprint added in
    create_app (or after it) is in it without anyone writing it down."""
    app = app_for(redis_url=redis_url)
    bp = Blueprint("later", __name__)

    @bp.get("/v1/later/<int:n>")
    def later(n: int):
        """A route nobody documented."""
        return {"n": n}

    app.register_blueprint(bp)
    spec = app.test_client().get("/openapi.json").get_json()
    validate(spec)
    op = spec["paths"]["/v1/later/{n}"]["get"]
    assert op["summary"] == "A route nobody documented."
    assert op["parameters"][0] == {"name": "n", "in": "path", "required": True, "schema": {"type": "integer"}}
    assert "default" in op["responses"]
    assert operations(spec) == routes(app)


def test_with_keys_the_document_is_open_and_names_the_bearer_key(idle_stack):
    resp = idle_stack.get("/openapi.json")  # no key
    assert resp.status_code == 200, resp.text
    spec = resp.json()
    validate(spec)
    assert spec["components"]["securitySchemes"]["apiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "an API key of GENQ_API_KEYS(_FILE)",
    }
    for path, method in operations(spec):
        op = spec["paths"][path][method]
        if path in ("/healthz", "/health", "/readyz", "/metrics", "/openapi.json"):
            assert op["security"] == [] and "401" not in op["responses"], path
        else:
            assert op["security"] == [{"apiKey": []}] and "401" in op["responses"], path
            # ... and the API does answer 401 there without a key.
            url = re.sub(r"{[^}]+}", str(uuid.uuid4()), path)
            got = idle_stack.http.request(method, idle_stack.base + url, timeout=30)
            assert got.status_code == 401, (path, got.text)
            check(spec, response_schema(spec, path, method, 401), got.json())


# Bodies the API accepts, by route: each must fit the document's request schema.
GOOD_BODIES = {
    "/v1/jobs": [
        {"prompt": "Hello"},
        {
            "prompt": "Hello",
            "max_new_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 3,
            "stop": ["\n"],
            "ignore_eos": True,
            "priority": -4,
            "timeout_s": 60,
        },
        # A month ahead: this dict is built at collection, maybe half an hour before the test runs.
        {"prompt": "Hello", "stop": "\n", "deadline": time.time() + 30 * 86_400},
    ],
    "/basic_generate": [{"prompt": "Hello", "max_new_tokens": 3}],
    "/generate": [{"prompts": ["Hello", "Bye"], "max_new_tokens": 3}],
    "/v1/completions": [
        {"prompt": "Hello", "max_tokens": 3},
        {"prompt": ["Hello", "Bye"], "max_tokens": 3, "temperature": 0, "stop": "x", "priority": 2},
    ],
}


def test_schemas_fit_real_requests_and_responses(echo_stack):
    """Requests the live API accepts fit the document's request schemas, and what it answers
    (the job's view once it ended, errors, health) fits the response schemas."""
    spec = echo_stack.get("/openapi.json").json()
    model = echo_stack.name
    for path, bodies in GOOD_BODIES.items():
        for body in bodies:
            body = {**body, "model": model} if path in ("/v1/jobs", "/v1/completions") else body
            check(spec, body_schema(spec, path), body)
            resp = echo_stack.post(path, json=body)
            status = 202 if path == "/v1/jobs" else 200
            assert resp.status_code == status, (path, resp.text)
            if path != "/v1/completions":  # OpenAI's bodies are documented as objects only
                check(spec, response_schema(spec, path, "post", status), resp.json())
            if path == "/v1/jobs":
                job = echo_stack.get(resp.headers["Location"] + "?wait=30").json()
                assert job["status"] == "succeeded", job
                check(spec, response_schema(spec, "/v1/jobs/{job_id}", "get", 200), job)
                cancelled = echo_stack.post(resp.headers["Location"] + "/cancel")
                assert cancelled.status_code == 409
                check(spec, response_schema(spec, "/v1/jobs/{job_id}/cancel", "post", 409), cancelled.json())

    # A queued then cancelled job, and the error bodies.
    job_id = echo_stack.post("/v1/jobs", json={"prompt": "x", "model": model, "timeout_s": 600}).json()["id"]
    view = echo_stack.get(f"/v1/jobs/{job_id}").json()
    check(spec, response_schema(spec, "/v1/jobs/{job_id}", "get", 200), view)
    missing = echo_stack.get(f"/v1/jobs/{uuid.uuid4()}")
    check(spec, response_schema(spec, "/v1/jobs/{job_id}", "get", 404), missing.json())
    bad = echo_stack.post("/v1/jobs", json={"prompt": ""})
    assert bad.status_code == 400
    check(spec, response_schema(spec, "/v1/jobs", "post", 400), bad.json())
    with pytest.raises(jsonschema.ValidationError):
        check(spec, body_schema(spec, "/v1/jobs"), {"prompt": ""})
    check(spec, response_schema(spec, "/healthz", "get", 200), echo_stack.get("/healthz").json())
    check(spec, response_schema(spec, "/readyz", "get", 200), echo_stack.get("/readyz").json())


def test_the_batch_api_is_documented_by_its_models(echo_stack):
    """Files and batches are in the document with their models (not generic), and what the
    live API answers to an upload, a batch, a listing, a cancel and a delete fits them."""
    spec = echo_stack.get("/openapi.json").json()
    upload = spec["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert upload == {"$ref": "#/components/schemas/FileUpload"}
    assert body_schema(spec, "/v1/batches") == {"$ref": "#/components/schemas/BatchRequest"}
    for path, method, model in [
        ("/v1/files", "post", "File"),
        ("/v1/files/{file_id}", "get", "File"),
        ("/v1/files/{file_id}", "delete", "FileDeleted"),
        ("/v1/batches", "post", "Batch"),
        ("/v1/batches", "get", "BatchList"),
        ("/v1/batches/{batch_id}", "get", "Batch"),
        ("/v1/batches/{batch_id}/cancel", "post", "Batch"),
    ]:
        assert response_schema(spec, path, method, 200) == {"$ref": f"#/components/schemas/{model}"}, path
    content = spec["paths"]["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"]
    assert "application/octet-stream" in content

    def upload(text: str):
        files = {"file": ("in.jsonl", text)}
        return echo_stack.http.post(echo_stack.base + "/v1/files", data={"purpose": "batch"}, files=files, timeout=60)

    body = {"model": echo_stack.name, "prompt": "x", "max_tokens": 2}
    resp = upload(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    assert resp.status_code == 200, resp.text
    check(spec, response_schema(spec, "/v1/files", "post", 200), resp.json())
    file_id = resp.json()["id"]
    got = echo_stack.get(f"/v1/files/{file_id}").json()
    check(spec, response_schema(spec, "/v1/files/{file_id}", "get", 200), got)
    bad = upload("{}\nnot json\n")
    assert (bad.status_code, bad.json()["error"]["line"]) == (400, 2)
    check(spec, response_schema(spec, "/v1/files", "post", 400), bad.json())

    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    check(spec, body_schema(spec, "/v1/batches"), body)
    batch = echo_stack.post("/v1/batches", json=body)
    assert batch.status_code == 200, batch.text
    check(spec, response_schema(spec, "/v1/batches", "post", 200), batch.json())
    batch_id = batch.json()["id"]
    listed = echo_stack.get("/v1/batches?limit=5").json()
    check(spec, response_schema(spec, "/v1/batches", "get", 200), listed)
    assert batch_id in [b["id"] for b in listed["data"]]
    cancel = echo_stack.post(f"/v1/batches/{batch_id}/cancel")  # 409 if it already ended
    assert cancel.status_code in (200, 409), cancel.text
    check(spec, response_schema(spec, "/v1/batches/{batch_id}/cancel", "post", cancel.status_code), cancel.json())
    deadline = time.monotonic() + 60
    while (got := echo_stack.get(f"/v1/batches/{batch_id}").json())["status"] not in ("completed", "cancelled"):
        assert time.monotonic() < deadline, got
        time.sleep(0.2)
    check(spec, response_schema(spec, "/v1/batches/{batch_id}", "get", 200), got)
    gone = echo_stack.http.delete(f"{echo_stack.base}/v1/files/{file_id}", timeout=30)
    check(spec, response_schema(spec, "/v1/files/{file_id}", "delete", 200), gone.json())
    missing = echo_stack.get(f"/v1/files/{file_id}")
    assert missing.status_code == 404
    check(spec, response_schema(spec, "/v1/files/{file_id}", "get", 404), missing.json())
