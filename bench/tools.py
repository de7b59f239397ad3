"""`python -m bench.tools`: what a chat request with `tool_choice: "required"` costs per
generated token against the same request without tools (issue 30: at most 10 % more). One API
and one hf worker; each round, at each --levels concurrency, sends a wave of `required`
requests, then as many tokens (`max_tokens` = each one's completion_tokens + 1, the EOS that
ended it: a step our count leaves out; `ignore_eos`) with the tools but `tool_choice: "none"`
(the same prompt, no constraint) and with no tools (`plain`), then one-token requests of all
three; all unstreamed (a forced call comes at the end). Decode time per token: (mean latency -
mean one-token latency) / (mean tokens - 1); figures are medians over rounds. Findings and
method: docs/benchmarks.md, "Tool calling's cost per generated token". Quick check: `python -m
bench.tools --model tiny --levels 1,2 --rounds 1`.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

from bench.common import OtherLoad, Processes, make_log, own_cpu_s, parser, run_bench, run_lines, table, tree_cpu_s
from bench.common import fmt as _f
from bench.common import int_list as _int_list
from bench.load import Conn, Loop
from bench.prefix import CHAT, checkpoint
from bench.vllm import start_ours

log = make_log("tools")
GOAL = 1.10  # issue 30: required / plain, decode time per generated token
CITIES = "Paris|Tokyo|Lima|Oslo|Cairo|Sydney|Toronto|Mumbai|Nairobi|Berlin|Seoul|Dublin".split("|")
ZONES = {"Paris": "Europe/Paris", "Tokyo": "Asia/Tokyo", "Lima": "America/Lima", "Oslo": "Europe/Oslo"}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": CITIES}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": sorted(ZONES.values())}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a zone", "parameters": TIME}},
]
CONFIGS = ("required", "none", "plain")


def ask(n: int) -> list[dict]:
    """The n-th user message: each request's own (prefix caching treats every config alike)."""
    city = CITIES[n % len(CITIES)]
    q = f"What time is it in {city}?" if n % 3 == 2 else f"How warm is it in {city} today?"
    return [{"role": "user", "content": f"Trip {n}. {q}"}]


def body(model: str, config: str, n: int, max_tokens: int) -> bytes:
    b = {"model": model, "messages": ask(n), "max_tokens": max_tokens, "temperature": 0}
    if config != "plain":
        b |= {"tools": TOOLS, "tool_choice": config}
    if config == "required":
        b["parallel_tool_calls"] = False  # one call: a bounded output even from a random model
    else:
        b["ignore_eos"] = True
    return json.dumps(b).encode()


def unstreamed(conn: Conn, data: bytes, rq) -> None:
    resp = conn.request("POST", CHAT, data)
    raw = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {raw[:300]!r}")
    out = json.loads(raw)
    choice = out["choices"][0]
    rq.usage, rq.calls = out["usage"], len(choice["message"].get("tool_calls") or [])
    # Steps: a reply that ended by EOS took one more than completion_tokens (the EOS is not counted)
    rq.steps = out["usage"]["completion_tokens"] + (choice["finish_reason"] != "length")


def wave(running, config: str, clients: int, per_client: int, first: int, tokens) -> list:
    """`clients` at once, `per_client` requests each, the (client, k)-th asking for
    `tokens[client, k]` tokens (or `tokens` when an int); their records."""
    want = lambda i, k: tokens if isinstance(tokens, int) else tokens[i, k]  # noqa: E731
    make = lambda i, k: body(running.model, config, first + i * per_client + k, want(i, k))  # noqa: E731
    loop = Loop(running.port, clients, make, unstreamed, f"tools-{config}", per_client)
    loop.start().join(900)
    bad = [r for r in loop.records if not r.ok]
    if bad or len(loop.records) != clients * per_client:
        raise RuntimeError(f"{config}: {len(bad)} failed of {len(loop.records)}: {bad[0].error if bad else ''}")
    if config != "required" and any(r.steps != want(r.client, r.k) for r in loop.records):
        raise RuntimeError(f"{config}: completion_tokens other than max_tokens (ignore_eos?)")
    return loop.records


def summarize(full: list, probes: list) -> dict:
    """Decode time per token by two points: the full requests' mean latency less the mean
    latency of one-token requests (TTFT: prefill and one step), over the tokens after the first."""
    tokens = [r.steps for r in full]
    lat, ttft = statistics.mean(r.latency for r in full), statistics.mean(r.latency for r in probes)
    return {
        "tokens": sum(tokens),
        "lat_per_token": sum(r.latency for r in full) / sum(tokens),
        "decode_per_token": (lat - ttft) / (statistics.mean(tokens) - 1),
        "ttft": ttft,
        "prompt_tokens": statistics.mean(r.usage["prompt_tokens"] for r in full),
    }


