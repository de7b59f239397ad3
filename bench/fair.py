"""`python -m bench.fair`: a calm key's latency while another key floods the queue (issues 34
and 45). For each mode (fair share on, off) it starts a stack of its own (a private Redis, the
API with two keys, one hf worker on the tiny model or, with `--model smollm2`, the real
SmolLM2), measures the calm key's job latency idle (one job at a time) and a flood job's alone,
then submits a flood of long jobs from the other key and, while the flood is worked on, the
calm key's short jobs at a steady pace; latency is the job's `total_s` (created to finished).
The flood's throughput (its jobs finished a second) is compared between a window before the
calm jobs and the window they take. The flood is not waited for: the stack stops after the
calm jobs. Prints a Markdown table and writes bench/out/fair.json; docs/benchmarks.md, "Fair
share between keys", has the commands and the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from scripts import devmodels
from scripts import stack as stackmod

FLOOD_KEY, CALM_KEY = "sk-bench-flood-000000", "sk-bench-calm-0000000"
OUT = stackmod.ROOT / "bench" / "out"


class Stack:
    def __init__(self, fair: bool, args, logs: Path):
        self.db = stackmod.PrivateRedis()
        port = stackmod.free_port()
        self.base = f"http://127.0.0.1:{port}"
        keys_file = logs / "keys"
        keys_file.write_text(f"{FLOOD_KEY} name=flood\n{CALM_KEY} name=calm weight={args.calm_weight}\n")
        env = {
            "REDIS_URL": self.db.url,
            "GENQ_MODEL": str(checkpoint(args.model)),
            "GENQ_MODEL_NAME": "bench-fair",
            "GENQ_PORT": str(port),
            "GENQ_API_WORKERS": "2",
            "GENQ_API_KEYS_FILE": str(keys_file),
            "GENQ_FAIR_SHARE": str(fair).lower(),
            "GENQ_FAIR_DEPTH": str(args.depth),
            "GENQ_MAX_BATCH_SIZE": str(args.batch),
            "GENQ_MAX_QUEUE_DEPTH": str(args.flood * 2),
            "GENQ_DTYPE": "float32" if args.model == "tiny" else "auto",
        }
        mode = "on" if fair else "off"
        self.procs = [stackmod.Proc("api", stackmod.api_argv(), env, logs / f"api-{mode}.log")]
        self.procs.append(stackmod.Proc("worker", stackmod.worker_argv("hf"), env, logs / f"worker-{mode}.log"))
        self.http = requests.Session()
        self.http.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=32))
        ready = lambda: self.http.get(self.base + "/readyz", timeout=2).status_code == 200  # noqa: E731
        stackmod.wait_until(lambda: _quiet(ready), 120, "the stack", self.procs)

    def submit(self, key: str, max_tokens: int) -> str:
        body = {"prompt": "Hello, my name is", "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        resp = self.http.post(f"{self.base}/v1/jobs", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        resp.raise_for_status()
        return resp.json()["id"]

    def wait(self, job_id: str, key: str, wait: bool = True) -> dict:
        """The job's record, once it has ended (`wait`), else as it is now."""
        while True:
            url = f"{self.base}/v1/jobs/{job_id}?wait={60 if wait else 0}"
            resp = self.http.get(url, headers={"Authorization": f"Bearer {key}"})
            resp.raise_for_status()
            job = resp.json()
            if not wait or job["status"] not in ("queued", "running"):
                break
        assert not wait or job["status"] == "succeeded", job
        return job

    def stop(self) -> None:
        self.http.close()
        for proc in reversed(self.procs):
            proc.stop()
        self.db.stop()


def checkpoint(model: str) -> Path:
    """The tiny random test model, or the real SmolLM2-135M-Instruct (scripts/realmodel.py)."""
    if model == "smollm2":
        from scripts import realmodel

        return realmodel.ensure()
    return devmodels.ensure("tiny", stackmod.TINY_MODEL_DIR)


def _quiet(check) -> bool:
    try:
        return check()
    except requests.RequestException:
        return False


