"""`python -m bench.vllm` (`make bench-vllm`): our API over a vLLM worker beside vLLM's own
OpenAI-compatible server, same checkpoint, same engine settings, one after the other; writes
docs/benchmarks-vllm.md.

1. *Ours*: private Redis (or REDIS_URL when it answers), one worker with GENQ_ENGINE=vllm and
   GENQ_MAX_BATCH_SIZE=64 (vLLM's `max_num_seqs`), the API under gunicorn; closed-loop clients
   (bench.load: one keep-alive `http.client` connection per client thread, no think time) on
   `POST /v1/completions` with temperature 0, max_tokens 32, ignore_eos, not streamed.
2. *vLLM's server*: everything of step 1 stopped first, then
   `python -m vllm.entrypoints.openai.api_server --model <ckpt> --enforce-eager --dtype float32
   --max-num-seqs 64 --disable-log-stats --disable-uvicorn-access-log` (VLLM_CPU_KVCACHE_SPACE=1,
   as our worker), the same requests.

Never both engines at once: the machine has two cores. Per level: req/s, output tokens/s,
p50/p90/p99 latency; ratios ours / theirs. Where the time goes: our job records (queue wait, time
in the worker) and CPU per process (API, worker, vLLM engine core, Redis; vLLM's API server and
engine core). Everything started is stopped (process groups), also on Ctrl-C or an error. Logs
and raw JSON: bench/out/vllm-<timestamp>/ (git-ignored).
Quick run: `python -m bench.vllm --model tiny --levels 1,2 --duration 2 --no-write`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import shlex
import signal
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import redis

from bench.common import MAX_NEW_TOKENS, PROMPTS, mean
from bench.load import closed_loop
from bench.stream import Processes, job_stats, machine_facts, model_dirs, quietest, redis_version, table
from scripts import stack

ROOT = stack.ROOT
MODEL_DIRS = model_dirs()
DEFAULT_LEVELS = "1,8,32,64"
MAX_NUM_SEQS = 64
KV_CACHE_GIB = "1"
TARGET_THROUGHPUT_RATIO = 0.9  # ours / theirs req/s, at every level
TARGET_P50_RATIO = 1.1  # ours / theirs p50 latency, at every level
ENGINE_CORE = "EngineCore"  # vLLM names its engine-core process VLLM::EngineCore_...


def log(msg: str) -> None:
    print(f"[vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _system_busy_s() -> float:
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = (f + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _is_engine_core(p: psutil.Process) -> bool:
    try:
        return ENGINE_CORE in p.name() or any(ENGINE_CORE in c for c in p.cmdline())
    except psutil.Error:
        return False


def split_tree(pid: int) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(the process and its helpers, vLLM engine-core processes) of one process tree."""
    try:
        root = psutil.Process(pid)
        kids = root.children(recursive=True)
    except psutil.Error:
        return [], []
    core = [p for p in kids if _is_engine_core(p)]
    core_pids = {p.pid for p in core}
    for p in list(core):
        try:
            core += [c for c in p.children(recursive=True) if c.pid not in core_pids]
        except psutil.Error:
            pass
    core_pids = {p.pid for p in core}
    return [root] + [p for p in kids if p.pid not in core_pids], core


class ProcMeter:
    """CPU of named groups of processes (each counted once) over the load window, in cores;
    `other` is what the rest of the machine used meanwhile."""

    def __init__(self, groups):
        self.groups = groups  # name -> callable returning the group's processes
        self.procs: dict[str, list[psutil.Process]] = {}
        self.start: dict = {}
        self.result: dict = {}

    @staticmethod
    def _cpu(procs) -> float:
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def _sample(self) -> dict:
        s = {name: self._cpu(ps) for name, ps in self.procs.items()}
        t = os.times()
        s["client"] = t.user + t.system
        s["_system"], s["_t"] = _system_busy_s(), time.monotonic()
        return s

    def __call__(self, event: str) -> None:
        if event == "start":
            self.procs = {name: fn() for name, fn in self.groups.items()}
            self.start = self._sample()
            return
        end = self._sample()
        d = {k: end[k] - self.start[k] for k in end}
        wall, system = d.pop("_t"), d.pop("_system")
        d["other"] = max(0.0, system - sum(d.values()))
        self.result = {k: v / wall for k, v in d.items()}
        self.result["_wall"] = wall


