"""`python -m bench.frontend`: what the front end (API + Celery worker + Redis) costs per request.

A private redis-server, one worker of the echo engine (no model: it answers at once), the API
under gunicorn (`--api-workers`, default 1), and closed-loop clients on `POST /v1/completions`
(`--clients`, default 32, from `--procs` `python -m bench.load` processes; `max_tokens`
`--tokens`, default 4) for `--duration` s. Reports jobs/s, the CPU ms per request of the API
processes, the worker, Redis and the load generator, and the Redis commands per request
(`INFO commandstats` before and after the window; all of Redis's clients: API, worker,
heartbeats). `--profile DIR`: py-spy (`--py-spy`, installed outside the project's env) records
the API's gunicorn worker(s) and the Celery worker during the window, as speedscope JSON and
a flat table of the top functions. `--floor`: beside genqueue's stack, under the same load
and in turn with it (`--runs` rounds), the textbook Flask + Celery app of bench/floor_app.py
(same gunicorn settings, a plain Celery worker, no genqueue code) and the same Flask app
answering by itself (no Celery, no Redis): what the frameworks cost, against which genqueue's
figure can be read. Prints one JSON object; writes no doc. Quick run:
`python -m bench.frontend --duration 3`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import types
import urllib.request
from pathlib import Path

import psutil
import redis

from bench.common import RedisTarget, Stack, log, parser, per_request_ms, quietest, run_bench
from bench.load import spawn_load
from bench.scaling import Window


def _profilers(py_spy: str, pids: dict[str, list[int]], outdir: Path, duration: float) -> list:
    out = []
    for name, group in pids.items():
        for pid in group:
            for fmt, ext in (("speedscope", "json"), ("raw", "txt")):
                path = outdir / f"{name}-{pid}.{ext}"
                argv = [py_spy, "record", "--pid", str(pid), "--duration", str(int(duration)), "--rate", "200",
                        "--format", fmt, "--output", str(path), "--nonblocking", "--threads", "--gil"]
                if fmt == "raw":
                    argv.remove("--threads")
                out.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return out


def top_functions(raw: Path, n: int = 25) -> list[tuple[str, float, float]]:
    """From py-spy's raw (collapsed stacks) output: (function, self %, total %) of the n
    functions with the most total samples."""
    total: dict[str, int] = {}
    own: dict[str, int] = {}
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        c = int(count)
        samples += c
        frames = stack.split(";")
        for f in set(frames):
            total[f] = total.get(f, 0) + c
        own[frames[-1]] = own.get(frames[-1], 0) + c
    rows = sorted(total, key=total.get, reverse=True)[:n]
    return [(f, 100 * own.get(f, 0) / samples, 100 * total[f] / samples) for f in rows] if samples else []


def once(procs, st: Stack, db: RedisTarget, r: redis.Redis, args, outdir: Path, tag: str) -> dict:
    api_children = [c.pid for c in psutil.Process(st.api.pid).children(recursive=True)]
    worker_pid = st.worker.pid if st.worker is not None else None
    w = Window(r, {"api": st.api.pid, "worker": worker_pid, "redis": db.pid})
    profs: list = []

    def on_window(event: str) -> None:
        if event == "start" and args.profile:
            profs.extend(_profilers(args.py_spy, {"api": api_children, "worker": [worker_pid] if worker_pid else []},
                                    args.profile, args.duration))
        w(event)

    res = spawn_load(procs, st.port, args.clients, args.procs, args.duration, outdir, tag, on_window=on_window,
                     max_new_tokens=args.tokens, completions_model=st.name)
    for p in profs:
        p.wait(timeout=60)
    cpu = res["cpu"] = dict(w.meter.result)
    cpu["client"] = res.pop("client_cpu")
    cpu["other"] = max(0.0, cpu.get("other", 0.0) - cpu["client"])
    if worker_pid is None:
        cpu["worker"] = 0.0  # the HTTP floor: no worker at all
    n = res["requests"]
    res["cpu_ms_per_request"] = {k: per_request_ms(res, k) for k in ("api", "worker", "redis", "client")}
    res["cpu_ms_per_request"]["front_end"] = sum(res["cpu_ms_per_request"][k] for k in ("api", "worker", "redis"))
    res["redis_commands_per_request"] = sum(w.calls.values()) / n if n else float("nan")
    res["redis_calls"] = {k: round(v / n, 2) for k, v in sorted(w.calls.items(), key=lambda kv: -kv[1])} if n else {}
    res["redis_exec_ms_per_request"] = w.usec / 1000 / n if n else float("nan")
    c = res["cpu_ms_per_request"]
    log(f"{res['rate']:.0f} jobs/s, p50 {res['p50'] * 1000:.1f} ms; CPU ms/request: API {c['api']:.2f} worker "
        f"{c['worker']:.2f} Redis {c['redis']:.2f} (front end {c['front_end']:.2f}) client {c['client']:.2f}; "
        f"{res['redis_commands_per_request']:.1f} Redis commands/request; other load {cpu['other']:.2f} cores; "
        f"errors {res['errors']}")
    if res["errors"]:
        log(f"  first error: {res['error_sample']}")
    return res


def start_floor(procs, redis_url: str, http_only: bool = False):
    """bench/floor_app.py's API (genqueue's gunicorn settings) and a plain Celery worker on
    `redis_url`; returns an object with what `once` reads of a Stack (api, worker, port, name).
    `http_only`: the app answers in the route itself, no Celery and no worker."""
    from scripts import stack

    port = stack.free_port()
    env = {"REDIS_URL": redis_url, "GENQ_PORT": str(port)}
    worker = None
    if http_only:
        env["FLOOR_HTTP_ONLY"] = "1"
    else:
        worker = procs.start("floor-worker", [sys.executable, "-m", "celery", "-A", "bench.floor_app:celery",
                                              "worker", "-P", "threads", "-c", "32", "--without-heartbeat",
                                              "--without-mingle", "--without-gossip", "-l", "warning"], env)
    api = procs.start(f"floor-api{'-http' if http_only else ''}",
                      [stack.api_argv()[0], "--config", "python:bench.floor_gunicorn", "bench.floor_app:app"], env)
    body = json.dumps({"model": "floor", "prompt": "one two three", "max_tokens": 2}).encode()

    def answers() -> bool:
        try:
            rq = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                        {"Content-Type": "application/json"})
            with urllib.request.urlopen(rq, timeout=5) as resp:
                return b'"choices"' in resp.read()
        except OSError:
            return False

    stack.wait_until(answers, 60, "the floor app", [p for p in (api, worker) if p])
    return types.SimpleNamespace(api=api, worker=worker, port=port, name="floor")


def main(argv: list[str] | None = None) -> int:
    ap = parser("bench.frontend", __doc__, model=False)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--procs", type=int, default=4, help="load-generator processes (default 4)")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=4, help="max_tokens per request (default 4)")
    ap.add_argument("--api-workers", type=int, default=1)
    ap.add_argument("--runs", type=int, default=1, help="measurements, each reported (default 1)")
    ap.add_argument("--profile", type=Path, default=None, help="record py-spy profiles into this folder")
    ap.add_argument("--py-spy", default=os.environ.get("PY_SPY", "py-spy"))
    ap.add_argument("--floor", action="store_true",
                    help="also measure bench/floor_app.py (plain Flask + Celery, and Flask alone) in turn "
                    "with genqueue")
    args = ap.parse_args(argv)
    args.max_other_load = max(args.max_other_load, 100.0) if args.retries == 0 else args.max_other_load
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)

    def measure(procs, res: dict, outdir: Path) -> None:
        db = RedisTarget(procs, private=True)
        res["redis_version"] = db.version
        r = redis.Redis.from_url(db.url, decode_responses=True)
        st = Stack(procs, db.url, "echo", "echo", "front")
        st.start_worker()
        st.start_api(args.api_workers)
        sides = [("genqueue", st, res.setdefault("runs", []))]
        if args.floor:
            sides += [("floor (plain Flask + Celery)", start_floor(procs, db.url), res.setdefault("floor_runs", [])),
                      ("HTTP floor (Flask alone)", start_floor(procs, db.url, http_only=True),
                       res.setdefault("http_floor_runs", []))]
        for i in range(args.runs):
            for k, (name, side, runs) in enumerate(sides):
                log(f"{name}, run {i + 1}:")
                pids = [side.api.pid, side.worker.pid if side.worker else None, db.pid]
                runs.append(quietest(lambda: once(procs, side, db, r, args, outdir, f"side{k}-{i}"), args, pids))
        st.stop()
        if args.floor:
            res["median_cpu_ms_per_request"] = {
                name: {k: statistics.median(x["cpu_ms_per_request"][k] for x in runs)
                       for k in ("api", "worker", "redis", "front_end")}
                for name, _, runs in sides
            }
            for name, m in res["median_cpu_ms_per_request"].items():
                log(f"median CPU ms/request, {name}: API {m['api']:.2f} worker {m['worker']:.2f} "
                    f"Redis {m['redis']:.2f} front end {m['front_end']:.2f}")

    res = run_bench("bench.frontend", args, argv, measure, loadavg_start=os.getloadavg())
    if res is None:
        return 130
    if args.profile:
        res["profile"] = {p.name: top_functions(p) for p in sorted(args.profile.glob("*.txt"))}
        for name, rows in res["profile"].items():
            print(f"\n== {name}: top functions (self %, total %)", file=sys.stderr)
            for f, s, t in rows:
                print(f"{s:6.1f} {t:6.1f}  {f}", file=sys.stderr)
    print(json.dumps({k: v for k, v in res.items() if k != "profile"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
