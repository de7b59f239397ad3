"""OpenAI-compatible endpoints: `POST /v1/completions` and `POST /v1/chat/completions` (plain
and streamed), `POST /v1/embeddings`, `GET /v1/models` and `GET /v1/models/<id>`. Every prompt
of a request is its own job, like everywhere else; an embeddings request is one job."""

from __future__ import annotations

from flask import Blueprint

from webapp import auth, embeddings
from webapp.completions import current_completions
from webapp.errors import error_response
from webapp.openapi import BLOCKING_ERRORS, IDEMPOTENCY, SSE, doc
from webapp.protocol.chat import ChatCompletionRequest, ChatCompletionResponse
from webapp.protocol.completions import CompletionRequest, CompletionResponse
from webapp.protocol.embeddings import EmbeddingRequest, EmbeddingResponse
from webapp.protocol.models import ModelCard, ModelList
from webapp.routes._body import parse
from webapp.service import current_service

bp = Blueprint("openai", __name__, url_prefix="/v1")


def _cards() -> dict[str, ModelCard]:
    seen: dict[str, ModelCard] = {}
    for w in current_service().live_workers(fresh=True):
        card = seen.setdefault(w.model, ModelCard(id=w.model, created=int(w.started), max_model_len=w.max_model_len))
        card.created = min(card.created, int(w.started))
        if w.device not in card.devices:
            card.devices.append(w.device)
    return seen


@bp.get("/models")
@doc(response=ModelList, errors=(503,))
def models():
    """The models live workers serve."""
    return ModelList(data=list(_cards().values())).model_dump(mode="json")


@bp.get("/models/<path:model_id>")
@doc(response=ModelCard, errors=(404, 503))
def model(model_id: str):
    """One model live workers serve (404 `model_not_found` for one they do not)."""
    card = _cards().get(model_id)
    if card is None:
        return error_response(404, "model_not_found", f"no live worker serves {model_id!r}", param="model")
    return card.model_dump(mode="json")


@bp.post("/completions")
@doc(
    params=(IDEMPOTENCY,),
    body=CompletionRequest,
    response=CompletionResponse,
    stream=SSE("with `stream`: OpenAI's completion chunks, then `[DONE]`"),
    errors=BLOCKING_ERRORS,
)
def completions():
    """OpenAI's completions: every prompt its own job."""
    req = parse(CompletionRequest)
    return current_completions().answer(req.to_jobs(), auth.current_owner())


@bp.post("/chat/completions")
@doc(
    params=(IDEMPOTENCY,),
    body=ChatCompletionRequest,
    response=ChatCompletionResponse,
    stream=SSE("with `stream`: OpenAI's chat completion chunks (each choice opens with its role), then `[DONE]`"),
    errors=BLOCKING_ERRORS,
)
def chat_completions():
    """OpenAI's chat completions: the model's chat template over the messages, every choice its own job."""
    req = parse(ChatCompletionRequest)
    return current_completions().answer(req.to_jobs(), auth.current_owner())


@bp.post("/embeddings")
@doc(params=(IDEMPOTENCY,), body=EmbeddingRequest, response=EmbeddingResponse, errors=BLOCKING_ERRORS)
def create_embeddings():
    """OpenAI's embeddings: one job carries every input, to a worker whose model is a
    sentence-embedding one."""
    req = parse(EmbeddingRequest)
    return embeddings.answer(req, auth.current_owner())
