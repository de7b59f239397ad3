"""The closed-loop HTTP driver of every benchmark: client threads, each with one keep-alive
connection, each sending its next request as soon as the previous one has answered; a hook says
what a request is (`post_request`, `sse_request`). `python -m bench.load` runs it in a process
of its own, several of them sidestepping one interpreter's GIL (`spawn_load`). The window and
the rate: docs/benchmarks.md, "The harnesses".
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
from types import SimpleNamespace

from bench.common import (
    MAX_NEW_TOKENS,
    PROMPTS,
    CpuMeter,
    log,
    mean,
    module_argv,
    own_cpu_s,
    pcts,
    percentile,
    quietest,
)

#: A keep-alive connection the server closed while idle: send once more on a new one.
_RETRYABLE = (http.client.CannotSendRequest, http.client.BadStatusLine, ConnectionError)


def generate_bodies(max_new_tokens: int = MAX_NEW_TOKENS) -> list[bytes]:
    """One JSON body per prompt, encoded once: the client does no JSON work per request."""
    return [json.dumps({"prompt": p, "max_new_tokens": max_new_tokens, "ignore_eos": True}).encode() for p in PROMPTS]


def completion_bodies(model: str | None, max_tokens: int = MAX_NEW_TOKENS, stream: bool = False) -> list[bytes]:
    """Bodies for POST /v1/completions: greedy, EOS ignored."""
    greedy = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **({"stream": True} if stream else {})}
    return [json.dumps({"model": model, "prompt": p, **greedy}).encode() for p in PROMPTS]


def chat_bodies(model: str | None, max_tokens: int = MAX_NEW_TOKENS) -> list[bytes]:
    """Bodies for POST /v1/chat/completions: one user message per prompt, greedy, EOS ignored."""
    greedy = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return [
        json.dumps({"model": model, "messages": [{"role": "user", "content": p}], **greedy}).encode() for p in PROMPTS
    ]


class Conn:
    """One keep-alive HTTP connection; a request that finds it closed by the server while idle
    is sent once more on a new one."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 600.0):
        self.host, self.port, self.timeout = host, port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None) -> http.client.HTTPResponse:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
                return self.conn.getresponse()
            except _RETRYABLE:
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


#: A per-request hook: does one request on the client's connection, sets what it measured on
#: the request (a SimpleNamespace), raises on failure.
Hook = Callable[[Conn, bytes, SimpleNamespace], None]


