"""A prompt past the model's context is refused at submit (400 `prompt_too_long`, vLLM's error,
naming the limit) on every submitting route, and nothing is queued: the workers announce their
context, their tokenizer's bound on a text's tokens (worker/tokenbound.py) and their chat
template's bound on what it adds to a conversation (worker/chatbound.py), the API decides by
those bounds whether a prompt or a conversation surely fits (webapp/context.py) and has a
worker count it only when it cannot tell, on threads that jobs do not hold (worker/asks.py).
The bounds themselves, on synthetic tokenizers and templates and on the real ones (the dev
models', the real SmolLM2 checkpoint's); then the whole stack with the tiny model (context
512) and with SmolLM2 (8192)."""

from __future__ import annotations

import json
import random
import time

import openai
import pytest
import redis
import requests
from prometheus_client.parser import text_string_to_metric_families

from tasks import keys
from tasks.registry import ChatBound, Registry, TokenBound, WorkerInfo
from tasks.schemas import ChatMessage, ChatOptions
from webapp import context
from worker import chatbound, tokenbound
from worker.chat import Chat
from worker.engines.base import GenerationError
from worker.tokenbound import Unbounded, analyse

CONTEXT = 512  # the tiny model's
TEMPLATE = "tests/chat_template.jinja"


# -- the API's decision (webapp/context.py) ----------------------------------------------------


def worker(max_model_len=CONTEXT, per_byte=1, extra=1, bound=True, **kw) -> WorkerInfo:
    return WorkerInfo(
        name=kw.get("name", "w"),
        model="m",
        engine="hf",
        capacity=8,
        host="h",
        pid=1,
        started=0.0,
        max_model_len=max_model_len,
        token_bound=TokenBound(per_byte=per_byte, extra=extra) if bound else None,
        chat_bound=kw.get("chat_bound"),
    )


def test_the_context_of_a_models_workers():
    ctx = context.context_of([worker(), worker(max_model_len=384, per_byte=3, extra=0)])
    assert ctx.max_model_len == 384 and (ctx.bound.per_byte, ctx.bound.extra) == (3, 1)
    # One worker without a bound: every text is counted.
    assert context.context_of([worker(), worker(per_byte=None)]).bound.per_byte is None
    # No check at submit without workers, or beside one that announces no context or counts
    # nothing (no tokenizer, an older worker).
    assert context.context_of([]) is None
    assert context.context_of([worker(), worker(max_model_len=None)]) is None
    assert context.context_of([worker(), worker(bound=False)]) is None


def test_upper_bounds_and_what_surely_fits():
    ctx = context.Context(CONTEXT, TokenBound(per_byte=1, extra=2))
    assert context.upper_bound("héllo", ctx.bound) == 6 + 2
    assert context.upper_bound("\ud800", ctx.bound) == 3 + 2  # a lone surrogate, as sent in JSON
    assert context.upper_bound([1, 2, 3], ctx.bound) == 3  # token ids: exact
    assert context.upper_bound("x", TokenBound(per_byte=None)) is None
    # A text: fits by its bound, or only counting can tell (never "surely not").
    assert context.surely_fits("x" * 494, 16, ctx) is True  # 494 + 2 + 16 = 512
    assert context.surely_fits("x" * 495, 16, ctx) is None
    assert context.surely_fits("x" * 10, 16, context.Context(CONTEXT, TokenBound(per_byte=None))) is None
    # Token ids: exactly.
    assert context.surely_fits([7] * 496, 16, ctx) is True
    assert context.surely_fits([7] * 497, 16, ctx) is False
    # truncate_prompt_tokens keeps the last k (-1: the context), as the engines do.
    assert context.surely_fits([7] * 900, 16, ctx, truncate=100) is True
    assert context.surely_fits("x" * 5000, 16, ctx, truncate=496) is True
    assert context.surely_fits([7] * 900, 16, ctx, truncate=-1) is False
    assert context.kept(900, -1, CONTEXT) == CONTEXT and context.kept(900, None, CONTEXT) == 900
    assert context.fits(496, 16, CONTEXT) and not context.fits(497, 16, CONTEXT)


def test_the_error_is_vllms_and_names_the_field_to_shorten():
    err = context.too_long(CONTEXT, 600, 16, "prompt")
    assert (err.status, err.code, err.param) == (400, "prompt_too_long", "prompt")
    assert err.message == (
        "This model's maximum context length is 512 tokens. However, you requested 616 tokens "
        "(600 in the messages, 16 in the completion). Please reduce the length of the messages or completion."
    )
    assert context.too_long(CONTEXT, 512, 1, "messages").param == "messages"  # no room for one token
    assert context.too_long(CONTEXT, 500, 16, "messages").param == "max_new_tokens"  # the completion's fault


def conversation(*messages: tuple, **kw) -> ChatOptions:
    """(role, content) or (role, content, name) each."""
    return ChatOptions(
        messages=[ChatMessage(role=m[0], content=m[1], name=(m[2:] or [None])[0]) for m in messages], **kw
    )


