"""The OpenAI-style streams of an answer (`CompletionService.stream`, webapp/completions.py):
one choice per job, in the chunks of the API the request came from, usage counted from the
jobs' finish events, a failed job's error as the last event, `[DONE]` at the end; with tools, a
chat choice's text through its parser stream (webapp/parsers/). `sub` is the request's
`Submitted` (webapp/completions.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flask import Response

from webapp import sse
from webapp.errors import error_body, job_error_status
from webapp.parsers import REASONING_FIELD
from webapp.parsers.output import deltas
from webapp.protocol import chat, common, messages
from webapp.protocol.completions import choice, completion
from webapp.protocol.output import finish_reason


def _set(call: dict[str, Any]) -> dict[str, Any]:
    """A stream delta's tool call without its unset (null) fields."""
    out = {k: v for k, v in call.items() if v is not None}
    out["function"] = {k: v for k, v in call["function"].items() if v is not None}
    return out


class Relay:
    """What every OpenAI-style stream shares: one choice per job, usage counted from the jobs'
    finish events, a failed job's error as the last event, `[DONE]` at the end."""

    def __init__(self, sub: Any):
        self.sub = sub
        self.index = {job_id: i for i, job_id in enumerate(sub.ids)}
        self.counts = [0, 0, 0]  # prompt, completion, cached tokens

    def chunk(self, i: int, text: str, finish: str | None, logprobs: dict | None) -> str:
        raise NotImplementedError

    def usage_chunk(self) -> str:
        raise NotImplementedError

    def head(self) -> list[str]:
        return []

    def token(self, job_id, ev) -> str:
        if ev.finish and ev.usage:
            self.counts[0] += ev.usage["prompt_tokens"]
            self.counts[1] += ev.usage["completion_tokens"]
            self.counts[2] += common.cached_tokens(ev.usage)
        return self.chunk(self.index[job_id], ev.text, ev.finish, ev.logprobs)

    def end(self, _, ev) -> sse.Last:
        return sse.Last(sse.event(error_body(job_error_status(ev.error["code"]), **ev.error)))

    def restart(self, job_id, ev) -> sse.Last:
        # OpenAI's stream has no way to take text back; greedy and seeded jobs replay
        # without a seam (tasks/streams.py), a sampled one can only end here.
        message = f"choice {self.index[job_id]} started over on another worker; send the request again"
        return sse.Last(sse.event(error_body(502, "worker_lost", message)))

    def tail(self, complete: bool) -> Iterator[str]:
        if complete and self.sub.jobs.include_usage:
            yield self.usage_chunk()
        yield sse.event("[DONE]")

    def response(self, events) -> Response:
        return sse.relay(events, self.token, self.end, self.restart, self.head(), self.tail, comments=False)


