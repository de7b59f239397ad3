"""Batch API throughput: an N-line batch (/v1/files + /v1/batches) against the same prompts
sent through /v1/completions by C concurrent clients, on one worker, and the Redis memory the
batch costs at its peak.

    python -m bench.batch                      # 2,000 lines, 64 clients, the opt-125m shape
    python -m bench.batch --lines 200 --clients 16 --shape tiny     # a quick look

It starts its own Redis, API (2 processes) and one hf worker (GENQ_MAX_BATCH_SIZE, default
32). It times a few interactive requests one after the other, alone; runs the batch (sampling
Redis' `used_memory` every 0.1 s from before the upload to its end), timing the same number
of interactive requests again once the batch's lines are on the queue (the issue's "an
interactive request's latency with a batch running stays within 2x"; they run inside the
batch's time); then sends the same prompts as interactive requests (one prompt each, at most
C in flight), greedy with the same `max_tokens` as the batch. It prints one JSON object:
lines/s of each and their ratio (the issue's target: >= 0.95), the interactive p50 alone and
beside the batch, the peak Redis memory above the idle baseline, and how many batch outputs
differ from the interactive ones (greedy: expected 0).
Figures depend on the machine and on what else runs there; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
import requests

from bench.common import cpu_model, prompt
from scripts import stack
from worker import devmodels


def _sample_memory(r: redis.Redis, stop: threading.Event, out: list[int]) -> None:
    while not stop.is_set():
        out.append(int(r.info("memory")["used_memory"]))
        stop.wait(0.1)


def measure(args) -> dict:
    load_before = os.getloadavg()[0]
    model_dir = devmodels.ensure(args.shape, stack.ROOT / ".models" / f"{args.shape}-opt")
    logs = Path(tempfile.mkdtemp(prefix="genq-bench-batch-"))
    server = stack.PrivateRedis()
    port = stack.free_port()
    base = f"http://127.0.0.1:{port}"
    name = "bench-batch"
    env = {
        "REDIS_URL": server.url, "GENQ_MODEL": str(model_dir), "GENQ_MODEL_NAME": name,
        "GENQ_PORT": str(port), "GENQ_HOST": "127.0.0.1", "GENQ_API_WORKERS": "2",
        "GENQ_MAX_BATCH_SIZE": str(args.batch_size), "GENQ_BATCH_WINDOW": str(args.window),
        **({"GENQ_RESERVED_SLOTS": str(args.reserved)} if args.reserved is not None else {}),
        "GENQ_MAX_QUEUE_DEPTH": str(max(1000, 4 * args.window, 2 * args.clients)),
    }  # fmt: skip
    procs = [
        stack.Proc("api", stack.api_argv(), env, logs / "api.log"),
        stack.Proc("worker", stack.worker_argv("hf"), env, logs / "worker.log"),
    ]
    http = requests.Session()
    http.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=args.clients + 8))
    r = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        stack.wait_until(lambda: stack.http_get(base + "/readyz")[0] == 200, 600, "a ready worker", procs)
        body = {"model": name, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        time.sleep(1.5)  # every API process's cache of live workers sees the worker
        for i in range(4):  # warm-up
            http.post(base + "/v1/completions", json={**body, "prompt": prompt(i)}, timeout=300).raise_for_status()
        prompts = [prompt(i) for i in range(args.lines)]

        def latencies(k: int) -> list[float]:
            """k interactive requests one after the other (priority 0), each timed."""
            out = []
            for i in range(k):
                t = time.monotonic()
                resp = http.post(base + "/v1/completions", json={**body, "prompt": prompt(10_000 + i)}, timeout=600)
                resp.raise_for_status()
                out.append(time.monotonic() - t)
            return sorted(out)

        alone = latencies(args.probes)

        # The batch.
        data = "".join(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": p}})
            + "\n" for i, p in enumerate(prompts)
        ).encode()  # fmt: skip
        baseline = int(r.info("memory")["used_memory"])
        samples: list[int] = []
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_memory, args=(r, stop, samples), daemon=True)
        sampler.start()
        t0 = time.monotonic()
        f = http.post(base + "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)}, timeout=600)
        f.raise_for_status()
        spec = {"input_file_id": f.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        batch = http.post(base + "/v1/batches", json=spec, timeout=60).json()
        while batch["status"] == "validating":
            time.sleep(0.1)
            batch = http.get(base + f"/v1/batches/{batch['id']}", timeout=60).json()
        time.sleep(1.0)  # the batch's window is on the queue
        beside = latencies(args.probes)
        while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.2)
            batch = http.get(base + f"/v1/batches/{batch['id']}", timeout=60).json()
        batch_s = time.monotonic() - t0
        stop.set()
        sampler.join()
        out = http.get(base + f"/v1/files/{batch['output_file_id']}/content", timeout=600).text.splitlines()
        batch_texts, job_ids = {}, []
        for raw in out:
            o = json.loads(raw)
            batch_texts[o["custom_id"]] = o["response"]["body"]["choices"][0]["text"]
            job_ids.append(o["response"]["request_id"])
        # Where the batch's time went: its jobs ran from the first created to the last finished;
        # the rest is upload, validation and the driver's feeding and collecting.
        pipe = r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(f"genq:job:{job_id}", "created", "started", "finished")
        times = [[float(x) for x in t] for t in pipe.execute() if all(t)]
        in_progress = batch["in_progress_at"] - batch["created_at"]
        jobs_span = max(t[2] for t in times) - min(t[0] for t in times) if times else None
        queue_s = sorted(t[1] - t[0] for t in times)

        # The same prompts, one request each, C clients.
        def one(i: int) -> tuple[int, str]:
            resp = http.post(base + "/v1/completions", json={**body, "prompt": prompts[i]}, timeout=600)
            resp.raise_for_status()
            return i, resp.json()["choices"][0]["text"]

        t0 = time.monotonic()
        with ThreadPoolExecutor(args.clients) as pool:
            single = dict(pool.map(one, range(args.lines)))
        single_s = time.monotonic() - t0
        differ = sum(batch_texts.get(f"r{i}") != single[i] for i in range(args.lines))
        return {
            "lines": args.lines, "clients": args.clients, "shape": args.shape, "max_tokens": args.max_tokens,
            "worker_batch_size": args.batch_size, "reserved_slots": args.reserved, "batch_window": args.window,
            "batch_status": batch["status"], "cpu": cpu_model(), "load_before": load_before,
            "batch_request_counts": batch["request_counts"],
            "batch_s": round(batch_s, 2), "batch_lines_per_s": round(args.lines / batch_s, 2),
            "completions_s": round(single_s, 2), "completions_lines_per_s": round(args.lines / single_s, 2),
            "ratio": round(single_s / batch_s, 3),
            "batch_validating_s": in_progress, "batch_jobs_span_s": jobs_span and round(jobs_span, 2),
            "batch_job_queue_s_p50": queue_s and round(queue_s[len(queue_s) // 2], 2),
            "interactive_p50_alone_s": round(alone[len(alone) // 2], 3),
            "interactive_p50_beside_batch_s": round(beside[len(beside) // 2], 3),
            "interactive_latency_ratio": round(beside[len(beside) // 2] / alone[len(alone) // 2], 2),
            "redis_baseline_mb": round(baseline / 2**20, 2),
            "redis_peak_above_baseline_mb": round((max(samples, default=baseline) - baseline) / 2**20, 2),
            "input_file_mb": round(len(data) / 2**20, 2),
            "outputs_differing": differ, "cpus": os.cpu_count(), "load_after": os.getloadavg()[0],
        }  # fmt: skip
    finally:
        http.close()
        r.close()
        for p in reversed(procs):
            p.stop()
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--shape", choices=sorted(devmodels.SHAPES), default="opt-125m")
    ap.add_argument("--batch-size", type=int, default=32, help="the worker's GENQ_MAX_BATCH_SIZE")
    ap.add_argument("--window", type=int, default=256, help="GENQ_BATCH_WINDOW")
    ap.add_argument("--reserved", type=int, default=None, help="GENQ_RESERVED_SLOTS (default: the worker's, an eighth)")
    ap.add_argument("--probes", type=int, default=10, help="interactive requests timed alone and beside the batch")
    print(json.dumps(measure(ap.parse_args()), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