def test_the_chat_bound_of_a_models_workers():
    """The loosest of the workers' (a job may go to any); none beside a worker without one (a
    template it could not bound, an older worker): then every conversation is counted."""
    a, b = ChatBound(base=29, per_message=10), ChatBound(base=13, per_message=14)
    ctx = context.context_of([worker(chat_bound=a), worker(chat_bound=b)])
    assert ctx.chat == ChatBound(base=29, per_message=14)
    assert context.context_of([worker(chat_bound=a), worker()]).chat is None
    assert context.context_of([worker()]).chat is None


def test_a_conversations_bound_and_what_surely_fits():
    ctx = context.Context(CONTEXT, TokenBound(per_byte=1, extra=1), ChatBound(base=10, per_message=5))
    chat = conversation(("system", "You are terse."), ("user", "héllo", "bob"))
    # base + each message's (per_message + content bytes + extra) + each name's (bytes + extra)
    expected = 10 + (5 + 14 + 1) + (5 + 6 + 1) + (3 + 1)
    assert context.chat_upper_bound(chat, ctx) == expected == 46
    # Special tokens asked for come on top (the template has its own: none by default).
    assert context.chat_upper_bound(chat, ctx, add_special_tokens=True) == 47
    assert context.chat_surely_fits(chat, CONTEXT - 46, ctx) is True
    assert context.chat_surely_fits(chat, CONTEXT - 45, ctx) is False
    assert context.chat_surely_fits(chat, CONTEXT - 46, ctx, add_special_tokens=True) is False
    assert context.chat_surely_fits(chat, CONTEXT - 40, ctx, truncate=40) is True  # its last 40 kept
    long = conversation(("user", "x" * 10_000))
    assert context.chat_surely_fits(long, 16, ctx) is False  # only counting can tell
    assert context.chat_surely_fits(long, 16, ctx, truncate=-1) is False  # the context, and 16 more
    # Only a worker can tell: no bound on the template, none on the text, or template variables
    # (the template may read them for anything).
    assert context.chat_upper_bound(chat, context.Context(CONTEXT, TokenBound(per_byte=1, extra=1))) is None
    no_text = context.Context(CONTEXT, TokenBound(per_byte=None), ChatBound(base=10, per_message=5))
    assert context.chat_upper_bound(chat, no_text) is None
    kwargs = conversation(("user", "hi"), chat_template_kwargs={"enable_thinking": True})
    assert context.chat_upper_bound(kwargs, ctx) is None and not context.chat_surely_fits(kwargs, 1, ctx)


# -- the worker's bound (worker/tokenbound.py) -------------------------------------------------

VOCAB = {chr(c) for c in range(ord("a"), ord("z") + 1)} | {"▁"}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
LLAMA2_NORMALIZER = {
    "type": "Sequence",
    "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
    ],
}
ADDED = [{"content": c, "normalized": False, "special": True} for c in ("<s>", "</s>", "<unk>")]


def spec(normalizer=None, pre_tokenizer=None, model="BPE", byte_fallback=False, added=ADDED) -> dict:
    return {
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "model": {"type": model, "byte_fallback": byte_fallback},
        "added_tokens": added,
    }


def bound(s: dict, specials: int = 1) -> tuple[int, int]:
    return analyse(s, VOCAB.__contains__, specials)


def test_bounds_of_each_kind_of_tokenizer():
    # Byte-level BPE (GPT-2, OPT, Llama 3, SmolLM2): a byte per token at least.
    assert bound(spec(pre_tokenizer=BYTE_LEVEL)) == (1, 1)
    assert bound(spec(pre_tokenizer=BYTE_LEVEL), specials=0) == (1, 0)
    # ... with a space before the text (one more), and NFC first (Qwen2: 3 bytes of one).
    assert bound(spec(pre_tokenizer={**BYTE_LEVEL, "add_prefix_space": True})) == (1, 2)
    split = {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "Isolated", "invert": False}
    qwen2 = spec({"type": "NFC"}, {"type": "Sequence", "pretokenizers": [split, {**BYTE_LEVEL, "use_regex": False}]})
    assert bound(qwen2) == (3, 1)
    assert bound(spec({"type": "NFKC"}, BYTE_LEVEL)) == (11, 1)
    # SentencePiece BPE with byte fallback (Llama 2, Mistral): "▁" before the text, spaces as "▁".
    assert bound(spec(LLAMA2_NORMALIZER, byte_fallback=True)) == (1, 2)
    metaspace = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    assert bound(spec(None, metaspace, model="Unigram", byte_fallback=True)) == (1, 2)
    assert bound(spec(None, {**metaspace, "prepend_scheme": "never"}, byte_fallback=True)) == (1, 1)
    # A "▁" outside the vocabulary is three byte tokens for one space.
    meta_x = {**metaspace, "replacement": "\u2581\u2581"}
    assert bound(spec(None, meta_x, byte_fallback=True, added=[])) == (2, 3)
    assert bound(spec(None, meta_x, byte_fallback=False, added=[])) == (2, 3)


