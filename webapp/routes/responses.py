"""OpenAI's Responses API: `POST /v1/responses` (blocking, streamed or in the background), and
a stored response's `GET` (also as its stream, resumed with `starting_after`), `cancel`,
`DELETE` and `input_items` (webapp/responses.py)."""

from __future__ import annotations

from flask import Blueprint, request

from webapp import auth
from webapp.errors import APIError
from webapp.openapi import BLOCKING_ERRORS, IDEMPOTENCY, SSE, Param, doc
from webapp.protocol import responses as proto
from webapp.responses import current_responses
from webapp.routes._body import parse

bp = Blueprint("responses", __name__, url_prefix="/v1/responses")


@bp.post("")
@doc(
    params=(IDEMPOTENCY,),
    body=proto.ResponsesRequest,
    stream=SSE("with `stream`: OpenAI's response events, each with its `sequence_number`"),
    errors=BLOCKING_ERRORS,
)
def create_response():
    """OpenAI's Responses API: one chat job; with `background`, answered at once (`queued`)."""
    req = parse(proto.ResponsesRequest)
    return current_responses().create(req, auth.current_owner())


@bp.get("/<resp_id>")
@doc(
    errors=(400, 404, 503),
    params=(
        Param("stream", "query", {"type": "boolean"}, "the response's events (one created with stream or background)"),
        Param("starting_after", "query", {"type": "integer", "minimum": 0}, "with stream: the events after this one"),
    ),
    stream=SSE("with `?stream=true`: the response's events, from the one after `starting_after`"),
)
def get_response(resp_id: str):
    """A stored response as it is now (or its events, `?stream=true`)."""
    service = current_responses()
    rec = service.load(resp_id, auth.owner_name())
    if request.args.get("stream", "false").lower() not in ("true", "1"):
        return service.current(rec)
    raw = request.args.get("starting_after")
    try:
        after = -1 if raw is None else int(raw)
    except ValueError:
        after = -2
    if after < -1:
        raise APIError(
            400, "invalid_request", "starting_after: a sequence_number (a whole number)", param="starting_after"
        )
    return service.stream(rec, None, after)


@bp.post("/<resp_id>/cancel")
@doc(errors=(400, 404, 409, 503))
def cancel_response(resp_id: str):
    """Cancel a background response that has not ended."""
    service = current_responses()
    return service.cancel(service.load(resp_id, auth.owner_name()))


@bp.delete("/<resp_id>")
@doc(errors=(404, 503))
def delete_response(resp_id: str):
    """Delete a stored response (its job is cancelled if it has not ended)."""
    service = current_responses()
    return service.delete(service.load(resp_id, auth.owner_name()))


@bp.get("/<resp_id>/input_items")
@doc(errors=(404, 503))
def input_items(resp_id: str):
    """The input items of a stored response (its own, not those of the responses before it)."""
    rec = current_responses().load(resp_id, auth.owner_name())
    items = proto.input_item_list(rec["id"], rec["input_items"])
    if request.args.get("order", "desc") == "desc":
        items.reverse()
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
    }
