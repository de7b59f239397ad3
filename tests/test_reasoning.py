"""Reasoning output (GENQ_REASONING_PARSER): the think span of a chat answer in `reasoning`,
not `content`, unstreamed, streamed and in batch lines; `reasoning_effort` and
`enable_thinking` reaching the template; structured output applied to what follows the
reasoning (StructuredOutput.after), in the hf engine on real forwards of two architectures.
The parsers' own cases (every split of a stream, the tags) are tests/test_parsers.py's.

The tiny models' weights are random: their text never closes a think span. The stack's
template opens one (`<think>` ends its generation prompt, as DeepSeek-R1's and Qwen3's do), so
with thinking on the whole output is reasoning, with thinking off the whole output is content,
and the job's own text (GET /v1/jobs/<id>) says what each must be."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from scripts import devmodels
from tasks.config import Settings
from tasks.schemas import JobSpec, SamplingParams, StructuredOutput
from webapp.completions import Submitted
from webapp.errors import APIError
from webapp.protocol.chat import ChatCompletionRequest
from webapp.protocol.output import ReasoningUse
from worker.engines.hf import HFEngine

TEMPLATE = Path(__file__).with_name("chat_template_think.jinja")
MESSAGES = [{"role": "user", "content": "Is 17 a prime number?"}]
DIGITS = StructuredOutput(regex="[0-9]{4,8}")


def to_jobs(**kw):
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **kw}).to_jobs()


# -- the request ------------------------------------------------------------------------------


def test_reasoning_effort_and_enable_thinking_reach_the_template_as_vllms_do():
    jobs = to_jobs(reasoning_effort="low")
    assert jobs.chat.chat_template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    assert jobs.reasoning == ReasoningUse(enable_thinking=True)
    off = to_jobs(reasoning_effort="none")
    assert off.chat.chat_template_kwargs["enable_thinking"] is False and off.reasoning.enable_thinking is False
    # The request's own chat_template_kwargs win over what reasoning_effort implies.
    own = to_jobs(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert own.reasoning.enable_thinking is True and own.chat.chat_template_kwargs["reasoning_effort"] == "none"
    assert to_jobs().chat.chat_template_kwargs == {}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
    ],
)
def test_bad_reasoning_fields_are_400_naming_the_field(body, field):
    with pytest.raises((APIError, ValueError)) as err:
        to_jobs(**body)
    assert field.split(".")[0] in str(err.value) if not isinstance(err.value, APIError) else err.value.param == field


@pytest.mark.parametrize(
    "use, end",
    [
        (ReasoningUse(None), None),  # no parser: nothing to wait for
        (ReasoningUse("deepseek_r1"), "</think>"),
        (ReasoningUse("deepseek_r1", enable_thinking=False), "</think>"),  # vLLM's ignores it
        (ReasoningUse("qwen3"), "</think>"),
        (ReasoningUse("qwen3", enable_thinking=False), None),  # no reasoning: constrained at once
    ],
)
def test_where_a_constraint_starts_follows_the_parser_and_thinking(use, end):
    assert use.end() == end


def test_a_batch_line_keeps_its_reasoning_parser():
    jobs = to_jobs(chat_template_kwargs={"enable_thinking": False})
    jobs.reasoning = ReasoningUse("qwen3", enable_thinking=False)
    back = Submitted.from_entry(Submitted(jobs, ["a"], "m", 1).entry())
    assert back.jobs.reasoning == jobs.reasoning
    assert back.jobs.output_parser().parse("x</think>y").content == "x</think>y"  # thinking off: all content


# -- structured output after the reasoning, on real forwards ----------------------------------


@pytest.fixture(scope="module", params=["opt", "llama"])
def engine(request, tiny_model):
    path = (
        tiny_model
        if request.param == "opt"
        else devmodels.ensure("tiny", tiny_model.parent / "tiny-llama", arch="llama")
    )
    eng = HFEngine(Settings(model=str(path), model_name="tiny", max_batch_size=4))
    yield eng
    eng.close()


def run(engine, **params):
    run.n += 1
    spec = JobSpec(id=f"r-{run.n}", model="tiny", prompt="The answer is", params=SamplingParams(**params))
    return engine.submit(spec).result(timeout=120)


run.n = 0


def test_a_constraint_after_a_text_holds_from_that_text_on(engine):
    """`after` set to the first tokens the model writes unconstrained: those come out as they
    would, then the constraint holds (digits); without `after` it holds from the start, and
    with an `after` the output never holds, the output is the unconstrained one."""
    free = run(engine, max_new_tokens=12, ignore_eos=True, return_token_ids=True)
    head = engine.tok.decode(free.token_ids[:3])
    assert head and free.text.startswith(head)
    # Without ignore_eos: the grammar ends the job when it is complete (its EOS).
    after = run(engine, max_new_tokens=12, structured_outputs=DIGITS.model_copy(update={"after": head}))
    assert after.text.startswith(head) and after.text != free.text
    rest = after.text[after.text.index(head) + len(head) :]
    assert rest and rest.isdigit(), after.text
    at_once = run(engine, max_new_tokens=12, structured_outputs=DIGITS)
    assert at_once.text.isdigit()
    never = DIGITS.model_copy(update={"after": "\x00never"})
    assert run(engine, max_new_tokens=12, ignore_eos=True, structured_outputs=never).text == free.text


# -- end to end: API, Redis, an hf worker ------------------------------------------------------


@pytest.fixture(scope="module")
def think_stack(tiny_model, stack_logs):
    """On a Redis of its own, as tests/test_tools.py's: another stack's API, on the shared one,
    would drive this one's batches with its own settings."""
    from conftest import private_stack

    with private_stack(
        tiny_model, stack_logs, GENQ_CHAT_TEMPLATE=str(TEMPLATE), GENQ_REASONING_PARSER="qwen3", GENQ_MAX_BATCH_SIZE="8"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(think_stack):
    with openai.OpenAI(base_url=think_stack.base + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def job_text(stack, response_id: str) -> str:
    import requests

    job_id = response_id.removeprefix("chatcmpl-")
    return requests.get(f"{stack.base}/v1/jobs/{job_id}", timeout=30).json()["result"]["text"]


def streamed(client, stack, **kw) -> tuple[str | None, str | None]:
    reasoning, content = None, None
    for chunk in client.chat.completions.create(model=stack.name, messages=MESSAGES, stream=True, **kw):
        for c in chunk.choices:
            r = (c.delta.model_extra or {}).get("reasoning")
            if r:
                reasoning = (reasoning or "") + r
            if c.delta.content:
                content = (content or "") + c.delta.content
    return reasoning, content


def test_the_think_span_is_reasoning_and_the_rest_content(client, think_stack):
    kw = dict(max_tokens=12, temperature=0)
    on = client.chat.completions.create(model=think_stack.name, messages=MESSAGES, **kw)
    text = job_text(think_stack, on.id)
    assert text and on.choices[0].message.content is None
    assert on.choices[0].message.model_extra["reasoning"] == text
    assert streamed(client, think_stack, **kw) == (text, None)

    off = dict(kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    answer = client.chat.completions.create(model=think_stack.name, messages=MESSAGES, **off)
    assert answer.choices[0].message.content == job_text(think_stack, answer.id)
    assert answer.choices[0].message.model_extra.get("reasoning") is None
    assert streamed(client, think_stack, **off) == (None, answer.choices[0].message.content)


def test_a_responses_answer_has_its_think_span_as_a_reasoning_item(client, think_stack):
    """/v1/responses: thinking on, the output is a `reasoning` item (its stream's
    reasoning_text deltas join to it); `reasoning.effort: "none"` turns thinking off (as
    chat's reasoning_effort), and the output is a message."""
    import uuid

    kw = dict(model=think_stack.name, input=MESSAGES[0]["content"], max_output_tokens=12, temperature=0)
    on = client.responses.create(**kw)
    text = job_text(think_stack, "chatcmpl-" + str(uuid.UUID(on.id.removeprefix("resp_"))))
    (item,) = on.output
    assert item.type == "reasoning" and item.content[0].text == text and on.output_text == ""
    events = list(client.responses.create(stream=True, **kw))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == text and events[-1].response.output[0].content[0].text == text
    off = client.responses.create(reasoning={"effort": "none"}, **kw)
    assert [o.type for o in off.output] == ["message"] and off.output_text


def test_structured_output_applies_after_the_reasoning(client, think_stack):
    """Thinking on: the constraint waits for `</think>` (which the tiny model never writes), so
    the text is the unconstrained one; thinking off: it holds from the first token."""
    kw = dict(max_tokens=10, temperature=0)
    free = client.chat.completions.create(model=think_stack.name, messages=MESSAGES, **kw)
    digits = {"structured_outputs": {"regex": "[0-9]{4,8}"}}
    on = client.chat.completions.create(model=think_stack.name, messages=MESSAGES, extra_body=digits, **kw)
    assert on.choices[0].message.model_extra["reasoning"] == free.choices[0].message.model_extra["reasoning"]
    off = {**digits, "chat_template_kwargs": {"enable_thinking": False}}
    forced = client.chat.completions.create(model=think_stack.name, messages=MESSAGES, extra_body=off, **kw)
    assert forced.choices[0].message.content.isdigit()