class CompletionRelay(Relay):
    def chunk(self, i: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> str:
        sub = self.sub
        one = choice(i, text, finish, logprobs)
        return sse.event(completion(sub.response_id, sub.model, [one], created=sub.created))

    def usage_chunk(self) -> str:
        sub = self.sub
        return sse.event(completion(sub.response_id, sub.model, [], common.usage(*self.counts), sub.created))

    def head(self) -> list[str]:
        jobs = self.sub.jobs
        return [self.chunk(k, jobs.prompts[k // jobs.n]) for k in range(len(self.sub.ids))] if jobs.echo else []


class ChatRelay(Relay):
    def __init__(self, sub: Any):
        super().__init__(sub)
        # With tools or a reasoning parser, each choice's text goes through its own parser stream
        # (the answer's `chat_choice`, fed delta by delta): reasoning and content as soon as
        # they are known, the calls whole at the end, so that they equal the unstreamed answer's.
        parser = sub.jobs.output_parser()
        self.parsers = [parser.stream() for _ in sub.ids] if parser is not None else None

    def _event(self, choices: list[chat.ChatStreamChoice], usage: common.Usage | None = None) -> str:
        sub = self.sub
        chunk = chat.ChatCompletionChunk(
            id=sub.response_id, created=sub.created, model=sub.model, choices=choices, usage=usage
        ).model_dump(mode="json", exclude=None if usage else {"usage"})
        for c in chunk["choices"]:  # a delta's tool_calls as OpenAI streams them: only what is set
            calls = c["delta"].pop("tool_calls")
            if calls is not None:
                c["delta"]["tool_calls"] = [_set(call) for call in calls]
            if c["delta"][REASONING_FIELD] is None:
                del c["delta"][REASONING_FIELD]
        return sse.event(chunk)

    def chunk(self, i: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> str:
        top = self.sub.jobs.params.logprobs
        lp = chat.logprobs_of(logprobs, top) if top is not None and logprobs else None
        if self.parsers is not None:
            return self._parsed(i, text, finish, lp)
        delta = chat.Delta(content=text) if text or not finish else chat.Delta()
        choice = chat.ChatStreamChoice(index=i, delta=delta, logprobs=lp, finish_reason=common.finish(finish))
        return self._event([choice])

    def _parsed(self, i: int, text: str, finish: str | None, lp: chat.ChatLogprobs | None) -> str:
        """A choice's text through its parser: a chunk per event (the text's logprobs on the
        first, or on a chunk of their own while the parser holds the text back), and at the
        end a chunk with the finish reason."""
        stream, out = self.parsers[i], []
        for ev in stream.step(text, bool(finish)):
            delta = chat.Delta.model_validate(ev.delta())
            out.append(self._event([chat.ChatStreamChoice(index=i, delta=delta, logprobs=lp)]))
            lp = None
        if lp is not None:
            out.append(self._event([chat.ChatStreamChoice(index=i, delta=chat.Delta(), logprobs=lp)]))
        if finish:
            reason = finish_reason(self.sub.jobs.tools, common.finish(finish), stream.tool_calls)
            out.append(self._event([chat.ChatStreamChoice(index=i, delta=chat.Delta(), finish_reason=reason)]))
        return "".join(out)

    def usage_chunk(self) -> str:
        return self._event([], common.usage(*self.counts))

    def head(self) -> list[str]:
        # Every choice opens with the assistant's role, as vLLM's and OpenAI's streams do.
        role = chat.Delta(role="assistant", content="")
        return [self._event([chat.ChatStreamChoice(index=k, delta=role)]) for k in range(len(self.sub.ids))]


class MessagesRelay:
    """Anthropic's Messages stream of one job (/v1/messages): `message_start`, a text block's
    `content_block_start`/`_delta`/`_stop`, each tool call a `tool_use` block at the end (its
    input whole, as the chat stream's calls), `message_delta` with the stop reason and usage,
    `message_stop`; a failed job's `error` event last."""

    def __init__(self, sub: Any, stops: list[str] | None):
        self.sub, self.stops = sub, stops
        self.id = "msg_" + sub.ids[0].replace("-", "")
        parser = sub.jobs.output_parser()
        self.parser = parser.stream() if parser is not None else None
        self.blocks = 0
        self.text_block: int | None = None
        self.calls: dict[int, dict[str, str]] = {}

    @staticmethod
    def _event(kind: str, **data: Any) -> str:
        return sse.event({"type": kind, **data}, kind)

    def head(self) -> list[str]:
        start = messages.message(self.id, self.sub.model, [], None, self.stops, messages.usage(0, 0, 0))
        return [self._event("message_start", message=start)]

    def token(self, _job_id, ev) -> str:
        out: list[str] = []
        for d in deltas(self.parser, ev.text, bool(ev.finish)):
            if d.get("content"):
                if self.text_block is None:
                    self.text_block, self.blocks = self.blocks, self.blocks + 1
                    block = {"type": "text", "text": ""}
                    out.append(self._event("content_block_start", index=self.text_block, content_block=block))
                delta = {"type": "text_delta", "text": d["content"]}
                out.append(self._event("content_block_delta", index=self.text_block, delta=delta))
            for tc in d.get("tool_calls") or []:
                call = self.calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                call["name"] = tc["function"].get("name") or call["name"]
                call["arguments"] += tc["function"].get("arguments") or ""
        if ev.finish:
            out += self._finish(ev)
        return "".join(out)

    def _finish(self, ev) -> list[str]:
        out = []
        if self.text_block is not None:
            out.append(self._event("content_block_stop", index=self.text_block))
        calls = [self.calls[i] for i in sorted(self.calls)]
        for c in calls:
            index, self.blocks = self.blocks, self.blocks + 1
            block = {"type": "tool_use", "id": c["id"], "name": c["name"], "input": {}}
            out.append(self._event("content_block_start", index=index, content_block=block))
            delta = {"type": "input_json_delta", "partial_json": c["arguments"]}
            out.append(self._event("content_block_delta", index=index, delta=delta))
            out.append(self._event("content_block_stop", index=index))
        reason = messages.stop_reason(ev.finish, calls, self.stops)
        use = ev.usage or {}
        usage = messages.usage(use.get("prompt_tokens", 0), use.get("completion_tokens", 0), common.cached_tokens(use))
        delta = {"stop_reason": reason, "stop_sequence": messages.stop_sequence(reason, self.stops)}
        out.append(self._event("message_delta", delta=delta, usage=usage))
        out.append(self._event("message_stop"))
        return out

    def end(self, _job_id, ev) -> sse.Last:
        status = job_error_status(ev.error["code"])
        return sse.Last(sse.event(messages.error(status, ev.error["code"], ev.error["message"]), "error"))

    def restart(self, _job_id, _ev) -> sse.Last:
        text = "the message started over on another worker; send the request again"
        return sse.Last(sse.event(messages.error(502, "worker_lost", text), "error"))

    def response(self, events) -> Response:
        return sse.relay(events, self.token, self.end, self.restart, self.head(), comments=False)