@pytest.mark.parametrize(
    "why, s",
    [
        ("a normalizer that can lengthen text", spec({"type": "Lowercase"}, BYTE_LEVEL)),
        ("an opaque normalizer", spec({"type": "Precompiled", "precompiled_charsmap": "..."}, BYTE_LEVEL)),
        ("a regex replacement", spec({"type": "Replace", "pattern": {"Regex": "a"}, "content": "bbbb"}, BYTE_LEVEL)),
        ("another model", spec(pre_tokenizer=BYTE_LEVEL, model="Mystery")),
        (
            "a prefix per piece",
            spec(
                pre_tokenizer={
                    "type": "Sequence",
                    "pretokenizers": [{"type": "Whitespace"}, {**BYTE_LEVEL, "add_prefix_space": True}],
                }
            ),
        ),
        (
            "an added token too short for a segment's prefix",
            spec(LLAMA2_NORMALIZER, added=[{"content": "x", "normalized": False}]),
        ),
        (
            "an added token matched after normalization",
            spec(LLAMA2_NORMALIZER, added=[{"content": "<s>", "normalized": True}]),
        ),
    ],
)
def test_what_has_no_bound(why, s):
    with pytest.raises(Unbounded):
        bound(s)


def sentencepiece(space_in_vocab=True, metaspace=False, nfc=False, lowercase=False):
    """A Llama-2-like tokenizer: BPE over characters with byte fallback."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for piece in [*"abcdefghijklmnopqrstuvwxyz", *(["▁", "▁a", "▁t"] if space_in_vocab else []), "th", "the"]:
        vocab[piece] = len(vocab)
    merges = [("t", "h"), ("th", "e")] + ([("▁", "a"), ("▁", "t")] if space_in_vocab else [])
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    first = [normalizers.NFC()] if nfc else [normalizers.Lowercase()] if lowercase else []
    if metaspace:
        t.normalizer = normalizers.Sequence(first) if first else None
        t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    else:
        t.normalizer = normalizers.Sequence([*first, normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.add_special_tokens([AddedToken(c, normalized=False, special=True) for c in ("<unk>", "<s>", "</s>")])
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Texts of what makes tokenizers emit many tokens: spaces, added tokens, characters
    normalization lengthens, characters outside any vocabulary."""
    rng = random.Random(seed)
    pool = [" ", "  ", "▁", "<s>", "</s>", "the ", "a", "é", "\u0958", "\U0001d160", "\ufdfa", "图", "🤗", "\n", "ﬃ"]

    def one() -> str:
        return "".join(
            rng.choice(pool)
            if rng.random() < 0.7
            else chr(rng.choice([rng.randrange(32, 0xD800), rng.randrange(0xE000, 0x30000)]))
            for _ in range(rng.randrange(1, 48))
        )

    return [one() for _ in range(n)]


def assert_bound_holds(tok, b: TokenBound, texts: list[str]) -> None:
    for text in texts:
        n = len(tok(text).input_ids)
        assert n <= b.per_byte * len(text.encode()) + b.extra, (text, n, b)


@pytest.mark.parametrize(
    "kind, make, expected",
    [
        ("sentencepiece", lambda: sentencepiece(), (1, 2)),
        ("metaspace", lambda: sentencepiece(metaspace=True), (1, 2)),
        ("sentencepiece with NFC", lambda: sentencepiece(nfc=True), (3, 2)),
        ("metaspace with NFC", lambda: sentencepiece(metaspace=True, nfc=True), (3, 2)),
        # "▁" outside the vocabulary: three tokens for a space, and "<s>" too short to pay for
        # the next segment's: no bound.
        ("no ▁ in the vocabulary", lambda: sentencepiece(space_in_vocab=False), None),
        ("lowercase", lambda: sentencepiece(lowercase=True), None),
    ],
)
def test_the_bound_holds_on_sentencepiece_tokenizers(kind, make, expected):
    tok = make()
    b = tokenbound.bound_of(tok)
    assert (None if b.per_byte is None else (b.per_byte, b.extra)) == expected, kind
    if b.per_byte is not None:
        assert_bound_holds(tok, b, random_texts(2000))


@pytest.fixture(scope="module")
def dev_tokenizers(tiny_model):
    from transformers import AutoTokenizer

    from scripts import devmodels

    root = tiny_model.parent
    paths = {"opt": tiny_model, "qwen2": devmodels.ensure("tiny", root / "tiny-qwen2", arch="qwen2")}
    return {arch: AutoTokenizer.from_pretrained(p) for arch, p in paths.items()}


def test_the_bound_holds_on_the_dev_models_tokenizers(dev_tokenizers):
    """Byte-level BPE: OPT's (a BOS before the text) and Qwen2's (NFC first: 3 per byte)."""
    opt, qwen2 = dev_tokenizers["opt"], dev_tokenizers["qwen2"]
    assert tokenbound.bound_of(opt) == TokenBound(per_byte=1, extra=1)
    assert tokenbound.bound_of(qwen2) == TokenBound(per_byte=3, extra=1)
    texts = random_texts(2000, seed=1)
    assert_bound_holds(opt, TokenBound(per_byte=1, extra=1), texts)
    assert_bound_holds(qwen2, TokenBound(per_byte=3, extra=1), texts)
    # The bound is tight where it matters: one token per byte of text no merge covers.
    worst = max(len(opt(t).input_ids) - len(t.encode()) for t in texts)
    assert worst == 1


