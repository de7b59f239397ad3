"""`python -m bench.stream`: streaming latency through the whole stack, and writes
docs/benchmarks-streaming.md.

What it measures, in one run:

1. *In-process prefill* (a subprocess of its own, before any server starts): the same
   checkpoint loaded with transformers; one forward pass over one prompt (the engine's
   prefill: `use_cache=True, logits_to_keep=1`, then argmax), over the benchmark's prompts in
   turn; the median is the floor of time to first token. Also the time of one decode step at
   batch 1, the floor of inter-token latency.
2. *Streaming through the API*: private Redis (or REDIS_URL when it answers), one hf worker
   (GENQ_MAX_BATCH_SIZE=64), the API under gunicorn; N closed-loop streaming clients, each a
   thread with one keep-alive `http.client` connection. Each request (`--endpoint jobs`, the
   default): `POST /v1/jobs` (32 new tokens, greedy, ignore_eos), then
   `GET /v1/jobs/<id>/stream` on the same connection, read with `read1` as bytes arrive; the
   time of each `event: token` is taken when the bytes that complete it are read.
   (`--endpoint completions`: one `POST /v1/completions` with `"stream": true`; each `data:`
   chunk that has no finish reason is a token.)
   - TTFT: from just before the POST is sent to the arrival of the first token event, whatever
     its text (a token can end inside a UTF-8 character and carry ""); "TTFT text" is to the
     first token event with non-empty text.
   - ITL: the gaps between consecutive token events of one request (31 per request), pooled.
   - req/s: as bench.load does (each client's requests over the time they spanned, summed).
   - Where TTFT goes: from the job record (created, started) and the Redis Stream entry id of
     the first token (its millisecond timestamp, written by the worker's publisher).

Everything started here is stopped again (process groups), also on Ctrl-C or an error.
Logs and raw JSON go to bench/out/stream-<timestamp>/ (git-ignored).
Quick run: `python -m bench.stream --model tiny --levels 1,2 --duration 2 --no-write`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from bench.common import MAX_NEW_TOKENS, PROMPTS, mean, median, percentile

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LEVELS = "1,8,32"
MAX_BATCH_SIZE = 64
TARGET_TTFT_MARGIN_S = 0.050  # TTFT p50 at 1 stream <= in-process prefill + 50 ms

_RETRYABLE = (
    http.client.RemoteDisconnected,
    http.client.CannotSendRequest,
    http.client.BadStatusLine,
    ConnectionResetError,
    BrokenPipeError,
    ConnectionRefusedError,
)


def log(msg: str) -> None:
    print(f"[stream {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _system_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = (f + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# -- helpers shared with bench/vllm.py (kept here, not imported from bench/run.py, whose
#    internals change with its own needs) ------------------------------------------------------


def model_dirs() -> dict[str, Path]:
    from scripts import stack

    return {"opt-125m": ROOT / ".models" / "opt-125m", "tiny": stack.TINY_MODEL_DIR}


class Processes:
    """Everything a benchmark starts, stopped in reverse order by `close()`."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.items: list = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None):
        from scripts import stack

        p = stack.Proc(name, argv, env, self.logdir / f"{name}.log")
        self.items.append(p)
        return p

    def redis(self):
        from scripts import stack

        r = stack.PrivateRedis()
        self.items.append(r)
        return r

    def stop(self, item) -> None:
        item.stop()
        if item in self.items:
            self.items.remove(item)

    def close(self) -> None:
        while self.items:
            item = self.items.pop()
            try:
                item.stop()
            except Exception as exc:  # keep stopping the rest
                log(f"stopping {getattr(item, 'name', item)} failed: {exc!r}")


def tree_cpu_s(pid: int | None) -> float:
    import psutil

    if not pid:
        return math.nan
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return math.nan
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class CpuMeter:
    """CPU of named process trees (and of the rest of the machine) over a window, in cores."""

    def __init__(self, pids: dict[str, int | None]):
        self.pids = pids
        self.start: dict[str, float] = {}
        self.result: dict[str, float] = {}

    def _sample(self) -> dict[str, float]:
        s = {name: tree_cpu_s(pid) for name, pid in self.pids.items()}
        s["client"] = _own_cpu_s()
        s["_system"] = _system_busy_s()
        s["_t"] = time.monotonic()
        return s

    def __call__(self, event: str) -> None:
        if event == "start":
            self.start = self._sample()
            return
        end = self._sample()
        d = {k: end[k] - self.start[k] for k in end}
        wall, system = d.pop("_t"), d.pop("_system")
        ours = sum(v for v in d.values() if not math.isnan(v))
        d["other"] = max(0.0, system - ours)
        self.result = {k: v / wall for k, v in d.items()}
        self.result["_wall"] = wall


