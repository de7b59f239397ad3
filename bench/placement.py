"""`python -m bench.placement`: cache-aware placement across workers (issue 29, part 3).

Two hf workers of one model behind the API, `--tenants` tenants each with a system prompt of
its own (`--system-tokens`, an agent's rules and tools, like bench.prefix's load a), and
`--clients` closed-loop clients, each sending `--requests` streamed chat requests in a row
(greedy, `--new-tokens` tokens), every request from a tenant drawn at random (the same
sequence for both runs) with a short question. Each worker's prefix cache holds about
`--cache-tenants` of the system prompts (`GENQ_PREFIX_CACHE_GIB` set from the prompt's size and
the dtype), fewer than the tenants: without placement each worker sees every tenant and its
cache churns; with it, each tenant's jobs go where its prompt is cached. Run once with
`GENQ_PLACEMENT=false`, then with `true`, one after the other on one machine: the hit rate
(`usage.prompt_tokens_details.cached_tokens` over `prompt_tokens`, summed), the share of
requests that found their system prompt cached, req/s and TTFT.

Quick check: `python -m bench.placement --model tiny --system-tokens 150 --requests 4 --no-write`.
Results: bench/out/placement-<timestamp>/results.json; the table is printed, and written to
docs/benchmarks-placement.md (`--out`) unless `--no-write`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from bench.common import ROOT, Processes, machine_facts, make_log, mean, percentile, table
from bench.common import fmt as _f
from bench.prefix import Conn, Sizer, chat_body, chat_stream, checkpoint, questions, system_prompt
from bench.vllm import start_ours

log = make_log("placement")
DOC = ROOT / "docs" / "benchmarks-placement.md"


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
    records: list = []
    lock = threading.Lock()
    hook = chat_stream(args.new_tokens)

    def client(i: int) -> None:
        rng = random.Random(1000 + i)
        conn = Conn(running.port)
        try:
            for _ in range(args.requests):
                t = rng.randrange(len(systems))
                messages = [{"role": "system", "content": systems[t]}, {"role": "user", "content": rng.choice(asks)}]
                rq = SimpleNamespace(tenant=t, ok=False, error="")
                try:
                    hook(conn, chat_body(running.model, messages, args.new_tokens, True), rq)
                    rq.ok = True
                except Exception as exc:  # counted
                    rq.error = repr(exc)[:300]
                    conn.close()
                with lock:
                    records.append(rq)
        finally:
            conn.close()

    try:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(3600)
        wall = time.perf_counter() - t0
    finally:
        running.stop()
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
        "ttft_p50": percentile([r.ttft for r in ok], 50),
        "ttft_p90": percentile([r.ttft for r in ok], 90),
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
        rows.append(
            [
                "on" if r["placement"] else "off",
                f"{r['hit_rate']:.1%}",
                f"{r['system_found']:.0%}",
                f"{r['rate']:.2f}",
                _f(r["ttft_p50"], 3),
                _f(r["ttft_p90"], 3),
                f"{r['requests']} ({r['errors']} errors)",
            ]
        )
    m = res["machine"]
    head = (
        f"{res['checkpoint']}; {res['tenants']} tenants, system prompts of {res['system_tokens']} tokens; "
        f"{res['clients']} clients x {res['requests_per_client']} requests; 2 hf workers "
        f"({res['dtype']}, 1 torch thread each), prefix cache {res['cache_gib']:.3f} GiB each "
        f"(about {res['cache_tenants']} system prompts); {m.get('cpu_model', '?')}, {m.get('nproc', '?')} cores."
    )
    cols = ["placement", "hit rate (tokens)", "system prompt found", "req/s", "TTFT p50 s", "TTFT p90 s", "requests"]
    return head + "\n\n" + table(cols, rows) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.placement", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", dest="checkpoint", default="smollm2", help="smollm2 (default), tiny, or a path")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--cache-tenants", type=float, default=5, help="system prompts one worker's cache holds")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=12, help="per client")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--dtype", default="auto", help="auto: the machine's best (worker/engines/dtype.py)")
    p.add_argument("--min-chars", type=int, default=1024)
    p.add_argument("--out", type=Path, default=DOC, help="the page to write")
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


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
    outdir = ROOT / "bench" / "out" / f"placement-{time.strftime('%Y%m%d-%H%M%S')}"
    outdir.mkdir(parents=True, exist_ok=True)
    res = {
        "command": "python -m bench.placement " + " ".join(argv if argv is not None else sys.argv[1:]),
        "checkpoint": desc,
        "machine": machine_facts(),
        "tenants": args.tenants,
        "system_tokens": args.system_tokens_actual,
        "clients": args.clients,
        "requests_per_client": args.requests,
        "dtype": args.dtype,
        "cache_gib": args.cache_gib,
        "cache_tenants": args.cache_tenants,
        "runs": [],
    }
    procs = Processes(outdir, log)
    try:
        for placement in (False, True):
            res["runs"].append(run_mode(placement, procs, model_dir, args, outdir, systems))
    finally:
        procs.close()
    (outdir / "results.json").write_text(json.dumps(res, indent=1, default=str))
    log(f"raw results and logs in {outdir.relative_to(ROOT)}")
    page = render(res)
    print(page)
    if not args.no_write:
        args.out.write_text(
            "# Cache-aware placement across workers\n\nGenerated by `"
            + res["command"].strip()
            + "` (bench/placement.py says what it measures).\n\n"
            + page
        )
    bad = [r for r in res["runs"] if r["errors"] or not r["requests"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
