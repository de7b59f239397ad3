"""`python -m bench.scaling`: the queue and control plane with 1-16 workers of the sim engine (no
model: each decode step a sleep, like a worker whose GPU is on another host) under 1 and 2 API
processes; writes docs/scaling.md, whose head says what it measures. Quick run: `python -m
bench.scaling --workers 1,2 --api-workers 1 --duration 2 --no-write`.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import redis

from bench.common import (
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
    parser,
    quietest,
    run_bench,
    run_lines,
    table,
)
from bench.common import fmt as _f
from bench.common import noise as _noise
from bench.load import spawn_load

MARKER = marker("bench.scaling")
PARTS = ("api", "workers", "redis")  # the processes whose CPU per job the projection takes
INTRO = intro("Scaling out: the queue and control plane with many workers", "bench.scaling")
_attempts = itertools.count()


def commandstats(r: redis.Redis) -> dict[str, tuple[int, int]]:
    """Calls and microseconds of execution per command since Redis started."""
    return {k.removeprefix("cmdstat_"): (v["calls"], v["usec"]) for k, v in r.info("commandstats").items()}


class Window(CpuMeter):
    """A CpuMeter that also counts Redis's commands over the load window."""

    def __init__(self, r: redis.Redis, groups: dict):
        super().__init__(groups)
        self.r, self.calls, self.usec = r, {}, 0

    def __call__(self, event: str) -> None:
        if event == "start":
            self.c0 = commandstats(self.r)
        super().__call__(event)
        if event == "end":
            c1 = commandstats(self.r)
            d = {k: (n - self.c0.get(k, (0, 0))[0], us - self.c0.get(k, (0, 0))[1]) for k, (n, us) in c1.items()}
            self.calls = {k: n for k, (n, _) in d.items() if n > 0}
            self.usec = sum(us for _, us in d.values())


def point(st: Stack, db: RedisTarget, r: redis.Redis, n: int, api_workers: int, args, outdir: Path) -> dict:
    clients = min(args.max_clients, args.clients_per_worker * n)
    w = Window(r, {"api": st.api.pid, "workers": [p.pid for p in st.workers], "redis": db.pid})
    tag = f"w{n}-a{api_workers}-{next(_attempts)}"
    res = spawn_load(
        st.procs, st.port, clients, args.load_procs, args.duration, outdir, tag, w, max_new_tokens=args.tokens
    )
    cpu = res["cpu"]
    res["jobs"] = job_stats(r, st.name, res["window_start"], res["window_end"])
    done = res["jobs"]["jobs"] or res["requests"]
    res.update(workers=n, api_workers=api_workers, calls=w.calls)
    res["commands_per_job"] = sum(w.calls.values()) / done if done else float("nan")
    res["redis_exec_ms_per_job"] = w.usec / 1000 / done if done else float("nan")
    log(
        f"{n:2d} workers, {api_workers} API: {res['rate']:.1f} jobs/s, queue p50 "
        f"{res['jobs']['queued_p50_s'] * 1000:.1f} ms, {res['commands_per_job']:.1f} Redis commands/job, cores: API "
        f"{cpu.get('api', 0):.2f} workers {cpu.get('workers', 0):.2f} Redis {cpu.get('redis', 0):.2f} client "
        f"{cpu['client']:.2f} other {cpu['other']:.2f}, errors {res['errors']}"
    )
    if res["errors"]:
        log(f"  first error: {res['error_sample']}")
    return res


def measure(args, procs: Processes, res: dict, outdir: Path) -> None:
    db = RedisTarget(procs, private=True)
    res["redis_version"] = db.version
    r = redis.Redis.from_url(db.url, decode_responses=True)
    st = Stack(procs, db.url, "sim", "sim", "scale", args.batch, GENQ_SIM_STEP_MS=args.step_ms)
    rows = []
    for n in args.workers:
        while len(st.workers) < n:
            st.start_worker()
        for api_workers in args.api_workers:
            st.start_api(api_workers, ready_workers=n, what=f"{n} ready workers")
            pids = [st.api.pid, *(p.pid for p in st.workers), db.pid]
            rows.append(quietest(lambda: point(st, db, r, n, api_workers, args, outdir), args, pids, log))
            st.stop_api()
    res["points"] = rows


def step_s(spec: str, batch: float) -> float:
    from worker.engines.sim import step_ms

    a, b = step_ms(spec)
    return (a + b * batch) / 1000


def ideal(res: dict, n: int) -> float:
    """Jobs/s that n sim workers, each kept full, would finish with no control-plane cost."""
    a = res["args"]
    return n * a["batch"] / (a["tokens"] * step_s(a["step_ms"], a["batch"]))