def quietest(attempt, args) -> dict:
    """Run `attempt` again (up to --retries times) while the rest of the machine used more than
    --max-other-load cores during it; keep the quietest run."""
    runs = []
    for i in range(1 + args.retries):
        runs.append(attempt())
        if runs[-1]["cpu"].get("other", 0.0) <= args.max_other_load:
            break
        if i < args.retries:
            log(f"  other load above {args.max_other_load:g} cores: measuring again")
    best = min(runs, key=lambda x: x["cpu"].get("other", 0.0))
    best["attempts"] = len(runs)
    best["noisy"] = best["cpu"].get("other", 0.0) > args.max_other_load
    return best


def machine_facts() -> dict:
    import platform

    import psutil

    cpu_model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": cpu_model,
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg_start": os.getloadavg(),
    }


def redis_version(url: str) -> str:
    import redis

    try:
        return redis.Redis.from_url(url).info("server").get("redis_version", "?")
    except redis.RedisError:
        return "?"


def table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def job_stats(r, model: str, t0: float, t1: float) -> dict:
    """Queue wait, run time and batch size of this model's jobs that finished in [t0, t1]."""
    ids = [k.split(":", 2)[2] for k in r.scan_iter("genq:job:*", count=1000)]
    pipe = r.pipeline(transaction=False)
    for i in ids:
        pipe.hmget(f"genq:job:{i}", "model", "status", "created", "started", "finished")
    picked = []
    for i, (m, status, created, started, finished) in zip(ids, pipe.execute()):
        if m == model and status == "succeeded" and started and finished and t0 <= float(finished) <= t1:
            picked.append((i, float(created), float(started), float(finished)))
    batches = []
    if picked:
        for raw in r.mget([f"celery-task-meta-{i}" for i, *_ in picked]):
            try:
                batches.append(json.loads(raw)["result"]["batch_size"])
            except (TypeError, ValueError, KeyError):
                pass
    return {
        "jobs": len(picked),
        "queued_s": mean(s - c for _, c, s, _ in picked),
        "run_s": mean(f - s for _, _, s, f in picked),
        "total_s": mean(f - c for _, c, _, f in picked),
        "batch_size_mean": mean(batches),
        "batch_size_max": max(batches, default=math.nan),
    }


# -- in-process prefill (runs as a subprocess: `--inproc-child`) -----------------------------


def inproc_child(model_dir: str, reps: int, out_path: str) -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(model_dir)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    encs = [tok(p, return_tensors="pt") for p in PROMPTS]

    def prefill(enc):
        out = lm(input_ids=enc.input_ids, attention_mask=enc.attention_mask, use_cache=True, logits_to_keep=1)
        return out, out.logits[:, -1, :].argmax(-1)

    def timed(fn):
        b0, c0, t0 = _system_busy_s(), _own_cpu_s(), time.perf_counter()
        r = fn()
        t = time.perf_counter() - t0
        return r, t, max(0.0, (_system_busy_s() - b0) - (_own_cpu_s() - c0))

    res: dict = {"torch": torch.__version__, "transformers": transformers.__version__,
                 "torch_threads": torch.get_num_threads(),
                 "prompt_tokens": [int(e.input_ids.shape[1]) for e in encs]}
    with torch.inference_mode():
        for e in encs[:4]:  # warm-up
            prefill(e)
        pre, other_s, busy_t = [], 0.0, 0.0
        for _ in range(reps):
            for e in encs:
                _, t, o = timed(lambda: prefill(e))
                pre.append(t)
                other_s += o
                busy_t += t
        tok_t = []
        for p in PROMPTS:
            t0 = time.perf_counter()
            tok(p)
            tok_t.append(time.perf_counter() - t0)
        # Decode steps at batch 1: prefill, then MAX_NEW_TOKENS - 1 steps on the cache.
        steps = []
        for e in encs[:4]:
            out, nxt = prefill(e)
            cache, mask = out.past_key_values, e.attention_mask
            for _ in range(MAX_NEW_TOKENS - 1):
                mask = torch.nn.functional.pad(mask, (0, 1), value=1)
                t0 = time.perf_counter()
                o = lm(input_ids=nxt.view(1, 1), attention_mask=mask, past_key_values=cache, use_cache=True)
                nxt = o.logits[:, -1, :].argmax(-1)
                steps.append(time.perf_counter() - t0)
                cache = o.past_key_values
    res.update({
        "prefill_samples": len(pre),
        "prefill_median_s": median(pre),
        "prefill_p10_s": percentile(pre, 10),
        "prefill_p90_s": percentile(pre, 90),
        "tokenize_median_s": median(tok_t),
        "decode_step_median_s": median(steps),
        "decode_step_p90_s": percentile(steps, 90),
        "other_load": other_s / busy_t if busy_t else math.nan,
    })
    Path(out_path).write_text(json.dumps(res))
    return 0


