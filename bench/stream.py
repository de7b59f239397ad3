"""`python -m bench.stream`: time to first token (TTFT) and inter-token latency (ITL) through
the whole stack, beside the in-process prefill TTFT cannot beat (bench.inproc --prefill-reps);
writes docs/benchmarks-streaming.md. Method: docs/benchmarks.md, "The harnesses". Quick run:
`python -m bench.stream --model tiny --levels 1,2 --duration 2 --no-write`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.common import (
    MAX_NEW_TOKENS,
    Processes,
    RedisTarget,
    Stack,
    int_list,
    intro,
    main_with_render,
    make_log,
    marker,
    median,
    module_argv,
    parser,
    run_bench,
    run_lines,
    table,
)
from bench.common import fmt as _f
from bench.common import ms as _ms
from bench.common import noise as _noise
from bench.load import completion_bodies, generate_bodies, measure_levels, sse_request, sse_stats

DEFAULT_LEVELS = "1,8,32"
MAX_BATCH_SIZE = 64
log = make_log("stream")
TARGET_TTFT_MARGIN_S = 0.050  # TTFT p50 at 1 stream <= in-process prefill + 50 ms
MARKER = marker("bench.stream")
INTRO = intro("Streaming latency", "bench.stream")
PARTS = ("api_submit", "queue", "worker_first", "deliver")  # where TTFT goes, in order


def ttft_parts(r, timing: list[tuple[str, float, float]]) -> dict:
    """Medians of where the time to first token went, from the stack's own records in Redis:
    POST sent -> job record created (API) -> marked running (queue, Celery) -> first token
    written to the job's stream (worker: engine admission, prefill, publisher) -> first token
    event read by the client (API: XREAD wake-up, SSE, HTTP; includes opening the stream)."""
    from tasks import keys

    if not timing:
        return {}
    pipe = r.pipeline(transaction=False)
    for job_id, *_ in timing:
        pipe.hmget(keys.job(job_id), "created", "started")
        pipe.xrange(keys.stream(job_id), count=1)
    replies = pipe.execute()
    parts: dict[str, list[float]] = {k: [] for k in PARTS}
    firsts: list[float] = []
    for (_, w_post, w_first), (created, started), first in zip(timing, replies[0::2], replies[1::2]):
        if not (created and started and first and w_first):
            continue
        created, started = float(created), float(started)
        xadd = int(first[0][0].split("-")[0]) / 1000.0  # the stream entry's id: when it was written
        for k, v in zip(PARTS, (created - w_post, started - created, xadd - started, w_first - xadd)):
            parts[k].append(v)
        firsts.append(xadd)
    # First tokens written within a few ms of one another came out of one admission (one
    # prefill of the newcomers, then one publisher write): count those groups.
    firsts.sort()
    groups = sum(1 for i, t in enumerate(firsts) if i == 0 or t - firsts[i - 1] > 0.005)
    return {k: median(v) for k, v in parts.items()} | {"n": len(parts["queue"]), "admissions": groups}


def parse_args(argv):
    ap = parser("bench.stream", __doc__, levels=DEFAULT_LEVELS, out="benchmarks-streaming.md", render=True)
    ap.add_argument(
        "--endpoint",
        choices=["jobs", "completions"],
        default="jobs",
        help="jobs: POST /v1/jobs + GET /v1/jobs/<id>/stream; completions: POST /v1/completions, stream: true",
    )
    ap.add_argument("--api-workers", type=int, default=1, help="GENQ_API_WORKERS")
    ap.add_argument("--prefill-reps", type=int, default=2, help="in-process prefill: passes over the 16 prompts")
    args = ap.parse_args(argv)
    args.levels = int_list(ap, args.levels)
    return args


def measure(args, procs: Processes, res: dict, outdir: Path) -> None:
    import redis

    log("in-process prefill (nothing else of the benchmark runs)")
    out = outdir / "inproc.json"
    procs.run(
        "inproc", module_argv("bench.inproc", model=res["model_dir_abs"], prefill_reps=args.prefill_reps, out=out)
    )
    res["inproc"] = ip = json.loads(out.read_text())
    log(
        f"prefill median {ip['prefill_median_s'] * 1000:.1f} ms, decode step at batch 1 "
        f"{ip['decode_step_median_s'] * 1000:.1f} ms, other load {ip['other_load']:.2f} cores"
    )
    db = RedisTarget(procs)
    res["redis_kind"], res["redis_version"] = db.kind, db.version
    st = Stack(procs, db.url, res["model_dir_abs"], "hf", "stream", MAX_BATCH_SIZE)
    st.start_worker()
    st.start_api(args.api_workers)
    log(f"stack ready on port {st.port}; warming up")
    r = redis.Redis.from_url(db.url, decode_responses=True)
    groups = {"api": st.api.pid, "worker": st.worker.pid, "redis": db.pid}
    bodies = generate_bodies() if args.endpoint == "jobs" else completion_bodies(st.name, stream=True)
    res["levels"] = measure_levels(
        "stream",
        st.port,
        args.levels,
        args,
        groups,
        bodies=bodies,
        request=sse_request(args.endpoint),
        summarize=sse_stats,
        log=log,
        after=lambda x: {"parts": ttft_parts(r, x.pop("_timing"))},
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = lambda: run_bench("bench.stream", args, argv, lambda *a: measure(args, *a), out_prefix="stream-", log=log)  # noqa: E731
    return main_with_render(args, run, render, INTRO, MARKER, log)


def target(res: dict) -> tuple[str, str]:
    ip = res["inproc"]
    one = next((r for r in res["levels"] if r["clients"] == 1), None)
    if one is None:
        return "N/A", "TTFT at 1 stream: level 1 not measured (--levels)"
    limit = ip["prefill_median_s"] + TARGET_TTFT_MARGIN_S
    ok = one["ttft_p50"] <= limit
    return (
        "PASS" if ok else "FAIL",
        f"TTFT at 1 stream: p50 {one['ttft_p50'] * 1000:.1f} ms; in-process prefill "
        f"{ip['prefill_median_s'] * 1000:.1f} ms + 50 ms = {limit * 1000:.1f} ms "
        f"({'within' if ok else 'over'} by {abs(limit - one['ttft_p50']) * 1000:.1f} ms)",
    )


def render(res: dict) -> str:
    m, ip, rows, a = res["machine"], res["inproc"], res["levels"], res["args"]
    endpoint = '`POST /v1/completions` with `"stream": true`'
    if a["endpoint"] == "jobs":
        endpoint = "`POST /v1/jobs`, then `GET /v1/jobs/<id>/stream` on the same connection"
    L = [MARKER, "", "## Latest run", "", *run_lines(res)]
    L += [
        f"- Software: Python {m['python']}, torch {ip['torch']} ({ip['torch_threads']} threads), transformers "
        f"{ip['transformers']}, Redis {res['redis_version']} ({res['redis_kind']})",
        f"- Checkpoint: `{res['model_dir']}` (random-weight {res.get('arch', 'opt')}, {res['params_m']:.1f}M "
        f"parameters); one hf worker, GENQ_MAX_BATCH_SIZE={MAX_BATCH_SIZE}, GENQ_API_WORKERS={a['api_workers']}",
        f"- Requests: {endpoint}, {MAX_NEW_TOKENS} tokens, greedy, `ignore_eos`; >= {a['duration']:g} s and "
        f">= {a['min_requests']} requests per client per level. TTFT: POST sent -> first token event; ITL: gaps "
        "between a request's token events, pooled",
    ]
    v, s = target(res)
    L += ["", "## Target", "", f"- **{v}** {s}; target: TTFT p50 at 1 stream <= in-process prefill + 50 ms"]
    L += ["", "## Streaming through the API", ""]
    hdr = "streams|requests|req/s|TTFT p50 ms|TTFT p90 ms|TTFT text p50 ms|ITL p50 ms|ITL p90 ms|ITL p99 ms|e2e p50 s"
    cells = []
    for r in rows:
        cells.append([r["clients"], f"{r['requests']}*" if r["capped"] else r["requests"], _f(r["rate"])])
        cells[-1] += [_ms(r[k]) for k in ("ttft_p50", "ttft_p90", "ttft_text_p50", "itl_p50", "itl_p90", "itl_p99")]
        cells[-1] += [_f(r["p50"], 3), r["errors"], _noise(r)]
    L.append(table(hdr + "|errors|other load", cells))
    L += ["", "## Where the time to first token goes", ""]
    parts = [(r, p) for r in rows if (p := r.get("parts") or {}).get("n")]
    prow = [[r["clients"], _ms(r["ttft_p50"])] + [_ms(p[k]) for k in PARTS] + [p["n"]] for r, p in parts]
    hdr = (
        "streams|TTFT p50 ms|POST -> job created|created -> running|running -> 1st token in Redis|Redis -> client|jobs"
    )
    L.append(table(hdr, prow) if prow else "(n/a: `--endpoint completions` does not expose job ids.)")
    L += ["", "## In-process reference (same checkpoint, transformers, no server)", ""]
    rows = [
        ["prefill of one prompt + argmax", _ms(ip["prefill_median_s"], 2), _ms(ip["prefill_p90_s"], 2)],
        ["decode step at batch 1 + argmax", _ms(ip["decode_step_median_s"], 2), _ms(ip["decode_step_p90_s"], 2)],
        ["tokenizing one prompt", _ms(ip["tokenize_median_s"], 2), ""],
    ]
    L += [table("what|median ms|p90 ms", rows), ""]
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
