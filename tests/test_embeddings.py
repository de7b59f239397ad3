"""POST /v1/embeddings end to end: real Redis, the API under gunicorn, embed-engine workers on
two real sentence-embedding checkpoints (all-MiniLM-L6-v2, BERT; all-mpnet-base-v2, MPNet,
fetched from the package registry by scripts/embedmodels.py). The vectors equal a reference
computed here with plain transformers and the pooling the checkpoint's config names; every bad
input is a JSON 400; keys and usage count; a worker SIGKILLed mid-batch leaves its jobs to
finish on another worker.
"""

from __future__ import annotations

import base64
import json
import signal
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from scripts import stack as stackmod
from tasks import keys
from tests.conftest import Stacks

KEY = "sk-embed-test-0123456789"
MAX_INPUTS = 64

TEXTS = [
    "The capital of France is Paris.",
    "A queue of jobs, served by long-lived workers.",
    "hi",
    "Embeddings turn a sentence into a vector whose direction carries its meaning, so that texts "
    "about the same thing end up close together, whatever words they use. " * 3,
    "Le chat est sur le tapis.",
    "Numbers 12345 and symbols #$%&* in one line.",
    "x",
    "A much longer passage about retrieval: a team embeds its documents once, keeps the vectors in "
    "an index, and at query time embeds each question and looks up the nearest passages, which a "
    "model then reads to answer. The corpus is large, the queries are many and small. " * 2,
]


@pytest.fixture(scope="session")
def models() -> dict[str, Path]:
    from scripts import embedmodels

    return {name: embedmodels.ensure(name) for name in ("minilm", "mpnet")}


class Reference:
    """A checkpoint's vectors computed with transformers alone, pooled and normalized as its
    sentence-transformers config (modules.json, 1_Pooling/config.json) says."""

    def __init__(self, path: Path):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        modules = json.loads((path / "modules.json").read_text())
        pooling = next(m for m in modules if m["type"].endswith("Pooling"))
        self.pooling = json.loads((path / pooling["path"] / "config.json").read_text())
        self.normalize = any(m["type"].endswith("Normalize") for m in modules)
        self.max_len = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]

    def ids(self, text: str) -> list[int]:
        return self.tok(text)["input_ids"]

    def embed(self, ids: list[int]) -> list[float]:
        torch = self.torch
        x = torch.tensor([ids])
        with torch.inference_mode():
            h = self.model(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state[0]
        if self.pooling.get("pooling_mode_cls_token"):
            v = h[0]
        elif self.pooling.get("pooling_mode_lasttoken"):
            v = h[-1]
        elif self.pooling.get("pooling_mode_max_tokens"):
            v = h.max(dim=0).values
        else:
            assert self.pooling.get("pooling_mode_mean_tokens"), self.pooling
            v = h.mean(dim=0)
        if self.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.tolist()


@pytest.fixture(scope="session")
def references(models) -> dict[str, Reference]:
    return {name: Reference(path) for name, path in models.items()}


@pytest.fixture(scope="module")
def embed_stacks(redis_url, stack_logs, models):
    """One API and one embed worker per model (minilm's API with a small GENQ_MAX_EMBED_INPUTS),
    stopped when the module's tests are done."""
    made: list[Stacks] = []
    out: dict = {}
    try:
        for name, path in models.items():
            stacks = Stacks(redis_url, path, stack_logs)
            made.append(stacks)
            s = stacks(
                GENQ_MAX_EMBED_INPUTS=str(MAX_INPUTS),
                GENQ_EMBED_BATCH_TOKENS="2048",
                GENQ_METRICS_PORT=str(stackmod.free_port()),
            )
            if name == "minilm":  # minilm's API asks for a key
                s.env["GENQ_API_KEYS"] = KEY
                s.http.headers["Authorization"] = f"Bearer {KEY}"
            s.start_api()
            s.start_worker()
            out[name] = s
        for s in out.values():
            s.wait_ready(timeout=120)
        yield out
    finally:
        for stacks in made:
            stacks.stop()


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)