def post_json(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def bodies_for(model: str) -> list[bytes]:
    return [json.dumps({"model": model, "prompt": p, "max_tokens": MAX_NEW_TOKENS, "temperature": 0,
                        "ignore_eos": True}).encode() for p in PROMPTS]


def engine_config(logfile: Path) -> dict[str, str] | None:
    """vLLM's engine configuration as it logs it at start ("... with config: k=v, k=v, ...")."""
    try:
        text = logfile.read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"Initializing a V1 LLM engine.*? with config: (.*)", text)
    if not m:
        return None
    out, depth, key, cur = {}, 0, None, ""
    for ch in m.group(1).rstrip() + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            if "=" in cur:
                key, val = cur.split("=", 1)
                out[key.strip()] = val.strip()
            cur = ""
            continue
        cur += ch
    return out


def measure_levels(label, port, model, levels, args, groups, after=None) -> list[dict]:
    """Warm up, then each level: closed-loop load on /v1/completions, CPU per group."""
    bodies = bodies_for(model)
    closed_loop("127.0.0.1", port, 1, 0, path="/v1/completions", bodies=bodies, expect=b'"choices"',
                warmup=0, min_per_client=3)
    closed_loop("127.0.0.1", port, min(8, max(levels)), 0, path="/v1/completions", bodies=bodies,
                expect=b'"choices"', warmup=0, min_per_client=1)
    rows = []
    for level in levels:

        def attempt():
            meter = ProcMeter(groups)
            res = closed_loop("127.0.0.1", port, level, args.duration, path="/v1/completions", bodies=bodies,
                              expect=b'"choices"', warmup=1, min_per_client=args.min_requests,
                              on_window=meter, offset=level)
            res.pop("latencies")
            res["cpu"] = meter.result
            if after:
                res.update(after(res))
            log(f"{label} level {level:3d}: {res['rate']:.2f} req/s, p50 {res['p50']:.3f} s, "
                f"{res['requests']} requests in {res['window_s']:.1f} s, errors {res['errors']}, "
                f"other load {meter.result.get('other', 0):.2f} cores")
            if res["errors"]:
                log(f"  first error: {res['error_sample']}")
            return res

        rows.append(quietest(attempt, args))
    return rows


def sanity(base: str, model: str) -> dict:
    """One request: the completion has MAX_NEW_TOKENS tokens; its text (greedy) is compared
    between the two servers."""
    body = post_json(base + "/v1/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_NEW_TOKENS,
                                                "temperature": 0, "ignore_eos": True})
    usage = body.get("usage") or {}
    if usage.get("completion_tokens") != MAX_NEW_TOKENS:
        raise RuntimeError(f"expected {MAX_NEW_TOKENS} completion tokens, got {body}")
    return {"text": body["choices"][0]["text"], "usage": usage}


