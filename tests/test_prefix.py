"""The hf engine's prefix cache: jobs whose prompts start alike reuse the keys/values computed
for earlier jobs, and the text stays `model.generate`'s of each prompt alone (float32), on
several architectures, with jobs arriving while others decode, after eviction from a small
cache and after preemption."""

from __future__ import annotations

import time

import pytest
import torch

from scripts import devmodels
from tasks.config import Settings
from tasks.schemas import JobSpec, SamplingParams
from tests.test_architectures import Reference
from worker.engines.base import JobCancelled
from worker.engines.hf import HFEngine
from worker.engines.kvcache import SlotKV
from worker.engines.prefix import PrefixCache, digests

SYSTEM = (
    "You are a careful assistant for a shop that sells tea, coffee and cocoa. Answer briefly, "
    "cite the price list, and never promise a delivery date. Tools: lookup(item), order(item, n). "
)
QUESTIONS = ["What is green tea?", "Price of cocoa?", "x", "Order two coffees", "1 2 3", "¿Té?"]
ARCHS = ["opt", "llama", "qwen2", "gpt2"]


@pytest.fixture(scope="module")
def checkpoints(tiny_model):
    root = tiny_model.parent
    return {a: devmodels.ensure("tiny", root / f"tiny-{a}", arch=a) for a in ARCHS}


def spec(i, prompt: str, n: int, priority: int = 0, **params) -> JobSpec:
    return JobSpec(
        id=f"p{i}", model="t", prompt=prompt, priority=priority, params=SamplingParams(max_new_tokens=n, **params)
    )


def engine(path, **kw) -> HFEngine:
    settings = dict(model=str(path), model_name="t", max_batch_size=4, reserved_slots=0, dtype="float32")
    return HFEngine(Settings(**{**settings, **kw}))


def wait_rows(eng: HFEngine, n: int) -> None:
    deadline = time.monotonic() + 60
    while len(eng.scheduler.rows) < n and time.monotonic() < deadline:
        time.sleep(0.002)


@pytest.mark.parametrize("name", ARCHS)
def test_reused_prefixes_give_generate_text(name, checkpoints):
    """A first job fills the cache; then jobs sharing its system prompt arrive while others
    decode (at other columns, beside rows that joined without a hit): each text is generate's,
    and each later job reports the shared blocks as cached."""
    path = checkpoints[name]
    ref = Reference(path)
    eng = engine(path)
    try:
        first = eng.submit(spec(0, SYSTEM + QUESTIONS[0], 12)).result(timeout=120)
        assert first.text == ref(SYSTEM + QUESTIONS[0], 12) and first.cached_tokens == 0
        jobs = [(SYSTEM + QUESTIONS[1], 20, eng.submit(spec(1, SYSTEM + QUESTIONS[1], 20)))]
        wait_rows(eng, 1)
        for i, q in enumerate(QUESTIONS[2:], start=2):
            prompt = SYSTEM + q if i % 2 else q * 3  # some share the prefix, some share nothing
            jobs.append((prompt, 8 + 2 * i, eng.submit(spec(i, prompt, 8 + 2 * i))))
            time.sleep(0.02 * (i % 3))
        system_tokens = len(eng.tok(SYSTEM).input_ids)
        for prompt, n, future in jobs:
            result = future.result(timeout=120)
            assert result.text == ref(prompt, n), (name, prompt)
            if prompt.startswith(SYSTEM):
                assert system_tokens - 20 < result.cached_tokens < result.prompt_tokens, prompt
            else:
                assert result.cached_tokens == 0
        assert eng.prefix.hits > 0 and eng.prefix.queries > eng.prefix.hits
    finally:
        eng.close()


def test_eviction_under_a_small_budget_stays_exact(checkpoints):
    """A cache of a few blocks: prompts evict each other's blocks, later blocks of a prefix
    before its earlier ones; texts stay exact and the pool never grows past its budget."""
    path = checkpoints["llama"]
    ref = Reference(path)
    eng = engine(path, prefix_cache_gib=0)
    cfg = eng.lm.config
    per_block = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 16 * (cfg.hidden_size // cfg.num_attention_heads) * 4
    )
    eng.close()
    eng = engine(path, prefix_cache_gib=6 * per_block / (1 << 30))
    try:
        assert eng.prefix.capacity == 6
        prompts = [SYSTEM + q for q in QUESTIONS] + [q * 9 + SYSTEM for q in QUESTIONS[:3]]
        for round_ in range(2):
            futures = [(p, eng.submit(spec(f"{round_}-{i}", p, 10))) for i, p in enumerate(prompts)]
            for prompt, future in futures:
                assert future.result(timeout=120).text == ref(prompt, 10), prompt
            assert len(eng.prefix.index) <= 6 and not eng.prefix.free
        assert eng.prefix.hits > 0
    finally:
        eng.close()