# -- streaming clients ------------------------------------------------------------------------


class _Req:
    __slots__ = ("end", "latency", "ok", "warm", "ttft", "ttft_text", "gaps", "job_id", "w_post", "w_first", "tokens")

    def __init__(self):
        self.ok, self.ttft, self.ttft_text, self.gaps = False, None, None, []
        self.job_id, self.w_post, self.w_first, self.tokens = None, None, None, 0


class _Client(threading.Thread):
    def __init__(self, run: "_Run", idx: int):
        super().__init__(name=f"stream-client-{idx}", daemon=True)
        self.run_, self.idx = run, idx
        self.conn: http.client.HTTPConnection | None = None
        self.records: list[_Req] = []
        self.done_warmup = False
        self.in_window = 0
        self.error_sample = ""

    def _connect(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.run_.host, self.run_.port, timeout=self.run_.timeout)
        return self.conn

    def _request(self, method: str, path: str, body: bytes | None) -> http.client.HTTPResponse:
        for attempt in (0, 1):
            conn = self._connect()
            try:
                conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
                return conn.getresponse()
            except _RETRYABLE:
                # A keep-alive connection the server closed while idle: reconnect once.
                conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _one(self, body: bytes, rq: _Req) -> None:
        r = self.run_
        t0 = time.perf_counter()
        rq.w_post = time.time()
        if r.endpoint == "jobs":
            resp = self._request("POST", "/v1/jobs", body)
            data = resp.read()
            if resp.status != 202:
                raise RuntimeError(f"POST /v1/jobs: HTTP {resp.status}: {data[:200]!r}")
            rq.job_id = json.loads(data)["id"]
            resp = self._request("GET", f"/v1/jobs/{rq.job_id}/stream", None)
        else:
            resp = self._request("POST", "/v1/completions", body)
        if resp.status != 200:
            raise RuntimeError(f"stream: HTTP {resp.status}: {resp.read()[:200]!r}")
        times: list[float] = []
        buf, finished = b"", False
        while not finished:
            chunk = resp.read1(65536)
            now = time.perf_counter()
            if not chunk:
                raise RuntimeError("the stream ended without a done event")
            buf += chunk
            while b"\n\n" in buf and not finished:
                raw, buf = buf.split(b"\n\n", 1)
                event, data = "message", []
                for line in raw.decode().split("\n"):
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].lstrip(" "))
                if not data:
                    continue  # a keep-alive comment
                payload = "\n".join(data)
                kind, text = self._classify(event, payload)
                if kind == "token":
                    if not times:
                        rq.w_first = time.time()
                    times.append(now)
                    if text and rq.ttft_text is None:
                        rq.ttft_text = now - t0
                elif kind == "done":
                    finished = True
                elif kind == "error":
                    raise RuntimeError(f"error event: {payload[:200]}")
        resp.read()  # the rest of the chunked body (its end), so the connection can be reused
        end = time.perf_counter()
        if len(times) != r.expect_tokens:
            raise RuntimeError(f"{len(times)} token events, expected {r.expect_tokens}")
        rq.tokens = len(times)
        rq.ttft = times[0] - t0
        rq.gaps = [b - a for a, b in zip(times, times[1:])]
        rq.latency = end - t0
        rq.ok = True

    def _classify(self, event: str, payload: str) -> tuple[str, str]:
        if self.run_.endpoint == "jobs":
            if event == "token":
                return "token", json.loads(payload)["text"]
            return event, ""
        if payload == "[DONE]":
            return "done", ""
        obj = json.loads(payload)
        if "error" in obj:
            return "error", ""
        choice = obj["choices"][0]
        if choice.get("finish_reason"):
            return "finish", choice.get("text", "")  # the last chunk: [DONE] follows
        return "token", choice.get("text", "")

    def run(self) -> None:
        r = self.run_
        k = 0
        try:
            while not r.stop.is_set():
                body = r.bodies[(r.offset + self.idx + k * r.clients) % len(r.bodies)]
                rq = _Req()
                rq.warm = k < r.warmup
                k += 1
                t0 = time.perf_counter()
                try:
                    self._one(body, rq)
                except Exception as exc:  # counted as an error; the loop goes on
                    rq.ok = False
                    if not self.error_sample:
                        self.error_sample = repr(exc)[:300]
                    if self.conn is not None:
                        self.conn.close()
                        self.conn = None
                    time.sleep(0.05)
                rq.latency = time.perf_counter() - t0
                rq.end = time.time()
                self.records.append(rq)
                if k >= r.warmup:
                    self.done_warmup = True
                ws = r.window_start
                if not rq.warm and ws is not None and rq.end >= ws:
                    self.in_window += 1
        finally:
            if self.conn is not None:
                self.conn.close()