def embed(s, timeout: float = 120, **body):
    return s.post("/v1/embeddings", json={"model": s.name, **body}, timeout=timeout)


def vectors(resp) -> list[list[float]]:
    assert resp.status_code == 200, resp.text[:500]
    data = resp.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    assert all(d["object"] == "embedding" for d in data)
    return [d["embedding"] for d in data]


@pytest.mark.parametrize("name", ["minilm", "mpnet"])
def test_vectors_equal_the_checkpoints_own(embed_stacks, references, name):
    """One request of inputs of every length, and 8 concurrent ones (their inputs share the
    engine's forwards, padded): each vector is the reference's (cosine >= 0.999), unit length,
    and usage counts the inputs' tokens."""
    s, ref = embed_stacks[name], references[name]
    dim = {"minilm": 384, "mpnet": 768}[name]
    resp = embed(s, input=TEXTS)
    body = resp.json()
    assert body["object"] == "list" and body["model"] == s.name and body["id"].startswith("embd-")
    tokens = sum(len(ref.ids(t)) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    expected = [ref.embed(ref.ids(t)) for t in TEXTS]
    for got, want in zip(vectors(resp), expected, strict=True):
        assert len(got) == dim
        assert cosine(got, want) >= 0.999
        assert abs(sum(x * x for x in got) - 1) < 1e-3

    def one(k: int) -> list[list[float]]:
        return vectors(embed(s, input=[TEXTS[(k + j) % len(TEXTS)] for j in range(5)]))

    with ThreadPoolExecutor(8) as pool:
        for k, got in enumerate(pool.map(one, range(8))):
            for j, v in enumerate(got):
                assert cosine(v, expected[(k + j) % len(TEXTS)]) >= 0.999


def test_base64_and_token_ids_give_the_same_vectors(embed_stacks, references):
    s, ref = embed_stacks["minilm"], references["minilm"]
    floats = vectors(embed(s, input="The capital of France is Paris."))[0]
    (b64,) = vectors(embed(s, input="The capital of France is Paris.", encoding_format="base64"))
    raw = base64.b64decode(b64)
    assert len(raw) == 4 * 384
    assert list(struct.unpack("<384f", raw)) == floats
    ids = ref.ids("The capital of France is Paris.")
    (one,) = vectors(embed(s, input=ids))  # a list of token ids: one input
    two = vectors(embed(s, input=[ids, ref.ids("hi")]))
    assert cosine(one, floats) >= 0.9999 and cosine(two[0], floats) >= 0.9999
    assert cosine(two[1], ref.embed(ref.ids("hi"))) >= 0.999
    resp = embed(s, input=ids, user="someone")
    assert resp.json()["usage"]["prompt_tokens"] == len(ids)


def test_truncate_prompt_tokens_cuts_long_inputs(embed_stacks, references):
    s, ref = embed_stacks["minilm"], references["minilm"]
    long = "word " * 400  # > 256 tokens
    resp = embed(s, input=["short", long], truncate_prompt_tokens=-1)
    got = vectors(resp)
    cut = ref.tok(long, truncation=True, max_length=ref.max_len)["input_ids"]
    assert len(cut) == ref.max_len
    assert cosine(got[1], ref.embed(cut)) >= 0.999
    assert resp.json()["usage"]["prompt_tokens"] == len(ref.ids("short")) + ref.max_len
    got = vectors(embed(s, input=[long], truncate_prompt_tokens=16))
    assert cosine(got[0], ref.embed(ref.tok(long, truncation=True, max_length=16)["input_ids"])) >= 0.999


def _error(resp, param: str | None = None) -> dict:
    assert resp.status_code == 400, resp.text[:500]
    err = resp.json()["error"]
    assert err["code"] and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": ["a", [1, 2]]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [True]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [-1]}, "input"),
        ({}, "input"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "a", "nonsense": 1}, "nonsense"),
        ({"input": ["a"] * (MAX_INPUTS + 1)}, "input"),
    ],
)
def test_bad_requests_are_400(embed_stacks, body, param):
    _error(embed(embed_stacks["minilm"], **body), param)


