"""Settings read from the environment, shared by the API and the workers."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from functools import lru_cache
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class _Env(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GENQ_", extra="ignore")


class RedisSettings(_Env):
    """Where Redis is (to deploy)."""

    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias="REDIS_URL")
    redis_sentinels: str = Field(
        "",
        pattern=r"^\s*([^\s,:]+:\d{1,5}(\s*,\s*[^\s,:]+:\d{1,5})*)?\s*$",
        description="Redis Sentinel: host:port,host:port,... of the sentinels; set, every process finds "
        "the master through them (tasks/redis_conn.py) and REDIS_URL is not used",
    )
    redis_master: str = Field(
        "mymaster", min_length=1, description="Redis Sentinel: the name the sentinels monitor the master under"
    )
    data_dir: str = Field(".data", description="`make run`'s private Redis data (relative: to the project)")


class ApiSettings(_Env):
    """The HTTP API: where it listens, its processes, its keys (to deploy)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_workers: int = Field(2, ge=1)
    api_connections: int = Field(1000, ge=1, description="open requests per API process")
    body_timeout: float = Field(
        30.0,
        ge=0,
        description="seconds a request body may take to arrive, a second more per MiB arrived (408 "
        "body_timeout); 0: no deadline (webapp/bodyguard.py)",
    )
    max_bodies_per_client: int = Field(
        32,
        ge=0,
        description="request bodies one client (an address, an API key) may be sending at once to one "
        "API process (429 too_many_bodies); 0: no bound",
    )
    api_keys: SecretStr | None = Field(None, description="comma list of API keys (see webapp/auth.py)")
    api_keys_file: str | None = Field(None, description="one API key (or sha256:<hex>) per line, with name and limits")
    tool_call_parser: Literal["hermes", "llama3_json", "llama4_json", "mistral", "pythonic"] | None = Field(
        None,
        description="the parser of the served model's tool calls for `tool_choice: \"auto\"` (vLLM's "
        "--tool-call-parser names, webapp/parsers/); none: `auto` with tools is refused",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None,
        description="the parser of the served model's reasoning (vLLM's --reasoning-parser names): a chat "
        "answer's think span goes to `reasoning`, not `content`; none: the output is content as it is",
    )


class EngineSettings(_Env):
    """The model a worker serves and how its engine runs it."""

    model: str = "facebook/opt-125m"
    model_name: str | None = None
    gguf_cache: str = Field(
        "~/.cache/genqueue/gguf",
        description="where a GENQ_MODEL that is a .gguf file is converted to (once) and loaded from (worker/gguf.py)",
    )
    engine: Literal["hf", "vllm", "llamacpp", "embed", "echo", "sim"] = Field(
        "hf",
        description="hf with a sentence-transformers folder (modules.json) as GENQ_MODEL serves embeddings "
        "(the embed engine, worker/engines/embed.py)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights' dtype; auto: bfloat16 on CPUs with native bf16, else float32"
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda|cuda:\d+)$",
        description="hf engine: where the model and its "
        "KV cache live: auto (CUDA when torch sees a GPU, else cpu), cpu, cuda or cuda:N",
    )
    max_batch_size: int = Field(32, ge=1, le=1024)
    chat_template: str | None = Field(
        None,
        description="a chat template (Jinja) file: the template of a model that has none, in place "
        "of the model's own where it has one (as vLLM's --chat-template); rendered by the worker",
    )
    torch_threads: int = Field(
        0, ge=0, description="the hf engine's torch (OpenMP) threads; 0: torch's default, one per core"
    )
    packed_linears: bool = Field(
        True,
        description="hf and embed engines: linear layers through oneDNN with weights packed at load "
        "(worker/engines/packed.py); false: PyTorch's nn.Linear",
    )
    background_step_every: int = Field(
        4,
        ge=1,
        description="hf engine: while foreground jobs (priority <= 0) run, background jobs "
        "(priority > 0: batch lines) take one decode step in this many; 1: every step",
    )
    reserved_slots: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="hf engine: jobs a worker takes beyond GENQ_MAX_BATCH_SIZE, so "
        "that foreground jobs (priority <= 0) reach it while batch lines fill every row (they then "
        "preempt a line); the batch driver leaves half of them free of lines; default: an eighth",
    )
    prefix_cache_gib: float | None = Field(
        None,
        ge=0,
        description="hf engine: memory for the keys/values of prompts' prefixes kept for later jobs "
        "(worker/engines/prefix.py), GiB; 0: no prefix caching; default: a tenth of the machine's "
        "(the GPU's) memory, at most 4",
    )
    max_prefill_tokens: int = Field(
        512,
        ge=0,
        description="hf engine: prompt tokens one step feeds at most, beside the running jobs' next "
        "tokens; a longer prompt is prefilled in chunks over several steps (with the prefix cache on), "
        "so that running streams keep their pace and short jobs do not wait behind it; 0: no bound",
    )
    prefill_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="hf engine: while interactive (not batch) jobs are decoding, the share of the engine's time that chunks "
        "of long prompts may take: after a chunk of t seconds, the running jobs get t * (1 - share) / "
        "share seconds of steps without one; 1: a chunk every step",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="llamacpp engine: llama.cpp's KV cache (default 0.375); hf engine: memory for the running batch's keys/values; a job whose row could "
        "take the batch past it (its prompt and max_new_tokens counted) waits for rows to leave; "
        "default: a quarter of the machine's (the GPU's) memory",
    )
    llamacpp_kv: Literal["shared", "split"] = Field(
        "shared",
        description="llamacpp engine: one KV cache the running jobs share (a job may use all of it), or "
        "split: a stream each of GENQ_KV_CACHE_GIB / GENQ_MAX_BATCH_SIZE (a job's context is at most "
        "that, as llama-server's slots; decode may be faster, and prompts are kept for later jobs)",
    )
    prefix_block_tokens: int = Field(
        16, ge=1, le=1024, description="hf engine: the prefix cache's block; prefixes are reused in whole blocks"
    )
    embed_batch_tokens: int = Field(
        4096,
        ge=16,
        description="embed engine: tokens one forward takes at most (the inputs' own where it runs without "
        "padding, else rows x the longest); the oldest jobs' inputs are packed into forwards of this size, "
        "shortest first",
    )
    vllm_enforce_eager: bool = Field(True, description="no graph capture/compilation (CPU: no gain)")
    vllm_kv_cache_gib: int = Field(1, ge=1, description="vLLM's KV cache on CPU, GiB")
    vllm_gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="vLLM (GPU): the share of each GPU's memory this engine takes; "
        "two workers on one GPU need a share each that adds up to at most 1",
    )
    vllm_tensor_parallel_size: int = Field(1, ge=1, description="vLLM: GPUs one engine shards the model over")
    vllm_max_model_len: int | None = Field(
        None, ge=16, description="vLLM: the context it serves (a smaller one needs less KV cache); default: the model's"
    )
    sim_step_ms: str = Field(
        "5+0.5",
        pattern=r"^\s*\d+(\.\d*)?\s*(\+\s*\d+(\.\d*)?\s*)?$",
        description="benchmarks only: the sim engine's decode step, 'a+b' sleeps a + b x batch ms "
        "(worker/engines/sim.py, docs/scaling.md)",
    )