def test_preempted_rows_resume_from_the_cache(checkpoints):
    """Background rows that give their place up keep their keys/values in the cache: taken up
    again, they feed only what the cache lacks, and the text is still generate's."""
    path = checkpoints["qwen2"]
    ref = Reference(path)
    eng = engine(path)
    try:
        prompts = [SYSTEM + q for q in QUESTIONS[:4]]
        jobs = [(p, 40, eng.submit(spec(i, p, 40, priority=1))) for i, p in enumerate(prompts)]
        wait_rows(eng, 4)
        hits = eng.prefix.hits
        for i, q in enumerate(QUESTIONS[4:], start=4):
            jobs.append((q, 10, eng.submit(spec(i, q, 10))))
        for prompt, n, future in jobs:
            assert future.result(timeout=120).text == ref(prompt, n), prompt
        assert eng.preemptions > 0
        # Re-prefills are not first prefills: they do not count, but they found their rows.
        assert eng.prefix.hits == hits or eng.prefix.hits > hits
        assert len(eng.prefix.index) > 0
    finally:
        eng.close()


def test_second_turn_of_a_chat_finds_the_first_turn_cached(checkpoints):
    """A conversation's next request repeats the earlier turns, the answer included: the cache
    holds the answer's blocks too (a row's blocks are kept when it leaves). Token ids, so that
    the answer is repeated as generated."""
    path = checkpoints["opt"]
    ref = Reference(path)
    eng = engine(path)
    try:
        turn1 = eng.tok(SYSTEM + "User: What is green tea?\nAssistant:").input_ids
        first = JobSpec(
            id="c1",
            model="t",
            prompt="",
            prompt_token_ids=turn1,
            params=SamplingParams(max_new_tokens=40, ignore_eos=True, return_token_ids=True),
        )
        answer = eng.submit(first).result(timeout=120)
        turn2 = turn1 + answer.token_ids + eng.tok("User: And black tea?", add_special_tokens=False).input_ids
        second = JobSpec(
            id="c2", model="t", prompt="", prompt_token_ids=turn2, params=SamplingParams(max_new_tokens=10)
        )
        result = eng.submit(second).result(timeout=120)
        with torch.inference_mode():
            out = ref.model.generate(torch.tensor([turn2]), max_new_tokens=10, do_sample=False)
        assert result.text == ref.tok.decode(out[0, len(turn2) :], skip_special_tokens=True)
        assert result.cached_tokens > len(turn1)  # past the first prompt: its answer too
    finally:
        eng.close()


def test_a_zero_budget_turns_caching_off(checkpoints):
    path = checkpoints["opt"]
    eng = engine(path, prefix_cache_gib=0)
    try:
        assert eng.prefix is None
        for i in range(2):
            assert eng.submit(spec(i, SYSTEM + "hi", 4)).result(timeout=60).cached_tokens == 0
    finally:
        eng.close()


def test_prompt_logprobs_jobs_compute_every_position(checkpoints):
    path = checkpoints["opt"]
    eng = engine(path)
    try:
        eng.submit(spec(0, SYSTEM + "hi", 4)).result(timeout=60)
        result = eng.submit(spec(1, SYSTEM + "hi", 4, prompt_logprobs=1)).result(timeout=60)
        assert result.cached_tokens == 0 and len(result.prompt_logprobs) == result.prompt_tokens
    finally:
        eng.close()


# -- the pool alone ------------------------------------------------------------------------


def kv_with_rows(tokens: list[list[int]]) -> SlotKV:
    """A SlotKV whose rows hold recognisable keys/values: token t's key is t everywhere."""
    kv = SlotKV(layers=2, heads=1, head_dim=2, dtype=torch.float32, max_rows=4)
    width = max(map(len, tokens))
    kv.begin(0, [len(t) for t in tokens])
    for layer in range(2):
        for r, t in enumerate(tokens):
            cols = slice(kv.end + 1 - len(t), kv.end + 1)
            kv.k[layer][r, 0, cols] = torch.tensor(t, dtype=torch.float32)[:, None] + layer
            kv.v[layer][r, 0, cols] = -torch.tensor(t, dtype=torch.float32)[:, None]
    kv.finish()
    assert width
    return kv