def test_inputs_the_model_cannot_take_are_400_naming_them(embed_stacks):
    s = embed_stacks["minilm"]
    err = _error(embed(s, input=["short", "word " * 400]), "input")
    assert err["code"] == "prompt_too_long" and "input[1]" in err["message"] and "256" in err["message"]
    err = _error(embed(s, input=[[101, 102], [101, 10**6, 102]]), "input")  # not in the vocabulary
    assert "input[1]" in err["message"]
    err = _error(embed(s, input="a", dimensions=128), "dimensions")  # not a Matryoshka model
    assert "Matryoshka" in err["message"]
    _error(embed(s, input="a", truncate_prompt_tokens=1000), "truncate_prompt_tokens")


def test_the_wrong_kind_of_model_is_400(embed_stacks, echo_stack):
    s = embed_stacks["minilm"]
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        err = _error(s.post(path, json={"model": s.name, **body}), "model")
        assert "embeddings" in err["message"]
    err = _error(echo_stack.post("/v1/embeddings", json={"model": echo_stack.name, "input": "hi"}), "model")
    assert "no embeddings" in err["message"]
    assert s.post("/v1/embeddings", json={"model": "no-such-model", "input": "a"}).status_code == 404


def test_keys_and_usage(embed_stacks, references):
    """minilm's API asks for a key: none is a 401; a request's tokens count in its key's usage
    (GET /v1/usage), as prompt tokens, once it has been answered."""
    import requests

    s, ref = embed_stacks["minilm"], references["minilm"]
    bare = requests.post(f"{s.base}/v1/embeddings", json={"model": s.name, "input": "a"}, timeout=30)
    assert bare.status_code == 401 and bare.json()["error"]["code"]

    def used() -> dict:
        rows = [u for u in s.get("/v1/usage").json()["data"] if u["model"] == s.name]
        return rows[0] if rows else {"jobs": 0, "prompt_tokens": 0, "completion_tokens": 0}

    before = used()
    resp = embed(s, input=TEXTS[:3])
    assert resp.status_code == 200
    tokens = sum(len(ref.ids(t)) for t in TEXTS[:3])
    assert resp.json()["usage"]["prompt_tokens"] == tokens
    after = used()
    assert after["jobs"] == before["jobs"] + 1  # one job carries a request's inputs
    assert after["prompt_tokens"] == before["prompt_tokens"] + tokens
    assert after["completion_tokens"] == before["completion_tokens"]


def test_the_worker_counts_inputs_and_tokens(embed_stacks):
    """genq:embedding_inputs_total and genq:prompt_tokens_total on the worker's exporter."""
    import re

    import requests

    s = embed_stacks["mpnet"]
    (port,) = [w["metrics_port"] for w in s.get("/readyz").json()["workers"]]

    def counts() -> tuple[float, float]:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        found = [
            sum(float(v) for v in re.findall(rf'^{name}{{[^}}]*model_name="{s.name}"[^}}]*}} (\S+)$', text, re.M))
            for name in ("genq:embedding_inputs_total", "genq:prompt_tokens_total")
        ]
        return found[0], found[1]

    inputs, tokens = counts()
    resp = embed(s, input=TEXTS[:5])
    assert resp.status_code == 200
    stackmod.wait_until(lambda: counts()[0] == inputs + 5, 10, "the counter", s.procs)
    assert counts()[1] == tokens + resp.json()["usage"]["prompt_tokens"]


