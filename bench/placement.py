"""`python -m bench.placement`: cache-aware placement across workers (issue 29, part 3): two hf
workers whose prefix caches hold fewer tenants' system prompts than there are, run once with
`GENQ_PLACEMENT=false` and once with `true`; writes docs/benchmarks-placement.md. Method:
docs/benchmarks.md, "The harnesses". Quick check: `python -m bench.placement --model tiny
--system-tokens 150 --requests 4 --no-write`.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from bench.common import (
    Processes,
    intro,
    make_log,
    marker,
    mean,
    parser,
    pcts,
    publish,
    run_bench,
    run_lines,
    table,
)
from bench.common import fmt as _f
from bench.load import Loop
from bench.prefix import Sizer, chat_body, chat_stream, checkpoint, questions, system_prompt
from bench.vllm import start_ours

log = make_log("placement")
MARKER = marker("bench.placement")
INTRO = intro("Cache-aware placement across workers", "bench.placement")


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
    heads = cfg.get("num_attention_heads") or cfg.get("n_head")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") or cfg.get("n_embd")) // heads
    return layers * 2 * kv_heads * head_dim * (4 if dtype == "float32" else 2)


def run_mode(placement: bool, procs: Processes, model_dir: Path, args, outdir: Path, systems: list[str]) -> dict:
    env = {
        "GENQ_PLACEMENT": str(placement).lower(),
        "GENQ_PREFIX_CACHE_GIB": f"{args.cache_gib:.4f}",
        "GENQ_PLACEMENT_MIN_CHARS": str(args.min_chars),
        "GENQ_TORCH_THREADS": "1",  # two workers on the machine's cores
    }
    ns = SimpleNamespace(torch_threads=1, hf_env=env, hf_workers=2, api_workers=1)
    label = f"hf-placement-{'on' if placement else 'off'}"
    running = start_ours("hf", args.dtype, procs, model_dir, ns, outdir, label)
    asks = questions()
    rngs = [random.Random(1000 + i) for i in range(args.clients)]  # the same draws in both runs

    def body(i: int, k: int) -> bytes:
        tenant = rngs[i].randrange(len(systems))
        messages = [{"role": "system", "content": systems[tenant]}, {"role": "user", "content": rngs[i].choice(asks)}]
        return chat_body(running.model, messages, args.new_tokens, True)

    try:
        t0 = time.perf_counter()
        loop = Loop(running.port, args.clients, body, chat_stream(args.new_tokens), "placement", args.requests)
        loop.start().join(3600)
        wall = time.perf_counter() - t0
    finally:
        running.stop()
    records = loop.records
    ok = [r for r in records if r.ok]
    prompt = sum(r.usage["prompt_tokens"] for r in ok)
    cached = sum(r.cached or 0 for r in ok)
    found = [r for r in ok if (r.cached or 0) >= args.system_tokens_actual - 2 * 16]
    out = {
        "placement": placement,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_sample": next((r.error for r in records if not r.ok), ""),
        "wall_s": wall,
        "rate": len(ok) / wall,
        "hit_rate": cached / prompt if prompt else 0.0,
        "system_found": len(found) / len(ok) if ok else 0.0,
        **pcts([r.ttft for r in ok], "ttft_", (50, 90)),
        "prompt_tokens": mean(r.usage["prompt_tokens"] for r in ok),
    }
    log(
        f"placement {'on' if placement else 'off'}: hit rate {out['hit_rate']:.1%}, system prompt found "
        f"{out['system_found']:.0%}, {out['rate']:.2f} req/s, TTFT p50 {_f(out['ttft_p50'], 3)} s, "
        f"errors {out['errors']}"
    )
    return out


def render(res: dict) -> str:
    rows = []
    for r in res["runs"]:
        rows.append(["on" if r["placement"] else "off", f"{r['hit_rate']:.1%}", f"{r['system_found']:.0%}"])
        rows[-1] += [f"{r['rate']:.2f}", _f(r["ttft_p50"], 3), _f(r["ttft_p90"], 3)]
        rows[-1].append(f"{r['requests']} ({r['errors']} errors)")
    head = (
        f"{res['checkpoint']}; {res['tenants']} tenants, system prompts of {res['system_tokens']} tokens; "
        f"{res['clients']} clients x {res['requests_per_client']} requests; 2 hf workers "
        f"({res['dtype']}, 1 torch thread each), prefix cache {res['cache_gib']:.3f} GiB each "
        f"(about {res['cache_tenants']} system prompts)"
    )
    cols = "placement|hit rate (tokens)|system prompt found|req/s|TTFT p50 s|TTFT p90 s|requests"
    return "\n".join([MARKER, "", "## Latest run", "", *run_lines(res), f"- {head}", "", table(cols, rows), ""])


def parse_args(argv):
    ap = parser("bench.placement", __doc__, out="benchmarks-placement.md", model=False, noise=False)
    ap.add_argument("--model", dest="checkpoint", default="smollm2", help="smollm2, tiny, or a path")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--cache-tenants", type=float, default=5, help="system prompts one worker's cache holds")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=12, help="per client")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="auto", help="auto: the machine's best (worker/engines/dtype.py)")
    ap.add_argument("--min-chars", type=int, default=1024)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dtype == "auto":
        from worker.engines import dtype as dtype_rule

        args.dtype = dtype_rule.resolve("auto", dtype_rule.cpu_flags())[0]
    model_dir, desc = checkpoint(args.checkpoint)
    sizer = Sizer(model_dir)
    systems = [system_prompt(sizer, args.system_tokens, seed=100 + t) for t in range(args.tenants)]
    args.system_tokens_actual = min(sizer.count(s) for s in systems)
    per_token = kv_bytes_per_token(model_dir, args.dtype)
    args.cache_gib = args.cache_tenants * (args.system_tokens_actual + 64) * per_token / (1 << 30)

    def measure(procs: Processes, res: dict, outdir: Path) -> None:
        for placement in (False, True):
            res["runs"].append(run_mode(placement, procs, model_dir, args, outdir, systems))

    facts = {"checkpoint": desc, "tenants": args.tenants, "system_tokens": args.system_tokens_actual}
    facts |= {"clients": args.clients, "requests_per_client": args.requests, "dtype": args.dtype}
    facts |= {"cache_gib": args.cache_gib, "cache_tenants": args.cache_tenants, "runs": []}
    res = run_bench("bench.placement", args, argv, measure, out_prefix="placement-", log=log, **facts)
    if publish(res, args, render, INTRO, MARKER, log):
        return 130
    return 1 if any(r["errors"] or not r["requests"] for r in res["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