def test_the_pool_keeps_whole_blocks_and_copies_them_back():
    a = list(range(100, 140))  # 40 tokens: two blocks of 16, 8 left over
    kv = kv_with_rows([a])
    cache = PrefixCache(2, 1, 2, torch.float32, "cpu", budget=10 * 2 * 2 * 16 * 2 * 4, block=16)
    assert cache.capacity == 10
    cache.store(kv, 0, a, [])
    assert len(cache.index) == 2
    assert cache.match(a, []) == [cache.index[n] for n in digests(a, 16, [])[:2]]
    assert len(cache.match(a[:32], [])) == 1  # at least one token is left to feed
    assert cache.match([1] + a[1:], []) == []  # another first token: another chain
    other = kv_with_rows([[0] * 40])
    cache.fill(other, 0, other.start, cache.match(a, []))
    assert other.k[1][0, 0, other.start : other.start + 32, 0].tolist() == [t + 1.0 for t in a[:32]]
    assert other.v[0][0, 0, other.start : other.start + 32, 1].tolist() == [-float(t) for t in a[:32]]


def test_eviction_takes_a_prefix_s_later_blocks_first():
    cache = PrefixCache(2, 1, 2, torch.float32, "cpu", budget=3 * 2 * 2 * 16 * 2 * 4, block=16)
    a, b = list(range(48)), list(range(1000, 1032))
    cache.store(kv_with_rows([a]), 0, a, [])
    assert len(cache.index) == 3
    cache.store(kv_with_rows([b]), 0, b, [])  # two new blocks: a's last two go
    assert len(cache.match(a + [1], [])) == 1 and len(cache.match(b + [1], [])) == 2


# -- chunked prefill -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_chunked_prefill_gives_one_piece_text(name, checkpoints):
    """With a step budget of 32 prompt tokens, long prompts are prefilled in chunks while a
    running job decodes and short jobs arrive: every text is generate's, the running job took
    steps between the chunks, and a short job finished before the long prompts were in."""
    path = checkpoints[name]
    ref = Reference(path)
    eng = engine(path, max_prefill_tokens=32)
    chunks = []
    step = eng.runner.step

    def spy(running, admit, partial=()):
        chunks.append((len(running), [s.chunk for s in partial]))
        return step(running, admit, partial)

    eng.runner.step = spy
    try:
        jobs = [("Hello", 60, eng.submit(spec(0, "Hello", 60, ignore_eos=True)))]
        wait_rows(eng, 1)
        longs = [SYSTEM * 2 + q for q in QUESTIONS[:2]]
        for i, prompt in enumerate(longs, start=1):
            jobs.append((prompt, 8, eng.submit(spec(i, prompt, 8))))
        short = eng.submit(spec(9, "1 2 3", 3))
        jobs[-1][2].result(timeout=120)
        assert short.done()  # it did not wait for the long prompts' prefill
        for prompt, n, future in jobs:
            assert future.result(timeout=120).text == ref(prompt, n), prompt
        assert short.result(timeout=60).text == ref("1 2 3", 3)
        cut = [c for _, partial in chunks for c in partial]
        assert cut and all(c % 16 == 0 for c in cut)
        assert any(running and partial for running, partial in chunks)  # decode went on beside chunks
    finally:
        eng.close()


@pytest.mark.parametrize("share", [0.1, 1.0])
def test_chunks_are_paced_while_rows_decode(share, checkpoints):
    """GENQ_PREFILL_SHARE: at 0.1 a chunk is followed by decode-only steps while a job runs
    (each chunk owes the running rows nine times its time); at 1 chunks run step after step.
    Texts stay generate's either way."""
    path = checkpoints["llama"]
    ref = Reference(path)
    eng = engine(path, max_prefill_tokens=16, prefill_share=share)
    steps = []
    step = eng.runner.step

    def spy(running, admit, partial=()):
        steps.append((len(running), bool(partial)))
        return step(running, admit, partial)

    eng.runner.step = spy
    try:
        stream = eng.submit(spec(0, "Hello", 400, ignore_eos=True))
        wait_rows(eng, 1)
        long = SYSTEM * 2 + QUESTIONS[0]
        assert eng.submit(spec(1, long, 4)).result(timeout=120).text == ref(long, 4)
        eng.cancel("p0")
        with pytest.raises(JobCancelled):
            stream.result(timeout=60)
        beside = [chunk for running, chunk in steps if running]  # the steps while the stream ran
        first = beside.index(True)
        last = len(beside) - 1 - beside[::-1].index(True)
        chunks = beside[first : last + 1]
        assert chunks.count(True) >= 3, steps
        back_to_back = any(a and b for a, b in zip(chunks, chunks[1:]))
        assert back_to_back == (share == 1.0), chunks
    finally:
        eng.close()


