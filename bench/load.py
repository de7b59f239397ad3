"""Closed-loop HTTP load: N client threads, each with one keep-alive `http.client` connection,
each sending its next request as soon as the previous one has answered (at most one request in
flight per client, no think time).

`http.client` rather than `requests`: it costs the client a fraction of the CPU per request, which
matters on a 2-core machine where the client competes with the server it measures. For rates of
hundreds of requests per second, `python -m bench.load` runs the same loop in a process of its
own, so several of them sidestep one interpreter's GIL (bench.run spawns them for the echo phase).

Measurement window: each client's first `warmup` requests do not count. The window opens when
every client has finished its warm-up (or at `start_at`, a wall-clock time shared by several
processes), and closes once `duration` seconds have passed *and* every client has completed at
least `min_per_client` requests inside it. Requests completed inside the window count; requests
still in flight when it closes are finished but not counted, so every counted request ran at the
full concurrency.
"""

from __future__ import annotations

import argparse
import http.client
import json
import resource
import sys
import threading
import time
from typing import Callable

from bench.common import MAX_NEW_TOKENS, PROMPTS, mean, percentile

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
    return [
        json.dumps({"prompt": p, "max_new_tokens": max_new_tokens, "ignore_eos": True}).encode()
        for p in PROMPTS
    ]


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class _Client(threading.Thread):
    def __init__(self, run: "_Run", idx: int):
        super().__init__(name=f"bench-client-{idx}", daemon=True)
        self.run_, self.idx = run, idx
        self.conn: http.client.HTTPConnection | None = None
        # (wall time the response ended, latency in s, ok, warm-up?)
        self.records: list[tuple[float, float, bool, bool]] = []
        self.done_warmup = False
        self.in_window = 0
        self.error_sample = ""

    def _post(self, body: bytes) -> tuple[int, bytes]:
        r = self.run_
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(r.host, r.port, timeout=r.timeout)
            try:
                self.conn.request("POST", r.path, body, {"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                return resp.status, resp.read()
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
                warm = k < r.warmup
                k += 1
                t0 = time.perf_counter()
                try:
                    status, data = self._post(body)
                    ok = status == 200 and r.expect in data
                    if not ok and not self.error_sample:
                        self.error_sample = f"HTTP {status}: {data[:200]!r}"
                except Exception as exc:  # counted as an error; the loop goes on
                    ok = False
                    if not self.error_sample:
                        self.error_sample = repr(exc)[:200]
                    if self.conn is not None:
                        self.conn.close()
                        self.conn = None
                    time.sleep(0.05)
                end = time.time()
                self.records.append((end, time.perf_counter() - t0, ok, warm))
                if k >= r.warmup:
                    self.done_warmup = True
                ws = r.window_start
                if not warm and ws is not None and end >= ws:
                    self.in_window += 1
        finally:
            if self.conn is not None:
                self.conn.close()


class _Run:
    def __init__(self, host, port, path, bodies, clients, warmup, timeout, offset, expect):
        self.host, self.port, self.path = host, port, path
        self.bodies, self.clients, self.warmup = bodies, clients, warmup
        self.timeout, self.offset, self.expect = timeout, offset, expect
        self.stop = threading.Event()
        self.window_start: float | None = None


def closed_loop(
    host: str,
    port: int,
    clients: int,
    duration: float,
    *,
    path: str = "/basic_generate",
    bodies: list[bytes] | None = None,
    expect: bytes = b'"generated_text"',
    min_per_client: int = 0,
    warmup: int = 1,
    start_at: float | None = None,
    max_window: float | None = None,
    timeout: float = 600.0,
    drain_timeout: float = 300.0,
    offset: int = 0,
    on_window: Callable[[str], None] | None = None,
) -> dict:
    """Run `clients` closed-loop clients; return the window's counts, rate and latencies.

    `on_window("start")` / `on_window("end")` are called as the window opens and closes (the
    caller samples server CPU there). `max_window` caps the window even if some client has not
    reached `min_per_client` (the result then says so).
    """
    run = _Run(host, port, path, bodies or generate_bodies(), clients, warmup, timeout, offset, expect)
    threads = [_Client(run, i) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        if start_at is None:
            while not all(t.done_warmup for t in threads):
                if not any(t.is_alive() for t in threads):
                    raise RuntimeError("every client thread died during warm-up")
                time.sleep(0.01)
        else:
            time.sleep(max(0.0, start_at - time.time()))
        run.window_start = ws = time.time()
        cpu0 = _cpu_seconds()
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
        cpu1 = _cpu_seconds()
        if on_window:
            on_window("end")
    finally:
        run.stop.set()
        drain_end = time.monotonic() + drain_timeout
        for t in threads:
            t.join(max(0.0, drain_end - time.monotonic()))

    lat, errors, n_total, rate = [], 0, 0, 0.0
    for t in threads:
        counted = []  # (start, end, ok) of this client's requests that ended inside the window
        for end, latency, ok, warm in list(t.records):
            n_total += 1
            if warm or not (ws <= end <= we):
                continue
            counted.append((end - latency, end, ok))
            if ok:
                lat.append(latency)
            else:
                errors += 1
        if counted:
            # A client's counted requests follow one another with no gap: from the start of its
            # first to the end of its last, they span whole request cycles. Summing each
            # client's rate over its own span is not quantized the way a count of completions
            # inside a fixed window is when all clients finish together (one batch at a time).
            span = counted[-1][1] - counted[0][0]
            if span > 0:
                rate += sum(ok for *_, ok in counted) / span
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
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--offset", type=int, default=0, help="first prompt index (varies prompts across processes)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    res = closed_loop(
        args.host,
        args.port,
        args.clients,
        args.duration,
        path=args.path,
        warmup=args.warmup,
        start_at=args.start_at,
        max_window=args.duration,
        offset=args.offset,
        drain_timeout=30,
    )
    with open(args.out, "w") as fh:
        json.dump(res, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
