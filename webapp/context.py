"""Does a prompt fit the model's context? Decided at submit, without a tokenizer (the API never
loads one), from what the model's live workers announce in their heartbeats: the context
(`max_model_len`), their tokenizer's bound on a text's tokens (`token_bound`, per UTF-8 byte,
worker/tokenbound.py) and their chat template's bound on what it adds to a conversation
(`chat_bound`, worker/chatbound.py). A prompt whose bound plus its completion fits surely fits,
and nothing more is done (the common case, conversations included); token ids are counted
exactly; only the rest (and every conversation where a worker could not bound its template, or
with `chat_template_kwargs`, which the template may read for anything) is counted by a worker
(webapp/completions.py, through webapp/tokens.py). A prompt that does not fit is refused
with vLLM's error, 400 `prompt_too_long`; the worker's own check stays behind it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tasks.registry import ChatBound, TokenBound, WorkerInfo
from tasks.schemas import ChatOptions
from webapp.errors import APIError


@dataclass(frozen=True)
class Context:
    """What a model's live workers say about its prompts: its context in tokens (the smallest
    any of them has: a job may go to any), the bound on a text's tokens (the loosest; per
    byte None: none known, every prompt is counted) and on what the chat template adds to a
    conversation (the loosest; None: every conversation is counted)."""

    max_model_len: int
    bound: TokenBound
    chat: ChatBound | None = None


def context_of(workers: Iterable[WorkerInfo]) -> Context | None:
    """The context of these workers (one model's), or None where prompts are not checked at
    submit: no live worker, or one that announces no context or counts no prompts (no
    tokenizer, an older worker: asked to count, it could not)."""
    workers = list(workers)
    if not workers or any(w.max_model_len is None or w.token_bound is None for w in workers):
        return None
    bounds = [w.token_bound for w in workers]
    per_byte = None if any(b.per_byte is None for b in bounds) else max(b.per_byte for b in bounds)
    bound = TokenBound(per_byte=per_byte, extra=max(b.extra for b in bounds))
    chats = [w.chat_bound for w in workers]
    chat = None
    if all(c is not None for c in chats):
        chat = ChatBound(base=max(c.base for c in chats), per_message=max(c.per_message for c in chats))
    return Context(min(w.max_model_len for w in workers), bound, chat)


def upper_bound(prompt: str | list[int], bound: TokenBound) -> int | None:
    """At most how many tokens `prompt` is: token ids exactly, a text by the bound (None when
    there is none)."""
    if not isinstance(prompt, str):
        return len(prompt)
    if bound.per_byte is None:
        return None
    return bound.per_byte * len(prompt.encode("utf-8", "surrogatepass")) + bound.extra


def chat_upper_bound(chat: ChatOptions, ctx: Context, add_special_tokens: bool = False) -> int | None:
    """At most how many tokens the worker's template makes of the conversation: the template's
    own (`ctx.chat`) plus each message's content and name by the text bound, and the special
    tokens a request that asks for them adds. None where only a worker can tell: no bound on
    the template or the text, or `chat_template_kwargs`, which the template may read for
    anything (a system prompt, a switch that adds one), and tools, tool calls and tool results,
    which each template renders its own way (worker/chatbound.py measures none)."""
    if ctx.chat is None or ctx.bound.per_byte is None or chat.chat_template_kwargs or chat.tools:
        return None
    if any(m.role == "tool" or m.tool_calls or m.content is None for m in chat.messages):
        return None
    total = ctx.chat.base + (ctx.bound.extra if add_special_tokens else 0)
    for m in chat.messages:
        total += ctx.chat.per_message + upper_bound(m.content, ctx.bound)
        if m.name is not None:
            total += upper_bound(m.name, ctx.bound)
    return total


def kept(tokens: int, truncate: int | None, max_model_len: int) -> int:
    """The prompt's tokens after `truncate_prompt_tokens` (its last k; -1: the context), as
    the engines keep them."""
    if truncate is None:
        return tokens
    return min(tokens, max_model_len if truncate == -1 else truncate)


def surely_fits(
    prompt: str | list[int], max_new: int, ctx: Context, truncate: int | None = None, exact: bool = False
) -> bool | None:
    """True when the prompt and `max_new` tokens surely fit the context, False when they
    surely do not (token ids: `exact`), None when only counting the prompt's tokens can tell."""
    bound = upper_bound(prompt, ctx.bound)
    if bound is None:
        return None
    if kept(bound, truncate, ctx.max_model_len) + max_new <= ctx.max_model_len:
        return True
    return False if not isinstance(prompt, str) else None


def chat_surely_fits(
    chat: ChatOptions, max_new: int, ctx: Context, truncate: int | None = None, add_special_tokens: bool = False
) -> bool:
    """True when the conversation's prompt and `max_new` tokens surely fit the context; False
    when only counting its tokens can tell."""
    bound = chat_upper_bound(chat, ctx, add_special_tokens)
    return bound is not None and kept(bound, truncate, ctx.max_model_len) + max_new <= ctx.max_model_len


def fits(prompt_tokens: int, max_new: int, max_model_len: int) -> bool:
    return prompt_tokens + max_new <= max_model_len


def too_long(
    max_model_len: int, prompt_tokens: int, max_new: int, field: str, max_tokens_field: str = "max_new_tokens"
) -> APIError:
    """vLLM's error for a request past the context, naming the field to shorten: the prompt
    (`prompt`, `messages`) when it leaves no room for a single token, else the request's
    `max_tokens_field` (OpenAI's `max_tokens`, the job API's `max_new_tokens`)."""
    param = field if prompt_tokens >= max_model_len else max_tokens_field
    return APIError(
        400,
        "prompt_too_long",
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_tokens + max_new} tokens ({prompt_tokens} in the messages, {max_new} in the completion). "
        "Please reduce the length of the messages or completion.",
        param=param,
    )
