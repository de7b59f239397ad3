"""`GET /v1/usage`'s answer: tokens used per API key and model (tasks/usage.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class KeyUsage(BaseModel):
    key: str = Field(description="the API key's name (`anonymous`: the jobs of an open API)")
    model: str
    jobs: int = Field(description="jobs counted: succeeded, and failed ones that kept a partial result")
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache (part of prompt_tokens)")
    total_tokens: int


class KeyLimits(BaseModel):
    rpm: int | None = Field(None, description="requests per minute (None: no limit)")
    tpm: int | None = Field(None, description="tokens (prompt and completion) per minute (None: no limit)")


class UsageList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyUsage] = Field(description="one entry per key and model, by key then model")
    key: str | None = Field(None, description="the name of the key that asked (None: the API is open)")
    admin: bool = Field(description="whether the caller sees every key's usage (an admin key, or an open API)")
    limits: KeyLimits | None = Field(None, description="the asking key's rate limits")
