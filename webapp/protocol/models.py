"""OpenAI's GET /v1/models: the models live workers serve."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="unix time the first live worker serving it started")
    owned_by: str = "genqueue"
    max_model_len: int | None = Field(None, description="the model's context, in tokens")
    devices: list[str] = Field([], description="where its live workers run it (cpu, cuda:N)")


class ModelList(BaseModel):
    """GET /v1/models' answer: the models live workers serve."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
