"""Interactive requests beside a batch, on the real stack (tiny hf model, one worker): batch
lines fill every row of the worker's batch (GENQ_MAX_BATCH_SIZE); the worker runs
GENQ_RESERVED_SLOTS threads beyond that, and the batch driver keeps the fleet's lines within
the workers' capacity plus half that reserve, so an interactive job is taken at once and runs,
preempting a line, instead of waiting for one to finish. (Latency and throughput figures:
docs/benchmarks.md, "Batch API beside interactive requests".)"""

from __future__ import annotations

import json
import threading
import time

import redis
import requests

from tasks import keys

CAPACITY, RESERVED = 4, 2
LINES, TOKENS = 12, 480  # long lines (the tiny model holds 512 positions): many decode steps each


def test_an_interactive_job_starts_beside_a_running_batch(make_stack, redis_url):
    s = make_stack(GENQ_MAX_BATCH_SIZE=str(CAPACITY), GENQ_RESERVED_SLOTS=str(RESERVED))
    s.start_api()
    s.start_worker()
    s.wait_ready(timeout=180)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        body = {"model": s.name, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
        data = "".join(
            json.dumps(
                {
                    "custom_id": f"l{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {**body, "prompt": f"line {i} of the batch"},
                }
            )
            + "\n"
            for i in range(LINES)
        ).encode()
        f = requests.post(
            s.base + "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)}, timeout=60
        )
        assert f.status_code == 200, f.text
        spec = {"input_file_id": f.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        batch = requests.post(s.base + "/v1/batches", json=spec, timeout=60).json()
        pending_key = keys.batch_part(batch["id"], "pending")

        # The driver holds at most capacity + reserve // 2 = 5 lines in flight.
        held: list[int] = []
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                held.append(r.hlen(pending_key))
                stop.wait(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        deadline = time.monotonic() + 120
        running: list[str] = []
        while len(running) < CAPACITY:
            assert time.monotonic() < deadline, "the batch's lines did not start"
            ids = [j for entry in r.hvals(pending_key) for j in json.loads(entry)["ids"]]
            running = [j for j in ids if r.hget(keys.job(j), "status") == "running"]
            time.sleep(0.05)

        job = requests.post(s.base + "/v1/jobs", json={"prompt": "urgent", "max_new_tokens": 8}, timeout=30).json()
        job = requests.get(s.base + f"/v1/jobs/{job['id']}?wait=120", timeout=150).json()
        assert job["status"] == "succeeded", job
        done = job["timings"]["finished"] if "timings" in job else job["finished"]
        # It was done while the lines that filled the batch when it came were all still
        # running: it preempted one, it did not wait for a line to finish.
        finished = [float(r.hget(keys.job(j), "finished") or "inf") for j in running]
        assert done < min(finished), (done, finished)

        requests.post(s.base + f"/v1/batches/{batch['id']}/cancel", timeout=30)
        deadline = time.monotonic() + 120
        while requests.get(s.base + f"/v1/batches/{batch['id']}", timeout=30).json()["status"] != "cancelled":
            assert time.monotonic() < deadline, "the batch did not end after cancel"
            time.sleep(0.2)
        stop.set()
        sampler.join()
        assert max(held) <= CAPACITY + RESERVED // 2, max(held)
        assert max(held) >= CAPACITY  # the lines did fill the batch
    finally:
        r.close()
