"""`GET /openapi.json`: the API's OpenAPI 3.1 document, built from the app itself.

Nothing here is a copy of the API: the paths and methods are the app's URL map, read when the
document is first asked for (so every blueprint registered in create_app is in it, documented
or not), and the bodies are the pydantic models the routes parse and answer with, as pydantic's
own JSON Schema (2020-12, the dialect of OpenAPI 3.1). A route adds what the URL map cannot
know with `@doc(...)`: its request model, its responses, its query and header parameters and
the error statuses it may answer. A route without `@doc` is still listed, with its docstring
and a generic error response.

Every error is the JSON of webapp.protocol.errors.ErrorResponse. With API keys configured,
every path but the open ones (webapp.auth.OPEN_PATHS, this document included) requires the
bearer key and documents 401. Deployment limits (body size, max_new_tokens, ?wait=) are given
in the text.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flask import Flask, current_app
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from webapp import auth
from webapp.protocol.errors import ErrorResponse

OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{model}"

# What each error status means here: one line per status, for every route that can answer it.
ERRORS: dict[int, str] = {
    400: "the request is invalid: `invalid_request`, `invalid_json`, `prompt_too_long`, "
    "`unsupported_parameter`, `invalid_file` (an upload's bad line, named)",
    401: "`unauthorized`: no API key, or an unknown one (only when the API has keys)",
    403: "`forbidden`: only an admin key may see that (another key's usage)",
    404: "`not_found` (no such job, or another key's) or `model_not_found`",
    409: "`already_final`: the job (or batch) had already ended; as a job's outcome, `cancelled`",
    413: "`request_entity_too_large` (the body is over GENQ_MAX_BODY_BYTES), `too_many_prompts` or "
    "`file_too_large` (GENQ_MAX_FILE_BYTES)",
    415: "`unsupported_media_type`: the body must be sent as `Content-Type: application/json`",
    429: "`queue_full` (GENQ_MAX_QUEUE_DEPTH), `quota_exceeded` (the key's max_queued) or "
    "`rate_limit_exceeded` (the key's rpm or tpm); see Retry-After",
    502: "the job failed on the worker (its error code: `worker_lost`, `generation_failed`, ...)",
    503: "`no_worker` serves the model, or `broker_unavailable` (Redis); see Retry-After",
    504: "the job ran out of time: `timeout` (it ran past its deadline or GENQ_JOB_TIMEOUT, "
    "or the call's wait ended first) or `expired` (its deadline passed while it waited)",
}
# The statuses of a route that reads a JSON body.
BODY_ERRORS = (400, 413, 415)
# Those of one that submits jobs, and of one that also waits for them.
SUBMIT_ERRORS = (*BODY_ERRORS, 404, 409, 429, 503)
BLOCKING_ERRORS = (*SUBMIT_ERRORS, 502, 504)


@dataclass(frozen=True)
class Param:
    name: str
    where: str  # "query" or "header"
    schema: dict[str, Any]
    description: str = ""


@dataclass(frozen=True)
class SSE:
    """A response of server-sent events: what they carry, and their `event:` names (a line
    without one is a "message" event)."""

    description: str
    events: tuple[str, ...] = ("message",)

    def schema(self) -> dict:
        """One event, as OpenAPI describes a text/event-stream item (3.1: `schema` is each event)."""
        return {
            "type": "object",
            "description": self.description,
            "required": ["data"],
            "properties": {
                "event": {"enum": list(self.events)},
                "data": {"type": "string", "contentMediaType": "application/json"},
                "id": {"type": "string"},
            },
        }


@dataclass(frozen=True)
class Doc:
    body: type[BaseModel] | None = None
    form: type[BaseModel] | None = None  # a multipart/form-data body (a file upload)
    status: int = 200
    response: type[BaseModel] | dict | None = None  # a model, or a JSON Schema of its own
    description: str = ""
    stream: SSE | None = None  # the response is a stream of server-sent events
    media_type: str | None = None  # a non-JSON, non-SSE response (e.g. /metrics' text)
    errors: tuple[int, ...] = ()
    params: tuple[Param, ...] = ()
    headers: dict[str, str] = field(default_factory=dict)  # response headers: name -> description
    tag: str | None = None


# The header of a safe retry (webapp/idempotency.py), on every submitting route.
IDEMPOTENCY = Param(
    "Idempotency-Key",
    "header",
    {"type": "string", "minLength": 1, "maxLength": 255},
    "a retry with the same key and body gets what the first request created (24 h, per API key); "
    "another body: 409 idempotency_key_reused",
)


def doc(**kw: Any) -> Callable:
    """Documents a view function for /openapi.json (see Doc for the fields)."""
    meta = Doc(**kw)

    def mark(fn: Callable) -> Callable:
        fn.__openapi__ = meta
        return fn

    return mark


_ARG = re.compile(r"<(?:(\w+)(?:\([^)]*\))?:)?(\w+)>")
_ARG_TYPES = {"int": "integer", "float": "number"}


def _path(rule: str) -> tuple[str, list[dict]]:
    """A Werkzeug rule as an OpenAPI path, and its path parameters."""
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": _ARG_TYPES.get(conv or "", "string")}}
        for conv, name in _ARG.findall(rule)
    ]
    return _ARG.sub(lambda m: "{" + m.group(2) + "}", rule), params


def _json(ref: str) -> dict:
    return {"application/json": {"schema": {"$ref": ref}}}


def _responses(meta: Doc, summary: str, ref: dict, error: dict) -> dict[str, Any]:
    """A documented operation's success response and its error statuses."""
    ok: dict[str, Any] = {"description": meta.description or summary or "ok"}
    content: dict[str, Any] = {}
    if isinstance(meta.response, dict):
        content["application/json"] = {"schema": meta.response}
    elif meta.response is not None:
        content.update(_json(ref[meta.response]))
    if meta.stream is not None:
        content["text/event-stream"] = {"schema": meta.stream.schema()}
    if meta.media_type is not None:
        content[meta.media_type] = {"schema": {"type": "string"}}
    if content:
        ok["content"] = content
    if meta.headers:
        ok["headers"] = {h: {"description": d, "schema": {"type": "string"}} for h, d in meta.headers.items()}
    responses = {str(meta.status): ok}
    statuses = set(meta.errors) | (set(BODY_ERRORS) if meta.body is not None else set())
    for status in sorted(statuses):
        responses[str(status)] = {**error, "description": ERRORS[status]}
    return responses


