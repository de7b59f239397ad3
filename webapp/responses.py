"""The bodies the job API, the teaching endpoints and the health routes answer with, as pydantic
models: what /openapi.json documents (webapp/openapi.py). Routes with simple bodies build them
through these models; the job view (tasks.jobs.decode_record) is checked against `JobView` by
the tests, and by the fuzzer against the document."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tasks.schemas import ErrorBody, GenerationResult, JobStatus


class JobCreated(BaseModel):
    """202 from POST /v1/jobs; the Location header names the job."""

    id: str
    status: Literal["queued"] = "queued"


class JobTimings(BaseModel):
    created: float = Field(description="unix time")
    started: float | None = Field(description="unix time the job (its last attempt) started")
    finished: float | None = Field(description="unix time")
    queued_s: float | None = Field(None, description="once started")
    run_s: float | None = Field(None, description="once finished, if it ran")
    total_s: float | None = Field(None, description="once finished")


class JobView(BaseModel):
    """GET /v1/jobs/{job_id} and POST /v1/jobs/{job_id}/cancel."""

    id: str
    model: str
    status: JobStatus
    attempts: int = Field(description="runs started, the current one included")
    attempts_forgiven: int = Field(
        0, description="runs whose worker was lost beside other running jobs: not counted against GENQ_MAX_ATTEMPTS"
    )
    priority: int = Field(description="lower is served first")
    deadline: float | None = Field(description="unix time")
    timings: JobTimings
    worker: str | None = Field(None, description="the worker that ran it (its last attempt)")
    error: ErrorBody | None = Field(None, description="why a failed, cancelled or expired job ended")
    result: GenerationResult | None = Field(
        None, description="a succeeded job's result, or a failed (timed out) job's partial one"
    )


class BasicGenerateResponse(BaseModel):
    generated_text: str = Field(description="the prompt and its completion")


class GenerateResponse(BaseModel):
    generated_texts: list[str] = Field(
        description="/generate: each prompt with its completion; /generate_vllm: the completions alone"
    )


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyWorker(BaseModel):
    name: str
    model: str | None = None
    engine: str
    device: str = Field("cpu", description="where it runs the model: cpu, cuda:N")
    capacity: int
    host: str | None = None
    metrics_port: int | None = None


class Ready(BaseModel):
    status: Literal["ready"]
    model: str
    workers: list[ReadyWorker] = Field(description="the live workers serving `model`")
    other_workers: list[ReadyWorker] = Field(
        default_factory=list, description="the live workers serving other models (each with its metrics port)"
    )
