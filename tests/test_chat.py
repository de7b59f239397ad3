"""`/v1/chat/completions`, `/tokenize` and `/detokenize` through a real stack, with the official
`openai` client: the worker renders the chat template (GENQ_CHAT_TEMPLATE, a file of the tests)
and its greedy reply equals `model.generate` on that rendering."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

TEMPLATE = Path(__file__).with_name("chat_template.jinja")
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def chat_stack(make_module_stack):
    s = make_module_stack(GENQ_CHAT_TEMPLATE=str(TEMPLATE), GENQ_MAX_BATCH_SIZE="8")
    s.start_api()
    s.start_worker()
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def client(chat_stack):
    with openai.OpenAI(base_url=chat_stack.base + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def chat_reference(tiny_model):
    """The template rendered by transformers in this process, tokenized without adding special
    tokens again, and greedy `model.generate` on it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()

    def ids(messages, **kw) -> list[int]:
        kw.setdefault("add_generation_prompt", True)
        text = tok.apply_chat_template(messages, chat_template=TEMPLATE.read_text(), tokenize=False, **kw)
        return tok(text, add_special_tokens=False).input_ids

    def complete(messages, max_new_tokens: int, **kw) -> str:
        prompt = torch.tensor([ids(messages, **kw)])
        with torch.inference_mode():
            out = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens, do_sample=False
            )
        return tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)

    complete.ids = ids
    complete.tok = tok
    return complete


def test_chat_completion_is_the_rendered_template_generated(client, chat_stack, chat_reference):
    out = client.chat.completions.create(
        model=chat_stack.name, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == chat_stack.name
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == chat_reference(MESSAGES, 12)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(chat_reference.ids(MESSAGES))  # no second BOS
    # Text parts are joined as one string; max_completion_tokens is max_tokens.
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    again = client.chat.completions.create(
        model=chat_stack.name, messages=parts, max_completion_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].message.content == choice.message.content


def test_continue_final_message(client, chat_stack, chat_reference):
    messages = [*MESSAGES, {"role": "assistant", "content": "Blue and"}]
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    out = client.chat.completions.create(
        model=chat_stack.name, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, **kw}
    )
    assert out.choices[0].message.content == chat_reference(messages, 6, **kw)


def test_n_choices_logprobs_and_the_stream(client, chat_stack):
    kw = dict(model=chat_stack.name, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    two = client.chat.completions.create(n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1] and {c.message.content for c in two.choices} == {plain}
    assert two.usage.completion_tokens == 20

    lp_answer = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    lp = lp_answer.choices[0].logprobs.content
    assert len(lp) == 10 and "".join(t.token for t in lp) == plain
    for t in lp:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].token == t.token and t.logprob == t.top_logprobs[0].logprob  # greedy
        assert t.bytes == list(t.token.encode())

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # The messages' 36 tokens were sent before: their whole 16-token blocks came from the
    # prefix cache, as for the request before.
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < chunks[-1].usage.prompt_tokens
    assert cached == lp_answer.usage.prompt_tokens_details.cached_tokens


def test_unimplemented_fields_are_refused_by_name(client, chat_stack):
    for field, value in (
        ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
        ("prediction", {"type": "content", "content": "x"}),
        ("modalities", ["audio"]),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=chat_stack.name, messages=MESSAGES, **{field: value})
        assert info.value.body["param"] == field and info.value.code == "unsupported_parameter"
    # Neutral values, as clients send them, change nothing.
    out = client.chat.completions.create(
        model=chat_stack.name, messages=MESSAGES, max_tokens=2, tools=None, response_format={"type": "text"}
    )
    assert out.usage.completion_tokens <= 2
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=chat_stack.name,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        )
    assert info.value.body["param"].startswith("messages.0")


def test_tokenize_and_detokenize_round_trip(chat_stack, chat_reference):
    resp = chat_stack.post("/tokenize", json={"model": chat_stack.name, "messages": MESSAGES})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == chat_reference.ids(MESSAGES) and body["count"] == len(body["tokens"])
    # A developer message is rendered as the system message it stands for (OpenAI's newer name).
    system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    developer = [{"role": "developer", "content": "Be brief."}, *MESSAGES]
    resp = chat_stack.post("/tokenize", json={"model": chat_stack.name, "messages": developer})
    assert resp.status_code == 200 and resp.json()["tokens"] == chat_reference.ids(system)
    text = "Hello, my name is"
    resp = chat_stack.post("/tokenize", json={"prompt": text, "return_token_strs": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == chat_reference.tok(text).input_ids
    assert body["token_strs"] == chat_reference.tok.convert_ids_to_tokens(body["tokens"])
    resp = chat_stack.post("/detokenize", json={"tokens": body["tokens"][1:]})  # without the BOS
    assert resp.status_code == 200 and resp.json() == {"prompt": text}
    resp = chat_stack.post("/detokenize", json={"tokens": [10**9]})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request"


def test_a_chat_line_in_a_batch_and_the_client(chat_stack, chat_reference, tmp_path, capsys):
    from genqueue import Client
    from genqueue.cli import main

    good = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    bad = {**good, "tools": [{"type": "function"}]}
    with Client(chat_stack.base) as c:
        rows = c.run_batch([good, bad], model=chat_stack.name, endpoint="/v1/chat/completions", progress=False)
        assert c.chat(MESSAGES, model=chat_stack.name, max_tokens=8, temperature=0, ignore_eos=True) == (
            chat_reference(MESSAGES, 8)
        )
    body = rows[0]["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == chat_reference(
        MESSAGES, 8
    )
    assert rows[1]["response"]["status_code"] == 400 and rows[1]["response"]["body"]["error"]["param"].startswith(
        "tools.0"
    )
    # genq batch takes the endpoint from the file's lines; genq chat prints the reply.
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps(
            {
                "custom_id": "a",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": chat_stack.name, **good},
            }
        )
        + "\n"
    )
    assert main(["batch", str(path), "--url", chat_stack.base, "--no-progress"]) == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert line["response"]["body"]["choices"][0]["message"]["content"] == chat_reference(MESSAGES, 8)
    argv = [
        "chat",
        "Name a colour.",
        "--system",
        "You are terse.",
        "--url",
        chat_stack.base,
        "--model",
        chat_stack.name,
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--param",
        "ignore_eos=true",
    ]
    assert main(argv) == 0
    assert capsys.readouterr().out == chat_reference(MESSAGES, 8) + "\n"


def test_a_model_without_a_chat_template(echo_stack):
    """The echo engine has no tokenizer, hence no template: 400 at once, saying what to do."""
    resp = echo_stack.post("/v1/chat/completions", json={"model": echo_stack.name, "messages": MESSAGES})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["code"] == "no_chat_template" and "GENQ_CHAT_TEMPLATE" in error["message"]
    resp = echo_stack.post("/tokenize", json={"model": echo_stack.name, "messages": MESSAGES})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "no_chat_template"