def run_level(running, clients: int, args, n0: int) -> dict:
    rounds, other = [], OtherLoad(lambda: own_cpu_s() + sum(tree_cpu_s(p) for p in running.pids if p))
    per = clients * args.per_client
    for rnd in range(args.warmup + args.rounds):
        if rnd == args.warmup:
            other.restart()
        n = n0 + rnd * 6 * per
        full = {"required": wave(running, "required", clients, args.per_client, n, args.max_tokens)}
        tokens = {(r.client, r.k): r.steps for r in full["required"]}
        order = CONFIGS[rnd % 3 :] + CONFIGS[: rnd % 3]  # the probes' order turns
        for j, config in enumerate(("none", "plain") if rnd % 2 == 0 else ("plain", "none")):
            full[config] = wave(running, config, clients, args.per_client, n + (1 + j) * per, tokens)
        probes = {c: wave(running, c, clients, args.per_client, n + (3 + j) * per, 1) for j, c in enumerate(order)}
        if rnd >= args.warmup:
            rounds.append({c: summarize(full[c], probes[c]) for c in CONFIGS})
            rounds[-1]["calls"] = sum(r.calls for r in full["required"])
    ratio = lambda m, b: statistics.median(r["required"][m] / r[b][m] for r in rounds)  # noqa: E731
    out = {"clients": clients, "requests": per * args.rounds, "rounds": rounds, "other_cores": other()}
    for m in ("decode_per_token", "lat_per_token", "ttft", "prompt_tokens"):
        out[m] = {c: statistics.median(r[c][m] for r in rounds) for c in CONFIGS}
        out[m] |= {"vs_plain": ratio(m, "plain"), "vs_none": ratio(m, "none")}
    out["tokens_mean"] = statistics.mean(r["required"]["tokens"] for r in rounds) / per
    out["calls"] = sum(r["calls"] for r in rounds)
    d = out["decode_per_token"]
    log(
        f"{clients} client(s): decode/token required/plain {d['vs_plain']:.3f}, required/none {d['vs_none']:.3f}; "
        f"other load {out['other_cores']:.2f} cores"
    )
    return out


def render(res: dict) -> str:
    rows = []
    for lv in res["levels"]:
        d, t = lv["decode_per_token"], lv["lat_per_token"]
        rows.append(
            [lv["clients"], f"{lv['requests']} ({lv['calls']} calls parsed)", _f(lv["tokens_mean"], 1)]
            + [_f(d[c] * 1e3, 1) for c in CONFIGS]
            + [f"{d['vs_plain']:.3f}", f"{d['vs_none']:.3f}", f"{t['vs_plain']:.3f}", _f(lv["other_cores"])]
            + [f"{_f(lv['ttft']['required'] * 1e3, 0)} / {_f(lv['ttft']['plain'] * 1e3, 0)}"]
            + [f"{lv['prompt_tokens']['required']:.0f} / {lv['prompt_tokens']['plain']:.0f}"]
            + ["PASS" if d["vs_plain"] <= GOAL else "FAIL"]
        )
    cols = "clients|required requests|tokens each|decode ms/token: required|none|plain"
    cols += "|required / plain|required / none|whole request per token: required / plain|other load"
    cols += "|TTFT ms: required / plain|prompt tokens: required / plain|goal <= 1.10"
    a = res["args"]
    head = f"{res['checkpoint']} ({res['dtype']}, {a['torch_threads']} torch thread(s)), {res['rounds']} rounds "
    head += f"after {res['warmup']} warm-up, each client {a['per_client']} request(s) per configuration and round"
    return "\n".join(["## Latest run", "", *run_lines(res), f"- {head}", "", table(cols, rows), ""])


def main(argv: list[str] | None = None) -> int:
    ap = parser("bench.tools", __doc__, model=False, noise=False)
    ap.add_argument("--model", dest="checkpoint", default="smollm2", help="smollm2, tiny, or a path")
    ap.add_argument("--levels", default="1,8", help="concurrent clients")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="rounds not counted (the schema's compile)")
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends per wave")
    ap.add_argument("--max-tokens", type=int, default=96, help="of the required requests")
    ap.add_argument("--torch-threads", type=int, default=1, help="the worker's (1: steadier on a shared machine)")
    ap.add_argument("--dtype", default="auto", help="auto: the machine's best (worker/engines/dtype.py)")
    args = ap.parse_args(argv)
    levels = _int_list(ap, args.levels)
    if args.dtype == "auto":
        from worker.engines import dtype as dtype_rule

        args.dtype = dtype_rule.resolve("auto", dtype_rule.cpu_flags())[0]
    model_dir, desc = checkpoint(args.checkpoint)

    def measure(procs: Processes, res: dict, outdir: Path) -> None:
        ns = SimpleNamespace(torch_threads=args.torch_threads, hf_env={}, hf_workers=1, api_workers=1)
        running = start_ours("hf", args.dtype, procs, model_dir, ns, outdir, "tools")
        try:
            for i, c in enumerate(levels):
                res["levels"].append(run_level(running, c, args, 100_000 * i))
        finally:
            running.stop()

    facts = {"checkpoint": desc, "dtype": args.dtype, "rounds": args.rounds, "warmup": args.warmup, "levels": []}
    res = run_bench("bench.tools", args, argv, measure, out_prefix="tools-", log=log, **facts)
    if res is None:
        return 130
    print(render(res).replace(str(Path.cwd()) + "/", ""), flush=True)
    log(f"raw results and logs in {res['outdir']}")
    return 0 if all(lv["requests"] for lv in res["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
