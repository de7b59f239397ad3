"""Settings read from the environment, shared by the API and the workers."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GENQ_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias="REDIS_URL")
    model: str = "facebook/opt-125m"
    model_name: str | None = None
    engine: Literal["hf", "vllm", "echo"] = "hf"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    max_batch_size: int = Field(32, ge=1, le=1024)
    vllm_enforce_eager: bool = Field(True, description="no graph capture/compilation (CPU: no gain)")
    vllm_kv_cache_gib: int = Field(1, ge=1, description="vLLM's KV cache on CPU, GiB")
    default_max_new_tokens: int = Field(32, ge=1)
    max_new_tokens_limit: int = Field(1024, ge=1)
    max_prompt_chars: int = Field(32_768, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1024)

    job_timeout: int = Field(600, ge=1, description="seconds one job may run")
    visibility_timeout: int | None = Field(
        None, ge=1, description="seconds before an unacknowledged job is delivered again"
    )
    result_ttl: int = Field(86_400, ge=60, description="seconds a job and its result are kept")
    max_queue_depth: int = Field(1000, ge=1)
    max_wait: float = Field(300.0, ge=0, description="longest ?wait= and blocking call, seconds")

    host: str = "127.0.0.1"
    port: int = 8000
    api_workers: int = Field(2, ge=1)
    api_connections: int = Field(1000, ge=1, description="open requests per API process")

    heartbeat_interval: float = Field(2.0, gt=0)
    heartbeat_ttl: float = Field(10.0, gt=0)

    @property
    def served_model(self) -> str:
        return self.model_name or self.model

    @property
    def redelivery_after(self) -> int:
        """Above the longest job, or a slow job would be delivered twice."""
        return self.visibility_timeout or 2 * self.job_timeout + 60


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def queue_for(model: str) -> str:
    """The Celery queue that carries jobs for one served model name."""
    return "genq." + re.sub(r"[^A-Za-z0-9_.-]", "_", model)
