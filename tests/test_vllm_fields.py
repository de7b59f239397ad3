"""vLLM's sampling and request fields and structured output (issue 19), through the real stack
with the official `openai` client (the hf worker on the tiny random-weight model): token-id
prompts, min_p, logit_bias, allowed_token_ids, bad_words, best_of, the output fields, and
response_format / structured_outputs, whose every output parses and validates. Then the
logits processors' rows as the batch changes (pure logic on the real tokenizer)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch
from transformers import AutoTokenizer

from tasks.schemas import SamplingParams, StructuredOutput
from worker.engines.logits import RowProcessors, bad_word_ids
from worker.engines.sampling import sample

PROMPT = "Hello, my name is"


@pytest.fixture(scope="module")
def client(hf_stack):
    with openai.OpenAI(base_url=hf_stack.base + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def complete(client, hf_stack, **kw):
    extra = kw.pop("extra_body", {})
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=hf_stack.name, prompt=kw.pop("prompt", PROMPT), extra_body=extra, **kw)


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_token_id_prompts_give_the_text_of_the_decoded_prompt(client, hf_stack, reference, tok):
    plain = complete(client, hf_stack, extra_body={"return_token_ids": True}).choices[0]
    ids = plain.model_extra["prompt_token_ids"]
    assert plain.text == reference(PROMPT, 12)
    one = complete(client, hf_stack, prompt=ids).choices[0]
    assert one.text == plain.text
    other = complete(client, hf_stack, prompt="The capital of France is", extra_body={"return_token_ids": True})
    both = complete(client, hf_stack, prompt=[ids, other.choices[0].model_extra["prompt_token_ids"]])
    assert [c.text for c in both.choices] == [plain.text, other.choices[0].text]
    # The completion's own token ids decode to its text.
    assert tok.decode(token_ids(plain)) == plain.text


def test_min_p_one_is_greedy_and_seeds_are_64_bit(client, hf_stack):
    greedy = complete(client, hf_stack).choices[0].text
    for seed in (-(2**63), -7, 2**63 - 1):
        assert (
            complete(client, hf_stack, temperature=1.0, seed=seed, extra_body={"min_p": 1.0}).choices[0].text == greedy
        )
    a = complete(client, hf_stack, temperature=1.0, seed=-7).choices[0].text
    assert complete(client, hf_stack, temperature=1.0, seed=-7).choices[0].text == a


def test_logit_bias_bans_and_forces_tokens(client, hf_stack):
    plain = token_ids(complete(client, hf_stack, extra_body={"return_token_ids": True}).choices[0])
    banned = complete(
        client, hf_stack, logit_bias={str(t): -100 for t in set(plain)}, extra_body={"return_token_ids": True}
    ).choices[0]
    assert token_ids(banned) and not set(token_ids(banned)) & set(plain)
    forced = complete(client, hf_stack, logit_bias={"77": 100}, extra_body={"return_token_ids": True}).choices[0]
    assert token_ids(forced) == [77] * 12


def test_allowed_token_ids_confine_every_token(client, hf_stack):
    allowed = [40, 41, 77, 300]
    out = complete(
        client,
        hf_stack,
        temperature=1.0,
        seed=3,
        max_tokens=16,
        extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
    ).choices[0]
    assert len(token_ids(out)) == 16 and set(token_ids(out)) <= set(allowed)


def test_bad_words_never_appear(client, hf_stack, tok):
    plain = complete(client, hf_stack, extra_body={"return_token_ids": True}).choices[0]
    word = tok.decode(token_ids(plain)[:1]).strip()
    banned = bad_word_ids(tok, [word])
    out = complete(client, hf_stack, max_tokens=24, extra_body={"bad_words": [word], "return_token_ids": True})
    ids = token_ids(out.choices[0])
    assert out.choices[0].text != plain.text
    for seq in banned:
        assert not any(tuple(ids[i : i + len(seq)]) == seq for i in range(len(ids)))


def test_best_of_returns_the_best_by_cumulative_logprob(client, hf_stack):
    kw = dict(temperature=1.0, max_tokens=8)
    best = complete(client, hf_stack, n=1, best_of=3, seed=11, **kw)
    (choice,) = best.choices
    assert choice.logprobs is None  # not asked for
    # The three candidates: seeds 11, 12, 13 (choice j of a request gets seed + j).
    alone = [complete(client, hf_stack, seed=11 + j, logprobs=0, **kw).choices[0] for j in range(3)]
    top = max(alone, key=lambda c: sum(c.logprobs.token_logprobs))
    assert choice.text == top.text
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in alone)
    two = complete(client, hf_stack, n=2, best_of=3, seed=11, logprobs=1, **kw).choices
    ranked = sorted(alone, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.text for c in two] == [c.text for c in ranked[:2]] and two[0].logprobs is not None


def test_output_fields(client, hf_stack, tok):
    plain = complete(client, hf_stack).choices[0].text
    stop = plain[3:6]
    kept = complete(client, hf_stack, stop=[stop], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == plain[: plain.index(stop) + len(stop)] and kept.finish_reason == "stop"
    # The pad token, forced, is a special token: left out of the text unless asked for.
    pad = {str(tok.pad_token_id): 100}
    assert complete(client, hf_stack, logit_bias=pad, max_tokens=3).choices[0].text == ""
    raw = complete(
        client,
        hf_stack,
        logit_bias=pad,
        max_tokens=3,
        extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": False},
    )
    assert raw.choices[0].text == tok.pad_token * 3
    ids = tok(PROMPT).input_ids
    out = complete(client, hf_stack, extra_body={"add_special_tokens": False, "return_token_ids": True})
    assert out.choices[0].model_extra["prompt_token_ids"] == tok(PROMPT, add_special_tokens=False).input_ids
    out = complete(client, hf_stack, extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True})
    assert out.usage.prompt_tokens == 3 and out.choices[0].model_extra["prompt_token_ids"] == ids[-3:]
    assert out.choices[0].text == complete(client, hf_stack, prompt=ids[-3:]).choices[0].text


def test_prompt_logprobs(client, hf_stack, tok):
    out = complete(client, hf_stack, max_tokens=2, extra_body={"prompt_logprobs": 2}).choices[0]
    ids = tok(PROMPT).input_ids
    entries = out.model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:]):
        assert str(token) in entry and all(v["logprob"] <= 0 for v in entry.values())
        ranked = sorted(entry.values(), key=lambda v: v["rank"])
        assert ranked[0]["rank"] == 1 and ranked[0]["logprob"] == max(v["logprob"] for v in entry.values())
        assert entry[str(token)]["decoded_token"] == tok.decode([token])


# -- structured output --------------------------------------------------------------------------

# Small enough that a random-weight model closes them well within max_tokens: bounded numbers,
# enums, short strings, short arrays.
SCHEMAS = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6}},
        "required": ["name"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "boolean"}},
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
]


def test_fifty_structured_requests_all_valid(client, hf_stack):
    def one(i: int):
        schema = SCHEMAS[i % 5]
        kw = dict(prompt=f"Record {i}:", max_tokens=64, temperature=0 if i % 2 else 1.0, seed=i)
        if i % 3:  # OpenAI's response_format, and vLLM's structured_outputs
            kw["extra_body"] = {
                "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i % 5}", "schema": schema}}
            }
        else:
            kw["extra_body"] = {"structured_outputs": {"json": schema}}
        return schema, complete(client, hf_stack, **kw).choices[0]

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(50)))
    for schema, choice in outs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)
    assert len({c.text for _, c in outs}) > 10


def test_regex_choice_grammar_json_object(client, hf_stack):
    for extra, valid in [
        (
            {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
            lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-",
        ),
        ({"structured_outputs": {"choice": ["yes", "no", "maybe so"]}}, lambda t: t in ("yes", "no", "maybe so")),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        (
            {"structured_outputs": {"grammar": 'root ::= "(" [a-c] ("," [a-c])? ")"'}},
            lambda t: t[0] == "(" and t[-1] == ")" and set(t[1:-1]) <= set("abc,"),
        ),
        (
            {"structured_outputs": {"grammar": 'start: "x" DIGIT\nDIGIT: /[0-9]/'}},
            lambda t: t[0] == "x" and t[1:].isdigit(),
        ),
        (
            {
                "response_format": {"type": "json_object"},
                "structured_outputs": {"json_object": True, "disable_any_whitespace": True},
            },
            lambda t: isinstance(json.loads(t), dict) and " " not in t,
        ),
    ]:
        for seed in (1, 2):
            out = complete(client, hf_stack, temperature=1.0, seed=seed, max_tokens=40, extra_body=extra).choices[0]
            assert out.finish_reason == "stop" and valid(out.text), (extra, out.text)
    # Chat takes the same fields.
    for seed in (1, 2):
        out = client.chat.completions.create(
            model=hf_stack.name,
            messages=[{"role": "user", "content": "Pick"}],
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[1]}},
            extra_body={"min_p": 0.01, "return_token_ids": True},
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS[1])


def test_bad_constraints_and_unknown_fields_are_400_naming_the_field(client, hf_stack):
    cases = [
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": {"type": "object", "properties": 5}}}, "structured_outputs.json"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"structured_outputs": {"regex": "a", "frobnicate": 1}}, "structured_outputs.frobnicate"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            complete(client, hf_stack, extra_body=extra)
        assert info.value.body["param"] == param, info.value.body
        assert param.split(".")[-1] in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, hf_stack, prompt=[5000])
    assert info.value.body["param"] == "prompt"
    # Fields that cannot change the output are accepted and ignored.
    out = complete(
        client, hf_stack, user="u", extra_body={"metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    )
    assert out.choices[0].text == complete(client, hf_stack).choices[0].text


# -- the processors' rows, as the batch changes (pure logic, the real tokenizer) ---------------------


def test_rows_follow_joins_selects_and_heads(tok):
    vocab = 4096
    schema = json.dumps(SCHEMAS[1])
    params = [
        SamplingParams(),
        SamplingParams(logit_bias={77: 100}),
        SamplingParams(allowed_token_ids=[40, 41]),
        SamplingParams(structured_outputs=StructuredOutput(json_schema=schema)),
        SamplingParams(bad_words=["blue"]),
    ]
    procs = RowProcessors.build(params[:3], [[2]] * 3, [0] * 3, 2, vocab, tokenizer=tok)
    new = RowProcessors.build(params[3:], [[2]] * 2, [0] * 2, 2, vocab, tokenizer=tok)
    procs = RowProcessors.join(procs, new, 3, 2, vocab)
    assert RowProcessors.build([SamplingParams()], [[2]], [0], 2, vocab) is None  # nobody asks: none at all
    gen = torch.Generator().manual_seed(0)
    text = ""
    for step in range(30):
        raw = torch.randn(5, vocab, generator=gen)
        before = raw.clone()
        logits = procs.apply(raw)
        assert torch.equal(raw, before) and torch.equal(logits[0], raw[0])  # raw untouched, row 0 too
        tokens = sample(logits, params, [None] * 5)
        head = procs.head(4)  # row 4 sits this step out on even steps
        (head if step % 2 else procs).update(tokens[:4] if step % 2 else tokens)
        assert tokens[1] == 77 and int(tokens[2]) in (40, 41)
        if int(tokens[3]) == 2:
            break
        text += tok.decode([int(tokens[3])])
    assert json.loads(text)["color"] in ("red", "green", "blue")
    # Rows leave: the grammar and the masks go with their rows.
    kept = procs.select(torch.tensor([4, 2]))
    assert kept.matchers is None and kept.bias is None and kept.banned is not None
    alone = kept.select(torch.tensor([0]))
    assert (alone.bad_seqs is not None) == any(len(w) > 1 for w in bad_word_ids(tok, ["blue"]))
