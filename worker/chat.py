"""Chat templates and tokenization, in the worker because it holds the model's tokenizer.

A chat job travels as its messages (JobSpec.chat); here they become the job's prompt with
transformers' own `apply_chat_template(..., tokenize=False)`, the renderer the template was
written for, before the engine sees the job. The rendered text already holds the template's
special tokens (BOS and the like), so the engines tokenize a chat prompt without adding them
again (`add_special_tokens=False`, as vLLM does). The request's tools are the template's `tools`
variable, as transformers and vLLM pass them. `GENQ_CHAT_TEMPLATE` (a Jinja file) is the
template of a model that has none, and replaces the model's own where both exist (as vLLM's
`--chat-template`). The API's `/tokenize` and `/detokenize` are answered here too (the
`genq.tokenize` task, worker/tasks.py), and its count of a prompt's tokens at submit (`count`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.schemas import NO_CHAT_TEMPLATE, ChatMessage, ChatOptions, JobSpec
from worker.engines.base import GenerationError


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as templates read it, as vLLM passes it: its set fields, a null content as ""
    (an assistant message of tool calls alone; templates join contents as strings), and each
    tool call's `arguments` as the object they hold rather than its JSON text (templates write
    `tool_call.arguments | tojson`); the API checked they are a JSON object's text."""
    out = message.model_dump(exclude_none=True)
    out.setdefault("content", "")
    if message.tool_calls:
        out["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
            for call in message.tool_calls
        ]
    return out


class Chat:
    """The chat template and tokenizer of one worker (`tok`: a transformers tokenizer, or
    None for engines without one: echo and sim)."""

    def __init__(self, tok: Any, template_file: str | None = None, max_model_len: int | None = None):
        self.tok = tok
        self.max_model_len = max_model_len
        own = getattr(tok, "chat_template", None) if tok is not None else None
        self.template = Path(template_file).read_text() if template_file else own
        if tok is None:
            self.template = None

    @property
    def available(self) -> bool:
        return self.template is not None

    def render(self, chat: ChatOptions) -> str:
        """The prompt of a conversation: the template rendered over its messages."""
        if self.template is None:
            raise GenerationError("no_chat_template", NO_CHAT_TEMPLATE)
        try:
            return self.tok.apply_chat_template(
                [template_message(m) for m in chat.messages],
                chat_template=self.template,
                tools=chat.tools or None,
                tokenize=False,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                **chat.chat_template_kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - the template's own error (raise_exception(), Jinja)
            raise GenerationError("invalid_request", f"the chat template failed: {exc}") from None

    def prompt_of(self, spec: JobSpec) -> JobSpec:
        """The job with its prompt: a chat job's rendered, any other as it came."""
        if spec.chat is None:
            return spec
        return spec.model_copy(update={"prompt": self.render(spec.chat)})

    # -- /tokenize and /detokenize

    def answer(self, req: dict) -> dict:
        """The body of a tokenize or detokenize request, or {"error": {code, message}}."""
        if self.tok is None:
            return {"error": {"code": "invalid_request", "message": "this model's engine has no tokenizer"}}
        try:
            if req["op"] == "detokenize":
                return self._detokenize(req["tokens"])
            if req["op"] == "count":
                return self._count(req)
            return self._tokenize(req)
        except GenerationError as exc:
            return {"error": {"code": exc.code, "message": exc.message}}
        except Exception as exc:  # noqa: BLE001 - the tokenizer refused the input: say so, never leave the API waiting
            return {"error": {"code": "invalid_request", "message": f"the tokenizer failed: {exc}"}}

    def _tokenize(self, req: dict) -> dict:
        if req.get("chat") is not None:
            text = self.render(ChatOptions.model_validate(req["chat"]))
        else:
            text = req["prompt"]
        ids = self.tok(text, add_special_tokens=req["add_special_tokens"]).input_ids
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        body["token_strs"] = self.tok.convert_ids_to_tokens(ids) if req.get("return_token_strs") else None
        return body

    def _count(self, req: dict) -> dict:
        """How many tokens each of `prompts` is, or the conversation `chat` rendered, as the
        engines tokenize a job's prompt (`add_special_tokens`; before any truncation): for the
        API's check against the context at submit (webapp/context.py)."""
        if req.get("chat") is not None:
            texts = [self.render(ChatOptions.model_validate(req["chat"]))]
        else:
            texts = req["prompts"]
        ids = self.tok(texts, add_special_tokens=req["add_special_tokens"]).input_ids
        return {"counts": [len(i) for i in ids], "max_model_len": self.max_model_len}

    def _detokenize(self, tokens: list[int]) -> dict:
        size = len(self.tok)
        bad = [t for t in tokens if not 0 <= t < size]
        if bad:
            raise GenerationError(
                "invalid_request", f"tokens: {bad[0]} is not a token id of this model (0 to {size - 1})"
            )
        return {"prompt": self.tok.decode(tokens)}