def test_a_bound_broken_on_the_probes_is_not_announced(dev_tokenizers, monkeypatch):
    monkeypatch.setattr(tokenbound, "analyse", lambda *a: (1, 0))  # one token short of OPT's BOS
    assert tokenbound.bound_of(dev_tokenizers["opt"]) == TokenBound(per_byte=None)


# -- the chat template's bound (worker/chatbound.py) ------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """The real SmolLM2-135M-Instruct checkpoint (scripts/realmodel.py; built once, ~25 s)."""
    from scripts import realmodel

    return realmodel.ensure()


def templated(tok, template: str | None = None) -> Chat:
    """A worker's Chat over `tok` with `template` (Jinja text; None: the tokenizer's own)."""
    chat = Chat(tok)
    if template is not None:
        chat.template = template
    return chat


def random_conversations(n: int, seed: int = 0) -> list[ChatOptions]:
    """Conversations of 1 to 24 messages of every role, in any order, with and without names
    and a system message, contents of every kind (random_texts: spaces, added tokens'
    text, characters normalization lengthens, characters outside any vocabulary) and length, each
    rendered with the generation prompt, without it, or continuing the final message."""
    rng = random.Random(seed)
    texts = random_texts(400, seed) + ["", "word " * 200, '"\\' * 50, "<|im_end|>\n<|im_start|>user\n" * 5]
    names = ["alice", "Bob Smith", "名字", " x "]
    roles = chatbound.ROLES
    convs = []
    for _ in range(n):
        messages = [
            ChatMessage(
                role=rng.choice(roles),
                content=rng.choice(texts),
                name=rng.choice(names) if rng.random() < 0.2 else None,
            )
            for _ in range(rng.randrange(1, 25))
        ]
        mode = rng.choice(
            [{}, {"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}]
        )
        convs.append(ChatOptions(messages=messages, **mode))
    return convs


def assert_chat_bound_holds(chat: Chat, tb: TokenBound, cb: ChatBound, convs: list[ChatOptions]) -> list[int]:
    """The API's bound (webapp/context.py) against the tokens the worker's engines make of each
    conversation's prompt; returns the slack of each the template renders."""
    ctx = context.Context(10**9, tb, cb)
    slack = []
    for opts in convs:
        try:
            text = chat.render(opts)
        except GenerationError:  # the template refuses it: a job of it fails on the worker
            continue
        n = len(chat.tok(text, add_special_tokens=False).input_ids)
        bound = context.chat_upper_bound(opts, ctx)
        assert n <= bound, ([m.role for m in opts.messages], text[:300], n, bound)
        slack.append(bound - n)
    return slack


@pytest.fixture(scope="module")
def tiny_tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("which", ["tests/chat_template.jinja", "the tiny model's own", "the tiny qwen2's own"])
def test_the_chat_bound_holds_on_the_dev_templates(which, dev_tokenizers):
    from scripts.stack import ROOT

    tok = dev_tokenizers["qwen2" if "qwen2" in which else "opt"]
    chat = templated(tok, (ROOT / TEMPLATE).read_text() if which == TEMPLATE else None)
    assert chat.available
    cb = chatbound.measure(chat)
    assert cb is not None, which
    slack = assert_chat_bound_holds(chat, tokenbound.bound_of(tok), cb, random_conversations(300))
    assert len(slack) == 300  # the template takes any conversation
    # Useful: a short conversation's bound is within a few tokens a message of its prompt.
    assert cb.per_message <= 16 and cb.base <= 16, cb


def test_the_chat_bound_holds_on_smollm2s_template(smollm2):
    """SmolLM2's template adds its default system prompt to a conversation without a system
    message first: that is in `base` (measured with and without one), not in every message's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    chat = templated(tok)
    assert "You are a helpful AI assistant named SmolLM" in chat.template
    tb = tokenbound.bound_of(tok)
    cb = chatbound.measure(chat)
    assert tb == TokenBound(per_byte=1, extra=0) and cb is not None
    default_system = len(
        tok(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        ).input_ids
    )
    assert cb.base >= default_system + 3  # and the generation prompt
    assert cb.per_message < default_system  # not added to each message
    slack = assert_chat_bound_holds(chat, tb, cb, random_conversations(400, seed=3))
    assert len(slack) == 400
    # The bound of a one-line question is within a few tokens of its prompt (31 tokens).
    hi = conversation(("user", "hi"))
    (n,) = [len(tok(chat.render(hi), add_special_tokens=False).input_ids)]
    assert n == 31 and n <= context.chat_upper_bound(hi, context.Context(8192, tb, cb)) <= n + 12


UNBOUNDED_TEMPLATES = {
    "repeats the content": "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{{ m.content }}\n{% endfor %}",
    "escapes the content": "{% for m in messages %}{{ {'role': m.role, 'content': m.content} | tojson }}\n{% endfor %}",
    "adds more each message": "{% for m in messages %}{{ '# ' * loop.index }}{{ m.content }}\n{% endfor %}",
    "reads the clock": "Today is {{ strftime_now('%d %B %Y') }}.\n{% for m in messages %}{{ m.content }}\n{% endfor %}",
    "refuses every conversation": "{{ raise_exception('no') }}",
}


@pytest.mark.parametrize("why", list(UNBOUNDED_TEMPLATES))
def test_a_template_whose_tokens_are_not_bounded_gets_no_bound(why, tiny_tok):
    assert chatbound.measure(templated(tiny_tok, UNBOUNDED_TEMPLATES[why])) is None


def test_a_template_with_a_constant_overhead_gets_one(tiny_tok):
    """Position-dependent but bounded (numbered turns), content-dependent branches that only
    shorten (a blank content left out), alternation enforced: all bounded."""
    template = (
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('alternate') }}{% endif %}"
        "Turn {{ loop.index }} {{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}: "
        "{% if m.content | trim %}{{ m.content | trim }}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}Turn {{ messages | length + 1 }} assistant: {% endif %}"
    )
    chat = templated(tiny_tok, template)
    cb = chatbound.measure(chat)
    assert cb is not None
    alternating = [
        ChatOptions(
            messages=[
                ChatMessage(role=("user", "assistant")[i % 2], content=m.content, name=m.name)
                for i, m in enumerate(c.messages)
            ]
        )
        for c in random_conversations(200, seed=5)
    ]
    assert len(assert_chat_bound_holds(chat, tokenbound.bound_of(tiny_tok), cb, alternating)) == 200


# -- the whole stack -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cstack(tiny_model, stack_logs):
    """A stack on a Redis of its own: the counts below must not see other modules' stacks (on
    a shared Redis another stack's API may drive this stack's batch)."""
    from conftest import private_stack

    from scripts import stack as stackmod

    with private_stack(
        tiny_model, stack_logs, GENQ_CHAT_TEMPLATE=str(stackmod.ROOT / TEMPLATE), GENQ_MAX_BATCH_SIZE="8"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def r(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="module")
def cr(cstack):
    """`cstack`'s Redis."""
    client = redis.Redis.from_url(cstack.redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="module")
def client(cstack):
    with openai.OpenAI(base_url=cstack.base + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def exactly(count, n: int) -> str:
    """A text that `count` makes exactly n tokens of (words, then a few characters to adjust)."""
    for k in range(max(1, n // 2 - 8), n):
        for tail in ("", ".", "..", " x", " x."):
            text = "word" + " word" * (k - 1) + tail
            if count(text) == n:
                return text
    raise AssertionError(f"no text of {n} tokens")


class Watch:
    """What the API queued and counted meanwhile: its /metrics, and the model's job records."""

    def __init__(self, stack, r):
        self.stack, self.r = stack, r
        self.before = self.now()

    def now(self) -> tuple[float, float, int]:
        text = self.stack.get("/metrics").text
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.labels.get("model_name") == self.stack.name
        }
        records = sum(
            1
            for k in self.r.scan_iter(keys.job("*"), count=1000)
            if self.r.type(k) == "hash" and self.r.hget(k, "model") == self.stack.name
        )
        return (
            samples.get("genq:api_jobs_submitted_total", 0.0),
            samples.get("genq:api_prompts_counted_total", 0.0),
            records,
        )

    def since(self) -> tuple[int, int, int]:
        """Jobs queued, requests counted by a worker, job records made, since it began."""
        now = self.now()
        return tuple(int(a - b) for a, b in zip(now, self.before))


def assert_too_long(resp, prompt_tokens: int, max_new: int, param: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "prompt_too_long" and err["param"] == param, err
    assert err["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
        f"{prompt_tokens + max_new} tokens ({prompt_tokens} in the messages, {max_new} in the completion). "
        "Please reduce the length of the messages or completion."
    )


def announced(stack, r) -> WorkerInfo:
    (w,) = [w for w in Registry(r, 30).live() if w.model == stack.name]
    return w


def test_the_worker_announces_its_context_and_bounds(cstack, cr, tok):
    from scripts.stack import ROOT

    w = announced(cstack, cr)
    assert w.max_model_len == CONTEXT and w.token_bound == TokenBound(per_byte=1, extra=1)
    # Its template's, as measured here on the same tokenizer and template.
    assert w.chat_bound is not None and w.chat_bound == chatbound.measure(Chat(tok, str(ROOT / TEMPLATE)))
    assert w.answers_asks


def test_jobs_api(cstack, cr, tok):
    def count(text):
        return len(tok(text).input_ids)

    watch = Watch(cstack, cr)
    # Past the context with its completion: refused at submit, nothing queued.
    over = exactly(count, CONTEXT - 16 + 1)
    assert_too_long(
        cstack.post("/v1/jobs", json={"prompt": over, "max_new_tokens": 16}), CONTEXT - 15, 16, "max_new_tokens"
    )
    alone = "word " * 600
    assert_too_long(cstack.post("/v1/jobs", json={"prompt": alone, "max_new_tokens": 4}), count(alone), 4, "prompt")
    assert_too_long(
        cstack.post("/basic_generate", json={"prompt": alone, "max_new_tokens": 4}), count(alone), 4, "prompt"
    )
    assert watch.since() == (0, 3, 0)
    # Just fits: queued, and the job runs to the context's end.
    under = exactly(count, CONTEXT - 16)
    resp = cstack.post("/v1/jobs", json={"prompt": under, "max_new_tokens": 16, "ignore_eos": True})
    assert resp.status_code == 202, resp.text
    job = cstack.get(f"/v1/jobs/{resp.json()['id']}?wait=60").json()
    assert job["status"] == "succeeded", job
    assert job["result"]["prompt_tokens"] == CONTEXT - 16 and job["result"]["completion_tokens"] == 16
    assert watch.since() == (1, 4, 1)


def test_a_short_prompt_is_not_counted(cstack, cr):
    """The common case costs nothing: a prompt whose bytes (+ BOS) and completion fit."""
    watch = Watch(cstack, cr)
    resp = cstack.post("/v1/jobs", json={"prompt": "Hello, my name is", "max_new_tokens": 4})
    assert resp.status_code == 202
    resp = cstack.post("/v1/completions", json={"prompt": ["Hello", "x" * (CONTEXT - 17)], "max_tokens": 16})
    assert resp.status_code == 200, resp.text
    assert watch.since()[:2] == (3, 0)


def test_completions(cstack, client, cr, tok):
    def count(text):
        return len(tok(text).input_ids)

    watch = Watch(cstack, cr)
    over = exactly(count, CONTEXT)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=cstack.name, prompt=over, max_tokens=4)
    assert info.value.code == "prompt_too_long" and info.value.body["param"] == "prompt"
    assert f"maximum context length is {CONTEXT} tokens" in info.value.body["message"]
    body = {"model": cstack.name, "prompt": ["Hello", exactly(count, CONTEXT - 9)], "max_tokens": 10}
    assert_too_long(cstack.post("/v1/completions", json=body), CONTEXT - 9, 10, "max_tokens")
    assert_too_long(cstack.post("/v1/completions", json={**body, "stream": True}), CONTEXT - 9, 10, "max_tokens")
    assert watch.since() == (0, 3, 0)
    # Token ids are counted as they are: no worker asked.
    ids = tok(over).input_ids
    resp = cstack.post("/v1/completions", json={"prompt": ids[: CONTEXT - 9], "max_tokens": 10})
    assert_too_long(resp, CONTEXT - 9, 10, "max_tokens")
    resp = cstack.post("/v1/completions", json={"prompt": [ids[:5], ids * 2], "max_tokens": 10})
    assert_too_long(resp, 2 * CONTEXT, 10, "prompt")
    assert watch.since() == (0, 3, 0)
    # truncate_prompt_tokens keeps the prompt's end: then it fits, as vLLM takes it.
    resp = cstack.post("/v1/completions", json={"prompt": ids * 2, "max_tokens": 10, "truncate_prompt_tokens": 100})
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == 100, resp.text
    # Just under the limit, as text and as token ids.
    resp = cstack.post("/v1/completions", json={"prompt": exactly(count, CONTEXT - 10), "max_tokens": 10})
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == CONTEXT - 10, resp.text
    resp = cstack.post("/v1/completions", json={"prompt": ids[: CONTEXT - 10], "max_tokens": 10})
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == CONTEXT - 10, resp.text
    assert watch.since() == (3, 4, 3)


def test_chat_completions(cstack, client, cr, tok):
    """A conversation's prompt is the worker's template over it: one whose bound (the
    template's and its contents') does not surely fit is counted by the worker."""
    from scripts.stack import ROOT

    template = (ROOT / TEMPLATE).read_text()

    def count(content):
        messages = [{"role": "user", "content": content}]
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False).input_ids)

    watch = Watch(cstack, cr)
    over = exactly(count, CONTEXT - 7)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=cstack.name, messages=[{"role": "user", "content": over}], max_tokens=8)
    assert info.value.code == "prompt_too_long" and info.value.body["param"] == "max_tokens"
    body = {"messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 8}
    resp = cstack.post("/v1/chat/completions", json=body)
    assert_too_long(resp, count("word " * 600), 8, "messages")
    assert_too_long(
        cstack.post("/v1/chat/completions", json={**body, "stream": True}), count("word " * 600), 8, "messages"
    )
    assert watch.since() == (0, 3, 0)
    under = exactly(count, CONTEXT - 8)
    out = client.chat.completions.create(model=cstack.name, messages=[{"role": "user", "content": under}], max_tokens=8)
    assert out.usage.prompt_tokens == CONTEXT - 8
    assert watch.since() == (1, 4, 1)
    # A short one surely fits: not counted.
    out = client.chat.completions.create(model=cstack.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert watch.since() == (2, 4, 2)


def chat_bound_of(stack, cr, chat: ChatOptions) -> int:
    """The API's bound on the conversation's prompt, by what the stack's worker announces."""
    w = announced(stack, cr)
    return context.chat_upper_bound(chat, context.Context(w.max_model_len, w.token_bound, w.chat_bound))


def test_a_chat_that_surely_fits_is_not_counted(cstack, client, cr, tok):
    """Chat is the main load: a conversation whose bound fits goes straight to the queue, with
    no round trip to a worker, whatever its shape; one past its bound is counted, and queued
    when it fits after all."""
    from scripts.stack import ROOT

    template = (ROOT / TEMPLATE).read_text()
    watch = Watch(cstack, cr)
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hello, who are you?", "name": "alice"},
        {"role": "assistant", "content": "A model."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "more."}]},
    ]
    out = client.chat.completions.create(model=cstack.name, messages=messages, max_tokens=4)
    assert out.usage.prompt_tokens > 30
    with client.chat.completions.create(
        model=cstack.name,
        messages=messages,
        max_tokens=4,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ) as stream:
        assert [c for c in stream][-1].usage.completion_tokens == 8
    resp = cstack.post(
        "/v1/chat/completions",
        json={
            "messages": messages[:2],
            "max_tokens": 3,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    assert resp.status_code == 200, resp.text
    assert watch.since() == (4, 0, 4)
    # Template variables: the template may read them for anything, so a worker counts.
    resp = cstack.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "chat_template_kwargs": {"x": 1}}
    )
    assert resp.status_code == 200, resp.text
    assert watch.since() == (5, 1, 5)
    # At the edge: a bound of exactly the context with its completion is not counted, one more is.
    one = ChatOptions(messages=[ChatMessage(role="user", content="")])
    room = CONTEXT - 8 - chat_bound_of(cstack, cr, one)  # bytes of content that fit by the bound
    edge = ("word " * room)[:room]
    assert chat_bound_of(cstack, cr, ChatOptions(messages=[ChatMessage(role="user", content=edge)])) == CONTEXT - 8
    for content, counted in ((edge, 1), (edge + "s", 2)):
        out = client.chat.completions.create(
            model=cstack.name, messages=[{"role": "user", "content": content}], max_tokens=8
        )
        text = tok.apply_chat_template(
            [{"role": "user", "content": content}], chat_template=template, tokenize=False, add_generation_prompt=True
        )
        assert out.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids) < CONTEXT - 8
        assert watch.since() == (5 + counted, counted, 5 + counted)


