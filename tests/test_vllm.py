"""The vLLM engine end to end: a real vLLM (CPU build) in a worker process on the tiny
checkpoint, behind the same API. Compared with vLLM's own `LLM.generate`."""

from __future__ import annotations

import importlib.util
import json
import uuid

import pytest
from conftest import VLLM_MAX_MODEL_LEN
from helpers import joined, sse_events, stream, submit

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
N = 12


@pytest.fixture(scope="module")
def expected(vllm_reference):
    # vLLM's own answers first, before the worker's engine competes for the two cores.
    return dict(zip(PROMPTS, vllm_reference(PROMPTS, N)))


def test_teaching_generate_vllm(expected, vllm_stack):
    one = vllm_stack.post("/generate_vllm", json={"prompts": PROMPTS[:1], "max_new_tokens": N})
    assert one.status_code == 200
    assert one.json() == {"generated_texts": [expected[PROMPTS[0]]]}
    three = vllm_stack.post("/generate_vllm", json={"prompts": PROMPTS, "max_new_tokens": N})
    assert three.json()["generated_texts"] == [expected[p] for p in PROMPTS]
    assert vllm_stack.post("/generate_vllm", json={"prompts": []}).json() == {"generated_texts": []}
    for bad in ({"prompts": "Hello"}, {"prompt": "Hello"}, {"prompts": [1]}, {"prompts": [""]}):
        resp = vllm_stack.post("/generate_vllm", json=bad)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request"


def test_jobs_routed_by_model_match_vllm(expected, vllm_stack):
    for prompt in PROMPTS:
        job_id = submit(vllm_stack, prompt=prompt, max_new_tokens=N, model=vllm_stack.name)
        job = vllm_stack.get(f"/v1/jobs/{job_id}?wait=60").json()
        assert job["status"] == "succeeded", job
        assert job["result"]["text"] == expected[prompt]
        assert job["result"]["completion_tokens"] == N


def test_streamed_vllm_job(vllm_stack):
    job_id = submit(vllm_stack, prompt="Once upon a time", max_new_tokens=20, ignore_eos=True)
    events = stream(vllm_stack, job_id)
    assert events[-1]["event"] == "done"
    assert [int(e["id"]) for e in events] == list(range(len(events)))
    done = json.loads(events[-1]["data"])
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 20
    result = vllm_stack.get(f"/v1/jobs/{job_id}?wait=30").json()["result"]
    assert joined(events) == result["text"]