class _Run:
    def __init__(self, host, port, endpoint, bodies, clients, warmup, timeout, offset, expect_tokens):
        self.host, self.port, self.endpoint = host, port, endpoint
        self.bodies, self.clients, self.warmup = bodies, clients, warmup
        self.timeout, self.offset, self.expect_tokens = timeout, offset, expect_tokens
        self.stop = threading.Event()
        self.window_start: float | None = None


def stream_bodies(endpoint: str, model: str | None, max_new_tokens: int = MAX_NEW_TOKENS) -> list[bytes]:
    if endpoint == "jobs":
        return [json.dumps({"prompt": p, "max_new_tokens": max_new_tokens, "ignore_eos": True}).encode()
                for p in PROMPTS]
    return [json.dumps({"model": model, "prompt": p, "max_tokens": max_new_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True}).encode() for p in PROMPTS]


def stream_loop(host: str, port: int, clients: int, duration: float, *, endpoint: str = "jobs",
                bodies: list[bytes], min_per_client: int = 0, warmup: int = 1, timeout: float = 600.0,
                drain_timeout: float = 300.0, offset: int = 0, on_window=None,
                expect_tokens: int = MAX_NEW_TOKENS) -> dict:
    """`clients` closed-loop streaming clients; the window rules are bench.load's."""
    run = _Run(host, port, endpoint, bodies, clients, warmup, timeout, offset, expect_tokens)
    threads = [_Client(run, i) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        while not all(t.done_warmup for t in threads):
            if not any(t.is_alive() for t in threads):
                raise RuntimeError("every client thread died during warm-up")
            time.sleep(0.01)
        run.window_start = ws = time.time()
        if on_window:
            on_window("start")
        cap = max(10 * duration, 600.0)
        capped = False
        while True:
            now = time.time()
            if now - ws >= duration and all(t.in_window >= min_per_client for t in threads):
                break
            if now - ws >= cap:
                capped = True
                break
            time.sleep(0.01)
        we = time.time()
        run.stop.set()
        if on_window:
            on_window("end")
    finally:
        run.stop.set()
        drain_end = time.monotonic() + drain_timeout
        for t in threads:
            t.join(max(0.0, drain_end - time.monotonic()))

    counted_ok: list[_Req] = []
    errors, rate = 0, 0.0
    for t in threads:
        mine = [rq for rq in list(t.records) if not rq.warm and ws <= rq.end <= we]
        errors += sum(not rq.ok for rq in mine)
        counted_ok += [rq for rq in mine if rq.ok]
        if mine:
            span = mine[-1].end - (mine[0].end - mine[0].latency)
            if span > 0:
                rate += sum(rq.ok for rq in mine) / span
    ttft = [rq.ttft for rq in counted_ok]
    ttft_text = [rq.ttft_text for rq in counted_ok if rq.ttft_text is not None]
    gaps = [g for rq in counted_ok for g in rq.gaps]
    lat = [rq.latency for rq in counted_ok]
    return {
        "clients": clients,
        "requests": len(counted_ok),
        "errors": errors,
        "error_sample": next((t.error_sample for t in threads if t.error_sample), ""),
        "window_s": we - ws,
        "window_start": ws,
        "window_end": we,
        "rate": rate,
        "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_mean": mean(ttft),
        "ttft_text_p50": percentile(ttft_text, 50),
        "itl_p50": percentile(gaps, 50), "itl_p90": percentile(gaps, 90), "itl_p99": percentile(gaps, 99),
        "itl_mean": mean(gaps),
        # Gaps under 1 ms: tokens that reached the client together (one read, or back to back).
        "itl_burst_share": (sum(g < 0.001 for g in gaps) / len(gaps)) if gaps else math.nan,
        "lat_p50": percentile(lat, 50), "lat_p90": percentile(lat, 90),
        "min_per_client": min((t.in_window for t in threads), default=0),
        "capped": capped,
        "stragglers": sum(t.is_alive() for t in threads),
        "_timing": [(rq.job_id, rq.w_post, rq.w_first) for rq in counted_ok if rq.job_id],
    }


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
    parts: dict[str, list[float]] = {"api_submit": [], "queue": [], "worker_first": [], "deliver": []}
    for (job_id, w_post, w_first), (created, started), first in zip(timing, replies[0::2], replies[1::2]):
        if not (created and started and first and w_first):
            continue
        created, started = float(created), float(started)
        xadd = int(first[0][0].split("-")[0]) / 1000.0
        parts["api_submit"].append(created - w_post)
        parts["queue"].append(started - created)
        parts["worker_first"].append(xadd - started)
        parts["deliver"].append(w_first - xadd)
    return {k: median(v) for k, v in parts.items()} | {"n": len(parts["queue"])}


# -- the run ----------------------------------------------------------------------------------


def parse_args(argv):
    MODEL_DIRS = model_dirs()
    ap = argparse.ArgumentParser(prog="python -m bench.stream", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODEL_DIRS), default="opt-125m",
                    help="dev checkpoint to build (worker/devmodels.py) and serve (default opt-125m)")
    ap.add_argument("--levels", default=DEFAULT_LEVELS, help=f"concurrent streams (default {DEFAULT_LEVELS})")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per level (default 20)")
    ap.add_argument("--min-requests", type=int, default=3, help="requests each client completes per level (default 3)")
    ap.add_argument("--endpoint", choices=["jobs", "completions"], default="jobs",
                    help="jobs: POST /v1/jobs + GET /v1/jobs/<id>/stream (default); "
                    "completions: POST /v1/completions with stream: true")
    ap.add_argument("--api-workers", type=int, default=1, help="GENQ_API_WORKERS (default 1)")
    ap.add_argument("--prefill-reps", type=int, default=2,
                    help="in-process prefill: passes over the 16 prompts (default 2: 32 samples)")
    ap.add_argument("--max-other-load", type=float, default=0.3,
                    help="a level during which processes outside the benchmark used more CPU cores "
                    "than this is measured again (default 0.3)")
    ap.add_argument("--retries", type=int, default=2, help="repeats of a disturbed level (default 2)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks-streaming.md")
    ap.add_argument("--no-write", action="store_true", help="print the report only")
    ap.add_argument("--inproc-child", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.levels = sorted({int(x) for x in args.levels.split(",") if x.strip()})
    except ValueError:
        ap.error("--levels takes comma-separated integers")
    if not args.levels or min(args.levels) < 1:
        ap.error("--levels needs positive integers")
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.inproc_child:
        return inproc_child(args.inproc_child[0], args.prefill_reps, args.inproc_child[1])

    import redis

    from scripts import stack
    from worker import devmodels

    MODEL_DIRS = model_dirs()

    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _raise_interrupt)
    started = time.monotonic()
    outdir = ROOT / "bench" / "out" / f"stream-{time.strftime('%Y%m%d-%H%M%S')}"
    outdir.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "command": " ".join(["python -m bench.stream", *map(shlex.quote, raw_argv)]),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_facts(),
        "model": args.model,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    log(f"checkpoint {args.model}: building if needed")
    model_dir = devmodels.ensure(args.model, MODEL_DIRS[args.model])
    res["model_dir"] = os.path.relpath(model_dir, ROOT)
    marker = json.loads((model_dir / devmodels.MARKER_NAME).read_text())
    res["params_m"] = marker.get("parameters", 0) / 1e6

    procs = Processes(outdir)
    try:
        log("in-process prefill (nothing else of the benchmark runs)")
        out = outdir / "inproc.json"
        p = procs.start("inproc", [sys.executable, "-m", "bench.stream", "--prefill-reps", str(args.prefill_reps),
                                   "--inproc-child", str(model_dir), str(out)])
        while p.alive():
            time.sleep(0.1)
        procs.stop(p)
        if p.popen.returncode != 0:
            raise RuntimeError(f"in-process prefill failed ({p.popen.returncode}):\n{p.tail()}")
        res["inproc"] = json.loads(out.read_text())
        ip = res["inproc"]
        log(f"prefill median {ip['prefill_median_s'] * 1000:.1f} ms, decode step at batch 1 "
            f"{ip['decode_step_median_s'] * 1000:.1f} ms, other load {ip['other_load']:.2f} cores")

        url = os.environ.get("REDIS_URL")
        if stack.redis_answers(url):
            redis_url, redis_pid, res["redis_kind"] = url, None, "REDIS_URL"
        else:
            private = procs.redis()
            redis_url, redis_pid, res["redis_kind"] = private.url, private.proc.pid, "private redis-server"
        res["redis_version"] = redis_version(redis_url)
        name = f"bench-stream-{uuid.uuid4().hex[:6]}"
        port = stack.free_port()
        env = {"REDIS_URL": redis_url, "GENQ_MODEL": str(model_dir), "GENQ_MODEL_NAME": name,
               "GENQ_HOST": "127.0.0.1", "GENQ_PORT": str(port), "GENQ_MAX_BATCH_SIZE": str(MAX_BATCH_SIZE),
               "GENQ_ENGINE": "hf", "GENQ_API_WORKERS": str(args.api_workers)}
        worker = procs.start("worker", stack.worker_argv("hf"), env)
        api = procs.start("api", stack.api_argv(), env)
        base = f"http://127.0.0.1:{port}"
        stack.wait_until(lambda: stack.http_get(base + "/healthz")[0] == 200, 60, "the API", [api, worker])
        stack.wait_until(lambda: stack.http_get(base + "/readyz")[0] == 200, 600, "a ready worker", [api, worker])
        log(f"stack ready on port {port}; warming up")
        bodies = stream_bodies(args.endpoint, name)
        stream_loop("127.0.0.1", port, 1, 0, endpoint=args.endpoint, bodies=bodies, warmup=0, min_per_client=3)
        stream_loop("127.0.0.1", port, min(8, max(args.levels)), 0, endpoint=args.endpoint, bodies=bodies,
                    warmup=0, min_per_client=1)
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        rows = []
        for level in args.levels:

            def attempt():
                meter = CpuMeter({"api": api.pid, "worker": worker.pid, "redis": redis_pid})
                x = stream_loop("127.0.0.1", port, level, args.duration, endpoint=args.endpoint, bodies=bodies,
                                warmup=1, min_per_client=args.min_requests, on_window=meter, offset=level)
                x["cpu"] = meter.result
                x["parts"] = ttft_parts(r, x.pop("_timing"))
                log(f"level {level:3d}: {x['rate']:.2f} req/s, TTFT p50 {x['ttft_p50'] * 1000:.1f} ms, "
                    f"ITL p50 {x['itl_p50'] * 1000:.1f} ms, {x['requests']} requests, errors {x['errors']}, "
                    f"other load {meter.result.get('other', 0):.2f} cores")
                if x["errors"]:
                    log(f"  first error: {x['error_sample']}")
                return x

            rows.append(quietest(attempt, args))
        res["levels"] = rows
    except KeyboardInterrupt:
        log("interrupted; stopping everything")
        return 130
    finally:
        procs.close()
    res["loadavg_end"] = os.getloadavg()
    res["elapsed_s"] = time.monotonic() - started
    (outdir / "results.json").write_text(json.dumps(res, indent=1, default=str))
    report = render(res)
    print(report, flush=True)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        log(f"wrote {args.out}")
    log(f"raw results and logs in {os.path.relpath(outdir, ROOT)}")
    return 0