def test_chat_batch_lines(cstack, client, cr):
    """A chat line is checked as the route checks it: a short one is queued uncounted, one past
    the context fails with the route's error, counted."""
    body = {"model": cstack.name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    long = {**body, "messages": [{"role": "user", "content": "word " * 600}]}
    lines = [
        {"custom_id": "short", "method": "POST", "url": "/v1/chat/completions", "body": body},
        {"custom_id": "long", "method": "POST", "url": "/v1/chat/completions", "body": long},
    ]
    watch = Watch(cstack, cr)
    f = client.files.create(file=("in.jsonl", "".join(json.dumps(ln) + "\n" for ln in lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    assert watch.since() == (1, 1, 1)
    (err,) = [json.loads(ln) for ln in client.files.content(batch.error_file_id).text.splitlines()]
    assert err["custom_id"] == "long" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["code"] == "prompt_too_long"
    assert err["response"]["body"] == requests.post(cstack.base + "/v1/chat/completions", json=long, timeout=60).json()


def test_a_batch_line_past_the_context_fails_with_the_routes_error(cstack, client, tok):
    body = {"model": cstack.name, "prompt": "word " * 600, "max_tokens": 4}
    lines = [
        {"custom_id": "long", "method": "POST", "url": "/v1/completions", "body": body},
        {"custom_id": "short", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": "Hello"}},
    ]
    f = client.files.create(file=("in.jsonl", "".join(json.dumps(ln) + "\n" for ln in lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    (err,) = [json.loads(ln) for ln in client.files.content(batch.error_file_id).text.splitlines()]
    direct = requests.post(cstack.base + "/v1/completions", json=body, timeout=60)
    assert err["custom_id"] == "long" and err["response"]["status_code"] == 400
    assert err["response"]["body"] == direct.json()
    assert_too_long(direct, len(tok(body["prompt"]).input_ids), 4, "prompt")


# -- counts never wait behind jobs (worker/asks.py) ---------------------------------------------


@pytest.fixture(scope="module")
def busy(make_module_stack):
    """A worker with one Celery thread: one running job holds every thread it has."""
    from scripts.stack import ROOT

    s = make_module_stack(GENQ_CHAT_TEMPLATE=str(ROOT / TEMPLATE), GENQ_MAX_BATCH_SIZE="1", GENQ_RESERVED_SLOTS="0")
    s.start_api()
    s.start_worker()
    s.wait_ready()
    return s


def test_a_count_is_answered_while_jobs_hold_every_thread(busy, r):
    """A Celery task would wait in Redis for the job to end (the worker prefetches no more
    than it has threads); the ask list is answered at once."""
    w = announced(busy, r)
    assert (w.capacity, w.reserved, w.answers_asks) == (1, 0, True)
    watch = Watch(busy, r)
    resp = busy.post("/v1/jobs", json={"prompt": "Hello", "max_new_tokens": 500, "ignore_eos": True})
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    deadline = time.monotonic() + 30
    while busy.get(f"/v1/jobs/{job_id}").json()["status"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # A conversation past its bound is counted (refused), a short one's tokens told.
    started = time.monotonic()
    long = {"messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 8}
    resp = busy.post("/v1/chat/completions", json=long)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "prompt_too_long", resp.text
    resp = busy.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 200 and resp.json()["count"] > 2, resp.text
    answered = time.monotonic() - started
    assert busy.get(f"/v1/jobs/{job_id}").json()["status"] == "running"  # the job holds the thread still
    assert watch.since()[1] == 1
    job = busy.get(f"/v1/jobs/{job_id}?wait=60").json()
    assert job["status"] == "succeeded" and job["result"]["completion_tokens"] == 500
    assert answered < 2.0, answered


def test_an_older_worker_is_asked_through_celery(r, tiny_tok):
    """The API asks through the ask list only where a live worker answers it; beside older
    workers only, through a `genq.tokenize` task as before. The list's answers: worker/asks.py
    over the worker's Chat."""
    import importlib
    import uuid

    from tasks.celery_app import TOKENIZE_TASK
    from tasks.config import queue_for
    from worker.asks import Answerers

    tokens = importlib.import_module("webapp.tokens")  # the package's `tokens` is its routes'

    class Service:  # what webapp/tokens.py uses of the API's JobService
        def __init__(self, workers):
            self.r, self.celery, self.workers, self.sent = r, self, workers, []

        def resolve_model(self, model):
            return model

        def require_worker(self, model):
            pass

        def workers_for(self, model):
            return self.workers

        def send_task(self, name, args, **kw):  # a Celery worker's task, answered here
            self.sent.append((name, kw))
            r.rpush(keys.reply(args[0]["id"]), json.dumps(Chat(tiny_tok).answer(args[0])))

    model = f"test-{uuid.uuid4().hex[:8]}"
    ask = {"op": "count", "add_special_tokens": True, "prompts": ["Hello", "word " * 10]}
    counts = [len(tiny_tok(p).input_ids) for p in ask["prompts"]]
    older = Service([worker().model_copy(update={"model": model})])
    assert tokens.ask(older, model, ask)["counts"] == counts
    ((name, kw),) = older.sent
    assert name == TOKENIZE_TASK and kw["queue"] == queue_for(model)
    answerers = Answerers(r, Chat(tiny_tok), queue_for(model))
    answerers.start()
    try:
        newer = Service([worker().model_copy(update={"model": model, "answers_asks": True})])
        assert tokens.ask(newer, model, ask)["counts"] == counts
        assert newer.sent == []
        # A question nobody waits for any more is dropped.
        r.rpush(keys.asks(queue_for(model)), json.dumps({**ask, "id": "gone", "deadline": time.time() - 1}))
        assert tokens.ask(newer, model, {"op": "detokenize", "tokens": [0]})["prompt"] is not None
        assert not r.exists(keys.reply("gone"))
    finally:
        answerers.stop()


# -- the real SmolLM2 checkpoint ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(make_module_stack, smollm2):
    s = make_module_stack(GENQ_MODEL=str(smollm2), GENQ_MAX_PROMPT_CHARS="200000")
    s.start_api()
    s.start_worker()
    s.wait_ready(timeout=180)
    return s


def test_smollm2_chat_is_not_counted_unless_it_may_not_fit(smol, r, smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    w = announced(smol, r)
    assert w.max_model_len == 8192 and w.chat_bound == chatbound.measure(Chat(tok))
    watch = Watch(smol, r)
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy? " * 40},
        ],
    ]
    for messages in conversations:
        resp = smol.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        n = len(tok(text, add_special_tokens=False).input_ids)
        assert resp.json()["usage"]["prompt_tokens"] == n
        assert n <= chat_bound_of(smol, r, ChatOptions(messages=[ChatMessage(**m) for m in messages]))
    assert watch.since() == (2, 0, 2)
    # Past the context: counted by the worker, refused with vLLM's error, nothing queued.
    long = [{"role": "user", "content": "word " * 8200}]
    resp = smol.post("/v1/chat/completions", json={"messages": long, "max_tokens": 4})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    text = tok.apply_chat_template(long, tokenize=False, add_generation_prompt=True)
    n = len(tok(text, add_special_tokens=False).input_ids)
    assert err["code"] == "prompt_too_long" and err["param"] == "messages", err
    assert err["message"].startswith(
        f"This model's maximum context length is 8192 tokens. However, you requested {n + 4} tokens"
    )
    assert watch.since() == (2, 1, 2)
