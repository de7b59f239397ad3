"""Liveness and readiness."""

from __future__ import annotations

from flask import Blueprint

from webapp.errors import BROKER_ERRORS, BROKER_RETRY_AFTER, error_response
from webapp.openapi import doc
from webapp.protocol.jobs import Health, Ready, ReadyWorker
from webapp.service import current_service

bp = Blueprint("health", __name__)


@bp.get("/healthz")
@doc(response=Health)
def healthz():
    """Liveness: the API process answers."""
    return Health().model_dump()


@bp.get("/health")
@doc(response=Health)
def health():
    """Liveness, at the path vLLM's server answers it on (what its users' probes ask)."""
    return healthz()


@bp.get("/readyz")
@doc(response=Ready, errors=(503,))
def readyz():
    """Readiness: a live worker with a loaded model serves the default model (503 otherwise)."""
    service = current_service()
    model = service.settings.served_model
    try:
        live = service.live_workers(fresh=True)
    except BROKER_ERRORS as exc:
        why = f"Redis does not answer: {type(exc).__name__}: {exc}"
        return error_response(503, "broker_unavailable", why, BROKER_RETRY_AFTER)
    workers = [w for w in live if w.model == model]
    if not workers:
        return error_response(503, "not_ready", f"no live worker with a loaded model serves {model!r}")
    shown = set(ReadyWorker.model_fields)
    return Ready(
        status="ready",
        model=model,
        workers=[ReadyWorker(**w.model_dump(include=shown)) for w in workers],
        # The workers of the other models (a second engine's, GENQ_ENGINES=hf,vllm): every
        # metrics port is here.
        other_workers=[ReadyWorker(**w.model_dump(include=shown)) for w in live if w.model != model],
    ).model_dump()
