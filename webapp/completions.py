"""One completion request, whatever door it came in by (`/v1/completions`,
`/v1/chat/completions`, the teaching endpoints, a batch line, `/v1/jobs`): the request model
turns itself into `Jobs` (webapp/protocol/jobs.py; its `to_jobs()`, as vLLM's
`to_sampling_params`), `CompletionService.submit` checks them against the limits and puts them
on the queue, and the answer is assembled from their results as a body (`body`) or a stream
(`stream`), in the shape of the API the request came from (`Jobs.api`).

`submit` is the only place that checks a request's jobs against this deployment's and its API
key's limits (with errors that name the request's own fields; its rpm/tpm rates too, which a
batch's lines are exempt from: the driver's key carries no rates) and resolves its model; the
routes and the batch driver only parse and call it.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from flask import Response, current_app, request

from tasks.schemas import NO_CHAT_TEMPLATE, SamplingParams
from tasks.usage import RateLimiter
from webapp import callbacks, context, idempotency, limits, metrics, tokens
from webapp.auth import ApiKey
from webapp.errors import APIError
from webapp.parsers import REASONING_FIELD
from webapp.protocol import chat, common
from webapp.protocol.completions import choice, completion
from webapp.protocol.jobs import Jobs
from webapp.protocol.output import ReasoningUse, finish_reason
from webapp.protocol.tools import ToolUse
from webapp.relays import ChatRelay, CompletionRelay
from webapp.service import JobService

log = logging.getLogger(__name__)

# How a worker's error message names the job's max_new_tokens ("with max_new_tokens=16 that exceeds
# the model's context"), which the request may call otherwise (`results`).
JOB_MAX_TOKENS = re.compile(r"\bmax_new_tokens\b")


@dataclass
class Submitted:
    """A request's jobs once queued: their ids in order, the model they went to, and what
    the answer needs."""

    jobs: Jobs
    ids: list[str]
    model: str
    created: int
    # The request had an Idempotency-Key: its jobs outlive its client, for a retry to take up
    # (webapp/idempotency.py), instead of being cancelled when it goes away.
    keep: bool = False

    @property
    def response_id(self) -> str:
        return f"{'chatcmpl' if self.jobs.api == 'chat' else 'cmpl'}-{self.ids[0]}"

    def entry(self) -> dict[str, Any]:
        """What a batch line keeps of it (JSON) to write its output line later (`from_entry`)."""
        entry: dict[str, Any] = {"ids": self.ids, "model": self.model, "created": self.created}
        if self.jobs.n > 1:
            entry["n"] = self.jobs.n
        if self.jobs.echo:
            entry.update(echo=True, prompts=self.jobs.prompts)
        if self.jobs.api == "chat":
            entry.update(api="chat", logprobs=self.jobs.params.logprobs)
            if self.jobs.tools is not None:
                entry["tools"] = self.jobs.tools.entry()
            if self.jobs.reasoning is not None:
                entry["reasoning"] = self.jobs.reasoning.entry()
        if self.jobs.best_of:
            entry.update(best_of=self.jobs.best_of, n=self.jobs.n, logprobs=self.jobs.params.logprobs)
        return entry

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> Submitted:
        jobs = Jobs(
            prompts=entry.get("prompts") or [],
            params=SamplingParams(logprobs=entry.get("logprobs")),
            n=entry.get("n", 1),
            echo=bool(entry.get("echo")),
            api=entry.get("api", "completions"),
            best_of=entry.get("best_of"),
            tools=ToolUse(**entry["tools"] | {"names": tuple(entry["tools"].get("names", ()))})
            if entry.get("tools")
            else None,
            reasoning=ReasoningUse(**entry["reasoning"]) if entry.get("reasoning") else None,
        )
        return cls(jobs, entry["ids"], entry["model"], int(entry["created"]))


# Where create_app keeps the app's CompletionService (app.extensions[EXTENSION]).
EXTENSION = "genq_completions"


def current_completions() -> CompletionService:
    """The CompletionService of the app handling this request."""
    return current_app.extensions[EXTENSION]


class CompletionService:
    """Submits a request's jobs and answers it: one per API process (over its JobService)."""

    def __init__(self, jobs: JobService):
        self.jobs = jobs

    @cached_property
    def rates(self) -> RateLimiter:
        """The API keys' rpm/tpm windows (tasks/usage.py)."""
        return RateLimiter(self.jobs.r)

    def submit(self, req: Jobs, owner: ApiKey | None, wait: bool = True) -> Submitted:
        """Check the limits, resolve the model and queue the jobs. `wait`: the caller answers
        once they end (a blocking call or a stream), so it fails at once with 503 when no live
        worker serves the model instead of hanging."""
        s = self.jobs
        keep = idempotency.header_key() is not None  # a bad one is a 400, also where nothing is queued
        every = [p for p in req.texts for _ in range(req.per_prompt)]
        limits.check(req, every, s.settings)
        callbacks.check_url(req.callback_url, s.settings)
        if req.tools is not None and req.tools.mode == "auto":
            req.tools = replace(req.tools, parser=self.tool_call_parser())
        if req.reasoning is not None:
            parser = s.settings.reasoning_parser
            req.reasoning = replace(req.reasoning, parser=parser) if parser else None
        model = s.model_for_engine(req.engine) if req.engine else s.resolve_model(req.model)
        created = int(time.time())
        if not every:
            return Submitted(req, [], model, created)
        if wait:
            s.require_worker(model)
        s.require_task(model, embed=False)
        if req.chat is not None:
            self.require_chat_template(model)
        params = limits.for_key(req, every, owner, s.settings)
        if req.best_of and params.logprobs is None:  # `best` ranks them by their tokens' logprobs
            params = params.model_copy(update={"logprobs": 0})
        so, end = params.structured_outputs, req.reasoning.end() if req.reasoning else None
        if so is not None and end and so.after is None:  # constrained after the reasoning, as vLLM
            params = params.model_copy(update={"structured_outputs": so.model_copy(update={"after": end})})
        self.check_context(req, params, model)

        def create() -> dict[str, Any]:
            limits.admit(self.rates, owner)  # last: a request refused for its input is not counted
            ids = s.enqueue(
                req.prompts,
                params,
                model,
                stream=req.stream,
                sched=req.sched,
                owner=owner,
                n=req.per_prompt,
                chat=req.chat,
                callback_url=req.callback_url,
            )
            return {"ids": ids, "model": model, "created": created}

        # A retry with the same Idempotency-Key and body gets the first request's jobs.
        made, _ = idempotency.once(owner.name if owner else "", create)
        return Submitted(req, made["ids"], made["model"], int(made["created"]), keep)

    def check_context(self, req: Jobs, params: SamplingParams, model: str) -> None:
        """400 `prompt_too_long` (vLLM's error), before anything is queued, for a prompt that
        with its completion does not fit the model's context as its live workers announce it
        (webapp/context.py). A prompt or a conversation that surely fits by its workers'
        bounds (their tokenizer's, and their chat template's) costs nothing more; the others
        are counted by a worker in one round trip. Without a context to check against, or when
        no worker answers, the job goes on to the worker's own check."""
        ctx = context.context_of(self.jobs.workers_for(model))
        if ctx is None:
            return
        max_new = params.max_new_tokens or self.jobs.settings.default_max_new_tokens
        truncate = params.truncate_prompt_tokens
        field = "prompt" if req.chat is None else "messages"
        unsure: list[str] = []
        if req.chat is not None:
            if context.chat_surely_fits(req.chat, max_new, ctx, truncate, bool(params.add_special_tokens)):
                return
        else:
            for p in req.prompts:
                ok = context.surely_fits(p, max_new, ctx, truncate)
                if ok is False:  # token ids: counted already
                    n = context.kept(len(p), truncate, ctx.max_model_len)
                    raise context.too_long(ctx.max_model_len, n, max_new, field, req.max_tokens_name)
                if ok is None:
                    unsure.append(p)
            if not unsure:
                return
        for n in self._count(req, params, model, list(dict.fromkeys(unsure))):
            n = context.kept(n, truncate, ctx.max_model_len)
            if not context.fits(n, max_new, ctx.max_model_len):
                raise context.too_long(ctx.max_model_len, n, max_new, field, req.max_tokens_name)

    def _count(self, req: Jobs, params: SamplingParams, model: str, texts: list[str]) -> list[int]:
        """The tokens of `texts` (or of the request's conversation) as a worker of `model`
        tokenizes a job's prompt; none when no worker could say (no live one, or none answered)."""
        add = params.add_special_tokens if params.add_special_tokens is not None else req.chat is None
        ask: dict[str, Any] = {"op": "count", "add_special_tokens": add}
        if req.chat is not None:
            ask["chat"] = req.chat.model_dump(mode="json")
        else:
            ask["prompts"] = texts
        metrics.prompts_counted(model)
        try:
            return tokens.ask(self.jobs, model, ask)["counts"]
        except APIError as exc:
            if exc.code not in ("no_worker", "timeout"):
                raise
            log.warning("prompt tokens not counted before queueing (%s): %s", exc.code, exc.message)
            return []

    def tool_call_parser(self) -> str:
        """The parser of `tool_choice: "auto"` (GENQ_TOOL_CALL_PARSER); without one, 400 that
        says how to enable it, as vLLM's ("requires --tool-call-parser")."""
        name = self.jobs.settings.tool_call_parser
        if not name:
            raise APIError(
                400,
                "invalid_request",
                '"auto" tool choice requires GENQ_TOOL_CALL_PARSER to be set (the served model\'s format: '
                'hermes, llama3_json, llama4_json, mistral or pythonic); or send tool_choice "none", '
                '"required" or a named function',
                param="tool_choice",
            )
        return name

    def require_chat_template(self, model: str) -> None:
        """400 at once when the model's live workers have no chat template (with no live
        worker, a queued chat job fails with the same error on a worker without one)."""
        workers = self.jobs.workers_for(model)
        if workers and not any(w.chat_template for w in workers):
            raise APIError(400, "no_chat_template", NO_CHAT_TEMPLATE, param="messages")

    def results(self, sub: Submitted, environ: dict | None = None) -> list[dict[str, Any]]:
        """The jobs' results in order (raises the APIError of the first that failed, in the
        request's words: a worker's message names the job's `max_new_tokens`)."""
        try:
            return self.jobs.collect(sub.ids, environ, abandon=not sub.keep)
        except APIError as exc:
            field = sub.jobs.max_tokens_field
            if field is None or not (JOB_MAX_TOKENS.search(exc.message) or exc.param == "max_new_tokens"):
                raise
            message = JOB_MAX_TOKENS.sub(field, exc.message)
            param = field if exc.param == "max_new_tokens" else exc.param
            raise APIError(exc.status, exc.code, message, exc.headers, param) from None

    def body(self, sub: Submitted, results: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole answer of a request whose jobs have all succeeded."""
        picked = best(sub, results) if sub.jobs.best_of else results
        body = chat_body(sub, picked) if sub.jobs.api == "chat" else completion_body(sub, picked)
        if picked is not results:  # usage counts every completion generated, each prompt once
            body["usage"] = common.usage_of(results, results[:: sub.jobs.best_of]).model_dump(mode="json")
        return body

    def answer(self, req: Jobs, owner: ApiKey | None) -> dict[str, Any] | Response:
        """Submit and answer a request at once: its body once the jobs have ended, or its
        stream (`req.stream`)."""
        sub = self.submit(req, owner)
        if req.stream:
            return self.stream(sub)
        return self.body(sub, self.results(sub, request.environ))

    def stream(self, sub: Submitted) -> Response:
        """The answer as server-sent events, in the API's chunks, while the jobs run."""
        relay = ChatRelay(sub) if sub.jobs.api == "chat" else CompletionRelay(sub)
        return relay.response(self.jobs.events(sub.ids, cancel_on_exit=not sub.keep))


def cumulative_logprob(result: dict[str, Any]) -> float:
    return sum((result.get("logprobs") or {}).get("token_logprobs") or [])


def best(sub: Submitted, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of each prompt's `best_of` results, the `n` of highest cumulative logprob, best first
    (without the logprobs the request did not ask for)."""
    jobs = sub.jobs
    keep = jobs.params.logprobs is not None
    picked = []
    for i in range(0, len(results), jobs.best_of):
        group = sorted(results[i : i + jobs.best_of], key=cumulative_logprob, reverse=True)[: jobs.n]
        picked += [r if keep else {**r, "logprobs": None} for r in group]
    return picked


# -- /v1/completions ------------------------------------------------------------------------


def completion_body(sub: Submitted, results: list[dict[str, Any]]) -> dict[str, Any]:
    jobs, n = sub.jobs, sub.jobs.n
    choices = [
        choice(
            k,
            (jobs.prompts[k // n] if jobs.echo else "") + r["text"],
            r["finish_reason"],
            r.get("logprobs"),
            prompt_logprobs=r.get("prompt_logprobs"),
            prompt_token_ids=r.get("prompt_token_ids"),
            token_ids=r.get("token_ids"),
        )
        for k, r in enumerate(results)
    ]
    return completion(sub.response_id, sub.model, choices, common.usage_of(results), sub.created)


# -- /v1/chat/completions -------------------------------------------------------------------


def chat_choice(sub: Submitted, k: int, result: dict[str, Any]) -> chat.ChatChoice:
    """One choice of a chat answer: the job's text as content, or, with a reasoning parser or
    tools (`Jobs.output_parser`), its think span as reasoning, the calls its tool parser finds
    in what follows, and the rest as content."""
    top = sub.jobs.params.logprobs
    finish = common.finish(result["finish_reason"])
    message = chat.AssistantMessage(content=result["text"])
    parser = sub.jobs.output_parser()
    if parser is not None:
        parsed = parser.parse(result["text"])
        calls = [chat.ToolCallOut.model_validate(c.to_openai()) for c in parsed.tool_calls]
        message = chat.AssistantMessage(content=parsed.content, reasoning=parsed.reasoning, tool_calls=calls or None)
        finish = finish_reason(sub.jobs.tools, finish, parsed.tool_calls)
    return chat.ChatChoice(
        index=k,
        message=message,
        finish_reason=finish,
        logprobs=chat.logprobs_of(result.get("logprobs"), top or 0) if top is not None else None,
    )


def chat_body(sub: Submitted, results: list[dict[str, Any]]) -> dict[str, Any]:
    choices = [chat_choice(sub, k, r) for k, r in enumerate(results)]
    body = chat.ChatCompletionResponse(
        id=sub.response_id, created=sub.created, model=sub.model, choices=choices, usage=common.usage_of(results)
    ).model_dump(mode="json")
    for c in body["choices"]:  # as OpenAI's: no tool_calls key in a reply without calls
        if c["message"]["tool_calls"] is None:
            del c["message"]["tool_calls"]
        if sub.jobs.reasoning is None:  # the reasoning key only where a parser looks for it
            del c["message"][REASONING_FIELD]
    return body