class Loop:
    """`clients` threads, each on a keep-alive connection of its own, sending `body(client, k)`
    (its k-th request) with `hook` as soon as the previous one has answered, until `stop()`, or
    `limit` requests each. Every request is kept in `records`: a SimpleNamespace with client,
    k, ok, error, end (wall clock), latency and what the hook set; `done` counts them per client."""

    def __init__(self, port: int, clients: int, body, hook: Hook, name: str, limit=None, timeout: float = 600.0):
        self.port, self.body, self.hook, self.limit, self.timeout = port, body, hook, limit, timeout
        self.records: list = []
        self.done = [0] * clients
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(clients)
        ]

    def start(self) -> Loop:
        for t in self.threads:
            t.start()
        return self

    def _run(self, i: int) -> None:
        conn = Conn(self.port, timeout=self.timeout)
        k = 0
        try:
            while not self._stop.is_set() and (self.limit is None or k < self.limit):
                rq = SimpleNamespace(client=i, k=k, ok=False, error="")
                t0 = time.perf_counter()
                try:
                    self.hook(conn, self.body(i, k), rq)
                    rq.ok = True
                except Exception as exc:  # counted as an error; the loop goes on
                    rq.error = repr(exc)[:300]
                    conn.close()
                    time.sleep(0.05)
                rq.end, rq.latency = time.time(), time.perf_counter() - t0
                k += 1
                with self._lock:
                    self.records.append(rq)
                    self.done[i] += 1
        finally:
            conn.close()

    def wait_each(self, n: int, timeout: float | None) -> None:
        """Until every client has finished `n` requests."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while min(self.done) < n:
            if not any(t.is_alive() for t in self.threads):
                raise RuntimeError(f"every client thread ended before {n} requests each: {self.done}")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"clients did not finish {n} requests in {timeout:g} s: {self.done}")
            time.sleep(0.01)

    def join(self, timeout: float | None = 600) -> None:
        end = time.monotonic() + (timeout or 0)
        for t in self.threads:
            t.join(None if timeout is None else max(0.0, end - time.monotonic()))

    def stop(self, timeout: float = 600) -> None:
        """Stop once the requests under way have ended."""
        self._stop.set()
        self.join(timeout)


def post_request(path: str = "/basic_generate", expect: bytes = b'"generated_text"') -> Hook:
    """POST the body, read the whole answer; ok when HTTP 200 and `expect` is in it."""

    def one(conn: Conn, body: bytes, rq) -> None:
        resp = conn.request("POST", path, body)
        data = resp.read()
        if resp.status != 200 or expect not in data:
            raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")

    return one


def sse_events(resp: http.client.HTTPResponse):
    """(event, data, perf_counter when its last bytes were read) of each event of a stream, read
    with `read1` as the bytes arrive; keep-alive comments skipped. Raises if the stream ends."""
    buf = b""
    while True:
        chunk = resp.read1(65536)
        now = time.perf_counter()
        if not chunk:
            raise RuntimeError("the stream ended before its last event")
        buf += chunk
        while b"\n\n" in buf:
            raw, buf = buf.split(b"\n\n", 1)
            event, data = "message", []
            for line in raw.decode().split("\n"):
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip(" "))
            if data:
                yield event, "\n".join(data), now


def sse_request(endpoint: str = "jobs", expect_tokens: int = MAX_NEW_TOKENS) -> Hook:
    """A streamed request, each token event timed when the bytes that complete it are read.
    `jobs`: POST /v1/jobs, then GET /v1/jobs/<id>/stream on the same connection; `completions`:
    POST /v1/completions with `"stream": true` (each chunk without a finish reason is a token).
    Sets on the request: ttft (to the first token event), ttft_text (to the first with text), gaps
    (between token events), job_id, w_post and w_first (wall clock)."""

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

    def one(conn: Conn, body: bytes, rq) -> None:
        t0 = time.perf_counter()
        rq.w_post, rq.job_id, rq.w_first, rq.ttft_text = time.time(), None, None, None
        if endpoint == "jobs":
            resp = conn.request("POST", "/v1/jobs", body)
            data = resp.read()
            if resp.status != 202:
                raise RuntimeError(f"POST /v1/jobs: HTTP {resp.status}: {data[:200]!r}")
            rq.job_id = json.loads(data)["id"]
            resp = conn.request("GET", f"/v1/jobs/{rq.job_id}/stream")
        else:
            resp = conn.request("POST", "/v1/completions", body)
        if resp.status != 200:
            raise RuntimeError(f"stream: HTTP {resp.status}: {resp.read()[:200]!r}")
        times: list[float] = []
        for event, payload, now in sse_events(resp):
            kind, text = classify(event, payload)
            if kind == "token":
                if not times:
                    rq.w_first = time.time()
                times.append(now)
                if text and rq.ttft_text is None:
                    rq.ttft_text = now - t0
            elif kind == "done":
                break
            elif kind == "error":
                raise RuntimeError(f"error event: {payload[:200]}")
        resp.read()  # the rest of the chunked body (its end), so the connection can be reused
        if len(times) != expect_tokens:
            raise RuntimeError(f"{len(times)} token events, expected {expect_tokens}")
        rq.ttft = times[0] - t0
        rq.gaps = [b - a for a, b in zip(times, times[1:])]

    return one


def sse_stats(counted: list) -> dict:
    """Time to first token and inter-token latency of the counted streamed requests."""
    ttft = [rq.ttft for rq in counted]
    ttft_text = [rq.ttft_text for rq in counted if rq.ttft_text is not None]
    gaps = [g for rq in counted for g in rq.gaps]
    return {
        **pcts(ttft, "ttft_", (50, 90)),
        "ttft_mean": mean(ttft),
        "ttft_text_p50": percentile(ttft_text, 50),
        **pcts(gaps, "itl_"),
        "itl_mean": mean(gaps),
        # Gaps under 1 ms: tokens that reached the client together (one read, or back to back).
        "itl_burst_share": (sum(g < 0.001 for g in gaps) / len(gaps)) if gaps else math.nan,
        "_timing": [(rq.job_id, rq.w_post, rq.w_first) for rq in counted if rq.job_id],
    }


def closed_loop(
    port: int,
    clients: int,
    duration: float,
    *,
    path: str = "/basic_generate",
    bodies: list[bytes] | None = None,
    expect: bytes = b'"generated_text"',
    request: Hook | None = None,
    summarize: Callable[[list], dict] | None = None,
    min_per_client: int = 0,
    warmup: int = 1,
    start_at: float | Callable[[], float] | None = None,
    max_window: float | None = None,
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
    bodies = bodies or generate_bodies()
    body = lambda i, k: bodies[(offset + i + k * clients) % len(bodies)]  # noqa: E731
    loop = Loop(port, clients, body, request or post_request(path, expect), "bench-client").start()
    try:
        if start_at is None or callable(start_at):
            loop.wait_each(max(warmup, 1), None)
        if callable(start_at):
            start_at = start_at()
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))
        before, ws, cpu0 = list(loop.done), time.time(), own_cpu_s()
        if on_window:
            on_window("start")
        cap, capped = max_window if max_window is not None else max(10 * duration, 600.0), False
        in_window = lambda: [d - b for d, b in zip(loop.done, before)]  # noqa: E731
        while time.time() - ws < duration or min(in_window()) < min_per_client:
            if capped := time.time() - ws >= cap:
                break
            time.sleep(0.01)
        we = time.time()
        loop._stop.set()
        cpu1 = own_cpu_s()
        if on_window:
            on_window("end")
    finally:
        loop.stop(drain_timeout)

    ok, errors, rate = [], 0, 0.0
    for i in range(clients):
        counted = [rq for rq in loop.records if rq.client == i and rq.k >= warmup and ws <= rq.end <= we]
        errors += sum(not rq.ok for rq in counted)
        ok += [rq for rq in counted if rq.ok]
        if counted and (span := counted[-1].end - (counted[0].end - counted[0].latency)) > 0:
            rate += sum(rq.ok for rq in counted) / span
    lat = [rq.latency for rq in ok]
    window = we - ws
    res = {"clients": clients, "requests": len(lat), "errors": errors}
    res["error_sample"] = next((rq.error for rq in loop.records if rq.error), "")
    res |= {"window_s": window, "window_start": ws, "window_end": we}
    res |= {"rate": rate, "window_rate": len(lat) / window if window > 0 else 0.0}
    res |= {"latencies": lat, **pcts(lat), "mean": mean(lat)}
    res |= {"min_per_client": min(in_window(), default=0), "capped": capped, "client_cpu_s": cpu1 - cpu0}
    res |= {"requests_total": len(loop.records), "stragglers": sum(t.is_alive() for t in loop.threads)}
    return res | (summarize(ok) if summarize else {})


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
        closed_loop(port, 1, 0, warmup=0, min_per_client=3, **loop)
        closed_loop(port, min(8, max(levels)), 0, warmup=0, min_per_client=1, **loop)
    rows = []
    for level in levels:

        def attempt():
            meter = CpuMeter(groups)
            least = args.min_requests if min_requests is None else min_requests
            res = closed_loop(
                port, level, args.duration, on_window=meter, min_per_client=least, **{"offset": level, **loop}
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
    procs, port, clients, nprocs, duration, outdir, tag, meter: CpuMeter, max_new_tokens=MAX_NEW_TOKENS
) -> dict:
    """Closed-loop load on POST /basic_generate from `nprocs` processes of `python -m bench.load`
    (so the client's GIL is not the limit), `clients` threads in all, one shared window that
    opens 0.3 s after every process's clients have warmed up and lasts `duration` s; their
    results merged. `meter` is called as the window opens and closes; its figures go to `cpu`,
    the load generators' own in `client` (not in `other`). Processes are started through
    `procs` (bench.common.Processes)."""
    nproc = max(1, min(nprocs, clients))
    per = [clients // nproc + (i < clients % nproc) for i in range(nproc)]
    barrier = outdir / f"{tag}-barrier"
    barrier.mkdir()
    loaders = []
    for i, n in enumerate(per):
        out = outdir / f"{tag}-load{i}.json"
        flags = {"port": port, "clients": n, "duration": duration, "barrier": barrier, "warmup": 3, "offset": i * 7}
        argv = module_argv("bench.load", **flags, max_new_tokens=max_new_tokens, out=out)
        loaders.append((procs.start(f"{tag}-load{i}", argv), out))
    # The window opens once every loader's clients have warmed up (within 120 s).
    deadline = time.monotonic() + 120
    while len(list(barrier.glob("ready-*"))) < nproc:
        dead = [p for p, _ in loaders if not p.alive()]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(
                f"a load generator {'exited' if dead else 'did not warm up'} before the window:\n"
                f"{(dead or [loaders[0][0]])[0].tail()}"
            )
        time.sleep(0.02)
    start_at = time.time() + 0.3
    (barrier / "start.tmp").write_text(repr(start_at))
    (barrier / "start.tmp").rename(barrier / "start")
    time.sleep(max(0.0, start_at - time.time()))
    meter("start")
    time.sleep(max(0.0, start_at + duration - time.time()))
    meter("end")
    parts, deadline = [], time.monotonic() + 120  # for the loaders' results
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
    res = {"clients": clients, "client_procs": nproc, "requests": n, "errors": sum(pt["errors"] for pt in parts)}
    res["error_sample"] = next((pt["error_sample"] for pt in parts if pt["error_sample"]), "")
    res |= {"window_s": window, "window_start": start_at, "window_end": start_at + window}
    res |= {"rate": sum(pt["rate"] for pt in parts), "window_rate": n / window if window else 0.0, **pcts(lat)}
    cpu = res["cpu"] = dict(meter.result)
    cpu["client"] = sum(pt["client_cpu_s"] for pt in parts) / window if window else math.nan
    cpu["other"] = max(0.0, cpu.get("other", 0.0) - cpu["client"])
    return res


def main(argv: list[str] | None = None) -> int:
    """One load-generator process of `spawn_load`: its clients warm up, it says so (a file in
    --barrier), and opens its window at the time the file BARRIER/start holds."""
    ap = argparse.ArgumentParser(prog="python -m bench.load")
    for flag, kind in (("--port", int), ("--clients", int), ("--duration", float), ("--barrier", Path), ("--out", str)):
        ap.add_argument(flag, type=kind, required=True)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--offset", type=int, default=0, help="first prompt index (varies prompts across processes)")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    args = ap.parse_args(argv)

    def barrier() -> float:
        (args.barrier / f"ready-{os.getpid()}").touch()
        while not (args.barrier / "start").exists():
            time.sleep(0.01)
        return float((args.barrier / "start").read_text())

    loop = {"bodies": generate_bodies(args.max_new_tokens), "warmup": args.warmup, "offset": args.offset}
    window = {"start_at": barrier, "max_window": args.duration, "drain_timeout": 30}
    res = closed_loop(args.port, args.clients, args.duration, **loop, **window)
    with open(args.out, "w") as fh:
        json.dump(res, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
