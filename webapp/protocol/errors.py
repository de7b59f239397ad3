"""The one error shape: every error answer's body, and an SSE `error` event's data. Our own
`code` and `message`, with OpenAI's `type` and `param` so that OpenAI clients read it too.
webapp/errors.py builds it (`error_body`) and holds the status table."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    code: str = Field(description="what went wrong, for programs: `invalid_request`, `not_found`, ...")
    message: str = Field(description="what went wrong, for people")
    type: Literal["invalid_request_error", "server_error"] = Field(description="OpenAI's error type")
    param: str | None = Field(description="the request field at fault, where one is")


class ErrorResponse(BaseModel):
    """The body of every error response (and of an SSE `error` event)."""

    error: ErrorDetail
