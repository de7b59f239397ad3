"""Anthropic's Messages API: `POST /v1/messages` (plain and streamed), a conversation as one
chat job (webapp/protocol/messages.py makes its chat request), answered in Anthropic's shapes,
its errors too."""

from __future__ import annotations

from flask import Blueprint, jsonify, request
from pydantic import ValidationError

from webapp import auth
from webapp.completions import chat_choice, current_completions
from webapp.errors import APIError, describe
from webapp.openapi import BLOCKING_ERRORS, SSE, doc
from webapp.protocol import messages as proto
from webapp.protocol.chat import ChatCompletionRequest
from webapp.protocol.common import cached_tokens
from webapp.relays import MessagesRelay
from webapp.routes._body import parse

bp = Blueprint("messages", __name__, url_prefix="/v1")


@bp.post("/messages")
@doc(
    body=proto.MessagesRequest,
    stream=SSE("with `stream`: Anthropic's events (`message_start`, `content_block_delta`, ..., `message_stop`)"),
    errors=BLOCKING_ERRORS,
)
def create_message():
    """Anthropic's Messages API: the conversation's reply (the same as its chat completion's)."""
    try:
        return _answer()
    except APIError as exc:
        resp = jsonify(proto.error(exc.status, exc.code, exc.message, exc.param))
        resp.status_code = exc.status
        resp.headers.update(exc.headers or {})
        return resp
    except ValidationError as exc:
        first = ".".join(str(p) for p in exc.errors(include_url=False)[0]["loc"]) or None
        resp = jsonify(proto.error(400, "invalid_request", describe(exc), first))
        resp.status_code = 400
        return resp


def _answer():
    req = parse(proto.MessagesRequest)
    jobs = ChatCompletionRequest.model_validate(req.chat_body()).to_jobs()
    completions = current_completions()
    sub = completions.submit(jobs, auth.current_owner())
    if req.stream:
        relay = MessagesRelay(sub, req.stop_sequences)
        return relay.response(completions.jobs.events(sub.ids, cancel_on_exit=not sub.keep))
    (result,) = completions.results(sub, request.environ)
    msg = chat_choice(sub, 0, result).message
    content = [{"type": "text", "text": msg.content}] if msg.content else []
    calls = msg.tool_calls or []
    content += [proto.tool_use(c.id, c.function.name, c.function.arguments) for c in calls]
    reason = proto.stop_reason(result["finish_reason"], calls, req.stop_sequences)
    use = proto.usage(result["prompt_tokens"], result["completion_tokens"], cached_tokens(result))
    return proto.message("msg_" + sub.ids[0].replace("-", ""), sub.model, content, reason, req.stop_sequences, use)
