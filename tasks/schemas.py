"""Pydantic schemas of what travels between the API and the workers.

`JobSpec` is what the API validates and puts on the queue; `GenerationResult` is what a worker
returns into the Celery result backend. Both are plain JSON on the wire.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class JobStatus(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


class SamplingParams(BaseModel):
    """Per-job decoding parameters. Greedy unless `temperature` > 0."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list, max_length=8)
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class JobRequest(SamplingParams):
    """Body of POST /v1/jobs."""

    prompt: str = Field(min_length=1)
    model: str | None = Field(None, min_length=1)


class BasicGenerateRequest(SamplingParams):
    """Body of the teaching server's POST /basic_generate."""

    prompt: str = Field(min_length=1)


class GenerateRequest(SamplingParams):
    """Body of the teaching server's POST /generate."""

    prompts: list[str] = Field(max_length=256)

    @field_validator("prompts")
    @classmethod
    def _non_empty_prompts(cls, v: list[str]) -> list[str]:
        if any(p == "" for p in v):
            raise ValueError("prompts must not be empty strings")
        return v


class JobSpec(BaseModel):
    """What a worker receives: one prompt, resolved model name, complete parameters."""

    id: str
    model: str
    prompt: str
    params: SamplingParams
    stream: bool = Field(True, description="publish token events (False: nobody can follow them)")


class GenerationResult(BaseModel):
    text: str = Field(description="the completion, without the prompt")
    finish_reason: Literal["length", "stop", "eos", "cancelled"]
    prompt_tokens: int
    completion_tokens: int
    batch_size: int = Field(description="the largest batch this job was decoded in")
    model: str
    worker: str | None = None


class ErrorBody(BaseModel):
    code: str
    message: str