def run_ours(procs: Processes, model_dir: Path, args, outdir: Path) -> dict:
    url = os.environ.get("REDIS_URL")
    private = None
    if stack.redis_answers(url):
        redis_url, redis_pid, kind = url, None, "REDIS_URL"
    else:
        private = procs.redis()
        redis_url, redis_pid, kind = private.url, private.proc.pid, "private redis-server"
    name = f"bench-vllm-{uuid.uuid4().hex[:6]}"
    port = stack.free_port()
    env = {"REDIS_URL": redis_url, "GENQ_MODEL": str(model_dir), "GENQ_MODEL_NAME": name, "GENQ_HOST": "127.0.0.1",
           "GENQ_PORT": str(port), "GENQ_ENGINE": "vllm", "GENQ_MAX_BATCH_SIZE": str(MAX_NUM_SEQS),
           "GENQ_API_WORKERS": str(args.api_workers), "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
           "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    worker = procs.start("ours-worker", stack.worker_argv("vllm"), env)
    api = procs.start("ours-api", stack.api_argv(), env)
    base = f"http://127.0.0.1:{port}"
    try:
        stack.wait_until(lambda: stack.http_get(base + "/healthz")[0] == 200, 60, "the API", [api, worker])
        stack.wait_until(lambda: stack.http_get(base + "/readyz")[0] == 200, 600, "a ready vLLM worker", [api, worker])
        startup = time.monotonic() - t0
        log(f"ours ready on port {port} after {startup:.0f} s")
        rv = redis_version(redis_url)
        check = sanity(base, name)
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        groups = {
            "api": lambda: stack_tree(api.pid),
            "worker": lambda: split_tree(worker.pid)[0],
            "engine core": lambda: split_tree(worker.pid)[1],
            "redis": lambda: stack_tree(redis_pid) if redis_pid else [],
        }
        rows = measure_levels("ours", port, name, args.levels, args, groups,
                              after=lambda res: {"jobs": job_stats(r, name, res["window_start"], res["window_end"])})
    finally:
        procs.stop(api)
        procs.stop(worker)
        if private:
            procs.stop(private)
    return {"levels": rows, "startup_s": startup, "check": check, "redis_kind": kind, "redis_version": rv,
            "model_name": name, "config": engine_config(outdir / "ours-worker.log")}


def stack_tree(pid: int | None) -> list[psutil.Process]:
    if not pid:
        return []
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return []


def run_theirs(procs: Processes, model_dir: Path, args, outdir: Path) -> dict:
    port = stack.free_port()
    argv = [stack.worker_argv("vllm")[0], "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--enforce-eager", "--dtype", "float32", "--max-num-seqs", str(MAX_NUM_SEQS), "--host", "127.0.0.1",
            "--port", str(port), "--disable-log-stats", "--disable-uvicorn-access-log"]
    env = {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    server = procs.start("vllm-server", argv, env)
    base = f"http://127.0.0.1:{port}"
    try:
        stack.wait_until(lambda: stack.http_get(base + "/v1/models", timeout=5)[0] == 200, 600,
                         "vLLM's server", [server])
        startup = time.monotonic() - t0
        model = json.loads(stack.http_get(base + "/v1/models")[1])["data"][0]["id"]
        log(f"vLLM's server ready on port {port} after {startup:.0f} s, model {model!r}")
        check = sanity(base, model)
        groups = {"server": lambda: split_tree(server.pid)[0], "engine core": lambda: split_tree(server.pid)[1]}
        rows = measure_levels("vLLM", port, model, args.levels, args, groups)
    finally:
        procs.stop(server)
    return {"levels": rows, "startup_s": startup, "check": check, "argv": argv, "env": env,
            "config": engine_config(outdir / "vllm-server.log")}


# -- report -----------------------------------------------------------------------------------


def _f(x, nd=2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{nd}f}"


def _noise(r: dict) -> str:
    s = _f(r["cpu"].get("other"))
    if r.get("attempts", 1) > 1:
        s += f" ({r['attempts']} tries)"
    return s + (" !" if r.get("noisy") else "")


def _per_req_ms(r: dict, key: str) -> float:
    return r["cpu"].get(key, math.nan) * r["cpu"].get("_wall", 0) / r["requests"] * 1000 if r["requests"] else math.nan


def verdicts(res: dict) -> list[tuple[str, str]]:
    ours = {r["clients"]: r for r in res["ours"]["levels"]}
    theirs = {r["clients"]: r for r in res["theirs"]["levels"]}
    out = []
    for c in sorted(set(ours) & set(theirs)):
        o, t = ours[c], theirs[c]
        tr = o["rate"] / t["rate"] if t["rate"] else math.nan
        lr = o["p50"] / t["p50"] if t["p50"] else math.nan
        out.append(("PASS" if tr >= TARGET_THROUGHPUT_RATIO else "FAIL",
                    f"throughput at {c} clients: {o['rate']:.2f} / {t['rate']:.2f} req/s = {tr:.2f} x "
                    f"(target >= {TARGET_THROUGHPUT_RATIO} x)"))
        out.append(("PASS" if lr <= TARGET_P50_RATIO else "FAIL",
                    f"p50 latency at {c} clients: {o['p50']:.3f} / {t['p50']:.3f} s = {lr:.2f} x "
                    f"(target <= {TARGET_P50_RATIO} x)"))
    return out


def config_diff(a: dict | None, b: dict | None) -> str:
    if not a or not b:
        return "could not read both engine configurations from the logs"
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if not keys:
        return "identical"
    return "differs only in " + ", ".join(f"`{k}` (ours `{a.get(k)}`, theirs `{b.get(k)}`)" for k in keys)


def render(res: dict) -> str:
    m, ours, theirs, a = res["machine"], res["ours"], res["theirs"], res["args"]
    L = ["# Our API over vLLM vs vLLM's own server", ""]
    L.append("Generated by `python -m bench.vllm` (bench/vllm.py, `make bench-vllm`); rerun it to refresh this page. "
             "The same checkpoint and the same vLLM engine settings behind two HTTP front ends: ours "
             "(gunicorn + Flask API, Redis, a Celery worker whose `VLLMEngine` drives vLLM's `AsyncLLM`) and "
             "vLLM's OpenAI-compatible server (FastAPI/uvicorn driving `AsyncLLM` directly), one after the other.")
    L += ["", "## Run", ""]
    L.append(f"- Command: `{res['command']}`")
    L.append(f"- Date: {res['date']} (took {res['elapsed_s'] / 60:.1f} min)")
    L.append(f"- Machine: {m['nproc']} CPUs (nproc), {m['cpu_model']}, {m['ram_gib']:.1f} GiB RAM, Linux {m['kernel']}; "
             f"load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at end "
             f"{', '.join(f'{x:.2f}' for x in res['loadavg_end'])}")
    L.append(f"- Software: Python {m['python']}; vLLM environment: {res['vllm_env']}; Redis {res['redis_version']} "
             f"({ours['redis_kind']})")
    L.append(f"- Checkpoint: `{res['model_dir']}` (`--model {res['model']}`: random-weight OPT from worker/devmodels.py, "
             f"{res['params_m']:.1f}M parameters, float32)")
    L.append(f"- Ours: one worker, `GENQ_ENGINE=vllm GENQ_MAX_BATCH_SIZE={MAX_NUM_SEQS}` (so `max_num_seqs={MAX_NUM_SEQS}`, "
             f"`enforce_eager`, `dtype=float32`, `VLLM_CPU_KVCACHE_SPACE={KV_CACHE_GIB}`); API under gunicorn (gevent), "
             f"GENQ_API_WORKERS={a['api_workers']}; ready {ours['startup_s']:.0f} s after start")
    L.append(f"- vLLM's server: `{' '.join(shlex.quote(x) for x in theirs['argv'][1:]).replace(str(ROOT) + '/', '')}` with "
             f"`VLLM_CPU_KVCACHE_SPACE={KV_CACHE_GIB}`; ready {theirs['startup_s']:.0f} s after start. "
             f"`--disable-uvicorn-access-log` because our API writes no access log either")
    L.append(f"- Engine configuration as each logged it at start: {config_diff(ours.get('config'), theirs.get('config'))}")
    same = ours["check"]["text"] == theirs["check"]["text"]
    L.append(f"- Requests: `POST /v1/completions` with `temperature: 0, max_tokens: {MAX_NEW_TOKENS}, ignore_eos: true`, "
             f"not streamed, the 16 prompts of bench/common.py in turn; closed-loop clients (bench.load: one keep-alive "
             f"`http.client` connection per client thread, no think time). Output tokens/s = {MAX_NEW_TOKENS} x req/s "
             f"(checked: every completion has {MAX_NEW_TOKENS} tokens). Greedy text of the first prompt: "
             + ("identical on both servers" if same else "**differs** between the servers"))
    L.append(f"- Window per level: >= {a['duration']:g} s and >= {a['min_requests']} requests per client after one "
             f"warm-up request each (and a warm-up round before the first level); req/s as bench.load computes it "
             f"(each client's requests over the time they spanned, summed). A level during which processes outside "
             f"the benchmark used more than {a['max_other_load']:g} cores is measured again (up to {a['retries']} "
             f"times) and the quietest kept")

    L += ["", "## Targets", ""]
    v = verdicts(res)
    L += [f"- **{x}** {s}" for x, s in v]
    if v:
        n_fail = sum(x == "FAIL" for x, _ in v)
        L.append(f"- Overall: **{'PASS' if not n_fail else 'FAIL'}** ({len(v) - n_fail} of {len(v)} met)")

    L += ["", "## Side by side", ""]
    tmap = {r["clients"]: r for r in theirs["levels"]}
    rows = []
    for o in ours["levels"]:
        t = tmap.get(o["clients"])
        if not t:
            continue
        tr, lr = o["rate"] / t["rate"], o["p50"] / t["p50"]
        rows.append([o["clients"], _f(o["rate"]), _f(t["rate"]), _f(o["rate"] * MAX_NEW_TOKENS, 1),
                     _f(t["rate"] * MAX_NEW_TOKENS, 1), f"{tr:.2f} {'PASS' if tr >= TARGET_THROUGHPUT_RATIO else 'FAIL'}",
                     _f(o["p50"], 3), _f(t["p50"], 3), f"{lr:.2f} {'PASS' if lr <= TARGET_P50_RATIO else 'FAIL'}"])
    L.append(table(["clients", "ours req/s", "vLLM req/s", "ours tok/s", "vLLM tok/s", "throughput ours / vLLM",
                    "ours p50 s", "vLLM p50 s", "p50 ours / vLLM"], rows))

    for title, side, extra in (("Ours: API -> Redis -> Celery -> vLLM worker", ours, True),
                               ("vLLM's OpenAI-compatible server", theirs, False)):
        L += ["", f"## {title}", ""]
        hdr = ["clients", "requests", "req/s", "output tok/s", "p50 s", "p90 s", "p99 s"]
        hdr += ["mean batch"] if extra else []
        hdr += ["errors", "other load"]
        L.append(table(hdr, [
            [r["clients"], r["requests"] if not r["capped"] else f"{r['requests']}*", _f(r["rate"]),
             _f(r["rate"] * MAX_NEW_TOKENS, 1), _f(r["p50"], 3), _f(r["p90"], 3), _f(r["p99"], 3)]
            + ([_f(r["jobs"]["batch_size_mean"], 1)] if extra else []) + [r["errors"], _noise(r)]
            for r in side["levels"]]))

    L += ["", "## Where the time goes", ""]
    rows = []
    for o in ours["levels"]:
        t = tmap.get(o["clients"])
        j = o["jobs"]
        rows.append([o["clients"], _f(o["mean"], 3), _f(j["queued_s"], 3), _f(j["run_s"], 3),
                     _f(o["mean"] - j["total_s"], 3), _f(t["mean"], 3) if t else "n/a",
                     _f(j["run_s"] - t["mean"], 3) if t else "n/a"])
    L.append(table(["clients", "ours e2e mean s", "queue wait s", "in worker s", "API + HTTP s", "vLLM e2e mean s",
                    "ours in worker - vLLM e2e s"], rows))
    L.append("")
    L.append("*queue wait*: job record created by the API -> marked running by a worker's Celery thread; *in worker*: "
             "running -> final (our `VLLMEngine`: tokenize, `AsyncLLM.generate`, token events to Redis, result "
             "stored); *API + HTTP*: the rest of our latency (HTTP, Flask, validation, Redis round trips, waking up "
             "on the done stream, fetching the result). The last column is what our worker adds (or saves) over "
             "vLLM's whole server request.")
    L += ["", "CPU during the window (cores = CPU seconds / wall seconds; per request = CPU ms / request):", ""]
    rows = []
    for o in ours["levels"]:
        t = tmap.get(o["clients"])
        oc = o["cpu"]
        ours_total = sum(oc.get(k, 0) for k in ("api", "worker", "engine core", "redis"))
        rows.append([o["clients"], _f(oc.get("api")), _f(oc.get("worker")), _f(oc.get("redis")), _f(oc.get("engine core")),
                     _f(ours_total), _f(t["cpu"].get("server")) if t else "n/a",
                     _f(t["cpu"].get("engine core")) if t else "n/a",
                     _f(sum(_per_req_ms(o, k) for k in ("api", "worker", "redis")), 1),
                     _f(_per_req_ms(t, "server"), 1) if t else "n/a",
                     _f(_per_req_ms(o, "engine core"), 1), _f(_per_req_ms(t, "engine core"), 1) if t else "n/a",
                     _f(oc.get("client")), _f(t["cpu"].get("client")) if t else "n/a"])
    L.append(table(["clients", "ours: API", "worker", "Redis", "engine core", "total", "vLLM: API server", "engine core",
                    "front end ms/req ours", "front end ms/req vLLM", "engine core ms/req ours",
                    "engine core ms/req vLLM", "client ours", "client vLLM"], rows))
    L.append("")
    L.append("*worker*: our worker process itself (Celery, its task threads, `AsyncLLM`'s front end: tokenizing, "
             "detokenizing, our token-event publisher); *engine core*: vLLM's engine-core process (scheduler and "
             "model), the same code on both sides. *front end*: everything else ours runs (API + worker + Redis) vs "
             "vLLM's API server process.")
    L.append("")
    return "\n".join(L)


# -- main -------------------------------------------------------------------------------------


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.vllm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODEL_DIRS), default="opt-125m",
                    help="dev checkpoint to build (worker/devmodels.py) and serve (default opt-125m)")
    ap.add_argument("--levels", default=DEFAULT_LEVELS, help=f"concurrent clients (default {DEFAULT_LEVELS})")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per level (default 20)")
    ap.add_argument("--min-requests", type=int, default=3, help="requests each client completes per level (default 3)")
    ap.add_argument("--api-workers", type=int, default=1, help="GENQ_API_WORKERS for ours (default 1)")
    ap.add_argument("--max-other-load", type=float, default=0.3,
                    help="a level during which processes outside the benchmark used more CPU cores than this is "
                    "measured again (default 0.3)")
    ap.add_argument("--retries", type=int, default=2, help="repeats of a disturbed level (default 2)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks-vllm.md")
    ap.add_argument("--no-write", action="store_true", help="print the report only")
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


