"""What every request becomes, `Jobs` (with its `Scheduling`), and the job API's wire formats
(/v1/jobs), the teaching endpoints' (/basic_generate, /generate, /generate_vllm,
/generate_stream) and the health routes': the request bodies (a prompt beside SamplingParams and
Scheduling fields) and the bodies the routes answer with, which /openapi.json documents. What a
job is to the workers (JobSpec, SamplingParams, GenerationResult) is tasks/schemas.py."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.schemas import PRIORITY_MAX, PRIORITY_MIN, ChatOptions, GenerationResult, JobStatus, SamplingParams
from webapp.parsers import OutputParser
from webapp.protocol.output import ReasoningUse, output_parser
from webapp.protocol.tools import ToolUse

# The longest `timeout_s`, and the latest `deadline` (unix time), a job may ask for: beyond them
# a time no longer fits a date (they are refused, not clamped).
TIMEOUT_S_MAX = 365 * 86_400.0
DEADLINE_MAX = 2.0**32


class Scheduling(BaseModel):
    """When a job runs: its place among the waiting jobs and how long it may wait and run."""

    model_config = ConfigDict(extra="forbid", strict=True)

    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX, description="lower is served first")
    timeout_s: float | None = Field(
        None, gt=0, le=TIMEOUT_S_MAX, allow_inf_nan=False, description="seconds from submission"
    )
    deadline: float | None = Field(None, gt=0, le=DEADLINE_MAX, allow_inf_nan=False, description="unix time")

    @field_validator("deadline")
    @classmethod
    def _ahead(cls, v: float | None) -> float | None:
        if v is not None and v <= time.time():
            raise ValueError("already passed")
        return v

    def deadline_from(self, now: float) -> float | None:
        """The job's absolute deadline: the earlier of `deadline` and `now + timeout_s`."""
        times = [t for t in (self.deadline, self.timeout_s and now + self.timeout_s) if t]
        return min(times) if times else None


def split_request(req: BaseModel, exclude: set[str]) -> tuple[SamplingParams, Scheduling]:
    """A request body's sampling parameters and scheduling fields, the rest (`exclude`) left out."""
    data = req.model_dump(exclude=exclude)
    sched = {k: data.pop(k) for k in Scheduling.model_fields if k in data}
    return SamplingParams.model_validate(data), Scheduling.model_validate(sched)


Api = Literal["completions", "chat", "teaching", "jobs"]


@dataclass
class Jobs:
    """What a request asks of the queue, whatever door it came in by: each request model turns
    itself into one (`to_jobs()`, or `Jobs.of`), which webapp.completions.CompletionService
    checks against the limits, queues and answers. Each of `prompts` `n` times (prompt i's j-th
    is job i * n + j, with `params.for_choice(j)`), at `sched`, for `model` (None: the default
    one) or for a worker of `engine`. The rest says how to answer: `api`, `stream`, `echo` (the
    prompt goes before its completion), `include_usage` (a stream's last chunk). `best_of`:
    that many jobs per prompt instead of `n`, of which the answer keeps the `n` of highest
    cumulative logprob. A prompt is a text or token ids."""

    prompts: list[str | list[int]]
    params: SamplingParams
    sched: Scheduling = field(default_factory=Scheduling)
    model: str | None = None
    engine: str | None = None
    n: int = 1
    api: Api = "completions"
    stream: bool = False
    echo: bool = False
    include_usage: bool = False
    chat: ChatOptions | None = None  # a conversation (the worker renders its prompt)
    tools: ToolUse | None = None  # what the answer makes of a chat's output (tool calls)
    reasoning: ReasoningUse | None = None  # and of its think span (webapp/protocol/output.py)
    best_of: int | None = None
    callback_url: str | None = None  # each job's record is POSTed there once it ends
    # The request's own name of `params.max_new_tokens` (OpenAI's `max_tokens`), which the errors
    # about it name as their field; None: the body's fields are SamplingParams', and say so.
    max_tokens_field: str | None = None

    @property
    def per_prompt(self) -> int:
        """Jobs per prompt."""
        return self.best_of or self.n

    @property
    def texts(self) -> list[str]:
        """What the deployment's limits on prompts apply to: the prompts (token ids: none, the
        worker checks their length), or the messages."""
        if self.chat is None:
            return [p if isinstance(p, str) else "" for p in self.prompts]
        texts = [m.content or "" for m in self.chat.messages]
        texts += [json.dumps(m.tool_calls) for m in self.chat.messages if m.tool_calls]
        return ["\n".join(texts + ([json.dumps(self.chat.tools)] if self.chat.tools else []))]

    def output_parser(self) -> OutputParser | None:
        """The parser of a chat choice's text (reasoning, tool calls); None: content as it is."""
        return output_parser(self.tools, self.reasoning)

    @property
    def max_tokens_name(self) -> str:
        """What the request calls `params.max_new_tokens`."""
        return self.max_tokens_field or "max_new_tokens"

    @classmethod
    def of(cls, req: BaseModel, prompts: list[str], exclude: set[str], **kw: Any) -> Jobs:
        """The jobs of a body that is SamplingParams and Scheduling fields beside `exclude`
        (`/v1/jobs`, the teaching endpoints)."""
        params, sched = split_request(req, exclude | {"callback_url"})
        return cls(prompts, params, sched, callback_url=getattr(req, "callback_url", None), **kw)


