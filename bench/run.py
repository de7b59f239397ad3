"""`python -m bench.run` (`make bench`): genqueue end to end against its own ceilings, in one
run, written to docs/benchmarks.md, whose head describes the phases (in process, the API path,
the echo engine, the API's memory). Logs and results.json: bench/out/<timestamp>/.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import sys
from pathlib import Path

import psutil
import redis

from bench.common import (
    ROOT,
    CpuMeter,
    Processes,
    RedisTarget,
    Stack,
    int_list,
    intro,
    job_stats,
    log,
    main_with_render,
    marker,
    module_argv,
    parser,
    quietest,
    run_bench,
    run_lines,
    table,
    tree,
    verdict,
    verdict_lines,
)
from bench.common import fmt as _f
from bench.common import noise as _noise
from bench.load import measure_levels, spawn_load
from worker.engines import dtype as dtype_rule

DEFAULT_LEVELS = "1,2,5,10,32,64"
MAX_BATCH_SIZE = 64
MARKER = marker("bench.run")
INTRO = intro("Benchmarks", "bench.run")

# Targets from the issue.
TARGET_THROUGHPUT_LEVEL, TARGET_THROUGHPUT_RATIO = 32, 0.8
TARGET_LATENCY_RATIO = 1.15
TARGET_ECHO_JOBS_S = 500.0
TARGET_API_RSS_MB = 100.0


def memory(api_pid: int) -> list[dict]:
    rows = []
    for i, p in enumerate(tree(api_pid)):
        try:
            m = p.memory_full_info()
        except psutil.Error:
            continue
        pss = getattr(m, "pss", math.nan)
        rows.append(
            {"role": "worker" if i else "master", "pid": p.pid, "rss_mb": m.rss / 2**20, "uss_mb": m.uss / 2**20}
        )
        rows[-1]["pss_mb"] = pss / 2**20
    return rows


def phase_inproc(procs: Processes, model_dir: Path, args, outdir: Path) -> dict:
    out = outdir / "inproc.json"
    batches = ",".join(map(str, args.levels))
    flags = {"max_other_load": args.max_other_load, "quiet_wait": args.quiet_wait, "out": out}
    procs.run("inproc", module_argv("bench.inproc", model=model_dir, batches=batches, reps=args.reps, **flags))
    return json.loads(out.read_text())


def phase_api_hf(procs, redis_url, redis_pid, model_dir, args, levels) -> dict:
    st = Stack(procs, redis_url, model_dir, "hf", "hf")
    st.start_worker(**({"OMP_NUM_THREADS": str(args.worker_threads)} if args.worker_threads else {}))
    st.start_api(1)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    log(f"hf stack ready on port {st.port}; warming up")
    groups = {"api": st.api.pid, "worker": st.worker.pid, "redis": redis_pid}
    after = lambda res: {"jobs": job_stats(r, st.name, res["window_start"], res["window_end"])}  # noqa: E731
    rows = measure_levels("API", st.port, levels, args, groups, list(groups.values()), after=after)
    mem = memory(st.api.pid)
    st.stop()
    return {"levels": rows, "memory": mem, "api_workers": 1}


def api_server_desc() -> str:
    """How gunicorn runs the API, read from webapp/gunicorn_conf.py without importing it (it may
    monkey-patch this process)."""
    from tasks.config import Settings

    text = (ROOT / "webapp" / "gunicorn_conf.py").read_text()
    m = re.search(r"^worker_class\s*=\s*['\"](\w+)['\"]", text, re.M)
    s = Settings()
    fields = (("api_threads", "threads"), ("api_connections", "connections"))
    extra = [f"{getattr(s, f)} {label}" for f, label in fields if hasattr(s, f) and re.search(rf"_s\.{f}\b", text)]
    return (m.group(1) if m else "sync") + (", " + ", ".join(extra) + " per worker" if extra else "")


_attempts = itertools.count(1)


def phase_echo(procs, redis_url, redis_pid, model_dir, args, outdir) -> dict:
    """The echo engine through the API: several `python -m bench.load` processes, one shared window."""
    st = Stack(procs, redis_url, model_dir, "echo", "echo")
    st.start_worker()
    runs = []

    def once(api_workers: int) -> dict:
        meter = CpuMeter({"api": st.api.pid, "worker": st.worker.pid, "redis": redis_pid})
        tag = f"echo-{next(_attempts)}"
        run = spawn_load(procs, st.port, args.echo_clients, args.echo_procs, args.echo_duration, outdir, tag, meter)
        run["api_workers"] = api_workers
        log(
            f"echo GENQ_API_WORKERS={api_workers}: {run['rate']:.1f} jobs/s, p50 {run['p50'] * 1000:.1f} ms, client "
            f"{run['cpu']['client']:.2f} cores, other load {run['cpu']['other']:.2f} cores, errors {run['errors']}"
        )
        return run

    try:
        for api_workers in args.echo_api_workers:
            st.start_api(api_workers)
            log(f"echo stack with GENQ_API_WORKERS={api_workers} ready on port {st.port}")
            runs.append(quietest(lambda: once(api_workers), args, [st.api.pid, st.worker.pid, redis_pid]))
            runs[-1]["memory"] = memory(st.api.pid)
            st.stop_api()
    finally:
        st.stop()
    return {"runs": runs}


def targets(res: dict) -> list[tuple[str, str]]:
    """(PASS|FAIL|N/A, sentence) per target of the issue."""
    api = {r["clients"]: r for r in res["api"]["levels"]}
    gen = {r["batch"]: r for r in res["inproc"]["generate"]}
    out = []
    lv = TARGET_THROUGHPUT_LEVEL
    if lv in api and lv in gen:
        ratio = api[lv]["rate"] / gen[lv]["req_s"]
        what = (
            f"throughput at {lv} clients: {api[lv]['rate']:.2f} req/s = {ratio:.2f} x in-process "
            f"generate at batch {lv} ({gen[lv]['req_s']:.2f} req/s); target >= {TARGET_THROUGHPUT_RATIO} x"
        )
        out.append(verdict(ratio >= TARGET_THROUGHPUT_RATIO, what))
    else:
        out.append(("N/A", f"throughput at {lv} clients: level {lv} not measured (--levels)"))
    if 1 in api and 1 in gen:
        ratio = api[1]["p50"] / gen[1]["latency_s"]
        what = (
            f"latency at 1 client: p50 {api[1]['p50']:.3f} s = {ratio:.2f} x one in-process generate "
            f"at batch 1 ({gen[1]['latency_s']:.3f} s); target <= {TARGET_LATENCY_RATIO} x"
        )
        out.append(verdict(ratio <= TARGET_LATENCY_RATIO, what))
    else:
        out.append(("N/A", "latency at 1 client: level 1 not measured (--levels)"))
    echo = res["echo"]["runs"]
    if echo:
        best = max(echo, key=lambda r: r["rate"])
        what = (
            f"echo engine through the API: {best['rate']:.0f} jobs/s (best, GENQ_API_WORKERS="
            f"{best['api_workers']}, {best['clients']} clients); target >= {TARGET_ECHO_JOBS_S:.0f} jobs/s"
        )
        out.append(verdict(best["rate"] >= TARGET_ECHO_JOBS_S, what))
    mems = memories(res)
    workers = [(m["rss_mb"], when) for when, rows in mems for m in rows if m["role"] == "worker"]
    if workers:
        worst, when = max(workers)
        totals = ", ".join(f"{sum(m['rss_mb'] for m in rows):.0f} MB {when}" for when, rows in mems)
        what = (
            f"API memory: largest gunicorn worker {worst:.0f} MB resident ({when}); target <= "
            f"{TARGET_API_RSS_MB:.0f} MB per worker. Totals incl. master: {totals}"
        )
        out.append(verdict(worst <= TARGET_API_RSS_MB, what))
    return out


def memories(res: dict) -> list[tuple[str, list[dict]]]:
    """(when, the API's processes' memory) after the hf levels and after each echo run."""
    mems = [("after the hf levels, GENQ_API_WORKERS=1", res["api"]["memory"])]
    return mems + [(f"after echo, GENQ_API_WORKERS={r['api_workers']}", r["memory"]) for r in res["echo"]["runs"]]


def engine_dtype(res: dict) -> str:
    """What the page says of the HFEngine's and the worker's weights (GENQ_DTYPE)."""
    d = res.get("engine_dtype")
    if d is None:  # results.json of a run before it was recorded
        return "the HFEngine and the worker in GENQ_DTYPE's dtype (not recorded)"
    why = f", {d['why'].removeprefix('auto: ')}" if d["setting"] == "auto" else ""
    return f"the HFEngine and the worker in **{d['dtype']}** (GENQ_DTYPE={d['setting']}{why})"


def render(res: dict) -> str:
    m, inproc, api, echo, a = res["machine"], res["inproc"], res["api"], res["echo"], res["args"]
    gen = {r["batch"]: r for r in inproc["generate"]}
    eng = {r["batch"]: r for r in inproc["engine"]}
    L = [MARKER, "", "## Latest run", "", *run_lines(res)]
    L += [
        f"- Software: Python {m['python']}, torch {inproc['torch']} ({inproc['torch_threads']} threads), "
        f"transformers {inproc['transformers']}, Redis {res['redis_version']} ({res['redis_kind']})",
        f"- Checkpoint: `{res['model_dir']}` (random-weight {res.get('arch', 'opt')}, {res['params_m']:.1f}M "
        f"parameters, stored in float32); `model.generate` in float32, as the teaching server ran it; "
        f"{engine_dtype(res)}; one hf worker, GENQ_MAX_BATCH_SIZE={MAX_BATCH_SIZE}, API under gunicorn "
        f"({res['api_server']}); >= {a['duration']:g} s and >= {a['min_requests']} requests per client per "
        f"level; in-process: median of {a['reps']} runs; echo: {a['echo_duration']:g} s",
    ]
    L += verdict_lines("Targets", targets(res))
    L += ["", "## 1. API path: `POST /basic_generate` through the queue to the hf worker", ""]
    hdr = "clients|requests|req/s|p50 s|p90 s|p99 s|mean batch|queue wait s|in worker s|API cores|worker cores|errors"
    rows = []
    for r in api["levels"]:
        rows.append([r["clients"], f"{r['requests']}*" if r["capped"] else r["requests"], _f(r["rate"])])
        rows[-1] += [_f(r[k], 3) for k in ("p50", "p90", "p99")] + [_f(r["jobs"]["batch_size_mean"], 1)]
        rows[-1] += [_f(r["jobs"]["queued_s"], 3), _f(r["jobs"]["run_s"], 3), _f(r["cpu"].get("api"))]
        rows[-1] += [_f(r["cpu"].get("worker")), r["errors"], _noise(r)]
    L.append(table(hdr + "|other load", rows))
    L += ["", "## 2. In process (no queue, no HTTP) beside the API", ""]
    levels = {r["clients"]: r for r in api["levels"]}
    rows = []
    for b in sorted(gen):
        g, e, r = gen[b], eng.get(b, {}), levels.get(b, {})
        rows.append([b, _f(g["req_s"]), _f(e.get("req_s")), _f(r.get("rate")), _f(_per(r.get("rate"), g.get("req_s")))])
        rows[-1] += [_f(_per(r.get("rate"), e.get("req_s"))), _f(g["latency_s"], 3), _f(e.get("latency_s"), 3)]
        rows[-1].append(_f(g["other_load"]))
    hdr = "batch = clients|generate req/s|HFEngine req/s|API req/s|API / generate|API / HFEngine|generate s|HFEngine s"
    L.append(table(hdr + "|other load", rows))
    L += ["", "## 3. Echo engine through the API (no model)", ""]
    hdr = "GENQ_API_WORKERS|clients|jobs/s|p50 ms|p99 ms|API cores|worker cores|Redis cores|client cores|errors"
    rows = []
    for r in echo["runs"]:
        rows.append([r["api_workers"], r["clients"], _f(r["rate"], 1), _f(r["p50"] * 1000, 1), _f(r["p99"] * 1000, 1)])
        rows[-1] += [_f(r["cpu"].get(k)) for k in ("api", "worker", "redis", "client")] + [r["errors"], _noise(r)]
    L.append(table(hdr + "|other load", rows))
    L += ["", "## 4. API memory", ""]
    rows = []
    for when, ms in memories(res):
        largest = max((x["rss_mb"] for x in ms if x["role"] == "worker"), default=None)
        rows.append([when, _f(largest, 1), _f(sum(x["rss_mb"] for x in ms), 1), _f(sum(x["pss_mb"] for x in ms), 1)])
    L += [table("when|largest worker RSS MB|total RSS MB|total PSS MB", rows), ""]
    return "\n".join(L)


def _per(a, b) -> float | None:
    return a / b if a is not None and b else None


def parse_args(argv: list[str] | None):
    ap = parser("bench.run", __doc__, levels=DEFAULT_LEVELS, out="benchmarks.md", render=True, quiet_wait=True)
    ap.add_argument("--reps", type=int, default=3, help="timed in-process runs per batch size")
    ap.add_argument("--echo-duration", type=float, default=None, help="seconds of the echo run (15, or --duration)")
    ap.add_argument("--echo-clients", type=int, default=32)
    ap.add_argument("--echo-procs", type=int, default=4, help="load-generator processes for echo")
    ap.add_argument("--echo-api-workers", default="1,2", help="GENQ_API_WORKERS values to try with echo")
    ap.add_argument("--worker-threads", type=int, default=None, help="OMP_NUM_THREADS for the hf worker (torch's)")
    args = ap.parse_args(argv)
    args.levels = int_list(ap, args.levels)
    args.echo_api_workers = int_list(ap, args.echo_api_workers, "--echo-api-workers")
    if args.echo_duration is None:
        args.echo_duration = min(15.0, args.duration)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def measure(procs: Processes, res: dict, outdir: Path) -> None:
        model_dir = Path(res["model_dir_abs"])
        setting = os.environ.get("GENQ_DTYPE", "auto")
        dtype, why = dtype_rule.resolve(setting)
        res["engine_dtype"] = {"setting": setting, "dtype": dtype, "why": why}
        log(f"in-process phases (generate, HFEngine) at batch sizes {args.levels}")
        res["inproc"] = phase_inproc(procs, model_dir, args, outdir)
        db = RedisTarget(procs)
        res["redis_kind"], res["redis_version"] = db.kind, db.version
        log(f"API phase at levels {args.levels}, {args.duration:g} s each")
        res["api"] = phase_api_hf(procs, db.url, db.pid, model_dir, args, args.levels)
        log(f"echo phase: {args.echo_clients} clients, {args.echo_duration:g} s, APIs {args.echo_api_workers}")
        res["echo"] = phase_echo(procs, db.url, db.pid, model_dir, args, outdir)

    run = lambda: run_bench("bench.run", args, argv, measure, api_server=api_server_desc())  # noqa: E731
    return main_with_render(args, run, render, INTRO, MARKER)


if __name__ == "__main__":
    sys.exit(main())
