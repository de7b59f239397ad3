"""`python -m bench.responses_compat`: the same checks of OpenAI's Responses API (and Anthropic's
Messages API), through the official `openai` and `anthropic` clients, against genqueue (the API,
one hf worker, a private Redis) and against vLLM's own OpenAI server with its Responses store on
(`VLLM_ENABLE_RESPONSES_API_STORE=1`), both on the real SmolLM2-135M-Instruct (scripts/realmodel.py),
one after the other; then what a background response becomes when each server restarts
(genqueue: its API process, and separately a SIGKILL of its worker mid-job; vLLM: its server,
and separately a SIGKILL of its engine-core process mid-response). Issue 43's "Measure" part.

Each check is PASS or FAIL with its reason (the exception, or what differed); a failing check
does not stop the run. Writes bench/out/responses-compat-<time>/results.json (and the servers'
logs) and prints a markdown table; `--render RESULTS_JSON` prints the table of an earlier run.
Findings: docs/benchmarks.md, "Responses API beside vLLM's server (issue 43)".
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import anthropic
import jsonschema
import openai
import requests

from bench.common import Processes, RedisTarget, Stack, make_log, names, parser, run_bench, run_lines, table
from bench.vllm import env_versions, split_tree, start_server

log = make_log("compat")
SERVERS = ("genqueue", "vllm")
TITLES = {"genqueue": "genqueue", "vllm": "vLLM server"}
SERVED_NAME = "SmolLM2-135M-Instruct"  # vLLM's --served-model-name
QUESTION = "What is the capital of France?"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
FORECAST = {"type": "function", "name": "get_forecast", "description": "the weather forecast", "parameters": CITY}
# A first turn long enough (~300 tokens) that a prefix cache of any block size up to 256 tokens
# has whole blocks of it to serve the second turn from.
ADA = (
    "Here is a short biography. Augusta Ada King, Countess of Lovelace, was an English mathematician and "
    "writer, chiefly known for her work on Charles Babbage's proposed mechanical general-purpose computer, "
    "the Analytical Engine. She was the first to recognise that the machine had applications beyond pure "
    "calculation. Ada was the only legitimate child of the poet Lord Byron and the reformer Anne Isabella "
    "Milbanke. All her half-siblings, Lord Byron's other children, were born out of wedlock to other women. "
    "Lord Byron separated from his wife a month after Ada was born and left England forever. He died in "
    "Greece when she was eight. Lady Byron was anxious about her daughter's upbringing and promoted Ada's "
    "interest in mathematics and logic in an effort to prevent her from developing her father's perceived "
    "insanity. Despite this, Ada remained interested in him, naming her two sons Byron and Gordon. Upon her "
    "death, she was buried next to him at her request. Although often ill in her childhood, Ada pursued her "
    "studies assiduously. She married William King in 1835. King was made Earl of Lovelace in 1838, Ada "
    "thereby becoming Countess of Lovelace. In 1843 she translated an article on the engine and added "
    "notes of her own, among them a method for calculating Bernoulli numbers. "
)
SSE_EXPECT_FIRST = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
SSE_EXPECT_LAST = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


class Target:
    """One server under test: its base URL, model name and clients."""

    def __init__(self, kind: str, base: str, model: str):
        self.kind, self.base, self.model = kind, base, model
        self.oa = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=180)
        self.an = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=180)

    def create(self, **kw):
        return self.oa.responses.create(model=self.model, **{"temperature": 0, **kw})

    def get(self, resp_id: str) -> tuple[int, dict | str]:
        """GET /v1/responses/{id} as plain HTTP: (status code, JSON body or text)."""
        r = requests.get(f"{self.base}/v1/responses/{resp_id}", timeout=60)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text[:300]

    def wait(self, resp_id: str, timeout: float = 240.0):
        end = time.monotonic() + timeout
        while True:
            r = self.oa.responses.retrieve(resp_id)
            if r.status not in ("queued", "in_progress") or time.monotonic() > end:
                return r
            time.sleep(0.2)

    def close(self) -> None:
        self.oa.close()
        self.an.close()


def wait_running(t: Target, resp_id: str, status: str, settle: float = 3.0) -> str:
    """Poll a background response until it leaves `queued`, for at most `settle` seconds (vLLM's
    store says `queued` until a polled background response has ended: it never says
    `in_progress`); its status then."""
    end = time.monotonic() + settle
    while status == "queued" and time.monotonic() < end:
        time.sleep(0.05)
        status = t.oa.responses.retrieve(resp_id).status
    return status


# -- the checks -------------------------------------------------------------------------------
# Each takes a Target and returns what it saw (a short line); it raises (an AssertionError
# naming what differed, or the client's exception) when the server fails it.

CHECKS: list[tuple[str, str, Callable[[Target], str]]] = []


def check(name: str, what: str):
    def add(fn):
        CHECKS.append((name, what, fn))
        return fn

    return add


def _final(r, want_paris: bool = True) -> str:
    assert r.status in ("completed", "incomplete"), f"status {r.status!r}, error {r.error}"
    text = r.output_text
    assert text, f"no output_text (output {r.output})"
    if want_paris:
        assert "Paris" in text, f"no 'Paris' in {text!r}"
    return text


@check("blocking, string input", "`input` a string: a completed `message` with `output_text`, `usage`")
def c_blocking(t: Target) -> str:
    r = t.create(input=QUESTION, max_output_tokens=24)
    text = _final(r)
    assert r.object == "response" and r.output[0].type == "message", f"output {r.output}"
    u = r.usage
    assert u and u.input_tokens > 0 and u.output_tokens > 0, f"usage {u}"
    assert u.total_tokens == u.input_tokens + u.output_tokens, f"usage {u}"
    return f"{text!r}, {u.input_tokens}+{u.output_tokens} tokens"


@check("blocking, list of messages", "`input` a list: a `developer` message, a `message` item with `input_text` parts")
def c_list(t: Target) -> str:
    r = t.create(
        input=[
            {"role": "developer", "content": "Answer in one sentence."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        max_output_tokens=24,
    )
    return repr(_final(r))


@check("instructions", "`instructions`: echoed, and the answer is chat completions' with that system message")
def c_instructions(t: Target) -> str:
    sys_msg = "Answer in one word."
    r = t.create(input=QUESTION, instructions=sys_msg, max_output_tokens=24)
    text = _final(r, want_paris=False)
    assert r.instructions == sys_msg, f"instructions echoed as {r.instructions!r}"
    chat = t.oa.chat.completions.create(
        model=t.model,
        messages=[{"role": "system", "content": sys_msg}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    want = chat.choices[0].message.content
    assert text == want, f"{text!r} here, {want!r} through chat completions"
    return repr(text)


@check("background + poll", "`background: true` answers `queued` at once; GET polls it to `completed`")
def c_background(t: Target) -> str:
    t0 = time.monotonic()
    r = t.create(input=QUESTION, background=True, max_output_tokens=24)
    took = time.monotonic() - t0
    assert r.status in ("queued", "in_progress"), f"create answered status {r.status!r}"
    done = t.wait(r.id)
    return f"create {r.status} in {took:.2f} s, then {done.status}: {_final(done)!r}"


@check("cancel", "POST /cancel of a background response once it runs: `cancelled`, and GET says so")
def c_cancel(t: Target) -> str:
    r = t.create(input="Write a long story.", background=True, max_output_tokens=1000, extra_body={"ignore_eos": True})
    try:
        status = wait_running(t, r.id, r.status)
        c = t.oa.responses.cancel(r.id)
        assert c.status == "cancelled", f"cancel answered status {c.status!r}"
        time.sleep(0.5)
        after = t.oa.responses.retrieve(r.id)
        assert after.status == "cancelled", f"GET after cancel: {after.status!r}"
        return f"{status} when cancelled; {after.usage.output_tokens if after.usage else 0} output tokens reported"
    finally:
        t.wait(r.id, 120)  # whatever happened, the next check does not share the server with it


@check("stream: events, sequence_number", "`stream: true`: OpenAI's event names in order, `sequence_number` 0, 1, ...")
def c_stream(t: Target) -> str:
    events = list(t.create(input=QUESTION, stream=True, max_output_tokens=24, store=False))
    types = [e.type for e in events]
    assert types[:4] == SSE_EXPECT_FIRST, f"first events {types[:4]}"
    assert types[-4:-1] == SSE_EXPECT_LAST and types[-1] in ("response.completed", "response.incomplete"), (
        f"last events {types[-4:]}"
    )
    seq = [e.sequence_number for e in events]
    assert seq == list(range(len(events))), f"sequence_number {seq[:6]}...{seq[-3:]}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text, f"deltas {text!r}, final {events[-1].response.output_text!r}"
    return f"{len(events)} events, {types.count('response.output_text.delta')} deltas"


@check("stream: SSE `event:` lines", "each server-sent event's `event:` line names its `type`")
def c_sse_lines(t: Target) -> str:
    body = {
        "model": t.model,
        "input": QUESTION,
        "stream": True,
        "max_output_tokens": 8,
        "temperature": 0,
        "store": False,
    }
    with requests.post(t.base + "/v1/responses", json=body, stream=True, timeout=180) as r:
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}"
        event, pairs = None, []
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                pairs.append((event, json.loads(data).get("type")))
                event = None
    bad = [p for p in pairs if p[0] != p[1]]
    assert pairs and not bad, f"{len(bad)} of {len(pairs)} events differ, e.g. event: {bad[0][0]!r}, type {bad[0][1]!r}"
    return f"{len(pairs)} events, each named"


@check("resume with starting_after", "a background stream read again from events 0, 3 and n-2: no gap, no duplicate")
def c_resume(t: Target) -> str:
    events = list(t.create(input=QUESTION, background=True, stream=True, max_output_tokens=24))
    assert events and events[-1].type in ("response.completed", "response.incomplete"), (
        f"the stream ended with {events[-1].type if events else 'nothing'}"
    )
    resp_id = events[0].response.id
    for n in (0, 3, len(events) - 2):
        rest = list(t.oa.responses.retrieve(resp_id, stream=True, starting_after=n))
        seq = [e.sequence_number for e in rest]
        assert seq == list(range(n + 1, len(events))), f"after {n}: sequence_number {seq[:5]}... of {len(events)}"
        got, want = [e.model_dump() for e in rest], [e.model_dump() for e in events[n + 1 :]]
        if got != want:
            i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise AssertionError(f"after {n}: event {n + 1 + i} differs: {got[i]} vs {want[i]}"[:400])
    return f"{len(events)} events, resumed after 0, 3, {len(events) - 2}"


def _two_turns(t: Target):
    first = t.create(input=ADA + "My name is Ada. " + QUESTION, max_output_tokens=24)
    second = t.create(previous_response_id=first.id, input="What is my name?", max_output_tokens=16)
    return first, second


TURNS: dict[str, tuple] = {}


@check("previous_response_id", "a second turn on `previous_response_id` answers, its prompt holding the first turn")
def c_previous(t: Target) -> str:
    first, second = TURNS[t.kind] = _two_turns(t)
    text = _final(second, want_paris=False)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens, (
        f"second turn's input_tokens {second.usage.input_tokens} <= first's {first.usage.input_tokens} + "
        f"{first.usage.output_tokens}"
    )
    return f"{text!r}, {second.usage.input_tokens} input tokens"


@check("cached_tokens on the second turn", "that second turn's `usage.input_tokens_details.cached_tokens` > 0")
def c_cached(t: Target) -> str:
    _, second = TURNS.get(t.kind) or _two_turns(t)
    details = second.usage.input_tokens_details
    cached = details.cached_tokens if details else None
    assert cached, f"cached_tokens {cached} of {second.usage.input_tokens} input tokens"
    return f"{cached} of {second.usage.input_tokens} input tokens"


def _tool_call(t: Target, parallel: bool | None) -> str:
    kw = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = t.create(
        input="What will the weather be in Paris for the next 3 days?",
        tools=[FORECAST],
        tool_choice="required",
        max_output_tokens=96,
        **kw,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls, f"status {r.status}, no function_call in output {[o.type for o in r.output]}: {r.output_text!r}"
    for c in calls:
        assert c.name == "get_forecast" and c.call_id, f"call {c}"
        try:
            jsonschema.validate(json.loads(c.arguments), CITY)
        except (ValueError, jsonschema.ValidationError) as exc:
            raise AssertionError(f"arguments {c.arguments!r}: {str(exc).splitlines()[0]}") from None
    TURNS.setdefault(t.kind + "-call", (r, calls[0]))
    return f"{len(calls)} call(s): {calls[0].name}({calls[0].arguments})"


@check(
    "function tool call",
    "`tools` (a function), `tool_choice: required`: `function_call` items with valid arguments",
)
def c_tool(t: Target) -> str:
    return _tool_call(t, None)


@check("function tool call, one", "the same with `parallel_tool_calls: false`: one `function_call`")
def c_tool_one(t: Target) -> str:
    return _tool_call(t, False)


@check("function_call_output back", "the call's output as a `function_call_output` item: the model answers in text")
def c_tool_output(t: Target) -> str:
    r, call = TURNS.get(t.kind + "-call") or (None, None)
    assert r is not None, "no function call to answer (both checks above failed)"
    follow = t.create(
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C."}],
        tools=[FORECAST],
        tool_choice="none",
        max_output_tokens=32,
    )
    return repr(_final(follow, want_paris=False))


@check("input_items", "GET /v1/responses/{id}/input_items lists the request's three messages")
def c_input_items(t: Target) -> str:
    msgs = [("user", "Hello"), ("assistant", "Hi!"), ("user", QUESTION)]
    r = t.create(input=[{"role": a, "content": b} for a, b in msgs], max_output_tokens=8)
    items = t.oa.responses.input_items.list(r.id, order="asc")
    got = [(i.role, i.content[0].text) for i in items.data if i.type == "message"]
    assert got == msgs, f"items {got}"
    return f"{len(items.data)} items"


@check("DELETE", "DELETE /v1/responses/{id}, then GET is a 404")
def c_delete(t: Target) -> str:
    r = t.create(input=QUESTION, max_output_tokens=4)
    t.oa.responses.delete(r.id)
    code, body = t.get(r.id)
    assert code == 404, f"GET after DELETE: HTTP {code}"
    return "deleted, then 404"


@check("unknown previous_response_id", "a `previous_response_id` that does not exist: 404")
def c_unknown_previous(t: Target) -> str:
    try:
        t.create(previous_response_id="resp_" + "0" * 32, input="Hi", max_output_tokens=4)
    except openai.NotFoundError as exc:
        return f"404: {str(exc)[:120]}"
    except openai.APIStatusError as exc:
        raise AssertionError(f"HTTP {exc.status_code}, not 404: {str(exc)[:200]}") from None
    raise AssertionError("answered 200")


@check("text.format json_schema", "`text.format` a JSON schema: the output parses and validates")
def c_json_schema(t: Target) -> str:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}}, "required": ["capital"]}
    r = t.create(
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        max_output_tokens=40,
    )
    text = _final(r, want_paris=False)
    jsonschema.validate(json.loads(text), schema)
    return repr(text)


def _messages_kw(t: Target) -> dict:
    return dict(
        model=t.model, max_tokens=32, messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0}
    )


@check("Messages API (anthropic), plain", "POST /v1/messages: a `text` block, `stop_reason`, `usage`")
def c_messages(t: Target) -> str:
    m = t.an.messages.create(**_messages_kw(t))
    assert m.type == "message" and m.role == "assistant", f"{m.type} {m.role}"
    texts = [b.text for b in m.content if b.type == "text"]
    assert texts and "Paris" in texts[0], f"content {m.content}"
    assert m.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {m.stop_reason!r}"
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0, f"usage {m.usage}"
    TURNS[t.kind + "-message"] = texts[0]
    return f"{texts[0]!r}, {m.stop_reason}"


@check("Messages API (anthropic), streamed", "`stream: true`: Anthropic's events in order, the plain answer's text")
def c_messages_stream(t: Target) -> str:
    events = list(t.an.messages.create(stream=True, **_messages_kw(t)))
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"], f"first events {types[:2]}"
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"], f"last events {types[-3:]}"
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    plain = TURNS.get(t.kind + "-message")
    assert plain is None or text == plain, f"streamed {text!r}, plain {plain!r}"
    return f"{len(events)} events"


def run_checks(t: Target, only: list[str] | None = None) -> dict[str, dict]:
    out = {}
    for name, _what, fn in CHECKS:
        if only and name not in only:
            continue
        t0 = time.monotonic()
        try:
            detail, ok = fn(t), True
        except Exception as exc:  # a check's failure is its result
            detail, ok = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500], False
        out[name] = {"ok": ok, "detail": detail, "s": round(time.monotonic() - t0, 2)}
        log(f"  {'PASS' if ok else 'FAIL'} {name}: {detail[:200]}")
    return out


# -- restarts ---------------------------------------------------------------------------------


def start_background(t: Target, tokens: int) -> tuple[str, str]:
    """A long background response, waited on until it runs: (its id, its status then)."""
    r = t.create(
        input="Tell me about Paris.", background=True, max_output_tokens=tokens, extra_body={"ignore_eos": True}
    )
    wait_running(t, r.id, r.status)
    time.sleep(0.3)  # some tokens into it
    return r.id, t.oa.responses.retrieve(r.id).status


def summary(code: int, body) -> str:
    if code == 200 and isinstance(body, dict):
        u = body.get("usage") or {}
        return f"200, status {body.get('status')!r}, {u.get('output_tokens', 0)} output tokens"
    if isinstance(body, dict):
        e = body.get("error") or body
        msg = e.get("message") if isinstance(e, dict) else e
        return f"{code}: {str(msg)[:160]}"
    return f"{code}: {str(body)[:160]}"


def after_restart(t: Target, resp_id: str, before: str, reference: str | None, event: str, down_s: float) -> dict:
    """GET the response right after the event, then (where it is there) until it ends."""
    code, body = t.get(resp_id)
    out = {"event": event, "before": before, "down_s": round(down_s, 1), "first_get": summary(code, body)}
    if code == 200:
        done = t.wait(resp_id, 300)
        out["final"] = f"{done.status}, {done.usage.output_tokens if done.usage else 0} output tokens"
        out["same_text_as_uninterrupted"] = reference is not None and done.output_text == reference
        out["text"], out["reference"] = done.output_text, reference
        if reference is not None and done.output_text != reference:
            a, b = done.output_text, reference
            out["differs_from_char"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    else:
        out["final"] = out["first_get"]
    log(f"  {event}: before {before}, first GET {out['first_get']}, final {out['final']}")
    return out


def reference_text(t: Target, tokens: int) -> str | None:
    try:
        r = t.create(
            input="Tell me about Paris.", max_output_tokens=tokens, store=False, extra_body={"ignore_eos": True}
        )
        return r.output_text
    except openai.OpenAIError as exc:
        log(f"  the uninterrupted reference failed: {exc}")
        return None


def watch(t: Target, resp_id: str, proc, seconds: float, t0: float) -> list[tuple[float, str]]:
    """GET the response every half second for `seconds` (or until `proc` exits, or the response
    has ended): each change of what comes back, with the seconds since `t0`."""
    seen: list[tuple[float, str]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            code, body = t.get(resp_id)
            now = summary(code, body)
            ended = code != 200 or body.get("status") not in ("queued", "in_progress")
        except requests.ConnectionError:
            now, ended = "no answer (connection refused)", not proc.alive()
        if not seen or seen[-1][1] != now:
            seen.append((round(time.monotonic() - t0, 1), now))
        if ended:
            break
        time.sleep(0.5)
    if not proc.alive():
        seen.append((round(time.monotonic() - t0, 1), "server process exited"))
    return seen


def restarts_genqueue(st: Stack, t: Target, tokens: int) -> tuple[list[dict], Target]:
    out = []
    ref = reference_text(t, tokens)
    # 1. The API process, stopped (SIGTERM) and started again while the response runs.
    try:
        resp_id, before = start_background(t, tokens)
        t0 = time.monotonic()
        st.stop_api()
        t.close()
        st.start_api(1)
        t = Target("genqueue", st.base, st.name)
        out.append(
            after_restart(
                t, resp_id, before, ref, "API process restarted (SIGTERM, new process)", time.monotonic() - t0
            )
        )
    except Exception as exc:
        out.append({"event": "API process restarted", "error": f"{type(exc).__name__}: {exc}"[:500]})
    # 2. The worker, SIGKILLed mid-job; a new worker started.
    try:
        resp_id, before = start_background(t, tokens)
        t0 = time.monotonic()
        w = st.workers.pop(0)
        w.signal(signal.SIGKILL)
        w.popen.wait(10)
        st.procs.stop(w)
        st.start_worker()
        st.wait_ready(1)
        event = "worker SIGKILLed mid-job, a new worker started"
        res = after_restart(t, resp_id, before, ref, event, time.monotonic() - t0)
        if res.get("text") is not None and not res.get("same_text_as_uninterrupted"):
            # The same request again, now, on the new worker: is the answer the re-run's?
            res["run_after_text"] = reference_text(t, tokens)
            res["same_text_as_a_run_after"] = res["run_after_text"] == res["text"]
        out.append(res)
    except Exception as exc:
        out.append({"event": "worker SIGKILLed", "error": f"{type(exc).__name__}: {exc}"[:500]})
    return out, t


def restarts_vllm(start: Callable[[], SimpleNamespace], srv, t: Target, tokens: int) -> list[dict]:
    """`srv`: the running server (bench.vllm.Running); `start()` starts a new one."""
    out = []
    ref = reference_text(t, tokens)
    # 1. The server, stopped (SIGTERM) and started again while the response runs.
    try:
        resp_id, before = start_background(t, tokens)
        t0 = time.monotonic()
        srv.stop()
        t.close()
        srv = start()
        t = Target("vllm", f"http://127.0.0.1:{srv.port}", srv.model)
        out.append(
            after_restart(t, resp_id, before, ref, "server restarted (SIGTERM, new process)", time.monotonic() - t0)
        )
    except Exception as exc:
        out.append({"event": "server restarted", "error": f"{type(exc).__name__}: {exc}"[:500]})
    # 2. Its engine-core process (the model's process, its analogue of a worker), SIGKILLed mid-response.
    try:
        resp_id, before = start_background(t, tokens)
        _, core, _ = split_tree(srv.proc.pid)
        assert core, "no EngineCore process found"
        t0 = time.monotonic()
        for p in core:
            p.send_signal(signal.SIGKILL)
        seen = watch(t, resp_id, srv.proc, 60.0, t0)
        event = "engine-core process SIGKILLed mid-response"
        res = {"event": event, "before": before, "seen": seen, "first_get": seen[0][1], "final": seen[-1][1]}
        res["server_alive_after"] = srv.proc.alive()
        log(f"  {event}: before {before}, then {seen}")
        out.append(res)
    except Exception as exc:
        out.append({"event": "engine-core SIGKILLed", "error": f"{type(exc).__name__}: {exc}"[:500]})
    finally:
        t.close()
        srv.stop()
    return out


# -- the run ----------------------------------------------------------------------------------


def run_genqueue(procs: Processes, model_dir: Path, dtype: str, args) -> dict:
    db = RedisTarget(procs, private=True)
    env = {"GENQ_DTYPE": dtype, "HF_HUB_OFFLINE": "1", "GENQ_TOOL_CALL_PARSER": "hermes", "GENQ_MAX_BATCH_SIZE": "8"}
    st = Stack(procs, db.url, model_dir, "hf", "genq", 8, **env)
    t0 = time.monotonic()
    try:
        st.start_worker()
        st.start_api(1)
        out = {"startup_s": time.monotonic() - t0, "how": "API (gunicorn, 1 process), 1 hf worker, private Redis"}
        out["env"] = {k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"}
        log(f"genqueue ready on port {st.port} after {out['startup_s']:.0f} s; {len(CHECKS)} checks")
        t = Target("genqueue", st.base, st.name)
        out["checks"] = run_checks(t, args.checks)
        if args.restarts:
            out["restart_tokens"] = args.restart_tokens
            out["restarts"], t = restarts_genqueue(st, t, args.restart_tokens)
        t.close()
        return out
    finally:
        st.stop()
        if db.proc:
            procs.stop(db.proc)


def run_vllm(procs: Processes, model_dir: Path, dtype: str, outdir: Path, args) -> dict:
    sargs = SimpleNamespace(
        server_args=["--served-model-name", SERVED_NAME, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        server_env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
    )
    starts = []

    def start():
        starts.append(1)
        return start_server(dtype, procs, model_dir, sargs, outdir, f"server-{len(starts)}")

    srv = start()
    try:
        out = {"startup_s": srv.info["startup_s"], "how": srv.info["command"], "env": srv.info["env"]}
        log(f"vLLM's server ready on port {srv.port} after {out['startup_s']:.0f} s; {len(CHECKS)} checks")
        t = Target("vllm", f"http://127.0.0.1:{srv.port}", srv.model)
        out["checks"] = run_checks(t, args.checks)
        if args.restarts:
            out["restart_tokens"] = args.vllm_restart_tokens
            out["restarts"] = restarts_vllm(start, srv, t, args.vllm_restart_tokens)
        t.close()
        return out
    finally:
        srv.stop()


def render(res: dict) -> str:
    servers = [k for k in SERVERS if k in res["servers"]]
    L = ["## Latest run", "", *run_lines(res)]
    L.append(
        f"- Model: {res['model']}; dtype {res['dtype']}; {res['vllm_env']}; openai {res['openai']}, "
        f"anthropic {res['anthropic']}"
    )
    for k in servers:
        s = res["servers"][k]
        if "error" in s:
            L.append(f"- {TITLES[k]}: **did not run**: {s['error'][:300]}")
            continue
        env = " ".join(f"{a}={b}" for a, b in s.get("env", {}).items())
        L.append(f"- {TITLES[k]}: {s['how']} ({env}); ready after {s['startup_s']:.0f} s")
    L += ["", "### Checks", ""]
    rows, whats = [], {n: w for n, w, _ in CHECKS}
    names_ = [n for n, _, _ in CHECKS if any(n in res["servers"][k].get("checks", {}) for k in servers)]
    for n in names_:
        row = [n, whats.get(n, "")]
        for k in servers:
            c = res["servers"][k].get("checks", {}).get(n)
            row.append("-" if c is None else "PASS" if c["ok"] else f"**FAIL**: {c['detail'][:160].replace('|', '/')}")
        rows.append(row)
    L.append(table(["check", "what", *(TITLES[k] for k in servers)], rows))
    totals = []
    for k in servers:
        cs = res["servers"][k].get("checks", {})
        totals.append(f"{TITLES[k]} {sum(c['ok'] for c in cs.values())} of {len(cs)}")
    L += ["", "Passed: " + ", ".join(totals) + "."]
    if any(res["servers"][k].get("restarts") for k in servers):
        L += ["", "### A background response across restarts", ""]
        rows = []
        for k in servers:
            for r in res["servers"][k].get("restarts", []):
                if "error" in r:
                    rows.append([TITLES[k], r["event"], "-", "-", f"harness error: {r['error'][:160]}"])
                    continue
                final = "the same" if r["final"] == r["first_get"] else r["final"]
                if r.get("seen"):
                    final = "; then ".join(f"{what} ({at:g} s)" for at, what in r["seen"][1:]) or "the same"
                if "same_text_as_uninterrupted" in r:
                    same = r["same_text_as_uninterrupted"]
                    final += ", text " + (
                        "= the uninterrupted run's"
                        if same
                        else f"differs from the uninterrupted run's from character {r.get('differs_from_char')}"
                    )
                if "same_text_as_a_run_after" in r:
                    final += " (= a run of the same request after it)" if r["same_text_as_a_run_after"] else ""
                tokens = res["servers"][k].get("restart_tokens", "?")
                rows.append([TITLES[k], r["event"], tokens, r["before"], r["first_get"], final])
        L.append(table("server|event|max_output_tokens|status before|first GET after|in the end", rows))
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = parser("bench.responses_compat", __doc__, model=False, noise=False, render=True)
    ap.add_argument("--servers", default=",".join(SERVERS), help="which, in this order")
    ap.add_argument("--checks", default="", help="only these checks (names separated by ';'; default all)")
    ap.add_argument(
        "--restart-tokens", type=int, default=200, help="max_output_tokens of genqueue's restarted response"
    )
    ap.add_argument(
        "--vllm-restart-tokens",
        type=int,
        default=2000,
        help="vLLM's (it decodes 200 tokens in about a second here: the restart would come after the end)",
    )
    ap.add_argument("--no-restarts", dest="restarts", action="store_false", help="the checks only")
    ap.add_argument("--dtype", default="auto", help="both servers' (auto: the machine's best, worker/engines/dtype.py)")
    args = ap.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    args.servers = names(ap, args.servers, SERVERS, "--servers")
    all_names = [n for n, _, _ in CHECKS]
    args.checks = [x.strip() for x in args.checks.split(";") if x.strip()] or None
    if args.checks and set(args.checks) - set(all_names):
        ap.error(f"--checks: unknown {sorted(set(args.checks) - set(all_names))}; names: {all_names}")
    if args.dtype == "auto":
        from worker.engines import dtype as dtype_rule

        args.dtype = dtype_rule.resolve("auto", dtype_rule.cpu_flags())[0]
    from scripts import realmodel

    model_dir = realmodel.ensure()

    def measure(procs: Processes, res: dict, outdir: Path) -> None:
        for k in args.servers:
            try:
                if k == "genqueue":
                    res["servers"][k] = run_genqueue(procs, model_dir, args.dtype, args)
                else:
                    res["servers"][k] = run_vllm(procs, model_dir, args.dtype, outdir, args)
            except (RuntimeError, OSError, TimeoutError) as exc:  # a server that cannot start is a result
                log(f"{k} failed: {exc}")
                res["servers"][k] = {"error": f"{type(exc).__name__}: {exc}"}
            (outdir / "results-partial.json").write_text(json.dumps(res, indent=1, default=str))

    facts = {
        "model": "SmolLM2-135M-Instruct (scripts/realmodel.py)",
        "dtype": args.dtype,
        "vllm_env": env_versions("vllm") if "vllm" in args.servers else "vLLM not run",
        "openai": openai.__version__,
        "anthropic": anthropic.__version__,
        "servers": {},
    }
    res = run_bench("bench.responses_compat", args, argv, measure, out_prefix="responses-compat-", log=log, **facts)
    if res is None:
        return 130
    print(render(res).replace(str(Path.cwd()) + "/", ""), flush=True)
    log(f"raw results and logs in {res['outdir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