def vllm_env_versions() -> str:
    import subprocess

    code = ("import importlib.metadata as m, torch\n"
            "print(f\"vllm-cpu {m.version('vllm-cpu')}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            "transformers {m.version('transformers')}\")")
    try:
        out = subprocess.run([stack.worker_argv("vllm")[0], "-c", code], capture_output=True, text=True, timeout=120)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError, RuntimeError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _raise_interrupt)
    started = time.monotonic()
    outdir = ROOT / "bench" / "out" / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}"
    outdir.mkdir(parents=True, exist_ok=True)
    from worker import devmodels

    res: dict = {
        "command": " ".join(["python -m bench.vllm", *map(shlex.quote, raw_argv)]),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_facts(),
        "model": args.model,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    log(f"checkpoint {args.model}: building if needed")
    model_dir = devmodels.ensure(args.model, MODEL_DIRS[args.model])
    res["model_dir"] = os.path.relpath(model_dir, ROOT)
    res["params_m"] = json.loads((model_dir / devmodels.MARKER_NAME).read_text()).get("parameters", 0) / 1e6
    res["vllm_env"] = vllm_env_versions()
    procs = Processes(outdir)
    try:
        log(f"ours: API + vLLM worker at levels {args.levels}, {args.duration:g} s each")
        res["ours"] = run_ours(procs, model_dir, args, outdir)
        res["redis_version"] = res["ours"]["redis_version"]
        log(f"vLLM's own server at levels {args.levels}")
        res["theirs"] = run_theirs(procs, model_dir, args, outdir)
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


if __name__ == "__main__":
    sys.exit(main())