def test_a_worker_killed_mid_batch_leaves_its_jobs_to_another(redis_url, stack_logs, models, references):
    """Two minilm workers; 8 clients send 32 inputs each in small forwards (a job spans many).
    Once a worker runs jobs it is SIGKILLed: every request still answers 200 with the right
    vectors, the killed worker's jobs run again on the other one (attempt 2), none twice more."""
    ref = references["minilm"]
    stacks = Stacks(redis_url, models["minilm"], stack_logs)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        s = stacks(GENQ_EMBED_BATCH_TOKENS="512", GENQ_MAX_BATCH_SIZE="4", GENQ_TORCH_THREADS="1")
        s.start_api()
        workers = [s.start_worker(), s.start_worker()]
        stackmod.wait_until(lambda: len(s.get("/readyz").json().get("workers", [])) == 2, 120, "2 workers", s.procs)
        names = {w["name"] for w in s.get("/readyz").json()["workers"]}
        name_of = {p.pid: next(n for n in names if f"-{p.pid}@" in n) for p in workers}
        texts = [f"Passage {i}. " + TEXTS[3] for i in range(32)]
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(embed, s, input=texts, timeout=300) for _ in range(8)]
            while True:
                stackmod.wait_until(
                    lambda: any(r.hlen(keys.inflight(n)) for n in name_of.values()), 60, "jobs to run", s.procs
                )
                for w in workers:
                    w.signal(signal.SIGSTOP)
                held = {p.pid: r.hkeys(keys.inflight(name_of[p.pid])) for p in workers}
                busy = [p for p in workers if held[p.pid]]
                if busy:
                    break
                for w in workers:
                    w.signal(signal.SIGCONT)
            victim = busy[0]
            victim.signal(signal.SIGKILL)
            for w in workers:
                if w is not victim:
                    w.signal(signal.SIGCONT)
            victim.popen.wait(10)
            resps = [f.result() for f in futures]
        want = [ref.embed(ref.ids(t)) for t in texts[:2]]
        attempts = {}
        for resp in resps:
            got = vectors(resp)
            assert len(got) == 32
            assert all(cosine(g, w) >= 0.999 for g, w in zip(got, want))
            job_id = resp.json()["id"].removeprefix("embd-")
            rec = s.get(f"/v1/jobs/{job_id}").json()
            assert rec["status"] == "succeeded"
            attempts[job_id] = rec["attempts"]
        moved = held[victim.pid]
        assert moved and all(attempts[j] == 2 for j in moved), (moved, attempts)
        assert all(a in (1, 2) for a in attempts.values())
    finally:
        r.close()
        stacks.stop()


def test_matryoshka_dimensions_cut_and_renormalize(models, tmp_path):
    """A checkpoint whose config.json says it is a Matryoshka model (minilm's files, its config
    marked so) takes `dimensions`: the first n of its vector, renormalized; others are refused.
    The engine alone, in this process (the API checks the same by what workers announce)."""
    import torch

    from tasks.config import Settings
    from tasks.schemas import EmbedOptions, JobSpec, SamplingParams
    from worker.engines.base import GenerationError
    from worker.engines.embed import EmbedEngine

    src = models["minilm"]
    for f in src.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [64, 128, 384]}))
    engine = EmbedEngine(Settings(model=str(tmp_path), dtype="float32", torch_threads=1))
    try:
        assert engine.matryoshka == [64, 128, 384]

        def run(dims):
            spec = JobSpec(
                id=f"m-{dims}",
                model="m",
                prompt="",
                params=SamplingParams(),
                embed=EmbedOptions(inputs=TEXTS[:3], dimensions=dims),
            )
            res = engine.submit(spec).result(timeout=60)
            return torch.tensor(
                [struct.unpack(f"<{len(base64.b64decode(b)) // 4}f", base64.b64decode(b)) for b in res.embeddings]
            )

        full, cut = run(None), run(128)
        assert cut.shape == (3, 128)
        want = torch.nn.functional.normalize(full[:, :128], dim=1)
        assert torch.allclose(cut, want, atol=1e-5)
        for bad in (100, 512):
            with pytest.raises(GenerationError) as err:
                run(bad)
            assert err.value.param == "dimensions"
    finally:
        engine.close()