class LimitSettings(_Env):
    """What one request and one job may take, and how long things are kept."""

    default_max_new_tokens: int = Field(32, ge=1)
    max_new_tokens_limit: int = Field(1024, ge=1)
    max_prompt_chars: int = Field(32_768, ge=1)
    max_embed_inputs: int = Field(
        2048, ge=1, le=8192, description="inputs one /v1/embeddings request (one batch line) may carry"
    )
    max_body_bytes: int = Field(1 << 20, ge=1024)
    job_timeout: int = Field(600, ge=1, description="seconds one job may run")
    max_attempts: int = Field(
        3, ge=1, description="attempts at a job whose worker dies or hangs before it fails (worker_lost)"
    )
    result_ttl: int = Field(86_400, ge=60, description="seconds a job and its result are kept")
    response_ttl: int = Field(
        86_400, ge=60, description="seconds a stored /v1/responses response (its conversation and output) is kept"
    )
    max_queue_depth: int = Field(1000, ge=1)
    max_wait: float = Field(300.0, ge=0, description="longest ?wait= and blocking call, seconds")


class BatchSettings(_Env):
    """Files and batches (webapp/batches/)."""

    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024, description="largest /v1/files upload, bytes")
    file_ttl: int = Field(7 * 86_400, ge=60, description="seconds a file (and a finished batch) is kept")
    batch_window: int = Field(256, ge=1, description="lines of one batch waiting or running at once")
    batch_job_ttl: int = Field(
        60,
        ge=0,
        description="seconds a batch line's jobs (their records and results) are kept once the line is written "
        "to the batch's output or error file (0: deleted then; never longer than GENQ_RESULT_TTL; a job with a "
        "callback_url: at least GENQ_CALLBACK_DEADLINE): Redis holds the jobs of the lines a batch settled in "
        "this long (some 7 KB a line), not its whole run's",
    )
    files_dir: str | None = Field(
        None,
        description="a directory (the same path in every API process: one host, or a shared volume) for the "
        "content of files and of a batch's output as it runs; Redis then keeps only their metadata and at "
        "most GENQ_FILES_FLUSH_LINES output lines per batch (webapp/batches/disk.py); unset: all in Redis",
    )
    files_flush_lines: int = Field(
        256,
        ge=1,
        description="with GENQ_FILES_DIR: the output (or error) lines a batch holds in Redis before "
        "the driver appends them to its part file on disk",
    )


