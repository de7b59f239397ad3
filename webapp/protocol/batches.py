"""The Batch API's wire formats: what POST /v1/batches and a batch's input lines take, and the
File, Batch and BatchList bodies the routes answer with (OpenAI's shapes, field for field), each
built from its Redis record (`from_record`) and sent as `.model_dump(mode="json")`."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Endpoint = Literal["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]
TIMESTAMPS = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class BatchRequest(BaseModel):
    """Body of POST /v1/batches."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str = Field(min_length=1)
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)
    callback_url: str | None = Field(
        None,
        min_length=1,
        max_length=2048,
        description="genqueue: POST the batch (as GET /v1/batches/{id}) here once it ends",
    )


class BatchLine(BaseModel):
    """One line of a batch's input file (its body is checked when the line is fed, as the
    completions route checks a request)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class FileUpload(BaseModel):
    """The multipart form of POST /v1/files."""

    purpose: Literal["batch"]
    file: bytes = Field(description="JSONL: one JSON object per line (a batch's requests)")


class File(BaseModel):
    """A file: GET /v1/files/{file_id}, and the answer to an upload."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(description="unix time")
    expires_at: int | None = Field(description="unix time")
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"] = "processed"
    status_details: str | None = None

    @classmethod
    def from_record(cls, rec: dict) -> File:
        return cls(
            id=rec["id"],
            bytes=int(rec["bytes"]),
            created_at=int(rec["created_at"]),
            expires_at=int(rec["expires_at"]) if rec.get("expires_at") else None,
            filename=rec["filename"],
            purpose=rec["purpose"],
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = Field(None, description="the input file's line at fault (1-based), where one is")


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class Batch(BaseModel):
    """A batch: POST /v1/batches, GET /v1/batches/{batch_id}, its cancel."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = Field(description="why validation failed (each bad line), or why it failed")
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int | None
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None

    @classmethod
    def from_record(cls, rec: dict) -> Batch:
        def ts(name: str) -> int | None:
            return int(float(rec[name])) if rec.get(name) else None

        def num(name: str) -> int:
            return int(rec.get(name) or 0)

        inp, out = num("prompt_tokens"), num("completion_tokens")
        return cls(
            id=rec["id"],
            endpoint=rec["endpoint"],
            errors=json.loads(rec["errors"]) if rec.get("errors") else None,
            input_file_id=rec["input_file_id"],
            completion_window=rec["completion_window"],
            status=rec["status"],
            output_file_id=rec.get("output_file_id") or None,
            error_file_id=rec.get("error_file_id") or None,
            **{name: ts(name) for name in TIMESTAMPS},
            request_counts=RequestCounts(total=num("total"), completed=num("completed"), failed=num("failed")),
            usage=BatchUsage(
                input_tokens=inp,
                output_tokens=out,
                total_tokens=inp + out,
                input_tokens_details=InputTokensDetails(cached_tokens=num("cached_tokens")),
            ),
            metadata=json.loads(rec["metadata"]) if rec.get("metadata") else None,
        )


class BatchList(BaseModel):
    """GET /v1/batches: the caller's batches, newest first."""

    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool
