"""`python -m bench.observability`: what metrics and Celery task events cost, side by side in
one run, on the echo path (jobs/s through the API with no model) and, with `--hf`, on the hf
path at 32 clients (requests/s with the opt-125m-shaped checkpoint).

Each configuration has a stack of its own (worker and API), all of them up at once and idle but
for the one measured; they take turns, round after round (the order reversed every other
round), and each configuration's rate is compared with the baseline's of the same round (metrics
and events off): on a shared machine that cancels most of the drift between rounds. The median
of those paired ratios is the figure; CPU per job of the API, the worker and Redis is beside it.
Every measurement waits for a quiet machine and is repeated when other processes disturbed it
(bench.run's rules).

  off       GENQ_API_METRICS=false, no worker exporter, no task events (the baseline)
  metrics   GENQ_API_METRICS=true and every worker's exporter on (GENQ_METRICS_PORT)
  events    the baseline plus GENQ_CELERY_EVENTS=true (what Flower needs)
  nologs    the baseline without the job log lines (GENQ_LOG_LEVEL=WARNING); ask for it
  off-again the baseline once more (ask for it): the difference between two identical stacks

The job log lines are on in all of them but `nologs` (the default). Prints a Markdown table; the figures in
docs/benchmarks.md come from it. Logs and raw JSON go to bench/out/obs-<timestamp>/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.common import Processes, RedisTarget, Stack, log, median, model_dirs, parser, quietest, run_bench
from bench.load import closed_loop, measure_levels
from bench.run import echo_once
from scripts import stack

CONFIGS = {
    "off": {"GENQ_API_METRICS": "false"},
    "metrics": {"GENQ_API_METRICS": "true"},
    "events": {"GENQ_API_METRICS": "false", "GENQ_CELERY_EVENTS": "true"},
    # Not in the default run: the baseline without the job log lines (--configs off,nologs), and
    # the baseline again, as a control: its difference from `off` is the noise floor.
    "nologs": {"GENQ_API_METRICS": "false", "GENQ_LOG_LEVEL": "WARNING"},
    "off-again": {"GENQ_API_METRICS": "false"},
}


def start(procs, redis_url, model_dir, engine, config) -> Stack:
    st = Stack(procs, redis_url, model_dir, engine, f"{engine}-{config}", **CONFIGS[config])
    st.start_worker(**({"GENQ_METRICS_PORT": str(stack.free_port())} if config == "metrics" else {}))
    st.start_api(1)
    if engine == "hf":
        closed_loop("127.0.0.1", st.port, 8, 0, warmup=0, min_per_client=1)
    return st


def measure(procs, st: Stack, redis_pid, engine, args, outdir) -> dict:
    pids = [st.api.pid, st.worker.pid, redis_pid]
    if engine == "echo":
        return quietest(lambda: echo_once(procs, st, redis_pid, 1, args, outdir), args, pids)
    groups = {"api": st.api.pid, "worker": st.worker.pid, "redis": redis_pid}
    return measure_levels(f"hf {st.label}", st.port, [args.hf_clients], args, groups, pids, warm=False,
                          min_requests=2)[0]


def phase(procs, redis_url, redis_pid, model_dir, engine, configs, args, outdir) -> dict[str, list]:
    """All configurations' stacks up at once (idle but for the one measured), measured in turn,
    round after round, the order reversed every other round."""
    stacks = {c: start(procs, redis_url, model_dir, engine, c) for c in configs}
    out: dict[str, list] = {c: [] for c in configs}
    try:
        for r in range(args.rounds):
            for config in configs if r % 2 == 0 else reversed(configs):
                out[config].append(measure(procs, stacks[config], redis_pid, engine, args, outdir))
                log(f"round {r + 1} {engine} {config}: {out[config][-1]['rate']:.2f}/s")
    finally:
        for st in stacks.values():
            st.stop()
    return out


def cpu_ms(run: dict) -> float:
    """CPU of the API, the worker and Redis per job, in ms: what a configuration costs, much
    less disturbed by the rest of a shared machine than the rate is."""
    cpu = run["cpu"]
    return sum(cpu.get(k, 0.0) for k in ("api", "worker", "redis")) / run["rate"] * 1000 if run["rate"] else float("nan")


def table(results: dict, unit: str) -> str:
    base_cpu = median([cpu_ms(r) for r in results["off"]])
    rows = [f"| configuration | {unit} (median) | each round | vs off, same round (median, range) | CPU ms/job (API+worker+Redis) | vs off "
            "| p50 ms | other load (max) |",
            "|---|---:|---|---:|---:|---:|---:|---:|"]
    for config, runs in results.items():
        paired = sorted(r["rate"] / o["rate"] - 1 for r, o in zip(runs, results["off"]))
        rate, cpu = median([r["rate"] for r in runs]), median([cpu_ms(r) for r in runs])
        each = ", ".join(f"{r['rate']:.1f}" for r in runs)
        p50 = median([r["p50"] * 1000 for r in runs])
        other = max(r["cpu"].get("other", 0.0) for r in runs)
        rows.append(f"| {config} | {rate:.1f} | {each} | {median(paired):+.1%} ({paired[0]:+.0%} … {paired[-1]:+.0%}) | {cpu:.2f} | "
                    f"{cpu / base_cpu - 1:+.1%} | {p50:.1f} | {other:.2f} |")
    return "\n".join(rows)


def report(results: dict, args) -> str:
    out = [f"Command: `{results.get('command', 'python -m bench.observability')}`; {results.get('date', '?')}; "
           f"{results.get('machine', {}).get('nproc', '?')} CPUs", ""]
    if results["echo"].get("off"):
        out += [f"Echo path: {args.echo_clients} clients on POST /basic_generate, GENQ_API_WORKERS=1, "
                f"{args.echo_duration:g} s per measurement, {args.rounds} rounds", "", table(results["echo"], "jobs/s")]
    if results["hf"].get("off"):
        out += ["", f"hf path: {args.hf_clients} clients, {args.model} checkpoint, {args.duration:g} s per "
                f"measurement, {args.rounds} rounds", "", table(results["hf"], "req/s")]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = parser("bench.observability", __doc__, quiet_wait=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="off,metrics,events")
    ap.add_argument("--echo-duration", type=float, default=15.0)
    ap.add_argument("--echo-clients", type=int, default=32)
    ap.add_argument("--echo-procs", type=int, default=4)
    ap.add_argument("--hf", action="store_true", help="also the hf path (opt-125m-shaped checkpoint)")
    ap.add_argument("--no-echo", action="store_true", help="skip the echo path")
    ap.add_argument("--hf-clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per hf measurement")
    ap.add_argument("--report", type=Path, help="print the report of an earlier run's results.json, run nothing")
    args = ap.parse_args(argv)
    if args.report:
        res = json.loads(args.report.read_text())
        vars(args).update({k: v for k, v in res.get("args", {}).items() if k != "model" or v})  # the run's own
        print(report(res, args))
        return 0
    configs = [c for c in args.configs.split(",") if c]
    hf_model = args.model
    args.model = None  # run_bench builds no checkpoint: the tiny one for echo, --model for --hf

    def run(procs: Processes, res: dict, outdir: Path) -> None:
        from worker import devmodels

        res.update(echo={c: [] for c in configs}, hf={c: [] for c in configs})
        db = RedisTarget(procs, private=True)
        tiny = devmodels.ensure("tiny", model_dirs()["tiny"])
        if not args.no_echo:
            res["echo"] = phase(procs, db.url, db.pid, tiny, "echo", configs, args, outdir)
        if args.hf:
            model_dir = devmodels.ensure(hf_model, model_dirs()[hf_model])
            res["hf"] = phase(procs, db.url, db.pid, model_dir, "hf", configs, args, outdir)

    res = run_bench("bench.observability", args, argv, run, out_prefix="obs-")
    if res is None:
        return 130
    args.model = hf_model
    print("\n" + report(res, args))
    log(f"raw results in {res['outdir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