def test_a_cache_too_small_for_the_chunks_prefills_whole(checkpoints):
    """Chunks live in the prefix cache; where it cannot hold a prompt's, the prompt is
    prefilled in one piece rather than chunked for ever."""
    path = checkpoints["opt"]
    ref = Reference(path)
    eng = engine(path, prefix_cache_gib=0)
    cfg = eng.lm.config
    per_block = 2 * cfg.num_hidden_layers * cfg.hidden_size * 16 * 4
    eng.close()
    eng = engine(path, max_prefill_tokens=16, prefix_cache_gib=3 * per_block / (1 << 30))
    try:
        prompt = SYSTEM * 2
        assert eng.submit(spec(0, prompt, 6)).result(timeout=120).text == ref(prompt, 6)
    finally:
        eng.close()


def test_siblings_sent_together_compute_their_prompt_once(checkpoints):
    """`n` > 1 / `best_of` siblings (and a burst of one prompt) arrive together: one computes
    the prompt, the others find it cached a step later; texts stay generate's."""
    path = checkpoints["llama"]
    ref = Reference(path)
    eng = engine(path)
    try:
        prompt = SYSTEM + "Tell me about tea."
        results = [f.result(timeout=120) for f in [eng.submit(spec(i, prompt, 8)) for i in range(3)]]
        assert [r.text for r in results] == [ref(prompt, 8)] * 3
        assert results[0].cached_tokens == 0
        assert all(r.cached_tokens >= r.prompt_tokens - 16 for r in results[1:])
    finally:
        eng.close()


def test_the_batch_s_keys_values_stay_in_their_budget(checkpoints):
    """A KV budget for about two long rows: long jobs run two at a time, short ones beside
    them, the buffers never grow past the budget, and every text is generate's."""
    path = checkpoints["gpt2"]
    ref = Reference(path)
    eng = engine(path, prefix_cache_gib=0)
    column = eng.runner.kv.column_bytes
    eng.close()
    eng = engine(path, kv_cache_gib=2 * 2 * 200 * column / (1 << 30))
    peak = []
    step = eng.runner.step

    def spy(running, admit, partial=()):
        out = step(running, admit, partial)
        kv = eng.runner.kv
        peak.append((kv.rows, kv.mask.shape[0] * kv.mask.shape[1]))
        return out

    eng.runner.step = spy
    try:
        prompts = [q * 3 + SYSTEM for q in QUESTIONS[:4]]
        futures = [(p, eng.submit(spec(i, p, 40))) for i, p in enumerate(prompts)]
        for prompt, future in futures:
            assert future.result(timeout=120).text == ref(prompt, 40), prompt
        assert max(rows for rows, _ in peak) == 2
        assert max(size for _, size in peak) <= eng.runner.kv.max_columns
    finally:
        eng.close()


@pytest.mark.parametrize("name", ARCHS)
def test_rows_that_share_a_prompt_read_it_once_and_give_generate_text(name, checkpoints, monkeypatch):
    """Cascade attention: while every running row starts with the same system prompt, their
    attention reads its keys/values once (from one row) and each row's own columns after it,
    merged by log-sum-exp; the texts stay generate's, also as rows without it join and leave."""
    from worker.engines import runner

    monkeypatch.setattr(runner, "CASCADE_MIN_TOKENS", 16)  # the tiny models' context is short
    path = checkpoints[name]
    ref = Reference(path)
    eng = engine(path)
    try:
        eng.submit(spec(0, SYSTEM + QUESTIONS[0], 4)).result(timeout=120)  # the prompt is cached
        jobs = []
        for i, q in enumerate(QUESTIONS[1:], start=1):
            prompt = SYSTEM + q if i != 4 else q * 5  # one row shares nothing: no cascade while it runs
            jobs.append((prompt, 6 + 3 * i, eng.submit(spec(i, prompt, 6 + 3 * i))))
            if i == 2:
                wait_rows(eng, 2)
        for prompt, n, future in jobs:
            assert future.result(timeout=120).text == ref(prompt, n), (name, prompt)
        assert eng.runner.kv.cascades > 0
    finally:
        eng.close()
