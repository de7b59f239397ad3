"""`python -m bench.fair`: a calm key's latency while another key floods the queue (issue 34,
item 1). For each mode (fair share on, off) it starts a stack of its own (a private Redis, the
API with two keys, one hf worker on the tiny model or, with `--model smollm2`, the real SmolLM2), measures the calm key's job latency idle
(one job at a time), then submits a flood of jobs from the other key and, while the flood is
worked on, the calm key's jobs at a steady pace; latency is the job's `total_s` (created to
finished). Prints a Markdown table and writes bench/out/fair.json. docs/benchmarks.md, "Fair
share between keys", has the command and the results.
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
        keys_file.write_text(f"{FLOOD_KEY} name=flood\n{CALM_KEY} name=calm\n")
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
        body = {"prompt": "Hello, my name is", "max_new_tokens": max_tokens, "temperature": 0}
        resp = self.http.post(f"{self.base}/v1/jobs", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        resp.raise_for_status()
        return resp.json()["id"]

    def wait(self, job_id: str, key: str) -> dict:
        resp = self.http.get(f"{self.base}/v1/jobs/{job_id}?wait=300", headers={"Authorization": f"Bearer {key}"})
        resp.raise_for_status()
        job = resp.json()
        assert job["status"] == "succeeded", job
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
        # Warm up: every batch shape the flood will see, then one job at a time.
        with ThreadPoolExecutor(16) as pool:
            warm = list(pool.map(lambda _: s.submit(FLOOD_KEY, args.max_tokens), range(args.warm)))
        for j in warm + [s.submit(CALM_KEY, args.max_tokens) for _ in range(3)]:
            s.wait(j, FLOOD_KEY if j in warm else CALM_KEY)
        idle_jobs = [s.wait(s.submit(CALM_KEY, args.max_tokens), CALM_KEY) for _ in range(args.calm)]
        idle = [j["timings"]["total_s"] for j in idle_jobs]
        t0 = time.time()
        with ThreadPoolExecutor(16) as pool:
            flood = list(pool.map(lambda _: s.submit(FLOOD_KEY, args.max_tokens), range(args.flood)))
        calm = []
        for _ in range(args.calm):  # a steady pace while the flood is worked on
            calm.append(s.submit(CALM_KEY, args.max_tokens))
            time.sleep(args.pace)
        calm_jobs = [s.wait(j, CALM_KEY) for j in calm]
        flood_jobs = [s.wait(j, FLOOD_KEY) for j in flood]
        flood_end = max(j["timings"]["finished"] for j in flood_jobs)
        last_start = max(j["timings"]["started"] for j in flood_jobs)
        ahead = [j for j in calm_jobs if j["timings"]["started"] < last_start]
        lat = [j["timings"]["total_s"] for j in calm_jobs]
        return {
            "calm_queued_p50_s": statistics.median(j["timings"]["queued_s"] for j in calm_jobs),
            "calm_run_p50_s": statistics.median(j["timings"]["run_s"] for j in calm_jobs),
            "fair_share": fair,
            "idle_queued_p50_s": statistics.median(j["timings"]["queued_s"] for j in idle_jobs),
            "idle_p50_s": statistics.median(idle),
            "flood_p50_s": statistics.median(lat),
            "flood_max_s": max(lat),
            "ratio": statistics.median(lat) / statistics.median(idle),
            "calm_started_before_flood_last": len(ahead),
            "flood_s": flood_end - t0,
        }
    finally:
        s.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flood", type=int, default=300, help="jobs the flooding key submits at once")
    p.add_argument("--calm", type=int, default=20, help="jobs of the calm key, idle and during the flood")
    p.add_argument("--pace", type=float, default=0.1, help="seconds between the calm key's jobs")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="GENQ_MAX_BATCH_SIZE of the one worker")
    p.add_argument("--warm", type=int, default=64, help="jobs of a flood that warms the worker up first")
    p.add_argument("--depth", type=int, default=4, help="GENQ_FAIR_DEPTH")
    p.add_argument("--out", type=Path, default=OUT / "fair.json", help="where the results go (JSON)")
    p.add_argument("--modes", default="on,off", help="fair share on, off, or both")
    p.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="tiny (float32) or SmolLM2-135M-Instruct (auto dtype)",
    )
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-fair-") as tmp:
        for mode in args.modes.split(","):
            results.append(run_mode(mode == "on", args, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**vars(args), "out": str(args.out)}
    args.out.write_text(json.dumps({"args": meta, "cpus": os.cpu_count(), "results": results}))
    print(
        f"\n{args.flood}-job flood, {args.calm} calm jobs every {args.pace} s, max_tokens {args.max_tokens}, "
        f"batch {args.batch}, GENQ_FAIR_DEPTH {args.depth}, model {args.model}\n"
    )
    print("| fair share | calm p50 idle | calm p50 in flood | ratio | of which queued / running (p50) | flood took |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {'on' if r['fair_share'] else 'off'} | {r['idle_p50_s']:.3f} s | {r['flood_p50_s']:.3f} s | "
            f"{r['ratio']:.1f}x | {r['calm_queued_p50_s']:.3f} s / {r['calm_run_p50_s']:.3f} s | {r['flood_s']:.1f} s |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
