"""Pydantic schemas of what travels between the API and the workers: the job contract.

`JobSpec` is what the API validates and puts on the queue; `GenerationResult` is what a worker
returns into the Celery result backend. Both are plain JSON on the wire. The HTTP API's own
request and response bodies are webapp/protocol/.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class JobStatus(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"  # its deadline passed before it started: it never ran

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled, JobStatus.expired)


# The most alternatives a job may ask log-probabilities for at each token (OpenAI's limit for
# completions), and the most stop token ids.
LOGPROBS_MAX = 5
STOP_TOKEN_IDS_MAX = 16
# Seeds are any 64-bit signed integer, as vLLM's.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# The most entries of `logit_bias` (OpenAI: 300), `allowed_token_ids` and `bad_words`.
LOGIT_BIAS_MAX = 300
ALLOWED_TOKEN_IDS_MAX = 4096
BAD_WORDS_MAX = 64
TOKEN_ID_MAX = 2**31 - 1


class StructuredOutput(BaseModel):
    """A constraint on the completion's text (vLLM's StructuredOutputsParams): exactly one of
    `json_schema` (a JSON Schema, as JSON text), `json_object` (any JSON object), `regex`,
    `choice` (one of these strings) and `grammar` (EBNF, or Lark). The hf engine masks the logits
    of the rows that have one with xgrammar (worker/engines/structured.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_schema: str | None = Field(None, description="a JSON Schema, as JSON text")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=256)
    grammar: str | None = None
    disable_any_whitespace: bool = Field(False, description="JSON without whitespace between its tokens")
    after: str | None = Field(
        None,
        description="the constraint holds from where the output first holds this text on (the end of "
        "a reasoning span: set by the API with GENQ_REASONING_PARSER, as vLLM applies structured output "
        "to what follows the reasoning); before it, any text",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutput:
        kinds = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                f"exactly one of json, json_object, regex, choice, grammar is needed, not {kinds or 'none'}"
            )
        return self

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (a cache key)."""
        return (
            self.json_schema,
            self.json_object,
            self.regex,
            tuple(self.choice or ()),
            self.grammar,
            self.disable_any_whitespace,
        )


class SamplingParams(BaseModel):
    """Per-job decoding parameters. Greedy unless `temperature` > 0. The penalties, `min_tokens`,
    `stop_token_ids` and `logprobs` are vLLM's, with vLLM's meaning; each one's default is
    neutral (it changes nothing)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str] = Field(default_factory=list, max_length=8)
    ignore_eos: bool = False
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        allow_inf_nan=False,
        description="> 1 discourages every token of the prompt and the output so far (1: off)",
    )
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        allow_inf_nan=False,
        description="subtracted from the logit of every token the output already has (0: off)",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        allow_inf_nan=False,
        description="subtracted from a token's logit once per time the output has it (0: off)",
    )
    min_tokens: int = Field(
        0, ge=0, le=2**31 - 1, description="EOS and stop_token_ids are impossible before this many tokens"
    )
    stop_token_ids: list[int] = Field(
        default_factory=list,
        max_length=STOP_TOKEN_IDS_MAX,
        description="token ids that end the completion (not part of its text), beside EOS",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=LOGPROBS_MAX,
        description="return each token's log-probability and those of the n likeliest tokens",
    )
    # vLLM's other sampling and output parameters; each default changes nothing.
    min_p: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="drop tokens less likely than min_p times the likeliest one (sampling; 0: off)",
    )
    logit_bias: dict[int, float] = Field(
        default_factory=dict,
        max_length=LOGIT_BIAS_MAX,
        description="token id -> added to its logit, clamped to [-100, 100]",
    )
    allowed_token_ids: list[int] | None = Field(
        None, min_length=1, max_length=ALLOWED_TOKEN_IDS_MAX, description="only these tokens may be generated"
    )
    bad_words: list[str] = Field(
        default_factory=list, max_length=BAD_WORDS_MAX, description="words (token sequences) never generated"
    )
    structured_outputs: StructuredOutput | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    add_special_tokens: bool | None = Field(
        None, description="tokenize the prompt with the model's special tokens (None: yes, but not for chat)"
    )
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=TOKEN_ID_MAX, description="keep only the prompt's last k tokens (-1: the model's context)"
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=LOGPROBS_MAX, description="each prompt token's log-probability and the n likeliest there"
    )
    return_token_ids: bool = Field(False, description="the result carries the prompt's and the completion's token ids")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v):
        # JSON object keys are strings: token ids as decimal text (OpenAI's format).
        if isinstance(v, dict):
            try:
                return {int(k) if isinstance(k, str) else k: b for k, b in v.items()}
            except ValueError:
                raise ValueError("keys are token ids (whole numbers)") from None
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_values(cls, v: dict[int, float]) -> dict[int, float]:
        if any(not 0 <= t <= TOKEN_ID_MAX for t in v):
            raise ValueError(f"token ids are whole numbers from 0 to {TOKEN_ID_MAX}")
        if any(b != b or b in (float("inf"), float("-inf")) for b in v.values()):
            raise ValueError("biases are finite numbers")
        return v

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(not 0 <= t <= TOKEN_ID_MAX for t in v):
            raise ValueError(f"token ids are whole numbers from 0 to {TOKEN_ID_MAX}")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str]) -> list[str]:
        if any(not w.strip() for w in v):
            raise ValueError("bad words must not be empty")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be at least 1, or -1 (the model's context)")
        return v

    @field_validator("stop", mode="before", json_schema_input_type=str | list[str])
    @classmethod
    def _one_stop(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int]) -> list[int]:
        if any(not 0 <= t < 2**31 for t in v):
            raise ValueError("token ids are whole numbers from 0 to 2**31 - 1")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, v: int, info: ValidationInfo) -> int:
        most = info.data.get("max_new_tokens")
        if most is not None and v > most:
            raise ValueError(f"must not exceed max_new_tokens ({most})")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def masked(self) -> bool:
        """Whether some token may be banned or biased at some step (the logits processors')."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words or self.structured_outputs)

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def for_choice(self, j: int) -> SamplingParams:
        """The parameters of the `j`-th of `n` completions of one prompt: its own seed (the
        request's seed + j), so that seeded choices differ and each can be reproduced."""
        if j == 0 or self.seed is None:
            return self
        seed = (self.seed + j - SEED_MIN) % 2**64 + SEED_MIN  # wraps around within 64 bits
        return self.model_copy(update={"seed": seed})


# A job's priority: as vLLM's, a lower value is served first. 0 (the default) is the middle, so
# that there is room above (urgent) and below (batch work). tasks/celery_app.py maps it onto
# the broker's priority sub-queues.
PRIORITY_MIN, PRIORITY_MAX = -4, 4


class ChatMessage(BaseModel):
    """One message of a conversation, its content as text (the API joins text parts). An
    assistant message may carry the calls it made (`tool_calls`, OpenAI's shape: `id`, `type`,
    `function.name`, `function.arguments` as JSON text; its content then may be None), a `tool`
    message the result of one (`tool_call_id`)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatOptions(BaseModel):
    """A chat job's conversation and chat-template options: the worker renders them into the
    job's prompt with the model's chat template (worker/chat.py)."""

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[dict[str, Any]] | None = Field(
        None, description="the request's tools (OpenAI's shape), the template's `tools` variable"
    )


# What a chat request to a model without a chat template is told (API and worker alike).
NO_CHAT_TEMPLATE = "this model has no chat template; start its worker with GENQ_CHAT_TEMPLATE=<file>"


# The most inputs one embedding job may carry (GENQ_MAX_EMBED_INPUTS is at most this).
EMBED_INPUTS_MAX = 8192


class EmbedOptions(BaseModel):
    """An embedding job (POST /v1/embeddings): its inputs, each a text or token ids, embedded
    by a worker whose model is a sentence-embedding one (worker/engines/embed.py)."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[str | list[int]] = Field(min_length=1, max_length=EMBED_INPUTS_MAX)
    dimensions: int | None = Field(None, ge=1, description="keep the first n dimensions, renormalized (Matryoshka)")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=TOKEN_ID_MAX, description="cut each input to k tokens (-1: the model's limit)"
    )


