"""OpenAI's usage shape with prefix-cache hits: every `usage` has
`prompt_tokens_details.cached_tokens`, summed over a request's jobs as `prompt_tokens` is, 0 for a
result (or stream) from a worker that sends no `cached_tokens`. The numbers end to end are in
test_openai (hf), test_chat (a chat stream) and test_vllm (vLLM's `num_cached_tokens`)."""

from __future__ import annotations

import json

import openai.types
import pytest

from tasks.schemas import GenerationResult, SamplingParams
from tasks.streams import TokenEvent
from webapp.completions import CompletionService, Submitted
from webapp.protocol import common as protocol
from webapp.protocol.batches import Batch
from webapp.protocol.jobs import Jobs, JobView
from webapp.relays import ChatRelay, CompletionRelay


def result(prompt: int, completion: int, cached: int | None = None, logprob: float = -1.0) -> dict:
    """A job's result as a worker returns it (without `cached_tokens` when `cached` is None, as a
    worker from before the prefix cache did)."""
    r = GenerationResult(
        text="x" * completion,
        finish_reason="length",
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached or 0,
        batch_size=1,
        model="m",
        logprobs={"tokens": ["x"], "token_logprobs": [logprob], "top_logprobs": [{"x": logprob}], "text_offset": [0]},
    ).model_dump()
    if cached is None:
        del r["cached_tokens"]
    return r


def submitted(prompts: int, api: str = "completions", n: int = 1, best_of: int | None = None) -> Submitted:
    jobs = Jobs([f"p{i}" for i in range(prompts)], SamplingParams(), n=n, api=api, best_of=best_of)
    return Submitted(jobs, [f"job{k}" for k in range(prompts * (best_of or n))], "m", 1)


def data(frame: str) -> dict:
    (line,) = [ln for ln in frame.splitlines() if ln.startswith("data: ")]
    return json.loads(line[len("data: ") :])


def test_usage_has_prompt_tokens_details_always():
    assert protocol.usage(10, 5).model_dump() == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    body = protocol.usage(40, 2, 32).model_dump(mode="json")
    assert body["prompt_tokens_details"] == {"cached_tokens": 32} and body["total_tokens"] == 42
    # What the official client makes of it.
    parsed = openai.types.CompletionUsage.model_validate(body)
    assert parsed.prompt_tokens_details.cached_tokens == 32


def test_a_missing_or_null_cached_tokens_counts_zero():
    assert protocol.cached_tokens({"prompt_tokens": 3, "completion_tokens": 1}) == 0
    assert protocol.cached_tokens({"cached_tokens": None}) == 0
    assert protocol.cached_tokens(None) == 0
    assert protocol.cached_tokens({"cached_tokens": 16}) == 16
    total = protocol.usage_of([result(20, 2, 16), result(30, 3), result(5, 1, 0)])
    assert (total.prompt_tokens, total.completion_tokens, total.prompt_tokens_details.cached_tokens) == (55, 6, 16)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_bodies_sum_cached_tokens_over_the_jobs(api):
    sub = submitted(2, api=api, n=2)
    results = [result(40, 4, 32), result(40, 4, 32), result(20, 4, 16), result(20, 4)]
    body = CompletionService(None).body(sub, results)
    assert body["usage"] == {
        "prompt_tokens": 120,
        "completion_tokens": 16,
        "total_tokens": 136,
        "prompt_tokens_details": {"cached_tokens": 80},
    }


def test_best_of_counts_cached_tokens_as_prompt_tokens_once_per_prompt():
    """best_of: usage counts every completion generated and each prompt once (its first job's
    prompt and cached tokens), however many of its jobs the answer keeps."""
    sub = submitted(2, n=1, best_of=3)
    results = [
        result(40, 4, 0, logprob=-3.0),
        result(40, 4, 32, logprob=-1.0),  # the best of prompt 0
        result(40, 4, 32, logprob=-2.0),
        result(50, 5, 48, logprob=-1.0),
        result(50, 5, 48, logprob=-2.0),
        result(50, 5, 48, logprob=-3.0),
    ]
    body = CompletionService(None).body(sub, results)
    assert len(body["choices"]) == 2
    assert body["usage"] == {
        "prompt_tokens": 90,
        "completion_tokens": 27,
        "total_tokens": 117,
        "prompt_tokens_details": {"cached_tokens": 48},
    }


@pytest.mark.parametrize("relay", [CompletionRelay, ChatRelay])
def test_the_streams_usage_chunk_sums_the_finish_events(relay):
    sub = submitted(3)
    r = relay(sub)
    r.token("job0", TokenEvent(0, "a"))
    r.token(
        "job0",
        TokenEvent(1, "", finish="length", usage={"prompt_tokens": 40, "completion_tokens": 2, "cached_tokens": 32}),
    )
    r.token(
        "job1",
        TokenEvent(1, "b", finish="length", usage={"prompt_tokens": 20, "completion_tokens": 2, "cached_tokens": 0}),
    )
    # A worker from before the prefix cache: no cached_tokens in its usage.
    r.token("job2", TokenEvent(1, "c", finish="length", usage={"prompt_tokens": 10, "completion_tokens": 2}))
    chunk = data(r.usage_chunk())
    assert chunk["choices"] == []
    assert chunk["usage"] == {
        "prompt_tokens": 70,
        "completion_tokens": 6,
        "total_tokens": 76,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    # The other chunks have no usage at all (OpenAI leaves it out until the last).
    assert "usage" not in data(r.chunk(0, "a"))


def test_the_batch_usage_has_the_cached_input_tokens():
    rec = {
        "id": "batch_1",
        "endpoint": "/v1/completions",
        "input_file_id": "file-1",
        "completion_window": "24h",
        "status": "completed",
        "created_at": "1700000000",
        "prompt_tokens": "120",
        "completion_tokens": "16",
        "cached_tokens": "80",
    }
    usage = Batch.from_record(rec).model_dump(mode="json")["usage"]
    assert usage["input_tokens"] == 120 and usage["total_tokens"] == 136
    assert usage["input_tokens_details"] == {"cached_tokens": 80}
    # A batch recorded before cached tokens were counted.
    del rec["cached_tokens"]
    assert Batch.from_record(rec).usage.input_tokens_details.cached_tokens == 0
    parsed = openai.types.Batch.model_validate(Batch.from_record({**rec, "cached_tokens": "7"}).model_dump(mode="json"))
    assert parsed.usage.input_tokens_details.cached_tokens == 7


def test_a_job_result_always_has_cached_tokens():
    """GET /v1/jobs/{id}: a result from a worker from before the prefix cache says 0."""
    view = {
        "id": "j",
        "model": "m",
        "status": "succeeded",
        "attempts": 1,
        "priority": 0,
        "deadline": None,
        "timings": {"created": 1.0, "started": 2.0, "finished": 3.0},
        "result": result(7, 2),
    }
    assert "cached_tokens" not in view["result"]
    assert JobView.answer(view)["result"]["cached_tokens"] == 0
    assert JobView.answer({**view, "result": result(40, 2, 32)})["result"]["cached_tokens"] == 32
    assert "result" not in JobView.answer({k: v for k, v in view.items() if k != "result"})
