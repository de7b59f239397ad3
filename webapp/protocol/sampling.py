"""The sampling fields /v1/completions and /v1/chat/completions share, in one base model
(`SamplingRequest`, as vLLM's requests build their SamplingParams): one table of what a field
sent as null (or left out) means (`DEFAULTS`), the job's SamplingParams built from it once
(`to_params`), and each check both APIs make written once. Structured outputs (`response_format`,
`structured_outputs`, `guided_*`) become the job's StructuredOutput here too."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.schemas import (
    LOGPROBS_MAX,
    PRIORITY_MAX,
    PRIORITY_MIN,
    SEED_MAX,
    SEED_MIN,
    STOP_TOKEN_IDS_MAX,
    TOKEN_ID_MAX,
    SamplingParams,
)
from webapp.errors import APIError
from webapp.protocol.common import invalid, unsupported
from webapp.protocol.jobs import Jobs, Scheduling

# What a field sent as null, or left out, means: OpenAI's and vLLM's defaults (vLLM's
# `_DEFAULT_SAMPLING_PARAMS`), which the schema documents as the fields' defaults. Each is the
# job's SamplingParams field of that name (None: the job's own default).
DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "ignore_eos": False,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "add_special_tokens": None,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "return_token_ids": False,
}

# The types of the sampling fields each API declares in its own place (SamplingRequest).
Temperature = Annotated[float | None, Field(ge=0.0, le=2.0)]
TopP = Annotated[float | None, Field(gt=0.0, le=1.0)]
Seed = Annotated[int | None, Field(ge=SEED_MIN, le=SEED_MAX)]
Stop = str | list[str] | None

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's (vLLM's) named JSON Schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON Schema."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsIn(BaseModel):
    """vLLM's `structured_outputs` (StructuredOutputsParams), as a request sends it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # Accepted at their neutral values only.
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class SamplingRequest(BaseModel):
    """The fields completions and chat declare alike: vLLM's sampling and output parameters (all
    implemented), OpenAI's penalties, vLLM's sampling extensions, the priority, and OpenAI's
    fields that are accepted and not used. Each API declares `model`, `temperature`, `top_p`,
    `stop`, `seed`, `n`, `best_of`, `stream` and `stream_options` itself, where its schema lists
    them (with the types above), and its fields accepted at neutral values only (`NEUTRAL`)."""

    # A field accepted only at a value that changes nothing -> those values.
    NEUTRAL: ClassVar[dict[str, tuple]] = {}

    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as text) -> bias, clamped to ±100")
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = DEFAULTS["include_stop_str_in_output"]
    skip_special_tokens: bool | None = DEFAULTS["skip_special_tokens"]
    spaces_between_special_tokens: bool | None = DEFAULTS["spaces_between_special_tokens"]
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=TOKEN_ID_MAX)
    prompt_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX)
    return_token_ids: bool | None = DEFAULTS["return_token_ids"]
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    # vLLM's former names of structured_outputs' fields.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    presence_penalty: float | None = Field(DEFAULTS["presence_penalty"], ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(DEFAULTS["frequency_penalty"], ge=-2.0, le=2.0, allow_inf_nan=False)
    # vLLM's extensions.
    top_k: int | None = Field(DEFAULTS["top_k"], ge=-1, description="0 or -1 disables top-k")
    ignore_eos: bool | None = DEFAULTS["ignore_eos"]
    repetition_penalty: float | None = Field(DEFAULTS["repetition_penalty"], gt=0.0, le=10.0, allow_inf_nan=False)
    min_tokens: int | None = Field(DEFAULTS["min_tokens"], ge=0, le=2**31 - 1)
    stop_token_ids: list[int] | None = Field(None, max_length=STOP_TOKEN_IDS_MAX)
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX, strict=True, description="lower is served first")
    # genqueue's extension: each job's record is POSTed there once it ends (webapp/callbacks.py).
    callback_url: str | None = Field(
        None, min_length=1, max_length=2048, description="genqueue: POST each job's record here once it ends"
    )
    # Accepted and not used: they do not change what is generated.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    request_id: str | None = None
    cache_salt: str | None = None

    @property
    def choices(self) -> int:
        """Completions per prompt (`n`)."""
        return self.n or 1

    @property
    def ranked(self) -> int | None:
        """`best_of` where it asks for more than `n` (the answer keeps the best `n`), else None."""
        return self.best_of if (self.best_of or 1) > self.choices else None

    def refuse_neutral(self) -> None:
        """400 `unsupported_parameter`, naming the first, for a field of NEUTRAL at another value."""
        for name, neutral in self.NEUTRAL.items():
            if getattr(self, name) not in neutral:
                raise unsupported(name)

    def check_best_of(self) -> None:
        if self.best_of is not None and self.best_of < self.choices:
            raise APIError(400, "invalid_request", f"best_of must be at least n ({self.choices})", param="best_of")
        if self.ranked and self.stream:
            raise APIError(400, "invalid_request", "best_of above n cannot be streamed", param="best_of")

    def check_min_tokens(self, most: int | None) -> None:
        """`min_tokens` within the request's `max_tokens` (`most`; None: the server's default)."""
        if self.min_tokens and most is not None and self.min_tokens > most:
            raise invalid("min_tokens", f"must not exceed max_tokens ({most})")

    def to_params(self, max_new_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The job's SamplingParams: each field of DEFAULTS as sent (its default for null), and
        those that take more than a copy; 400 naming the field for what the job cannot take."""
        fields = {name: default if (v := getattr(self, name)) is None else v for name, default in DEFAULTS.items()}
        fields.update(
            max_new_tokens=max_new_tokens,
            logprobs=logprobs,
            top_k=max(fields["top_k"], 0),  # vLLM's -1, as 0, disables top-k
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            bad_words=list(self.bad_words or []),
            allowed_token_ids=self.allowed_token_ids or None,  # none listed: every token
            logit_bias=self.token_bias(),
            structured_outputs=self.structured(),
        )
        return SamplingParams.model_validate(fields)

    def token_bias(self) -> dict[int, float]:
        bias: dict[int, float] = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                bias[int(k)] = v
            except ValueError:
                raise invalid("logit_bias", f"{k!r} is not a token id") from None
        return bias

    def jobs(self, prompts: list[str | list[int]], params: SamplingParams, **kw: Any) -> Jobs:
        """The request's Jobs: what completions and chat set alike, and `kw`."""
        return Jobs(
            prompts,
            params,
            Scheduling(priority=self.priority),
            model=self.model,
            n=self.choices,
            stream=bool(self.stream),
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
            best_of=self.ranked,
            max_tokens_field="max_tokens",
            callback_url=self.callback_url,
            **kw,
        )

    def structured(self) -> dict | None:
        """The job's StructuredOutput (as a dict), from `response_format`, `structured_outputs`
        or the `guided_*` fields (response_format overrides, as in vLLM); 400 naming the field
        for what is not valid."""
        so = self.structured_outputs
        out: dict[str, Any] = {}
        name = "structured_outputs"
        if so is not None:
            for field in ("disable_additional_properties", "whitespace_pattern", "structural_tag"):
                if getattr(so, field) not in (None, False):
                    raise unsupported(f"{name}.{field}")
            kinds = dict(zip(CONSTRAINTS, (so.json_, so.regex, so.choice, so.grammar, so.json_object or None)))
            out = {k: v for k, v in kinds.items() if v is not None}
            if so.disable_any_whitespace:
                out["disable_any_whitespace"] = True
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        if any(v is not None for v in guided.values()):
            name = next(f"guided_{k}" for k, v in guided.items() if v is not None)
            out.update({k: v for k, v in guided.items() if v is not None})
        rf = self.response_format
        if rf is not None and rf.type != "text":
            name = "response_format"
            for k in CONSTRAINTS:
                out.pop(k, None)
            if rf.type == "json_object":
                out["json_object"] = True
            elif rf.json_schema is None or rf.json_schema.json_schema is None:
                raise invalid(name, "json_schema.schema is needed")
            else:
                out["json"] = rf.json_schema.json_schema
        kinds = [k for k in CONSTRAINTS if k in out]
        if not kinds:
            if so is not None:
                raise invalid(name, f"one of {', '.join(CONSTRAINTS)} is needed")
            return None
        if len(kinds) > 1:
            raise invalid(name, f"only one kind of constraint may be given, not {' and '.join(kinds)}")
        if "json" in out:
            schema = out.pop("json")
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError:
                    raise invalid(name, "the JSON schema is not JSON") from None
            if not isinstance(schema, (dict, bool)):
                raise invalid(name, "a JSON schema is an object")
            out["json_schema"] = json.dumps(schema, sort_keys=True)
        if "regex" in out:
            try:
                re.compile(out["regex"])
            except re.error as exc:
                raise invalid(name, f"not a regular expression ({exc})") from None
        if "choice" in out and (not out["choice"] or len(out["choice"]) > 256):
            raise invalid(name, "1 to 256 choices")
        return out
