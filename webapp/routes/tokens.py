"""vLLM's `POST /tokenize` (a prompt, or a conversation through the chat template) and
`POST /detokenize`, answered by a worker of the model (webapp/tokens.py)."""

from __future__ import annotations

from flask import Blueprint

from webapp import tokens
from webapp.completions import current_completions
from webapp.openapi import SUBMIT_ERRORS, doc
from webapp.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChat,
    TokenizeRequest,
    TokenizeResponse,
)
from webapp.routes._body import parse
from webapp.service import current_service

bp = Blueprint("tokens", __name__)


@bp.post("/tokenize")
@doc(body=TokenizeRequest, response=TokenizeResponse, errors=(*SUBMIT_ERRORS, 504), tag="tokens")
def tokenize():
    """The token ids of a prompt, or of a conversation's prompt as its chat template renders it."""
    req = parse(TokenizeRequest).root
    body = {"op": "tokenize", "add_special_tokens": req.add_special_tokens, "return_token_strs": req.return_token_strs}
    if isinstance(req, TokenizeChat):
        current_completions().require_chat_template(current_service().resolve_model(req.model))
        body["chat"] = req.chat_options().model_dump(mode="json")
    else:
        body["prompt"] = req.prompt
    return TokenizeResponse.model_validate(tokens.ask(current_service(), req.model, body)).model_dump()


@bp.post("/detokenize")
@doc(body=DetokenizeRequest, response=DetokenizeResponse, errors=(*SUBMIT_ERRORS, 504), tag="tokens")
def detokenize():
    """The text of token ids."""
    req = parse(DetokenizeRequest)
    answer = tokens.ask(current_service(), req.model, {"op": "detokenize", "tokens": req.tokens})
    return DetokenizeResponse.model_validate(answer).model_dump()
