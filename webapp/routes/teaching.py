"""The teaching server's endpoints, same JSON as before, now served through the job queue.

Each prompt becomes its own job, so the prompts of one call and of concurrent calls are
batched together by the worker. A call blocks (or streams) until its jobs have ended, and
fails at once with 503 when no worker serves the model.
"""

from __future__ import annotations

from flask import Blueprint, request

from webapp import auth, sse
from webapp.completions import Submitted, current_completions
from webapp.openapi import BLOCKING_ERRORS, IDEMPOTENCY, SSE, SUBMIT_ERRORS, doc
from webapp.protocol.jobs import BasicGenerateRequest, BasicGenerateResponse, GenerateRequest, GenerateResponse, Jobs
from webapp.routes._body import parse
from webapp.service import current_service

bp = Blueprint("teaching", __name__)


def _submit(prompts: list[str], req, engine: str | None = None, stream: bool = False) -> Submitted:
    jobs = Jobs.of(req, prompts, {"prompt", "prompts"}, engine=engine, api="teaching", stream=stream)
    return current_completions().submit(jobs, auth.current_owner())


def _completions(sub: Submitted) -> list[str]:
    return [r["text"] for r in current_completions().results(sub, request.environ)]


@bp.post("/basic_generate")
@doc(
    params=(IDEMPOTENCY,),
    body=BasicGenerateRequest,
    response=BasicGenerateResponse,
    errors=BLOCKING_ERRORS,
    tag="teaching",
)
def basic_generate():
    """Complete one prompt, blocking until it is done."""
    req = parse(BasicGenerateRequest)
    (completion,) = _completions(_submit([req.prompt], req))
    return BasicGenerateResponse(generated_text=req.prompt + completion).model_dump()


@bp.post("/generate")
@doc(params=(IDEMPOTENCY,), body=GenerateRequest, response=GenerateResponse, errors=BLOCKING_ERRORS, tag="teaching")
def generate():
    """Complete several prompts, blocking until all are done."""
    req = parse(GenerateRequest)
    completions = _completions(_submit(req.prompts, req))
    return GenerateResponse(generated_texts=[p + c for p, c in zip(req.prompts, completions)]).model_dump()


@bp.post("/generate_vllm")
@doc(params=(IDEMPOTENCY,), body=GenerateRequest, response=GenerateResponse, errors=BLOCKING_ERRORS, tag="teaching")
def generate_vllm():
    """Completions without their prompts, as vLLM returns them, from a vLLM worker."""
    req = parse(GenerateRequest)
    return GenerateResponse(generated_texts=_completions(_submit(req.prompts, req, engine="vllm"))).model_dump()


@bp.post("/generate_stream")
@doc(
    params=(IDEMPOTENCY,),
    body=BasicGenerateRequest,
    stream=SSE('`{"token", "sequence_id"}` per token'),
    errors=SUBMIT_ERRORS,
    tag="teaching",
)
def generate_stream():
    """One `data: {"token", "sequence_id"}` line per generated token."""
    req = parse(BasicGenerateRequest)
    sub = _submit([req.prompt], req, stream=True)
    (job_id,) = sub.ids

    def token(_, ev):
        if ev.text or not ev.finish:
            return sse.event({"token": ev.text, "sequence_id": job_id})
        return None

    def end(_, ev):
        return sse.event({"error": ev.error, "sequence_id": job_id})

    def restart(_, ev):
        return sse.event({"restart": True, "attempt": ev.attempt, "sequence_id": job_id})

    return sse.relay(current_service().events([job_id], cancel_on_exit=not sub.keep), token, end, restart)
