"""vLLM's POST /tokenize (a prompt, or a conversation through its chat template) and POST
/detokenize, which a worker of the model answers (webapp/tokens.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, RootModel

from webapp.protocol.chat import ChatTemplateFields


class TokenizePrompt(BaseModel):
    """Body of POST /tokenize for a prompt."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="as a completion's prompt is tokenized")
    return_token_strs: bool = False


class TokenizeChat(ChatTemplateFields):
    """Body of POST /tokenize for a conversation: the prompt its chat template renders."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    add_special_tokens: bool = Field(False, description="the template holds its special tokens already")
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizeRequest(RootModel[TokenizeChat | TokenizePrompt]):
    """Body of POST /tokenize: a `prompt`, or the `messages` of a conversation."""
