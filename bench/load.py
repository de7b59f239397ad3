"""The closed-loop HTTP driver of every benchmark: N client threads, each with one keep-alive
`http.client` connection (a fraction of `requests`' CPU per request), each sending its next
request as soon as the previous one has answered. A per-request hook says what a request is:
`post_request` (a POST, its whole answer read) or `sse_request` (a stream, its token events
timed as their bytes arrive). `python -m bench.load` runs the loop in a process of its own, so
several sidestep one interpreter's GIL (`spawn_load`).

Window: each client's first `warmup` requests do not count; it opens when every client has
warmed up (or at a time shared by several processes) and closes once `duration` s have passed
*and* every client has completed `min_per_client` requests in it. Rate: each client's counted
requests over the time they spanned, summed over clients (a count inside a fixed window would
jump by a whole batch when all clients finish together).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import MAX_NEW_TOKENS, PROMPTS, CpuMeter, log, mean, own_cpu_s, percentile, quietest

_RETRYABLE = (
    http.client.RemoteDisconnected,
    http.client.CannotSendRequest,
    http.client.BadStatusLine,
    ConnectionResetError,
    BrokenPipeError,
    ConnectionRefusedError,
)


def generate_bodies(max_new_tokens: int = MAX_NEW_TOKENS) -> list[bytes]:
    """One JSON body per prompt, encoded once: the client does no JSON work per request."""
    return [json.dumps({"prompt": p, "max_new_tokens": max_new_tokens, "ignore_eos": True}).encode() for p in PROMPTS]


def completion_bodies(model: str | None, max_tokens: int = MAX_NEW_TOKENS, stream: bool = False) -> list[bytes]:
    """Bodies for POST /v1/completions: greedy, EOS ignored."""
    extra = {"stream": True} if stream else {}
    return [
        json.dumps(
            {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
        ).encode()
        for p in PROMPTS
    ]


def chat_bodies(model: str | None, max_tokens: int = MAX_NEW_TOKENS) -> list[bytes]:
    """Bodies for POST /v1/chat/completions: one user message per prompt, greedy, EOS ignored."""
    return [
        json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": p}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
        ).encode()
        for p in PROMPTS
    ]


class Req:
    """One request of a client: when it ended, how long it took, whether it succeeded; a hook
    adds what it measures as attributes."""

    def __init__(self, warm: bool):
        self.warm, self.ok, self.end, self.latency = warm, False, 0.0, 0.0


#: A per-request hook: does one request on the client's connection (`client.request`), sets what
#: it measured on the Req, raises on failure.
Hook = Callable[["_Client", bytes, Req], None]


class _Client(threading.Thread):
    def __init__(self, run: _Run, idx: int):
        super().__init__(name=f"bench-client-{idx}", daemon=True)
        self.run_, self.idx = run, idx
        self.conn: http.client.HTTPConnection | None = None
        self.records: list[Req] = []
        self.done_warmup = False
        self.in_window = 0
        self.error_sample = ""

    def request(self, method: str, path: str, body: bytes | None = None) -> http.client.HTTPResponse:
        r = self.run_
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(r.host, r.port, timeout=r.timeout)
            try:
                self.conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
                return self.conn.getresponse()
            except _RETRYABLE:
                # A keep-alive connection the server closed while idle: reconnect once.
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def run(self) -> None:
        r = self.run_
        k = 0
        try:
            while not r.stop.is_set():
                body = r.bodies[(r.offset + self.idx + k * r.clients) % len(r.bodies)]
                rq = Req(k < r.warmup)
                k += 1
                t0 = time.perf_counter()
                try:
                    r.hook(self, body, rq)
                    rq.ok = True
                except Exception as exc:  # counted as an error; the loop goes on
                    if not self.error_sample:
                        self.error_sample = repr(exc)[:300]
                    if self.conn is not None:
                        self.conn.close()
                        self.conn = None
                    time.sleep(0.05)
                rq.end = time.time()
                rq.latency = time.perf_counter() - t0
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
    def __init__(self, host, port, hook, bodies, clients, warmup, timeout, offset):
        self.host, self.port, self.hook = host, port, hook
        self.bodies, self.clients, self.warmup = bodies, clients, warmup
        self.timeout, self.offset = timeout, offset
        self.stop = threading.Event()
        self.window_start: float | None = None


def post_request(path: str = "/basic_generate", expect: bytes = b'"generated_text"') -> Hook:
    """POST the body, read the whole answer; ok when HTTP 200 and `expect` is in it."""

    def one(client: _Client, body: bytes, rq: Req) -> None:
        resp = client.request("POST", path, body)
        data = resp.read()
        if resp.status != 200 or expect not in data:
            raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")

    return one


def sse_request(endpoint: str = "jobs", expect_tokens: int = MAX_NEW_TOKENS) -> Hook:
    """A streamed request, its body read with `read1` as bytes arrive; each token event is
    timed when the bytes that complete it are read. `jobs`: POST /v1/jobs, then GET
    /v1/jobs/<id>/stream on the same connection; `completions`: POST /v1/completions with
    `"stream": true` (each `data:` chunk without a finish reason is a token). Sets on the Req:
    ttft (to the first token event, whatever its text), ttft_text (to the first with text),
    gaps (between consecutive token events), job_id, w_post and w_first (wall clock)."""

    def classify(event: str, payload: str) -> tuple[str, str]:
        if endpoint == "jobs":
            return (event, json.loads(payload)["text"]) if event == "token" else (event, "")
        if payload == "[DONE]":
            return "done", ""
        obj = json.loads(payload)
        if "error" in obj:
            return "error", ""
        choice = obj["choices"][0]
        if choice.get("finish_reason"):
            return "finish", choice.get("text", "")  # the last chunk: [DONE] follows
        return "token", choice.get("text", "")

    def one(client: _Client, body: bytes, rq: Req) -> None:
        t0 = time.perf_counter()
        rq.w_post, rq.job_id, rq.w_first, rq.ttft_text = time.time(), None, None, None
        if endpoint == "jobs":
            resp = client.request("POST", "/v1/jobs", body)
            data = resp.read()
            if resp.status != 202:
                raise RuntimeError(f"POST /v1/jobs: HTTP {resp.status}: {data[:200]!r}")
            rq.job_id = json.loads(data)["id"]
            resp = client.request("GET", f"/v1/jobs/{rq.job_id}/stream")
        else:
            resp = client.request("POST", "/v1/completions", body)
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
                kind, text = classify(event, payload)
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
        if len(times) != expect_tokens:
            raise RuntimeError(f"{len(times)} token events, expected {expect_tokens}")
        rq.ttft = times[0] - t0
        rq.gaps = [b - a for a, b in zip(times, times[1:])]

    return one


def sse_stats(counted: list[Req]) -> dict:
    """Time to first token and inter-token latency of the counted streamed requests."""
    ttft = [rq.ttft for rq in counted]
    ttft_text = [rq.ttft_text for rq in counted if rq.ttft_text is not None]
    gaps = [g for rq in counted for g in rq.gaps]
    return {
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "ttft_mean": mean(ttft),
        "ttft_text_p50": percentile(ttft_text, 50),
        "itl_p50": percentile(gaps, 50),
        "itl_p90": percentile(gaps, 90),
        "itl_p99": percentile(gaps, 99),
        "itl_mean": mean(gaps),
        # Gaps under 1 ms: tokens that reached the client together (one read, or back to back).
        "itl_burst_share": (sum(g < 0.001 for g in gaps) / len(gaps)) if gaps else math.nan,
        "_timing": [(rq.job_id, rq.w_post, rq.w_first) for rq in counted if rq.job_id],
    }


def closed_loop(
    host: str,
    port: int,
    clients: int,
    duration: float,
    *,
    path: str = "/basic_generate",
    bodies: list[bytes] | None = None,
    expect: bytes = b'"generated_text"',
    request: Hook | None = None,
    summarize: Callable[[list[Req]], dict] | None = None,
    min_per_client: int = 0,
    warmup: int = 1,
    start_at: float | Callable[[], float] | None = None,
    max_window: float | None = None,
    timeout: float = 600.0,
    drain_timeout: float = 300.0,
    offset: int = 0,
    on_window: Callable[[str], None] | None = None,
) -> dict:
    """Run `clients` closed-loop clients; return the window's counts, rate and latencies.

    `start_at`: the wall-clock time the window opens (shared by several processes), or a
    callable called once every client has warmed up that returns it (a barrier between
    processes); None: as soon as every client has warmed up.
    `request`: the per-request hook (default: `post_request(path, expect)`); `summarize`: more
    figures from the counted successful requests (e.g. `sse_stats`). `on_window("start")` /
    `on_window("end")` are called as the window opens and closes (the caller samples server CPU
    there). `max_window` caps the window even if some client has not reached `min_per_client`
    (the result then says so).
    """
    run = _Run(
        host, port, request or post_request(path, expect), bodies or generate_bodies(), clients, warmup, timeout, offset
    )
    threads = [_Client(run, i) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        if start_at is None or callable(start_at):
            while not all(t.done_warmup for t in threads):
                if not any(t.is_alive() for t in threads):
                    raise RuntimeError("every client thread died during warm-up")
                time.sleep(0.01)
        if callable(start_at):
            start_at = start_at()
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))
        run.window_start = ws = time.time()
        cpu0 = own_cpu_s()
        if on_window:
            on_window("start")
        cap = max_window if max_window is not None else max(10 * duration, 600.0)
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
        cpu1 = own_cpu_s()
        if on_window:
            on_window("end")
    finally:
        run.stop.set()
        drain_end = time.monotonic() + drain_timeout
        for t in threads:
            t.join(max(0.0, drain_end - time.monotonic()))

    ok: list[Req] = []
    errors, n_total, rate = 0, 0, 0.0
    for t in threads:
        records = list(t.records)
        n_total += len(records)
        counted = [rq for rq in records if not rq.warm and ws <= rq.end <= we]
        errors += sum(not rq.ok for rq in counted)
        ok += [rq for rq in counted if rq.ok]
        if counted:
            span = counted[-1].end - (counted[0].end - counted[0].latency)
            if span > 0:
                rate += sum(rq.ok for rq in counted) / span
    lat = [rq.latency for rq in ok]
    window = we - ws
    return {
        "clients": clients,
        "requests": len(lat),
        "errors": errors,
        "error_sample": next((t.error_sample for t in threads if t.error_sample), ""),
        "window_s": window,
        "window_start": ws,
        "window_end": we,
        "rate": rate,
        "window_rate": len(lat) / window if window > 0 else 0.0,
        "latencies": lat,
        "p50": percentile(lat, 50),
        "p90": percentile(lat, 90),
        "p99": percentile(lat, 99),
        "mean": mean(lat),
        "min_per_client": min((t.in_window for t in threads), default=0),
        "capped": capped,
        "client_cpu_s": cpu1 - cpu0,
        "requests_total": n_total,
        "stragglers": sum(t.is_alive() for t in threads),
        **(summarize(ok) if summarize else {}),
    }


def measure_levels(
    label: str,
    port: int,
    levels: list[int],
    args,
    groups: dict,
    pids=(),
    *,
    warm: bool = True,
    min_requests: int | None = None,
    after: Callable[[dict], dict] | None = None,
    log: Callable[[str], None] = log,
    **loop,
) -> list[dict]:
    """A warm-up round (unless `warm` is false), then per level: `closed_loop` (keyword
    arguments `loop`: path, bodies, request, ...) for --duration s and >= `min_requests`
    (--min-requests) per client, CPU of `groups` (a CpuMeter) in `cpu`, `after(result)` merged in,
    repeated by `quietest` while other processes disturbed it. `pids`: our process trees."""
    if warm:
        closed_loop("127.0.0.1", port, 1, 0, warmup=0, min_per_client=3, **loop)
        closed_loop("127.0.0.1", port, min(8, max(levels)), 0, warmup=0, min_per_client=1, **loop)
    rows = []
    for level in levels:

        def attempt():
            meter = CpuMeter(groups)
            res = closed_loop(
                "127.0.0.1",
                port,
                level,
                args.duration,
                warmup=1,
                on_window=meter,
                offset=level,
                min_per_client=args.min_requests if min_requests is None else min_requests,
                **loop,
            )
            res.pop("latencies")
            res["cpu"] = meter.result
            if after:
                res.update(after(res))
            log(
                f"{label} level {level:3d}: {res['rate']:.2f} req/s, p50 {res['p50']:.3f} s, "
                f"{res['requests']} requests in {res['window_s']:.1f} s, errors {res['errors']}, "
                f"other load {meter.result.get('other', 0):.2f} cores"
            )
            if res["errors"]:
                log(f"  first error: {res['error_sample']}")
            return res

        rows.append(quietest(attempt, args, pids, log))
    return rows


def spawn_load(
    procs,
    port: int,
    clients: int,
    nprocs: int,
    duration: float,
    outdir,
    tag: str,
    on_window: Callable[[str], None] | None = None,
    lead: float = 0.3,
    max_new_tokens: int = MAX_NEW_TOKENS,
    timeout: float = 120,
    completions_model: str | None = None,
) -> dict:
    """Closed-loop load on POST /basic_generate from `nprocs` processes of `python -m bench.load`
    (so the client's GIL is not the limit), `clients` threads in all, one shared window that
    opens `lead` s after every process's clients have warmed up and lasts `duration` s; their
    results merged. `completions_model`: POST /v1/completions for that model instead (greedy,
    EOS ignored, `max_new_tokens` as max_tokens). `client_cpu`: their
    CPU in cores over the window. Processes are started through `procs` (bench.common.Processes)."""
    nproc = max(1, min(nprocs, clients))
    per = [clients // nproc + (i < clients % nproc) for i in range(nproc)]
    barrier = outdir / f"{tag}-barrier"
    barrier.mkdir()
    loaders = []
    for i, n in enumerate(per):
        out = outdir / f"{tag}-load{i}.json"
        argv = [
            sys.executable,
            "-m",
            "bench.load",
            "--port",
            str(port),
            "--clients",
            str(n),
            "--duration",
            str(duration),
            "--barrier",
            str(barrier),
            "--warmup",
            "3",
            "--offset",
            str(i * 7),
            "--max-new-tokens",
            str(max_new_tokens),
            "--out",
            str(out),
        ]
        if completions_model:
            argv += ["--path", "/v1/completions", "--completions-model", completions_model]
        loaders.append((procs.start(f"{tag}-load{i}", argv), out))
    # The window opens once every loader's clients have warmed up, however long that takes.
    deadline = time.monotonic() + timeout
    while len(list(barrier.glob("ready-*"))) < nproc:
        dead = [p for p, _ in loaders if not p.alive()]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(
                f"a load generator {'exited' if dead else 'did not warm up'} before the window:\n"
                f"{(dead or [loaders[0][0]])[0].tail()}"
            )
        time.sleep(0.02)
    start_at = time.time() + lead
    (barrier / "start.tmp").write_text(repr(start_at))
    (barrier / "start.tmp").rename(barrier / "start")
    time.sleep(max(0.0, start_at - time.time()))
    if on_window:
        on_window("start")
    time.sleep(max(0.0, start_at + duration - time.time()))
    if on_window:
        on_window("end")
    parts = []
    deadline = time.monotonic() + timeout
    for p, out in loaders:
        while p.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        procs.stop(p)
        if not out.exists():
            raise RuntimeError(f"{p.name} wrote no result:\n{p.tail()}")
        parts.append(json.loads(out.read_text()))
    window = mean(pt["window_s"] for pt in parts)
    lat = sorted(x for pt in parts for x in pt["latencies"])
    n = sum(pt["requests"] for pt in parts)
    return {
        "clients": clients,
        "client_procs": nproc,
        "requests": n,
        "errors": sum(pt["errors"] for pt in parts),
        "error_sample": next((pt["error_sample"] for pt in parts if pt["error_sample"]), ""),
        "window_s": window,
        "window_start": start_at,
        "window_end": start_at + window,
        "rate": sum(pt["rate"] for pt in parts),
        "window_rate": n / window if window else 0.0,
        "p50": percentile(lat, 50),
        "p90": percentile(lat, 90),
        "p99": percentile(lat, 99),
        "client_cpu": sum(pt["client_cpu_s"] for pt in parts) / window if window else math.nan,
    }


def main(argv: list[str] | None = None) -> int:
    """One load-generator process; bench.run starts several and merges their JSON."""
    ap = argparse.ArgumentParser(prog="python -m bench.load")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--path", default="/basic_generate")
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--duration", type=float, required=True)
    ap.add_argument("--start-at", type=float, default=None, help="wall-clock time the window opens")
    ap.add_argument(
        "--barrier",
        type=Path,
        default=None,
        help="once warm, create BARRIER/ready-<pid>, then open the window at the time BARRIER/start holds",
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--offset", type=int, default=0, help="first prompt index (varies prompts across processes)")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument(
        "--completions-model",
        default=None,
        help="bodies for POST /v1/completions with this model (use with --path /v1/completions)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.completions_model:
        bodies, expect = completion_bodies(args.completions_model, args.max_new_tokens), b'"choices"'
    else:
        bodies, expect = generate_bodies(args.max_new_tokens), b'"generated_text"'

    def barrier() -> float:
        (args.barrier / f"ready-{os.getpid()}").touch()
        while not (args.barrier / "start").exists():
            time.sleep(0.01)
        return float((args.barrier / "start").read_text())

    res = closed_loop(
        args.host,
        args.port,
        args.clients,
        args.duration,
        path=args.path,
        bodies=bodies,
        expect=expect,
        warmup=args.warmup,
        start_at=barrier if args.barrier else args.start_at,
        max_window=args.duration,
        offset=args.offset,
        drain_timeout=30,
    )
    with open(args.out, "w") as fh:
        json.dump(res, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