def test_vllm_reports_its_prefix_cache_hits(vllm_stack):
    """vLLM's `num_cached_tokens` as usage.prompt_tokens_details.cached_tokens: the same prompt
    of about 200 tokens (over one of the CPU build's 128-token blocks) twice, the second's whole
    blocks from vLLM's prefix cache; the job API's result and stream say the same."""
    prompt = f"[{uuid.uuid4().hex}] " + " ".join(["The quick brown fox jumps over the lazy dog."] * 8)
    body = {"model": vllm_stack.name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = vllm_stack.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens"] > 128 and first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = vllm_stack.post("/v1/completions", json=body).json()["usage"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert second["prompt_tokens"] == first["prompt_tokens"] and 0 < cached < second["prompt_tokens"]
    job_id = submit(vllm_stack, prompt=prompt, max_new_tokens=4, temperature=0, ignore_eos=True)
    done = json.loads(stream(vllm_stack, job_id)[-1]["data"])
    assert done["usage"] == {"prompt_tokens": first["prompt_tokens"], "completion_tokens": 4, "cached_tokens": cached}
    assert vllm_stack.get(f"/v1/jobs/{job_id}?wait=60").json()["result"]["cached_tokens"] == cached


def test_openai_completions_on_vllm(expected, vllm_stack):
    body = {"model": vllm_stack.name, "prompt": PROMPTS, "max_tokens": N, "temperature": 0}
    out = vllm_stack.post("/v1/completions", json=body).json()
    assert [c["text"] for c in out["choices"]] == [expected[p] for p in PROMPTS]


def test_cancelling_aborts_the_vllm_request(vllm_stack):
    # Sixteen long jobs share the batch, so each runs for seconds. A loaded machine can still
    # finish one before the cancel lands (409), or before the engine acts on it (its stream ends
    # `done`; seen once in a CI run, 2026-12-07, not reproduced): then try again with a new batch.
    for _ in range(3):
        ids = [submit(vllm_stack, prompt=f"Hello {i}", max_new_tokens=360, ignore_eos=True) for i in range(16)]
        with vllm_stack.http.get(f"{vllm_stack.base}/v1/jobs/{ids[0]}/stream", stream=True, timeout=60) as resp:
            sse_events(resp, limit=1)  # it is running
        resp = vllm_stack.post(f"/v1/jobs/{ids[0]}/cancel")
        if resp.status_code != 200:
            assert resp.json()["error"]["code"] == "already_final"
            continue
        events = stream(vllm_stack, ids[0])
        if events[-1]["event"] == "error":
            break
    assert resp.status_code == 200
    assert events[-1]["event"] == "error"
    assert json.loads(events[-1]["data"])["error"]["code"] == "cancelled"
    assert len([e for e in events if e["event"] == "token"]) < 360  # it stopped early
    for job_id in ids[1:]:
        assert vllm_stack.get(f"/v1/jobs/{job_id}?wait=120").json()["status"] == "succeeded"
    # The worker goes on serving.
    after = vllm_stack.post("/generate_vllm", json={"prompts": ["Hello"], "max_new_tokens": 3})
    assert after.status_code == 200


def test_prompt_too_long_for_vllm(vllm_stack):
    """Refused at submit against the vLLM worker's context (GENQ_VLLM_MAX_MODEL_LEN), which it
    announces with its tokenizer's bound (tests/test_context.py)."""
    resp = vllm_stack.post("/generate_vllm", json={"prompts": ["word " * 600]})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "prompt_too_long"
    body = {"model": vllm_stack.name, "prompt": "word " * 300, "max_tokens": 4}
    err = vllm_stack.post("/v1/completions", json=body).json()["error"]
    assert err["code"] == "prompt_too_long" and err["param"] == "prompt", err
    assert err["message"].startswith(f"This model's maximum context length is {VLLM_MAX_MODEL_LEN} tokens."), err
    # Token ids are counted as sent: just under the context fits, one more does not.
    ids = [100] * (VLLM_MAX_MODEL_LEN - 4)
    assert vllm_stack.post("/v1/completions", json={**body, "prompt": ids}).status_code == 200
    err = vllm_stack.post("/v1/completions", json={**body, "prompt": ids + [100]}).json()["error"]
    assert err["code"] == "prompt_too_long" and err["param"] == "max_tokens", err


def test_the_api_and_hf_worker_run_without_vllm(hf_stack):
    assert importlib.util.find_spec("vllm") is None
    resp = hf_stack.post("/basic_generate", json={"prompt": "Hello", "max_new_tokens": 3})
    assert resp.status_code == 200


def test_a_job_past_its_deadline_is_aborted_with_its_partial_text(vllm_stack):
    long = {"prompt": "Hello", "max_new_tokens": 360, "ignore_eos": True, "model": vllm_stack.name}
    # Calibrate: how long this machine takes for the whole job; the deadline comes half-way.
    whole = vllm_stack.get(f"/v1/jobs/{submit(vllm_stack, **long)}?wait=120").json()
    assert whole["status"] == "succeeded", whole
    timeout = 2 * whole["timings"]["queued_s"] + whole["timings"]["run_s"] / 2
    job = vllm_stack.get(f"/v1/jobs/{submit(vllm_stack, **long, timeout_s=timeout)}?wait=120").json()
    assert job["status"] == "failed" and job["error"]["code"] == "timeout", job
    assert job["result"]["finish_reason"] == "timeout"
    assert 0 < job["result"]["completion_tokens"] < long["max_new_tokens"]


def test_vllm_sampling_parameters_and_logprobs(vllm_stack):
    """vLLM's own parameters reach its SamplingParams; log-probabilities come back as vLLM's
    server writes them, in the response and in the stream chunks."""
    body = {
        "model": vllm_stack.name,
        "prompt": "Hello, my name is",
        "max_tokens": 8,
        "temperature": 0,
        "repetition_penalty": 1.2,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "min_tokens": 4,
        "stop_token_ids": [2],
        "logprobs": 2,
        "n": 2,
    }
    out = vllm_stack.post("/v1/completions", json=body)
    assert out.status_code == 200, out.text
    choices = out.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and choices[0]["text"] == choices[1]["text"]
    lp = choices[0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) >= 4
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(2 <= len(t) <= 3 for t in lp["top_logprobs"])
    resp = vllm_stack.http.post(
        f"{vllm_stack.base}/v1/completions", json={**body, "n": 1, "stream": True}, stream=True, timeout=120
    )
    chunks = [json.loads(line[6:]) for line in resp.iter_lines(decode_unicode=True) if line.startswith("data: {")]
    streamed = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


def test_vllm_engine_settings_reach_the_engine(vllm_stack):
    """GENQ_VLLM_MAX_MODEL_LEN (like GENQ_VLLM_GPU_MEMORY_UTILIZATION and
    GENQ_VLLM_TENSOR_PARALLEL_SIZE beside it) is passed to vLLM's engine, which serves that
    context: the worker announces it and refuses a prompt past it."""
    from conftest import VLLM_MAX_MODEL_LEN

    cards = {m["id"]: m for m in vllm_stack.get("/v1/models").json()["data"]}
    assert cards[vllm_stack.name]["max_model_len"] == VLLM_MAX_MODEL_LEN
    resp = vllm_stack.post(
        "/generate_vllm", json={"prompts": ["word " * (VLLM_MAX_MODEL_LEN - 8)], "max_new_tokens": 16}
    )
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "prompt_too_long", resp.text


def test_chat_on_vllm_is_the_rendered_template_without_a_second_bos(vllm_stack, tiny_model):
    """The vLLM worker renders the template (GENQ_CHAT_TEMPLATE) and feeds vLLM its token ids as
    they are: the reply equals a completion of the same tokens (the rendered text after its BOS
    text, which the completion's tokenizer adds back), and /tokenize says those tokens."""
    from pathlib import Path

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    template = (Path(__file__).parent / "chat_template.jinja").read_text()
    messages = [{"role": "user", "content": "Name a colour."}]
    rendered = tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    ids = tok(rendered, add_special_tokens=False).input_ids
    assert rendered.startswith(tok.bos_token) and ids == tok(rendered[len(tok.bos_token) :]).input_ids
    kw = {"model": vllm_stack.name, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    chat = vllm_stack.post("/v1/chat/completions", json={"messages": messages, **kw})
    assert chat.status_code == 200, chat.text
    plain = vllm_stack.post("/v1/completions", json={"prompt": rendered[len(tok.bos_token) :], **kw}).json()
    assert chat.json()["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    assert chat.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] == len(ids)
    tokens = vllm_stack.post("/tokenize", json={"messages": messages})
    assert tokens.status_code == 200 and tokens.json()["tokens"] == ids


def test_vllm_fields_and_structured_output_reach_vllm(vllm_stack, tiny_model):
    """The fields of issue 19 go to vLLM's own SamplingParams / StructuredOutputsParams: the
    same checks as tests/test_vllm_fields.py, answered by vLLM."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)

    def complete(**body):
        resp = vllm_stack.post(
            "/v1/completions",
            json={"model": vllm_stack.name, "max_tokens": 10, "temperature": 0, "prompt": "Hello, my name is", **body},
        )
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"]

    (plain,) = complete(return_token_ids=True)
    ids = plain["prompt_token_ids"]
    assert ids == tok("Hello, my name is").input_ids and tok.decode(plain["token_ids"]) == plain["text"]
    assert [c["text"] for c in complete(prompt=[ids, ids[1:]])][0] == plain["text"]
    assert complete(temperature=1.0, seed=-5, min_p=1.0)[0]["text"] == plain["text"]
    (forced,) = complete(logit_bias={"77": 100}, return_token_ids=True)
    assert forced["token_ids"] == [77] * 10
    (allowed,) = complete(allowed_token_ids=[40, 41], temperature=1.0, seed=1, return_token_ids=True)
    assert set(allowed["token_ids"]) <= {40, 41}
    (lp,) = complete(prompt_logprobs=1, max_tokens=1)
    assert lp["prompt_logprobs"][0] is None and str(ids[1]) in lp["prompt_logprobs"][1]
    # A JSON schema reaches vLLM too, but vLLM's xgrammar backend allows unbounded whitespace
    # between JSON tokens (its per-request disable_any_whitespace is not read: the server's
    # setting is), which a random model fills max_tokens with; the same JSON as a regex here.
    for seed in (1, 2, 3):
        (out,) = complete(
            temperature=1.0, seed=seed, max_tokens=40, structured_outputs={"regex": r'\{"color": "(red|green)"\}'}
        )
        assert json.loads(out["text"])["color"] in ("red", "green"), out
    (out,) = complete(structured_outputs={"choice": ["yes", "no"]})
    assert out["text"] in ("yes", "no")


def test_forced_tool_calls_through_the_vllm_engine(vllm_stack):
    """A named function and `required` through a vLLM worker: the forcing schemas reach vLLM's
    structured output, and the calls' arguments match the tools' schemas."""
    import jsonschema

    zone = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    tools = [
        {"type": "function", "function": {"name": "get_time", "parameters": zone}},
        {"type": "function", "function": {"name": "get_weather", "parameters": city}},
    ]
    schemas = {"get_time": zone, "get_weather": city}
    body = {"model": vllm_stack.name, "messages": [{"role": "user", "content": "Time?"}], "tools": tools}
    body.update(max_tokens=120, temperature=0)
    for choice, finish in (
        ({"type": "function", "function": {"name": "get_time"}}, "stop"),
        ("required", "tool_calls"),
    ):
        # One call for `required` (the random model would add calls until max_tokens otherwise).
        resp = vllm_stack.post(
            "/v1/chat/completions", json={**body, "tool_choice": choice, "parallel_tool_calls": False}
        )
        assert resp.status_code == 200, resp.text
        (answer,) = resp.json()["choices"]
        assert answer["finish_reason"] == finish and answer["message"]["content"] is None, answer
        calls = answer["message"]["tool_calls"]
        assert calls and (choice == "required" or [c["function"]["name"] for c in calls] == ["get_time"])
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