class JobSpec(BaseModel):
    """What a worker receives: one prompt, resolved model name, complete parameters."""

    id: str
    model: str
    prompt: str
    prompt_token_ids: list[int] | None = Field(None, description="the prompt as token ids (then `prompt` is empty)")
    chat: ChatOptions | None = Field(None, description="a chat job: the worker renders its prompt from these")
    embed: EmbedOptions | None = Field(None, description="an embedding job: its inputs (`prompt` is empty)")
    params: SamplingParams
    stream: bool = Field(True, description="publish token events (False: nobody can follow them)")
    priority: int = 0
    deadline: float | None = Field(None, description="unix time; past it the job expires or times out")
    owner: str | None = Field(None, description="the submitting API key's name (never the key)")
    weight: int = Field(1, ge=1, description="its owner's fair-share weight (tasks/fair.py, the engine's order)")
    callback_url: str | None = Field(None, description="where the API POSTs the job's record once it ends")
    republished_after: int | None = Field(
        None,
        description="set on a message recovery published again: the job's attempts then. A worker starts a job "
        "only from that count (0 for the API's own message): another copy of a message whose job started since "
        "(kept by a worker across a Redis failover, or given back by kombu) is dropped, not run twice",
    )


class Logprobs(BaseModel):
    """Log-probabilities of a completion's tokens, in OpenAI's completions format (also vLLM's):
    one entry per generated token in each list. Values are those of the model's own
    distribution (log-softmax of its logits, before temperature and penalties), as vLLM's
    default; -9999.0 stands for minus infinity."""

    tokens: list[str] = Field(default_factory=list, description="each token as text")
    token_logprobs: list[float] = Field(default_factory=list, description="each token's log-probability")
    top_logprobs: list[dict[str, float]] = Field(
        default_factory=list, description="per token: the `logprobs` likeliest tokens and the chosen one"
    )
    text_offset: list[int] = Field(
        default_factory=list, description="where each token starts, in characters from the completion's start"
    )

    def extend(self, other: Logprobs) -> None:
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self, name).extend(getattr(other, name))


class PromptLogprob(BaseModel):
    """A prompt position's token, as vLLM's `prompt_logprobs` entries."""

    logprob: float
    rank: int | None = Field(None, description="1: the likeliest token there")
    decoded_token: str | None = None


class GenerationResult(BaseModel):
    text: str = Field(description="the completion, without the prompt")
    finish_reason: Literal["length", "stop", "eos", "cancelled", "timeout"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(
        0, ge=0, description="prompt tokens whose keys/values came from the engine's prefix cache (not computed)"
    )
    batch_size: int = Field(description="the largest batch this job was decoded in")
    model: str
    worker: str | None = None
    logprobs: Logprobs | None = Field(None, description="with the job's `logprobs` parameter")
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None,
        description="with `prompt_logprobs`: per prompt token (None for the first), token id -> its logprob",
    )
    prompt_token_ids: list[int] | None = Field(None, description="with `return_token_ids`")
    token_ids: list[int] | None = Field(None, description="with `return_token_ids`: the completion's")
    embeddings: list[str] | None = Field(
        None, description="an embedding job's vectors, one per input in order: little-endian float32, base64"
    )