def saturated(r: dict, nproc: int) -> str:
    """Which resource ran closest to its ceiling: Redis (one core), the API (one core per
    process), the machine (every core busy)."""
    cpu = r["cpu"]
    busy = sum(cpu.get(k, 0.0) for k in ("api", "workers", "redis", "client", "other"))
    shares = {
        "Redis": cpu.get("redis", 0.0) / 1.0,
        "API": cpu.get("api", 0.0) / r["api_workers"],
        "machine": busy / nproc,
    }
    name = max(shares, key=shares.get)
    return f"{name} ({shares[name]:.0%})"


def render(res: dict) -> str:
    a, m, pts = res["args"], res["machine"], res["points"]
    L = [MARKER, "", "## Latest run", "", *run_lines(res)]
    L.append(
        f"- Redis {res['redis_version']} (private); workers `GENQ_ENGINE=sim GENQ_SIM_STEP_MS={a['step_ms']} "
        f"GENQ_MAX_BATCH_SIZE={a['batch']}` (a step of {step_s(a['step_ms'], a['batch']) * 1000:.1f} ms at batch "
        f"{a['batch']}); `POST /basic_generate`, `max_new_tokens: {a['tokens']}`, {a['clients_per_worker']} "
        f"clients per worker (at most {a['max_clients']}) from {a['load_procs']} `bench.load` processes, "
        f"{a['duration']:g} s per point"
    )
    L += ["", "## Jobs/s, queue time and Redis commands", ""]
    hdr = "workers|API procs|clients|jobs/s|ideal jobs/s|p50 ms|queue p50 ms|Redis cmds/job|API cores|workers cores"
    rows = []
    for r in pts:
        rows.append([r["workers"], r["api_workers"], r["clients"], _f(r["rate"], 1), _f(ideal(res, r["workers"]), 0)])
        rows[-1] += [_f(r["p50"] * 1000, 1), _f(r["jobs"]["queued_p50_s"] * 1000, 1), _f(r["commands_per_job"], 1)]
        rows[-1] += [_f(r["cpu"].get(k)) for k in ("api", "workers", "redis", "client")]
        rows[-1] += [_noise(r), saturated(r, m["nproc"]), r["errors"]]
    L.append(table(hdr + "|Redis cores|client cores|other load|closest to its ceiling|errors", rows))
    if pts:
        best = max(pts, key=lambda r: r["rate"])
        per = {k: best["cpu"].get(k, 0.0) / best["rate"] * 1000 if best["rate"] else float("nan") for k in PARTS}
        at = f"{best['workers']} workers, {best['api_workers']} API processes, {best['rate']:.0f} jobs/s"
        L += ["", f"## Projection from the best point ({at})"]
        # A short run on a loaded machine can read no Redis CPU at all (psutil's resolution).
        cap = 1000 / per["redis"] if per["redis"] > 0 else float("inf")
        L.append("")
        L.append(
            f"CPU per job: API {per['api']:.2f} ms, workers {per['workers']:.2f} ms, Redis {per['redis']:.2f} ms "
            f"({best['commands_per_job']:.0f} commands). One Redis (one thread) carries about **{cap:.0f} "
            f"jobs/s**; the API scales out; the workers with their GPUs. With each GPU worker at J jobs/s:"
        )
        hdr = (
            "J: jobs/s per GPU worker|GPU workers one Redis carries|at 70 %|CPU cores per worker host on the queue path"
        )
        rows = [
            [j, f"{cap / j:.0f}", f"{0.7 * cap / j:.0f}", f"{j * per['workers'] / 1000:.2f}"] for j in (5, 20, 50, 100)
        ]
        L += ["", table(hdr, rows)]
    L.append("")
    return "\n".join(L)


def parse_args(argv):
    ap = parser("bench.scaling", __doc__, out="scaling.md", render=True, model=False)
    ap.add_argument("--workers", default="1,2,4,8,16", help="sim worker counts")
    ap.add_argument("--api-workers", default="1,2", help="GENQ_API_WORKERS values")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per point")
    ap.add_argument("--step-ms", default="20+1", help="GENQ_SIM_STEP_MS of the workers")
    ap.add_argument("--batch", type=int, default=8, help="GENQ_MAX_BATCH_SIZE of each worker")
    ap.add_argument("--tokens", type=int, default=16, help="max_new_tokens of each job")
    ap.add_argument("--clients-per-worker", type=int, default=8)
    ap.add_argument("--max-clients", type=int, default=128)
    ap.add_argument("--load-procs", type=int, default=4, help="load-generator processes")
    args = ap.parse_args(argv)
    args.workers = int_list(ap, args.workers, "--workers")
    args.api_workers = int_list(ap, args.api_workers, "--api-workers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = lambda: run_bench("bench.scaling", args, argv, lambda *a: measure(args, *a), out_prefix="scaling-")  # noqa: E731
    return main_with_render(args, run, render, INTRO, MARKER)


if __name__ == "__main__":
    sys.exit(main())