CALLBACK_URL = "POST the job's record (as GET /v1/jobs/{id}) here once it ends, signed X-Genq-Signature"


class JobRequest(SamplingParams, Scheduling):
    """Body of POST /v1/jobs."""

    prompt: str = Field(min_length=1)
    model: str | None = Field(None, min_length=1)
    callback_url: str | None = Field(None, min_length=1, max_length=2048, description=CALLBACK_URL)


class BasicGenerateRequest(SamplingParams, Scheduling):
    """Body of the teaching server's POST /basic_generate."""

    prompt: str = Field(min_length=1)


class GenerateRequest(SamplingParams, Scheduling):
    """Body of the teaching server's POST /generate."""

    prompts: list[str] = Field(max_length=256)

    @field_validator("prompts")
    @classmethod
    def _non_empty_prompts(cls, v: list[str]) -> list[str]:
        if any(p == "" for p in v):
            raise ValueError("prompts must not be empty strings")
        return v


# -- responses ------------------------------------------------------------------------------


class JobCreated(BaseModel):
    """202 from POST /v1/jobs; the Location header names the job."""

    id: str
    status: Literal["queued"] = "queued"


class ErrorBody(BaseModel):
    code: str
    message: str


class JobTimings(BaseModel):
    created: float = Field(description="unix time")
    started: float | None = Field(description="unix time the job (its last attempt) started")
    finished: float | None = Field(description="unix time")
    queued_s: float | None = Field(None, description="once started")
    total_s: float | None = Field(None, description="once finished")
    run_s: float | None = Field(None, description="once finished, if it ran")


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

    @classmethod
    def answer(cls, view: dict[str, Any]) -> dict[str, Any]:
        """A job's view (tasks.records.decode_record, with its result) as the body: checked against
        this model, and with only the fields the view has (none added as null); a result's
        `cached_tokens` always (0 from a worker from before the prefix cache)."""
        body = cls.model_validate(view).model_dump(exclude_unset=True)
        if body.get("result") is not None:
            body["result"].setdefault("cached_tokens", 0)
        return body


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
    capacity: int
    host: str | None = None
    device: str = Field("cpu", description="where it runs the model: cpu, cuda:N")
    metrics_port: int | None = None


class Ready(BaseModel):
    status: Literal["ready"]
    model: str
    workers: list[ReadyWorker] = Field(description="the live workers serving `model`")
    other_workers: list[ReadyWorker] = Field(
        default_factory=list, description="the live workers serving other models (each with its metrics port)"
    )
