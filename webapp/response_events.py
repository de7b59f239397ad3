"""A response's stream events (OpenAI's Responses API, `stream: true`), made from its job's
token events alone: numbered from 0 (`sequence_number`), so a resumed stream
(`starting_after`) replays the job's tokens from the first and sends only the events after
the one named. webapp/responses.py serves them; `finished` makes the response object of a
job that succeeded, for both the stream's last event and a GET."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tasks.schemas import JobStatus
from tasks.streams import Restart, StreamEnd
from webapp import sse
from webapp.completions import Submitted, chat_choice
from webapp.parsers import REASONING_FIELD
from webapp.parsers.output import deltas
from webapp.protocol import responses as proto
from webapp.protocol.common import cached_tokens

# A job's status as a response's.
STATUS = {
    JobStatus.queued.value: "queued",
    JobStatus.running.value: "in_progress",
    JobStatus.cancelled.value: "cancelled",
    JobStatus.failed.value: "failed",
    JobStatus.expired.value: "failed",
}


def finished(rec: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The response object of a record whose job succeeded with `result`: the chat answer's
    message (`chat_choice`: tool and reasoning parsers) as output items."""
    sub = Submitted.from_entry(rec["entry"])
    msg = chat_choice(sub, 0, result).message
    calls = [c.model_dump(mode="json") for c in msg.tool_calls or []]
    output = proto.output_items(rec["id"], msg.content, msg.reasoning, calls)
    use = proto.usage(result["prompt_tokens"], result["completion_tokens"], cached_tokens(result))
    incomplete = "max_output_tokens" if result["finish_reason"] == "length" else None
    status = "incomplete" if incomplete else "completed"
    return proto.response_object(rec, status, output, use, incomplete=incomplete)


class ResponseEvents:
    """A response's stream events from its job's token events, numbered (`sequence_number`)
    from 0; those up to `after` are counted and not sent."""

    def __init__(self, rec: dict[str, Any], sub: Submitted, after: int = -1, on_final: Callable | None = None):
        self.rec, self.rid, self.after, self.seq = rec, rec["id"], after, 0
        self.on_final = on_final  # called with the response once it has ended
        parser = sub.jobs.output_parser()
        self.parser = parser.stream() if parser is not None else None
        self.text = ""  # the job's text so far
        self.items = 0  # output items opened
        self.open: tuple[str, int, str] | None = None  # the open item: kind, output index, its text
        self.calls: dict[int, dict[str, str]] = {}

    def emit(self, kind: str, **data: Any) -> str:
        seq, self.seq = self.seq, self.seq + 1
        if seq <= self.after:
            return ""
        return sse.event({"type": kind, "sequence_number": seq, **data}, kind)

    def head(self) -> list[str]:
        first = "queued" if self.rec["background"] else "in_progress"
        return [
            self.emit("response.created", response=proto.response_object(self.rec, first)),
            self.emit("response.in_progress", response=proto.response_object(self.rec, "in_progress")),
        ]

    def replay(self, events) -> list[str]:
        """Every event of an ended job's stream, at once."""
        frames = self.head()
        for item in events:
            if item is None:
                continue
            job_id, ev = item
            if isinstance(ev, StreamEnd):
                frames.append(self.end(job_id, ev).frame)
                break
            if isinstance(ev, Restart):
                frames.append(self.restart(job_id, ev).frame)
                break
            frames.append(self.token(job_id, ev))
            if ev.finish:
                break
        close = getattr(events, "close", None)
        if close is not None:
            close()
        return [f for f in frames if f]

    # -- the items ---------------------------------------------------------------------------

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        kind, index, text = self.open
        self.open = None
        if kind == "message":
            item_id = proto.message_id(self.rid)
            part = proto.text_part(text)
            return [
                self.emit(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self.emit(
                    "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part
                ),
                self.emit("response.output_item.done", output_index=index, item=proto.message_item(self.rid, text)),
            ]
        item_id = proto.reasoning_id(self.rid)
        return [
            self.emit("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0, text=text),
            self.emit("response.output_item.done", output_index=index, item=proto.reasoning_item(self.rid, text)),
        ]

    def _piece(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open[0] != kind:
            out += self._close()
            index, self.items = self.items, self.items + 1
            self.open = (kind, index, "")
            if kind == "message":
                item = proto.message_item(self.rid, "", "in_progress")
                out.append(self.emit("response.output_item.added", output_index=index, item=item))
                part = proto.text_part("")
                out.append(
                    self.emit(
                        "response.content_part.added",
                        item_id=item["id"],
                        output_index=index,
                        content_index=0,
                        part=part,
                    )
                )
            else:
                item = {"id": proto.reasoning_id(self.rid), "type": "reasoning", "summary": [], "content": []}
                out.append(self.emit("response.output_item.added", output_index=index, item=item))
        _, index, sofar = self.open
        self.open = (kind, index, sofar + text)
        if kind == "message":
            item_id = proto.message_id(self.rid)
            out.append(
                self.emit(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        else:
            out.append(
                self.emit(
                    "response.reasoning_text.delta",
                    item_id=proto.reasoning_id(self.rid),
                    output_index=index,
                    content_index=0,
                    delta=text,
                )
            )
        return out

    def _calls(self) -> list[str]:
        out: list[str] = []
        for k, i in enumerate(sorted(self.calls)):
            c = self.calls[i]
            index, self.items = self.items, self.items + 1
            item = proto.call_item(self.rid, k, c["id"], c["name"], "", "in_progress")
            out.append(self.emit("response.output_item.added", output_index=index, item=item))
            out.append(
                self.emit(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=c["arguments"],
                )
            )
            out.append(
                self.emit(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=c["name"],
                    arguments=c["arguments"],
                )
            )
            done = proto.call_item(self.rid, k, c["id"], c["name"], c["arguments"])
            out.append(self.emit("response.output_item.done", output_index=index, item=done))
        return out

    # -- sse.relay's callbacks -----------------------------------------------------------------

    def token(self, _job_id, ev) -> str:
        self.text += ev.text
        out: list[str] = []
        for d in deltas(self.parser, ev.text, bool(ev.finish)):
            if d.get(REASONING_FIELD):
                out += self._piece("reasoning", d[REASONING_FIELD])
            if d.get("content"):
                out += self._piece("message", d["content"])
            for tc in d.get("tool_calls") or []:
                call = self.calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                call["name"] = tc["function"].get("name") or call["name"]
                call["arguments"] += tc["function"].get("arguments") or ""
        if ev.finish:
            out += self._close()
            out += self._calls()
            use = ev.usage or {}
            result = {
                "text": self.text,
                "finish_reason": ev.finish,
                "prompt_tokens": use.get("prompt_tokens", 0),
                "completion_tokens": use.get("completion_tokens", 0),
                "cached_tokens": cached_tokens(use),
            }
            obj = finished(self.rec, result)
            if self.on_final is not None:
                self.on_final(obj)
            out.append(self.emit(f"response.{obj['status']}", response=obj))
        return "".join(out)

    def end(self, _job_id, ev: StreamEnd) -> sse.Last:
        status = STATUS.get(ev.status, "failed")
        error = {"code": ev.error.get("code", status), "message": ev.error.get("message", status)}
        obj = proto.response_object(self.rec, status, error=error if status == "failed" else None)
        return sse.Last(self._close_all() + self.emit("response.failed", response=obj))

    def _close_all(self) -> str:
        return "".join(self._close())

    def restart(self, _job_id, _ev) -> sse.Last:
        message = "the response started over on another worker; create it again"
        return sse.Last(self.emit("error", code="worker_lost", message=message, param=None))
