"""OpenAI's embeddings API (POST /v1/embeddings), as vLLM's server speaks it: the request
(`input` as a string, strings, token ids or lists of token ids; `encoding_format`,
`dimensions`, `user`; vLLM's `truncate_prompt_tokens` and `priority`) and the answer (one
vector per input, as floats or base64 float32, with usage). webapp/embeddings.py serves it."""

from __future__ import annotations

import array
import base64
import sys
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tasks.schemas import PRIORITY_MAX, PRIORITY_MIN, TOKEN_ID_MAX

Input = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(BaseModel):
    """Body of POST /v1/embeddings."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, min_length=1)
    input: list[str | list[int]] = Field(
        description="a text, a list of texts, token ids, or a list of token-id lists; none empty"
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector as its little-endian float32 bytes, base64"
    )
    dimensions: int | None = Field(
        None, ge=1, description="the vectors cut to this many dimensions and renormalized (Matryoshka models only)"
    )
    user: str | None = Field(None, max_length=256, description="the end user, for the client's own records")
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        le=TOKEN_ID_MAX,
        description="cut each input to this many tokens (-1: the model's limit); without it a longer input is a 400",
    )
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX, description="lower is served first")

    @field_validator("input", mode="before", json_schema_input_type=Input)
    @classmethod
    def _inputs(cls, v):
        """Every shape as a list of inputs (each a text or token ids), none empty."""
        if isinstance(v, str):
            v = [v]
        elif isinstance(v, list) and v and all(_is_id(t) for t in v):
            v = [v]
        if not isinstance(v, list):
            raise ValueError("a string, a list of strings, a list of token ids or a list of token-id lists")
        if not v:
            raise ValueError("must not be empty")
        if len({isinstance(t, str) for t in v}) > 1:
            raise ValueError("all strings or all lists of token ids, not both")
        for i, t in enumerate(v):
            if isinstance(t, str):
                if not t:
                    raise ValueError(f"input[{i}] is an empty string")
            elif isinstance(t, list) and all(_is_id(x) for x in t):
                if not t:
                    raise ValueError(f"input[{i}] is an empty list of token ids")
                if any(not 0 <= x <= TOKEN_ID_MAX for x in t):
                    raise ValueError(f"input[{i}]: token ids are whole numbers from 0 to {TOKEN_ID_MAX}")
            else:
                raise ValueError(f"input[{i}]: a string or a list of token ids, not {type(t).__name__}")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be at least 1, or -1 (the model's limit)")
        return v


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or (encoding_format base64) base64 float32")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


def floats(b64: str) -> list[float]:
    """A vector from its base64 little-endian float32 bytes (a worker's result)."""
    values = array.array("f", base64.b64decode(b64))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def body(response_id: str, created: int, model: str, vectors: list[str], encoding_format: str, tokens: int) -> dict:
    """The answer (EmbeddingResponse's shape, built as a dict: thousands of floats), from the
    workers' base64 vectors in input order."""
    data = [
        {"object": "embedding", "index": i, "embedding": v if encoding_format == "base64" else floats(v)}
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"id": response_id, "object": "list", "created": created, "model": model, "data": data, "usage": usage}