class CallbackSettings(_Env):
    """Completion callbacks (webapp/callbacks.py)."""

    webhook_secret: SecretStr | None = Field(
        None, description="signs each callback: X-Genq-Signature: sha256=<hex HMAC-SHA256 of the body>"
    )
    callback_allow: str = Field(
        "",
        description="comma list of the hosts (host, host:port, or .suffix) a callback_url may point to; "
        "empty: any public address (loopback, private and link-local ones are refused unless listed)",
    )
    callback_deadline: float = Field(
        3600.0, gt=0, description="seconds after a job ends that its callback is retried before it is dropped"
    )
    callback_timeout: float = Field(10.0, gt=0, description="seconds one callback POST may take")
    callback_concurrency: int = Field(
        8, ge=1, le=256, description="callbacks one API process delivers at once (a slow receiver holds one of them)"
    )


class WorkerSettings(_Env):
    """How workers tell they are alive and find lost jobs."""

    heartbeat_interval: float = Field(2.0, gt=0)
    heartbeat_ttl: float = Field(10.0, gt=0)
    reconcile_interval: float = Field(
        10.0, gt=0, description="seconds between a worker's checks for jobs whose messages were lost"
    )
    workers: int = Field(1, ge=1, le=64, description="make run: worker processes per engine (scripts/stack.py)")
    placement: bool = Field(
        True,
        description="cache-aware placement: with several workers of a model, a job whose prompt starts "
        "like one a worker ran lately goes to that worker's own lane, where its prefix cache holds the "
        "prefix (tasks/placement.py)",
    )
    placement_min_chars: int = Field(
        1024, ge=1, description="placement: the shortest prompt prefix (characters) worth sending to one worker"
    )
    placement_max_waiting: int = Field(
        4,
        ge=1,
        description="placement: a worker with this many jobs waiting in its lane is too busy; the job goes to "
        "the shared queue, where any worker takes it",
    )
    fair_share: bool = Field(
        True,
        description="fair share between API keys inside one priority: a key's jobs wait in a line of "
        "their own and the workers take from the lines in turn, weighted by the keys' weight= "
        "(tasks/fair.py); off: first-in, first-out",
    )
    fair_depth: int = Field(
        1,
        ge=1,
        description="fair share: the messages one priority step of a model's Celery queue holds before "
        "further ones wait in their owners' lines (each a job committed first-in, first-out ahead of "
        "the next choice; a worker refills the list as it takes each job)",
    )


class ObservabilitySettings(_Env):
    """Metrics, logs, events (webapp/metrics.py, worker/metrics.py, tasks/logs.py)."""

    api_metrics: bool = Field(True, description="the API's /metrics and its request counts")
    metrics_port: int = Field(0, ge=0, le=65535, description="worker exporter: first port tried (0 = off)")
    metrics_host: str = Field("127.0.0.1", description="address the worker exporter listens on")
    celery_events: bool = Field(False, description="Celery task events (for Flower); cost time per job")
    flower: bool = Field(False, description="make run: start Flower beside the stack (scripts/stack.py)")
    log_format: Literal["text", "json"] = "text"


class Settings(
    RedisSettings,
    ApiSettings,
    EngineSettings,
    LimitSettings,
    BatchSettings,
    CallbackSettings,
    WorkerSettings,
    ObservabilitySettings,
):
    """Every setting, in its groups above; each is `GENQ_<NAME>` in the environment (REDIS_URL
    for `redis_url`). The API and the workers read the same ones."""

    @property
    def served_model(self) -> str:
        """GENQ_MODEL_NAME, else GENQ_MODEL (a GGUF file's: its name without `.gguf`)."""
        if self.model_name:
            return self.model_name
        if self.model.lower().endswith(".gguf"):
            return os.path.basename(self.model)[: -len(".gguf")]
        return self.model

    @property
    def auth_enabled(self) -> bool:
        """API keys are configured: every route but health and metrics needs one."""
        return bool((self.api_keys and self.api_keys.get_secret_value().strip()) or self.api_keys_file)

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """GENQ_REDIS_SENTINELS as (host, port) pairs; empty: Redis at REDIS_URL."""
        pairs = [a.strip().rsplit(":", 1) for a in self.redis_sentinels.split(",") if a.strip()]
        return [(host, int(port)) for host, port in pairs]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def is_loopback(host: str) -> bool:
    """Whether every address `host` stands for is a loopback one (unknown: not)."""
    try:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def queue_for(model: str) -> str:
    """The Celery queue that carries jobs for one served model name."""
    return "genq." + re.sub(r"[^A-Za-z0-9_.-]", "_", model)