def run_mode(fair: bool, args, logs: Path) -> dict:
    s = Stack(fair, args, logs)
    try:
        # Warm up: the batch shapes the flood will see, then one job at a time.
        with ThreadPoolExecutor(16) as pool:
            warm = list(pool.map(lambda _: s.submit(FLOOD_KEY, args.calm_tokens), range(args.warm)))
        for j in warm + [s.submit(CALM_KEY, args.calm_tokens) for _ in range(3)]:
            s.wait(j, FLOOD_KEY if j in warm else CALM_KEY)
        idle_jobs = [s.wait(s.submit(CALM_KEY, args.calm_tokens), CALM_KEY) for _ in range(args.calm)]
        idle = [j["timings"]["total_s"] for j in idle_jobs]
        alone = s.wait(s.submit(FLOOD_KEY, args.flood_tokens), FLOOD_KEY)["timings"]["total_s"]
        t0 = time.time()
        with ThreadPoolExecutor(16) as pool:
            flood = list(pool.map(lambda _: s.submit(FLOOD_KEY, args.flood_tokens), range(args.flood)))
        # The flood alone for a while (its rate before), then the calm key's jobs at a pace.
        time.sleep(args.before if args.before is not None else 10 * alone)
        t1 = time.time()
        calm = []
        for _ in range(args.calm):
            calm.append(s.submit(CALM_KEY, args.calm_tokens))
            time.sleep(args.pace)
        calm_jobs = [s.wait(j, CALM_KEY) for j in calm]
        t2 = max(j["timings"]["finished"] for j in calm_jobs)
        flood_t = [s.wait(j, FLOOD_KEY, wait=False)["timings"] for j in flood]
        ended = [t["finished"] for t in flood_t if t.get("finished")]
        began = [t["started"] for t in flood_t if t.get("started")]
        # Per calm job: the flood jobs that started while it waited (what went ahead of it).
        ahead = [sum(c["timings"]["created"] < t < c["timings"]["started"] for t in began) for c in calm_jobs]
        settle = t0 + alone  # the first rows' jobs are under way
        before = sum(settle <= t < t1 for t in ended) / max(t1 - settle, 1e-9)
        during = sum(t1 <= t < t2 for t in ended) / max(t2 - t1, 1e-9)
        overall = sum(settle <= t < t2 for t in ended) / max(t2 - settle, 1e-9)
        lat = sorted(j["timings"]["total_s"] for j in calm_jobs)
        bound = statistics.median(idle) + alone
        return {
            "fair_share": fair,
            "calm_weight": args.calm_weight,
            "idle_p50_s": statistics.median(idle),
            "flood_job_alone_s": alone,
            "bound_s": bound,
            "flood_p50_s": statistics.median(lat),
            "flood_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "p50_over_bound": statistics.median(lat) / bound,
            "p99_over_bound": lat[min(len(lat) - 1, int(0.99 * len(lat)))] / bound,
            "calm_queued_p50_s": statistics.median(j["timings"]["queued_s"] for j in calm_jobs),
            "calm_run_p50_s": statistics.median(j["timings"]["run_s"] for j in calm_jobs),
            "flood_rate_before": before,
            "flood_rate_during": during,
            "flood_loss": 1 - during / before if before else None,
            "flood_rate": overall,
            "flood_started_ahead_max": max(ahead),
            "flood_started_ahead_p50": statistics.median(ahead),
            "flood_done_before": sum(settle <= t < t1 for t in ended),
            "flood_done_during": sum(t1 <= t < t2 for t in ended),
        }
    finally:
        s.stop()