def test_the_client_and_genq_embed(embed_stacks, references, tmp_path):
    """Client.embed (base64 on the wire, floats back) and `genq embed FILE` (one JSON line per
    non-empty line, in order, over several concurrent requests) give the reference's vectors."""
    import os
    import subprocess
    import sys

    from genqueue import Client
    from genqueue.errors import BadRequest

    s, ref = embed_stacks["minilm"], references["minilm"]
    want = [ref.embed(ref.ids(t)) for t in TEXTS]
    with Client(s.base, api_key=KEY) as c:
        one = c.embed(TEXTS[0], model=s.name)
        assert len(one) == 384 and cosine(one, want[0]) >= 0.999
        many = c.embed(TEXTS, model=s.name)
        assert all(cosine(g, w) >= 0.999 for g, w in zip(many, want, strict=True))
        with pytest.raises(BadRequest) as err:
            c.embed(["fine", ""], model=s.name)
        assert err.value.status == 400

    src = tmp_path / "texts.txt"
    src.write_text("\n".join(TEXTS[:4] + [""] + TEXTS[4:]) + "\n")  # an empty line is skipped
    env = {**os.environ, "GENQ_URL": s.base, "GENQ_API_KEY": KEY}
    out = subprocess.run(
        [sys.executable, "-m", "genqueue", "embed", str(src), "--model", s.name, "--batch-size", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [d["line"] for d in lines] == [1, 2, 3, 4, 6, 7, 8, 9]
    assert all(cosine(d["embedding"], w) >= 0.999 for d, w in zip(lines, want, strict=True))


def test_the_openai_sdk_and_a_batch_of_embeddings_lines(embed_stacks, references):
    """OpenAI's own client: embeddings.create (it asks for base64 and decodes it), and a Batch
    API run on /v1/embeddings whose output lines are OpenAI's ({id, custom_id, response
    {status_code, request_id, body}, error}, the body as the route answers), a refused line
    (empty input, another url) an error line, and the batch's usage its input tokens."""
    import time

    import openai

    s, ref = embed_stacks["minilm"], references["minilm"]
    client = openai.OpenAI(base_url=s.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    got = client.embeddings.create(model=s.name, input=TEXTS[:2])
    assert [len(d.embedding) for d in got.data] == [384, 384] and got.usage.prompt_tokens > 0
    assert cosine(got.data[1].embedding, ref.embed(ref.ids(TEXTS[1]))) >= 0.999

    n = 40
    lines = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": s.name, "input": [TEXTS[i % len(TEXTS)], f"line {i}"]},
        }
        for i in range(n)
    ]
    lines.append({"custom_id": "empty", "method": "POST", "url": "/v1/embeddings", "body": {"input": ""}})
    lines.append({"custom_id": "other", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 180
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (n + 2, n, 2)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    err = {e["custom_id"]: e for e in map(json.loads, client.files.content(batch.error_file_id).text.splitlines())}
    assert sorted(o["custom_id"] for o in out) == sorted(f"e-{i}" for i in range(n))
    tokens = 0
    for o in out:
        i = int(o["custom_id"].removeprefix("e-"))
        assert set(o) == {"id", "custom_id", "response", "error"} and o["error"] is None
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["object"] == "list" and body["model"] == s.name
        assert cosine(body["data"][0]["embedding"], ref.embed(ref.ids(TEXTS[i % len(TEXTS)]))) >= 0.999
        assert cosine(body["data"][1]["embedding"], ref.embed(ref.ids(f"line {i}"))) >= 0.999
        tokens += body["usage"]["prompt_tokens"]
    assert batch.usage.input_tokens == tokens and batch.usage.output_tokens == 0
    assert err["empty"]["response"]["status_code"] == 400
    assert err["empty"]["response"]["body"]["error"]["param"] == "input"
    assert err["other"]["response"]["body"]["error"]["code"] == "invalid_url"