# -- report -----------------------------------------------------------------------------------


def _ms(x, nd=1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x * 1000:.{nd}f}"


def _f(x, nd=2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{nd}f}"


def _noise(r: dict) -> str:
    s = _f(r["cpu"].get("other"))
    if r.get("attempts", 1) > 1:
        s += f" ({r['attempts']} tries)"
    return s + (" !" if r.get("noisy") else "")


def target(res: dict) -> tuple[str, str]:
    ip = res["inproc"]
    one = next((r for r in res["levels"] if r["clients"] == 1), None)
    if one is None:
        return "N/A", "TTFT at 1 stream: level 1 not measured (--levels)"
    limit = ip["prefill_median_s"] + TARGET_TTFT_MARGIN_S
    ok = one["ttft_p50"] <= limit
    return ("PASS" if ok else "FAIL",
            f"TTFT at 1 stream: p50 {one['ttft_p50'] * 1000:.1f} ms; in-process prefill "
            f"{ip['prefill_median_s'] * 1000:.1f} ms + 50 ms = {limit * 1000:.1f} ms "
            f"({'within' if ok else 'over'} by {abs(limit - one['ttft_p50']) * 1000:.1f} ms)")


def render(res: dict) -> str:
    m, ip, rows, a = res["machine"], res["inproc"], res["levels"], res["args"]
    endpoint = ("`POST /v1/jobs`, then `GET /v1/jobs/<id>/stream` on the same keep-alive connection"
                if a["endpoint"] == "jobs" else "`POST /v1/completions` with `\"stream\": true`")
    L = ["# Streaming latency", ""]
    L.append("Generated by `python -m bench.stream` (bench/stream.py); rerun it to refresh this page. "
             "Time to first token (TTFT) and inter-token latency (ITL) as a streaming client sees them, "
             "through gunicorn, Redis, Celery and one hf worker, beside the in-process prefill that "
             "TTFT cannot beat.")
    L += ["", "## Run", ""]
    L.append(f"- Command: `{res['command']}`")
    L.append(f"- Date: {res['date']} (took {res['elapsed_s'] / 60:.1f} min)")
    L.append(f"- Machine: {m['nproc']} CPUs (nproc), {m['cpu_model']}, {m['ram_gib']:.1f} GiB RAM, Linux {m['kernel']}; "
             f"load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at end "
             f"{', '.join(f'{x:.2f}' for x in res['loadavg_end'])}")
    L.append(f"- Software: Python {m['python']}, torch {ip['torch']} ({ip['torch_threads']} intra-op threads, the "
             f"default, in the worker too), transformers {ip['transformers']}, Redis {res['redis_version']} "
             f"({res['redis_kind']})")
    pt = ip["prompt_tokens"]
    L.append(f"- Checkpoint: `{res['model_dir']}` (`--model {res['model']}`: random-weight OPT from "
             f"worker/devmodels.py, {res['params_m']:.1f}M parameters, float32); the 16 prompts of bench/common.py, "
             f"{min(pt)}-{max(pt)} tokens ({mean(pt):.1f} on average, BOS included), in turn")
    L.append(f"- Stack: one hf worker, GENQ_MAX_BATCH_SIZE={MAX_BATCH_SIZE}; the API under gunicorn (gevent), "
             f"GENQ_API_WORKERS={a['api_workers']}; Redis as above")
    L.append(f"- Requests: {MAX_NEW_TOKENS} new tokens each, greedy, `ignore_eos: true`; each client: {endpoint}; "
             f"closed loop (next request as soon as the stream has ended), one `http.client` keep-alive "
             f"connection per client thread, the SSE body read with `read1` as bytes arrive")
    L.append(f"- Window per level: >= {a['duration']:g} s and >= {a['min_requests']} requests per client after one "
             f"warm-up request each; requests that end inside it count. A level during which processes outside "
             f"the benchmark used more than {a['max_other_load']:g} cores is measured again (up to "
             f"{a['retries']} times) and the quietest kept")
    L.append("- TTFT: from just before the first POST is sent to the arrival of the first token event, "
             "**whatever its text** (a token that ends inside a UTF-8 character carries \"\"); *TTFT text*: to "
             "the first token event with non-empty text. ITL: gaps between consecutive token events of one "
             f"request ({MAX_NEW_TOKENS - 1} per request), pooled over the level's requests. req/s: each client's "
             "requests over the time they spanned, summed over clients (as bench.load)")

    v, s = target(res)
    L += ["", "## Target", "", f"- **{v}** {s}; target: TTFT p50 at 1 stream <= in-process prefill + 50 ms"]

    L += ["", "## Streaming through the API", ""]
    L.append(table(
        ["streams", "requests", "req/s", "tokens/s", "TTFT p50 ms", "TTFT p90 ms", "TTFT text p50 ms",
         "ITL p50 ms", "ITL p90 ms", "ITL p99 ms", "ITL < 1 ms", "e2e p50 s", "errors", "other load"],
        [[r["clients"], r["requests"] if not r["capped"] else f"{r['requests']}*", _f(r["rate"]),
          _f(r["rate"] * MAX_NEW_TOKENS, 1), _ms(r["ttft_p50"]), _ms(r["ttft_p90"]), _ms(r["ttft_text_p50"]),
          _ms(r["itl_p50"]), _ms(r["itl_p90"]), _ms(r["itl_p99"]), f"{r['itl_burst_share'] * 100:.0f}%"
          if not math.isnan(r["itl_burst_share"]) else "n/a", _f(r["lat_p50"], 3), r["errors"], _noise(r)]
         for r in rows]))
    L.append("")
    L.append("*ITL < 1 ms*: share of gaps under 1 ms, i.e. tokens that reached the client together rather than one "
             "decode step apart. *other load*: CPU cores used by processes outside the benchmark during the "
             "window (`!`: above the limit even on the quietest try). A `*` marks a window cut short.")

    L += ["", "## Where the time to first token goes", ""]
    prow = []
    for r in rows:
        p = r.get("parts") or {}
        if not p.get("n"):
            continue
        prow.append([r["clients"], _ms(r["ttft_p50"]), _ms(p["api_submit"]), _ms(p["queue"]),
                     _ms(p["worker_first"]), _ms(p["deliver"]), p["n"], _f(r["cpu"].get("api")),
                     _f(r["cpu"].get("worker")), _f(r["cpu"].get("redis")), _f(r["cpu"].get("client"))])
    if prow:
        L.append(table(["streams", "TTFT p50 ms", "POST -> job created ms", "created -> running ms",
                        "running -> 1st token in Redis ms", "Redis -> client ms", "jobs",
                        "API cores", "worker cores", "Redis cores", "client cores"], prow))
        L.append("")
        L.append("Medians over the level's requests, from the stack's own records: the job record's `created` "
                 "(written by the API) and `started` (the worker's Celery task thread marks it running), and the "
                 "millisecond timestamp in the Redis Stream id of the job's first token event (written by the "
                 "worker's publisher thread after the prefill step). *Redis -> client*: the API's XREAD wakes, "
                 "the SSE event is written, the client reads it"
                 + (" (and, with `--endpoint jobs`, the GET that opens the stream, when the token is already there)."
                    if a["endpoint"] == "jobs" else ".")
                 + " Each column is a separate median, so they need not add up to the TTFT median. "
                 "Cores: CPU seconds / wall seconds of each process tree during the window.")
    else:
        L.append("(n/a: `--endpoint completions` does not expose job ids.)")

    L += ["", "## In-process reference (same checkpoint, transformers, no server)", ""]
    L.append(table(
        ["what", "median ms", "p10 ms", "p90 ms", "samples"],
        [["prefill: one forward over one prompt (`use_cache=True, logits_to_keep=1`) + argmax",
          _ms(ip["prefill_median_s"], 2), _ms(ip["prefill_p10_s"], 2), _ms(ip["prefill_p90_s"], 2),
          ip["prefill_samples"]],
         ["decode step at batch 1 (one token on the KV cache) + argmax", _ms(ip["decode_step_median_s"], 2), "",
          _ms(ip["decode_step_p90_s"], 2), 4 * (MAX_NEW_TOKENS - 1)],
         ["tokenizing one prompt", _ms(ip["tokenize_median_s"], 2), "", "", len(PROMPTS)]]))
    L.append("")
    L.append(f"Measured in a subprocess before any server started, with torch's default threads; other load "
             f"during the prefill samples: {_f(ip['other_load'])} cores. Prefill samples: "
             f"{a['prefill_reps']} passes over the 16 prompts after 4 warm-up passes.")
    one = next((r for r in rows if r["clients"] == 1), None)
    if one:
        L.append("")
        L.append(f"At 1 stream: TTFT p50 {one['ttft_p50'] * 1000:.1f} ms = prefill {ip['prefill_median_s'] * 1000:.1f} ms "
                 f"+ {(one['ttft_p50'] - ip['prefill_median_s']) * 1000:.1f} ms; ITL p50 {one['itl_p50'] * 1000:.1f} ms "
                 f"= {one['itl_p50'] / ip['decode_step_median_s']:.2f} x the in-process decode step.")
    L.append("")
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