def build(app: Flask) -> dict:
    """The OpenAPI document of `app`, as it is now."""
    settings = app.config["GENQ"]
    protected = settings.auth_enabled
    views = []
    models: set[type[BaseModel]] = {ErrorResponse}
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: (r.rule, r.endpoint)):
        if rule.endpoint == "static":
            continue
        fn = app.view_functions[rule.endpoint]
        meta: Doc | None = getattr(fn, "__openapi__", None)
        views.append((rule, fn, meta))
        if meta is not None:
            models.update(m for m in (meta.body, meta.form, meta.response) if isinstance(m, type))

    # One schema per model, shared definitions hoisted into components.
    keyed = [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)]
    refs, defs = models_json_schema(keyed, ref_template=REF)
    ref = {m: refs[(m, mode)]["$ref"] for m, mode in keyed}
    error = {"description": "error", "content": _json(ref[ErrorResponse])}

    paths: dict[str, dict] = {}
    for rule, fn, meta in views:
        path, path_params = _path(rule.rule)
        open_path = rule.rule in auth.OPEN_PATHS
        methods = sorted((rule.methods or set()) - {"HEAD", "OPTIONS"})
        for method in methods:
            summary, _, details = (fn.__doc__ or rule.endpoint).strip().partition("\n")
            op_id = rule.endpoint if len(methods) == 1 else f"{rule.endpoint}.{method.lower()}"
            op: dict[str, Any] = {
                "operationId": op_id.replace(".", "_"),
                "summary": summary.strip(),
                "tags": [meta.tag if meta and meta.tag else rule.endpoint.partition(".")[0]],
            }
            text = " ".join(p for p in ((meta.description if meta else ""), " ".join(details.split())) if p)
            if text:
                op["description"] = text
            params = list(path_params)
            if meta is None:
                # Not documented yet: any JSON (an error is still an ErrorResponse).
                responses: dict[str, Any] = {
                    "default": {
                        "description": "the route's answer (not described here), or an error",
                        "content": {"application/json": {"schema": {}}},
                    }
                }
            else:
                params += [
                    {"name": p.name, "in": p.where, "required": False, "schema": p.schema, "description": p.description}
                    for p in meta.params
                ]
                if meta.body is not None:
                    op["requestBody"] = {"required": True, "content": _json(ref[meta.body])}
                elif meta.form is not None:
                    form = {"multipart/form-data": {"schema": {"$ref": ref[meta.form]}}}
                    op["requestBody"] = {"required": True, "content": form}
                responses = _responses(meta, summary.strip(), ref, error)
            if protected and not open_path:
                responses["401"] = {**error, "description": ERRORS[401]}
            if params:
                op["parameters"] = params
            op["responses"] = responses
            if protected:
                op["security"] = [] if open_path else [{"apiKey": []}]
            paths.setdefault(path, {})[method.lower()] = op

    components: dict[str, Any] = {"schemas": defs.get("$defs", {})}
    if protected:
        components["securitySchemes"] = {
            "apiKey": {"type": "http", "scheme": "bearer", "description": "an API key of GENQ_API_KEYS(_FILE)"}
        }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "genqueue",
            "version": _version(),
            "description": "Text generation through a job queue. Limits of this deployment: bodies up to "
            f"{settings.max_body_bytes} bytes, prompts up to {settings.max_prompt_chars} characters, "
            f"max_new_tokens up to {settings.max_new_tokens_limit}, waits up to {settings.max_wait:g} s.",
        },
        "paths": paths,
        "components": components,
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("genqueue")
    except PackageNotFoundError:
        return "0"


def init_app(app: Flask) -> None:
    """Serve the document at /openapi.json; built on the first request, when every route of
    the app is registered, and kept."""

    @app.get("/openapi.json")
    @doc(response={"type": "object"}, description="this document (OpenAPI 3.1)", tag="meta")
    def openapi_json():
        """The API's OpenAPI document."""
        spec = app.extensions.get("genq.openapi")
        if spec is None:
            spec = app.extensions["genq.openapi"] = build(current_app)
        return spec