def throughput(args, logs: Path) -> list[dict]:
    """The flood alone (no calm key): its jobs/s with fair share on and off, in alternating
    rounds, each round a stack of its own: what the lines, the refill per take and
    GENQ_FAIR_DEPTH cost a key that has the worker to itself."""
    out = []
    for r in range(args.rounds):
        for fair in (True, False):
            s = Stack(fair, args, logs)
            try:
                for j in [s.submit(FLOOD_KEY, args.calm_tokens) for _ in range(args.warm)]:
                    s.wait(j, FLOOD_KEY)
                t0 = time.time()
                with ThreadPoolExecutor(16) as pool:
                    ids = list(pool.map(lambda _: s.submit(FLOOD_KEY, args.flood_tokens), range(args.throughput)))
                end = max(s.wait(j, FLOOD_KEY)["timings"]["finished"] for j in ids)
                out.append({"round": r, "fair_share": fair, "jobs_per_s": len(ids) / (end - t0)})
                print(json.dumps(out[-1]), flush=True)
            finally:
                s.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flood", type=int, default=300, help="jobs the flooding key submits at once")
    p.add_argument("--calm", type=int, default=10, help="jobs of the calm key, idle and during the flood")
    p.add_argument("--pace", type=float, default=0.5, help="seconds between the calm key's jobs")
    p.add_argument("--flood-tokens", type=int, default=256, help="max_new_tokens of a flood job (EOS ignored)")
    p.add_argument("--calm-tokens", type=int, default=16, help="max_new_tokens of a calm job (EOS ignored)")
    p.add_argument("--calm-weight", type=int, default=1, help="the calm key's weight (the flood's is 1)")
    p.add_argument("--batch", type=int, default=2, help="GENQ_MAX_BATCH_SIZE of the one worker")
    p.add_argument("--warm", type=int, default=8, help="jobs of a flood that warms the worker up first")
    p.add_argument("--depth", type=int, default=1, help="GENQ_FAIR_DEPTH")
    p.add_argument(
        "--before",
        type=float,
        default=None,
        help="seconds of flood alone before the calm jobs (default: 10 flood jobs' time)",
    )
    p.add_argument("--out", type=Path, default=OUT / "fair.json", help="where the results go (JSON)")
    p.add_argument("--modes", default="on,off", help="fair share on, off, or both")
    p.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="tiny (float32) or SmolLM2-135M-Instruct (auto dtype)",
    )
    p.add_argument("--throughput", type=int, default=0, help="instead: N flood jobs alone, fair share on vs off")
    p.add_argument("--rounds", type=int, default=2, help="with --throughput: alternating rounds")
    args = p.parse_args()
    if args.throughput:
        with tempfile.TemporaryDirectory(prefix="bench-fair-") as tmp:
            rounds = throughput(args, Path(tmp))
        on = [r["jobs_per_s"] for r in rounds if r["fair_share"]]
        off = [r["jobs_per_s"] for r in rounds if not r["fair_share"]]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "throughput": rounds}))
        print(f"\n{args.throughput} flood jobs of {args.flood_tokens} tokens, batch {args.batch}, model {args.model}")
        print(f"jobs/s, fair share on: {on}; off: {off}; on / off: {statistics.mean(on) / statistics.mean(off):.3f}")
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-fair-") as tmp:
        for mode in args.modes.split(","):
            results.append(run_mode(mode == "on", args, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**vars(args), "out": str(args.out)}
    args.out.write_text(json.dumps({"args": meta, "cpus": os.cpu_count(), "results": results}))
    print(
        f"\n{args.flood}-job flood of {args.flood_tokens} tokens, {args.calm} calm jobs of {args.calm_tokens} "
        f"every {args.pace} s (weight {args.calm_weight}:1), batch {args.batch}, GENQ_FAIR_DEPTH {args.depth}, "
        f"model {args.model}\n"
    )
    print(
        "| fair share | calm idle p50 | a flood job alone | bound | calm p50 in flood | p99 | p50 / bound | "
        "p99 / bound | flood jobs/s before / during the calm jobs | flood jobs/s in all |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        loss = f"{100 * r['flood_loss']:.0f} %" if r["flood_loss"] is not None else "n/a"
        print(
            f"| {'on' if r['fair_share'] else 'off'} | {r['idle_p50_s']:.2f} s | {r['flood_job_alone_s']:.2f} s | "
            f"{r['bound_s']:.2f} s | {r['flood_p50_s']:.2f} s | {r['flood_p99_s']:.2f} s | "
            f"{r['p50_over_bound']:.2f}x | {r['p99_over_bound']:.2f}x | "
            f"{r['flood_rate_before']:.3f} / {r['flood_rate_during']:.3f} ({loss}) | {r['flood_rate']:.3f} |"
        )
    if len(results) == 2 and results[1]["flood_rate"]:
        on, off = results
        print(
            f"\nflood jobs/s, fair share {'on' if on['fair_share'] else 'off'} over the other: "
            f"{on['flood_rate'] / off['flood_rate']:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
