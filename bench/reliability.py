"""`python -m bench.reliability` (`make reliability`): what becomes of accepted jobs when a
worker dies or hangs, when Redis restarts, and when a job kills every worker it meets; measured
with real processes (a private Redis, the API under gunicorn, hf workers on the tiny model) and
written to docs/reliability.md.

Each run gets a stack of its own (a served-model name, hence queues, of its own; fresh workers):

- reference: two workers, N greedy jobs, no fault: the texts every other run must reproduce;
- SIGKILL and SIGSTOP (--runs each): two workers with the default heartbeat, N jobs; the worker
  running most of them gets the signal mid-batch. Recovery time runs from the signal until every
  job it was running has succeeded on the other worker (the records' `finished` times). A
  stopped worker gets SIGCONT once every job is done: nothing may change after that;
- Redis restart: one worker, jobs queued and running; Redis (append-only file, fsync every
  second, as `make run`'s) SIGKILLed, the API probed while it is down, restarted on its port
  and data dir;
- poison job: GENQ_MAX_ATTEMPTS=3; whichever worker runs the job is SIGKILLed, on every
  attempt, and replaced (as `make run` restarts a worker).

Every wait has a timeout; everything started here is stopped on any exit, Ctrl-C and SIGTERM
included (bench.common.Processes). Logs and raw JSON go to bench/out/reliability-<timestamp>/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import redis
import requests

from bench.common import Processes, make_log, median, prompt, redis_version, run_bench, system_busy_s, table
from scripts import stack
from tasks import keys
from tasks.config import queue_for

ROOT = stack.ROOT
BATCH = 16  # GENQ_MAX_BATCH_SIZE of every worker
TARGET_S = 60  # issue 7: a lost worker's jobs are done elsewhere within a minute
NOISY = 0.3  # cores used by other processes above which the doc says the machine was shared
RESULT_KEY = "celery-task-meta-{}"  # where Celery's Redis result backend keeps a job's result
FINAL = ("succeeded", "failed", "cancelled")
DEFAULT_BEAT = {"GENQ_HEARTBEAT_INTERVAL": "2", "GENQ_HEARTBEAT_TTL": "10"}  # the defaults
QUICK_BEAT = {"GENQ_HEARTBEAT_INTERVAL": "0.5", "GENQ_HEARTBEAT_TTL": "3"}  # the tests' stacks'


@dataclass
class Plan:
    jobs: int  # per fault run
    tokens: int
    redis_jobs: int
    redis_tokens: int
    outage_s: float
    poison_tokens: int
    beat: dict


FULL = Plan(40, 64, 50, 200, 5.0, 480, DEFAULT_BEAT)
QUICK = Plan(16, 32, 16, 64, 2.0, 480, QUICK_BEAT)


def code_version() -> str:
    """The commit measured, and the code it runs that differs from it (a shared working tree)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    changed = git("status", "--porcelain", "--", "tasks", "worker", "webapp", "scripts").splitlines()
    return f"commit {git('rev-parse', '--short', 'HEAD') or '?'}" + (
        f", with uncommitted changes to {', '.join(line[3:] for line in changed)}" if changed
        else ", no uncommitted changes to tasks/, worker/, webapp/ or scripts/")


log = make_log("reliability")


def ours_cpu_s() -> float:
    """CPU seconds used by this process and everything it started, the exited ones included."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    for p in psutil.Process().children(recursive=True):
        try:
            c = p.cpu_times()
            total += c.user + c.system + c.children_user + c.children_system
        except psutil.Error:
            pass
    return total


class OtherLoad:
    """Cores used by processes outside the benchmark since creation."""

    def __init__(self):
        self.b0, self.o0, self.t0 = system_busy_s(), ours_cpu_s(), time.monotonic()

    def __call__(self) -> float:
        busy, ours, wall = system_busy_s() - self.b0, ours_cpu_s() - self.o0, time.monotonic() - self.t0
        return max(0.0, busy - ours) / wall if wall > 0 else math.nan


class Fleet:
    """An API and hf workers serving a model name of their own."""

    def __init__(self, procs: Processes, redis_url: str, label: str, env: dict[str, str]):
        self.procs, self.label = procs, label
        port = stack.free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.env = {
            "REDIS_URL": redis_url,
            "GENQ_MODEL": str(stack.TINY_MODEL_DIR),
            "GENQ_MODEL_NAME": f"rel-{label}-{uuid.uuid4().hex[:6]}",
            "GENQ_HOST": "127.0.0.1",
            "GENQ_PORT": str(port),
            "GENQ_API_WORKERS": "1",
            "GENQ_MAX_BATCH_SIZE": str(BATCH),
            "GENQ_LOG_LEVEL": "INFO",
            # Greedy texts are compared with the reference run's. In bfloat16 (what `auto` picks
            # on AMX/AVX512-BF16 CPUs) a job's logits depend on the batch it runs in, so a job
            # that ran again beside other jobs could differ; float32 keeps them batch-invariant.
            "GENQ_DTYPE": "float32",
            **env,
        }
        self.r = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
        self.http = requests.Session()
        self.workers: list[stack.Proc] = []
        self.started = 0
        self.api = procs.start(f"{label}-api", stack.api_argv(), self.env)
        try:
            stack.wait_until(lambda: stack.http_get(self.base + "/healthz")[0] == 200, 60, "the API", [self.api])
        except BaseException:
            self.stop()
            raise

    def start_worker(self) -> stack.Proc:
        w = self.procs.start(f"{self.label}-worker{self.started}", stack.worker_argv(), self.env)
        self.started += 1
        self.workers.append(w)
        return w

    def ready(self, n: int, timeout: float = 120) -> None:
        def count() -> bool:
            code, body = stack.http_get(self.base + "/readyz")
            return code == 200 and len(json.loads(body)["workers"]) >= n

        stack.wait_until(count, timeout, f"{n} ready workers", [self.api, *self.workers])

    def named(self, name: str) -> stack.Proc:
        (w,) = [w for w in self.workers if f"-{w.pid}@" in name]
        return w

    def drop(self, w: stack.Proc) -> None:
        self.workers.remove(w)
        self.procs.stop(w)

    def submit(self, prompts: list[str], tokens: int) -> list[str]:
        ids = []
        for p in prompts:
            resp = self.http.post(self.base + "/v1/jobs", json={"prompt": p, "max_new_tokens": tokens, "ignore_eos": True},
                                  timeout=30)
            if resp.status_code != 202:
                raise RuntimeError(f"POST /v1/jobs: {resp.status_code} {resp.text[:300]}")
            ids.append(resp.json()["id"])
        return ids

    def fields(self, ids: list[str], *names: str) -> list[list[str | None]]:
        """Fields of the job records, straight from Redis (one round trip: cheap to poll)."""
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hmget(keys.job(i), *names)
        return pipe.execute()

    def view(self, job_id: str) -> dict:
        resp = self.http.get(f"{self.base}/v1/jobs/{job_id}", timeout=30)
        return resp.json() if resp.status_code == 200 else {"status": f"HTTP {resp.status_code}"}

    def fingerprint(self, job_id: str) -> list:
        """What a client sees of a job (record and result), the stored result, the token stream."""
        return [self.view(job_id), self.r.get(RESULT_KEY.format(job_id)), self.r.xrange(keys.stream(job_id))]

    def message_of(self, job_id: str) -> str:
        """Where a job's broker message is: kombu's `unacked` hash, a queue list, or nowhere."""
        if any(job_id in raw for raw in self.r.hvals("unacked")):
            return "unacknowledged (kombu's unacked hash)"
        queue = queue_for(self.env["GENQ_MODEL_NAME"])
        for name in self.r.scan_iter(match=queue + "*", _type="list"):
            if any(job_id in raw for raw in self.r.lrange(name, 0, -1)):
                return f"queued (list {name!r})"
        return "nowhere: neither queued nor unacknowledged"

    def log_count(self, needle: str) -> int:
        return sum((self.procs.logdir / f"{self.label}-worker{n}.log").read_text(errors="replace").count(needle)
                   for n in range(self.started))

    def stop(self) -> None:
        for w in self.workers:
            w.signal(signal.SIGCONT)  # a stopped worker could not stop
        for p in [self.api, *self.workers]:
            self.procs.stop(p)
        self.http.close()
        self.r.close()


def wait_final(fleet: Fleet, ids: list[str], timeout: float, stall: float = 20) -> dict[str, list]:
    """Poll until every job is final, for at most `timeout` s, or `stall` s in which none ran
    or ended (those left will not end by themselves); returns each final job's fingerprint as
    first seen final (to tell later whether it changed)."""
    first: dict[str, list] = {}
    deadline = time.monotonic() + timeout
    progress = time.monotonic()
    while True:
        statuses = [s for (s,) in fleet.fields(ids, "status")]
        for i, status in zip(ids, statuses):
            if status in FINAL and i not in first:
                first[i] = fleet.fingerprint(i)
                progress = time.monotonic()
        if "running" in statuses:
            progress = time.monotonic()
        now = time.monotonic()
        if len(first) == len(ids) or now > deadline or now - progress > stall:
            return first
        time.sleep(0.2)


def duplicates(fleet: Fleet, ids: list[str], first: dict[str, list]) -> dict[str, list]:
    """Jobs with more attempts than one lost worker explains, or whose record, result or token
    stream changed after they were first seen final: why, and the job as it is now."""
    dup = {}
    for i in ids:
        if i not in first:
            continue
        now = fleet.fingerprint(i)
        why = [f"{what} changed after final" for what, a, b in zip(("record", "result", "stream"), first[i], now)
               if a != b]
        if first[i][2] != now[2]:
            why.append(f"stream entries added {[e for e in now[2] if e not in first[i][2]][:5]}, "
                       f"removed {[e for e in first[i][2] if e not in now[2]][:5]}")
        if now[0].get("attempts", 0) > 2:
            why.append("attempts > 2")
        if why:
            dup[i] = {"why": why, "job": now[0]}
    return dup


def prompts_for(n: int) -> list[str]:
    return [f"Job {i}: {prompt(i)}" for i in range(n)]


# -- scenarios --------------------------------------------------------------------------------


def pick_victim(fleet: Fleet, ids: list[str], tokens: int) -> tuple[str, list[str]]:
    """Mid-batch: once jobs run, the worker running most of them as soon as one of its jobs
    has a quarter of its tokens (or 10 s passed); returns its name and the jobs it runs."""
    stack.wait_until(lambda: any(s == "running" for s, _ in fleet.fields(ids, "status", "worker")), 60,
                     "jobs to run", [fleet.api, *fleet.workers])
    deadline = time.monotonic() + 10
    while True:
        running: dict[str, list[str]] = {}
        for i, (status, worker) in zip(ids, fleet.fields(ids, "status", "worker")):
            if status == "running":
                running.setdefault(worker, []).append(i)
        if running:
            name = max(running, key=lambda n: len(running[n]))
            if max(fleet.r.xlen(keys.stream(i)) for i in running[name]) >= tokens // 4 or time.monotonic() > deadline:
                return name, running[name]
        elif time.monotonic() > deadline:
            raise RuntimeError("the jobs finished before a worker could be stopped mid-batch")
        time.sleep(0.02)


def fault_run(procs, redis_url, plan: Plan, label: str, sig: signal.Signals | None, reference: dict) -> dict:
    """Two workers, plan.jobs greedy jobs; `sig` to the busiest worker mid-batch (None: the reference)."""
    other = OtherLoad()
    fleet = Fleet(procs, redis_url, label, plan.beat)
    out: dict = {"signal": sig.name if sig else None}
    victim = None
    try:
        fleet.start_worker()
        fleet.start_worker()
        fleet.ready(2)
        prompts = prompts_for(plan.jobs)
        submitted = time.time()
        ids = fleet.submit(prompts, plan.tokens)
        if sig:
            name, held = pick_victim(fleet, ids, plan.tokens)
            victim = fleet.named(name)
            victim.signal(sig)
            t_sig = time.time()
            if sig == signal.SIGKILL:
                victim.popen.wait(10)
            out.update(victim=name, held=len(held))
        first = wait_final(fleet, ids, 120)
        recs = [first[i][0] if i in first else fleet.view(i) for i in ids]
        texts = [r.get("result", {}).get("text") for r in recs]
        lost = [{**r, "id": i, "message": fleet.message_of(i)} for i, r in zip(ids, recs) if r["status"] != "succeeded"]
        finished = [r["timings"]["finished"] for r in recs if r["status"] == "succeeded"]
        out.update(jobs=len(ids), lost=len(lost), lost_jobs=lost,
                   all_done_s=max(finished) - (t_sig if sig else submitted) if finished and not lost else None)
        if sig is None:
            reference.update(zip(prompts, texts))
        out["mismatched"] = sum(reference.get(p) != t for p, t in zip(prompts, texts))
        if sig:
            moved = [r for r in recs if r.get("attempts", 0) > 1]
            restarted = [r["timings"]["started"] - t_sig for r in moved]
            out.update(moved=len(moved), moved_not_held=sum(r["id"] not in held for r in moved),
                       restarted_s=min(restarted) if restarted else None,
                       recovery_s=max(r["timings"]["finished"] - t_sig for r in moved)
                       if moved and all(r["status"] == "succeeded" for r in moved) else None)
        if sig == signal.SIGSTOP:  # awake again: whatever it writes now must be discarded
            victim.signal(signal.SIGCONT)
            woke = time.monotonic()
            while fleet.log_count("superseded; dropping it") < out["moved"] and time.monotonic() - woke < 30:
                time.sleep(0.2)
            out["dropped_on_wake"] = fleet.log_count("superseded; dropping it")
            time.sleep(3)  # what it generated meanwhile would be written by now
            out["back_after_wake"] = len(json.loads(stack.http_get(fleet.base + "/readyz")[1]).get("workers", []))
        dup = duplicates(fleet, ids, first)
        out.update(duplicated=len(dup), duplicated_jobs=dup)
        return out
    finally:
        out["other_load"] = other()
        fleet.stop()


def redis_restart(procs: Processes, outdir: Path, plan: Plan) -> dict:
    """One worker, jobs queued and running; Redis SIGKILLed, probed, restarted (same port, dir)."""
    other = OtherLoad()
    data = outdir / "redis-data"
    db = stack.PrivateRedis(data)  # make run's: AOF, appendfsync everysec
    procs.items.insert(0, db)  # stopped after the processes that use it
    fleet = Fleet(procs, db.url, "redis", plan.beat)
    out: dict = {"jobs": plan.redis_jobs, "tokens": plan.redis_tokens}
    try:
        fleet.start_worker()
        fleet.ready(1)
        ids = fleet.submit(prompts_for(plan.redis_jobs), plan.redis_tokens)
        stack.wait_until(lambda: any(s == "running" for (s,) in fleet.fields(ids, "status")), 60, "jobs to run",
                         [fleet.api, *fleet.workers])
        before = [s for (s,) in fleet.fields(ids, "status")]
        out["at_kill"] = {s: before.count(s) for s in sorted(set(before))}
        db.proc.signal(signal.SIGKILL)
        t_kill = time.monotonic()
        db.proc.popen.wait(10)
        probes: list[dict] = []

        def probe(until: float | None, stop_on_ok: bool = False) -> None:
            calls = [("GET /v1/jobs/<id>", "get", f"/v1/jobs/{ids[0]}", None), ("GET /readyz", "get", "/readyz", None)]
            if not stop_on_ok:
                calls.append(("POST /v1/jobs", "post", "/v1/jobs", {"prompt": "probe", "max_new_tokens": 1}))
            while True:
                for what, method, path, body in calls:
                    t = time.monotonic()
                    try:
                        resp = fleet.http.request(method, fleet.base + path, json=body, timeout=10)
                        code = resp.status_code
                        err = (resp.json().get("error") or {}).get("code") if code >= 400 else None
                    except (requests.RequestException, ValueError) as exc:
                        code, err = "none", type(exc).__name__
                    probes.append({"what": what, "code": code, "error": err, "latency_s": time.monotonic() - t,
                                   "at_s": t - t_kill, "down": stop_on_ok is False})
                    if stop_on_ok and what.startswith("GET /v1") and code == 200:
                        return
                if until is not None and time.monotonic() > until or time.monotonic() - t_kill > 120:
                    return
                time.sleep(0.25)

        probe(t_kill + plan.outage_s)
        port = db.port
        procs.stop(db)  # the lock and the port (the dir stays: durable)
        db = stack.PrivateRedis(data)
        procs.items.insert(0, db)
        t_up, t_up_wall = time.monotonic(), time.time()
        out.update(outage_s=t_up - t_kill, same_port=db.port == port)
        if db.port != port:
            raise RuntimeError(f"Redis came back on port {db.port}, not {port}")
        probe(None, stop_on_ok=True)
        if probes[-1]["code"] != 200:
            raise RuntimeError(f"the API did not answer 200 within 120 s of the kill: {probes[-1]}")
        out["api_back_s"] = probes[-1]["at_s"] - out["outage_s"]
        first = wait_final(fleet, ids, 180)
        recs = [first[i][0] if i in first else fleet.view(i) for i in ids]
        ok = [r for r in recs if r["status"] == "succeeded" and r["result"]["completion_tokens"] == plan.redis_tokens]
        lost = [{**r, "id": i, "message": fleet.message_of(i)} for i, r in zip(ids, recs) if r not in ok]
        dup = duplicates(fleet, ids, first)
        out.update(succeeded=len(ok), lost=len(lost), lost_jobs=lost, duplicated=len(dup), duplicated_jobs=dup,
                   attempts_over_1=sum(r.get("attempts", 0) > 1 for r in recs), worker_alive=fleet.workers[0].alive(),
                   last_done_s=max(r["timings"]["finished"] for r in ok) - t_up_wall if ok else None, probes=probes)
        return out
    finally:
        out["other_load"] = other()
        fleet.stop()
        procs.stop(db)
        shutil.rmtree(data, ignore_errors=True)


def poison(procs: Processes, redis_url: str, plan: Plan) -> dict:
    """GENQ_MAX_ATTEMPTS=3; whichever worker runs the job is SIGKILLed and replaced, each attempt."""
    other = OtherLoad()
    fleet = Fleet(procs, redis_url, "poison", {**plan.beat, "GENQ_MAX_ATTEMPTS": "3"})
    out: dict = {"attempts_seen": []}
    try:
        fleet.start_worker()
        fleet.start_worker()
        fleet.ready(2)
        t0 = time.time()
        (job,) = fleet.submit(["poison"], plan.poison_tokens)
        for attempt in (1, 2, 3):
            def running() -> bool:
                status, n = fleet.fields([job], "status", "attempts")[0]
                if status in FINAL:
                    raise RuntimeError(f"the poison job ended on attempt {n}: {fleet.view(job)}")
                return status == "running" and int(n) == attempt

            stack.wait_until(running, 90, f"attempt {attempt}", [fleet.api])
            rec = fleet.view(job)
            victim = fleet.named(rec["worker"])
            victim.signal(signal.SIGKILL)
            killed = time.time()
            victim.popen.wait(10)
            fleet.drop(victim)
            fleet.start_worker()  # as make run restarts a worker that died
            out["attempts_seen"].append({"attempt": attempt, "started_s": rec["timings"]["started"] - t0,
                                         "killed_s": killed - t0})
        stack.wait_until(lambda: fleet.fields([job], "status")[0][0] in FINAL, 90, "the poison job to end", [fleet.api])
        rec = fleet.view(job)
        out.update(status=rec["status"], attempts=rec["attempts"], error=rec.get("error"),
                   failed_s=rec["timings"]["finished"] - t0, after_last_kill_s=rec["timings"]["finished"] - t0
                   - out["attempts_seen"][-1]["killed_s"])
        fleet.ready(2)
        resp = fleet.http.post(fleet.base + "/basic_generate", json={"prompt": "Hello", "max_new_tokens": 4}, timeout=60)
        out["fleet_after"] = resp.status_code
        return out
    finally:
        out["other_load"] = other()
        fleet.stop()


# -- report -----------------------------------------------------------------------------------


def _s(x, nd=1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _summary(runs: list[dict], key: str) -> tuple[str, str]:
    vals = [r.get(key) for r in runs]
    if not vals or any(v is None for v in vals):
        return "n/a", "n/a"
    return _s(median(vals)), _s(max(vals))


def verdicts(res: dict) -> list[tuple[str, str]]:
    faults = res["sigkill"] + res["sigstop"]
    worst = [r.get("recovery_s") for r in faults]
    counted = [res["reference"], *faults, res["redis"]]
    lost, dup = (sum(r.get(k, 0) for r in counted) for k in ("lost", "duplicated"))
    p = res["poison"]
    ok = lambda c: "PASS" if c else "FAIL"  # noqa: E731
    rec_ok = faults and all(v is not None and v <= TARGET_S for v in worst)
    return [
        (ok(rec_ok), f"a lost worker's jobs all succeeded elsewhere within {TARGET_S} s of the signal "
                     f"(worst: {_s(max((v for v in worst if v is not None), default=None))} s)"),
        (ok(lost == 0), f"jobs lost: {lost} (all runs, the Redis restart's included)"),
        (ok(dup == 0), f"jobs duplicated: {dup}"),
        (ok(all(r.get("mismatched") == 0 for r in faults)), "greedy texts equal the reference run's"),
        (ok(p.get("status") == "failed" and (p.get("error") or {}).get("code") == "worker_lost"
            and p.get("fleet_after") == 200), "the poison job failed with worker_lost after 3 attempts, the fleet stayed up"),
    ] + [("FAIL", f"every scenario ran to its end ({len(res['errors'])} did not)")] * bool(res["errors"])


def findings(res: dict) -> list[str]:
    runs = [("reference run", res["reference"]), ("Redis restart", res["redis"])]
    runs[1:1] = [(f"{r['signal']} run {n + 1}", r) for k in ("sigkill", "sigstop") for n, r in enumerate(res[k])]
    out = []
    for label, r in runs:
        for j in r.get("lost_jobs", []):
            out.append(f"- {label}: job `{j['id']}` **lost**: status `{j['status']}`, attempts {j.get('attempts')}, "
                       f"worker `{j.get('worker', '-')}`; its broker message: {j['message']}")
        for i, d in r.get("duplicated_jobs", {}).items():
            out.append(f"- {label}: job `{i}` **duplicated**: {'; '.join(d['why'])} (status `{d['job'].get('status')}`, "
                       f"attempts {d['job'].get('attempts')}, worker `{d['job'].get('worker')}`)")
    if any(r.get("duplicated_jobs") for _, r in runs):
        out.append("\nStream entries are (entry id, fields): `i` the token index, `t` its text; `finish` marks the "
                   "stream's last event.")
    return out


def render(res: dict) -> str:
    m, plan, a = res["machine"], res["plan"], res["args"]
    beat = plan["beat"]
    L = ["# Reliability", "",
         "Generated by `make reliability` (`python -m bench.reliability`), which starts real processes "
         "(a private Redis, the API under gunicorn, hf workers on the tiny random-weight model), breaks "
         "them on purpose, and checks what became of every accepted job. See README.md, "
         "\"How jobs stay safe\", for the mechanisms.", "",
         "## Run", "",
         f"- Command: `{res['command']}`",
         f"- Date: {res['date']} (took {res['elapsed_s'] / 60:.1f} min); code: {res['code']}",
         f"- Machine: {m['nproc']} CPUs (nproc), {m['cpu_model']}, {m['ram_gib']:.1f} GiB RAM, Linux {m['kernel']}; "
         f"Python {m['python']}, Redis {res['redis_version']}; load average at start "
         f"{', '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at end {', '.join(f'{x:.2f}' for x in res['loadavg_end'])}",
         f"- Settings: hf workers on `{os.path.relpath(stack.TINY_MODEL_DIR, ROOT)}`, GENQ_MAX_BATCH_SIZE={BATCH}, GENQ_DTYPE=float32 "
         "(greedy texts are compared across batches; bfloat16 logits depend on the batch), "
         f"GENQ_HEARTBEAT_INTERVAL={beat['GENQ_HEARTBEAT_INTERVAL']} s, GENQ_HEARTBEAT_TTL={beat['GENQ_HEARTBEAT_TTL']} s"
         + (" (the defaults)" if beat == DEFAULT_BEAT else " (--quick: the tests' fast heartbeat, not the default)")
         + ", GENQ_VISIBILITY_TIMEOUT and GENQ_MAX_ATTEMPTS unset (1,260 s and 3); GENQ_API_WORKERS=1; every job "
         f"greedy with `ignore_eos`; {a['runs']} run(s) per fault; GENQ_* from the caller's environment ignored"]
    loads = [r["other_load"] for r in res["sigkill"] + res["sigstop"] + [res["reference"], res["redis"], res["poison"]]
             if not math.isnan(r.get("other_load", math.nan))]
    if loads and max(loads) > NOISY:
        L.append(f"- **The machine was shared** with other work (test runs) while this was measured: processes "
                 f"outside the benchmark used {min(loads):.1f}-{max(loads):.1f} CPU cores during the runs "
                 f"(column *other load*). Generation is slower then, so the times after the heartbeat TTL are longer "
                 f"than on an idle machine; counts of lost and duplicated jobs do not depend on it.")
    L += ["", "## Verdict", ""] + [f"- **{v}** {s}" for v, s in verdicts(res)]
    found = findings(res)
    L += ["", "Lost and duplicated jobs, each as its record was at the end:", "", *found] if found else \
        ["", "No job was lost or duplicated."]
    if res["errors"]:
        L += ["", "Errors:", ""] + [f"- {e}" for e in res["errors"]]

    ref = res["reference"]
    L += ["", "## A worker killed (SIGKILL) or hung (SIGSTOP) mid-batch", "",
          f"Two workers, {plan['jobs']} jobs of {plan['tokens']} tokens submitted at once; once they run, the "
          "worker running most of them gets the signal as soon as one of its jobs has a quarter of its tokens. "
          "Times are seconds from the signal, from the job records' `started`/`finished` stamps. "
          f"Without a fault (the reference run) all {plan['jobs']} were done "
          f"{_s(ref.get('all_done_s'))} s after submission.", ""]
    rows = []
    for label, runs in (("SIGKILL", res["sigkill"]), ("SIGSTOP", res["sigstop"])):
        rows.append([label, len(runs), "/".join(str(r.get("held", "?")) for r in runs),
                     *_summary(runs, "restarted_s"), *_summary(runs, "recovery_s"), *_summary(runs, "all_done_s"),
                     sum(r.get("lost", 0) for r in runs), sum(r.get("duplicated", 0) for r in runs),
                     sum(r.get("mismatched", 0) for r in runs), _s(max((r["other_load"] for r in runs), default=None))])
    L.append(table(["signal", "runs", "jobs on the lost worker", "restarted p50", "restarted max", "recovered p50",
                    "recovered max", f"all {plan['jobs']} done p50", "all done max", "lost", "duplicated",
                    "text ≠ reference", "other load max"], rows))
    L += ["", "*jobs on the lost worker*: running there at the signal, per run. *restarted*: until the first of them "
          "started again on the other worker: the heartbeat TTL counted from the lost worker's last heartbeat "
          "(up to one interval before the signal), plus up to one sweep interval (the survivor sweeps at each of "
          "its heartbeats), plus taking the job. "
          "*recovered*: until the last of them succeeded there. *lost*: not succeeded. *duplicated*: a job that "
          "took more than 2 attempts, or whose record (`GET /v1/jobs/<id>`: status, attempts, worker, timings, "
          "result), stored result or token stream changed after it was first seen final (checked at the end of "
          "the run; SIGSTOP runs: 3 s after the woken worker dropped its jobs). *text ≠ reference*: greedy "
          "text unlike the reference run's for the same prompt. *other load*: CPU cores used by processes "
          "outside the benchmark during the run.", "", "Per run:", ""]
    rows = [[r["signal"], n + 1, r.get("held", "?"), r.get("moved", "?"), _s(r.get("restarted_s")),
             _s(r.get("recovery_s")), _s(r.get("all_done_s")), r.get("lost", "?"), r.get("duplicated", "?"),
             r.get("mismatched", "?"), r.get("dropped_on_wake", "-"), r.get("back_after_wake", "-"),
             _s(r["other_load"])]
            for runs in (res["sigkill"], res["sigstop"]) for n, r in enumerate(runs)]
    L.append(table(["signal", "run", "held", "run again", "restarted s", "recovered s", "all done s", "lost",
                    "duplicated", "text ≠ reference", "dropped on SIGCONT", "workers after SIGCONT", "other load"], rows))
    L += ["", "*run again*: jobs with 2 attempts (those the lost worker had not finished before the signal). "
          "SIGSTOP runs: SIGCONT once every job had succeeded elsewhere; *dropped on SIGCONT*: jobs the woken "
          "worker found superseded and dropped (its log); the check for changes comes 3 s after that; "
          "*workers after SIGCONT*: ready workers then (the woken one serves again: 2)."]

    rd = res["redis"]
    L += ["", "## Redis restart", "",
          f"One worker, {rd.get('jobs')} jobs of {rd.get('tokens')} tokens; Redis with an append-only file "
          "(`appendfsync everysec`, as `make run`'s private Redis) SIGKILLed as soon as the first of them ran, "
          "when they were "
          f"{', '.join(f'{n} {s}' for s, n in rd.get('at_kill', {}).items())}; the API probed every 0.25 s "
          f"meanwhile; Redis started again on the same port and data directory after {_s(rd.get('outage_s'))} s.", ""]
    L.append(table(["jobs", "succeeded", "lost", "duplicated", "attempts > 1", "outage s", "API answers again s",
                    "all done s", "worker survived", "other load"],
                   [[rd.get("jobs"), rd.get("succeeded", "?"), rd.get("lost", "?"), rd.get("duplicated", "?"), rd.get("attempts_over_1", "?"),
                     _s(rd.get("outage_s")), _s(rd.get("api_back_s")), _s(rd.get("last_done_s")),
                     {True: "yes", False: "no"}.get(rd.get("worker_alive"), "?"), _s(rd["other_load"])]]))
    L += ["", "*API answers again* and *all done*: seconds after Redis was back. The API's answers:", ""]
    groups: dict[tuple, list[dict]] = {}
    for p in rd.get("probes", []):
        groups.setdefault(("while down" if p["down"] else "after the restart", p["what"], p["code"], p["error"]), []).append(p)
    L.append(table(["when", "request", "status", "error code", "answers", "slowest s"],
                   [[*k[:3], k[3] or "-", len(v), _s(max(p["latency_s"] for p in v), 2)] for k, v in groups.items()]))

    po = res["poison"]
    L += ["", "## Poison job", "",
          f"GENQ_MAX_ATTEMPTS=3, two workers; one job of {plan['poison_tokens']} tokens; whichever worker runs it is "
          "SIGKILLed on every attempt and replaced by a fresh one (as `make run` restarts a worker). Seconds from "
          "submission:", ""]
    L.append(table(["attempt", "started s", "its worker killed s"],
                   [[x["attempt"], _s(x["started_s"]), _s(x["killed_s"])] for x in po.get("attempts_seen", [])]))
    err = po.get("error") or {}
    L += ["", f"Outcome: status `{po.get('status')}` after {po.get('attempts')} attempts, "
              f"{_s(po.get('failed_s'))} s after submission ({_s(po.get('after_last_kill_s'))} s after the last kill), "
              f"error `{err.get('code')}`: \"{err.get('message')}\". A new job on the fleet afterwards: "
              f"HTTP {po.get('fleet_after')}."]
    return "\n".join(L) + "\n"


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="runs of each fault, SIGKILL and SIGSTOP (default 5)")
    ap.add_argument("--quick", action="store_true",
                    help=f"fewer, shorter jobs and the tests' fast heartbeat ({QUICK.jobs} x {QUICK.tokens} tokens, "
                    f"TTL {QUICK.beat['GENQ_HEARTBEAT_TTL']} s): a smoke test, not a measurement")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability.md")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    return args


def _guarded(errors: list[str], what: str, fn, *a) -> dict:
    """A scenario that fails is reported (and the rest still run); Ctrl-C is not caught."""
    try:
        return fn(*a)
    except Exception as exc:
        log(f"{what} failed: {exc!r}")
        errors.append(f"{what}: {type(exc).__name__}: {str(exc)[:500]}")
        return {"error": str(exc), "other_load": math.nan}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    ignored = sorted(k for k in os.environ if k.startswith("GENQ_") or k == "REDIS_URL")
    for k in ignored:  # the settings are the benchmark's own (the doc says which)
        del os.environ[k]
    if ignored:
        log(f"ignoring {', '.join(ignored)} from the environment")

    def measure(procs: Processes, res: dict, outdir: Path) -> None:
        from worker import devmodels

        devmodels.ensure("tiny", stack.TINY_MODEL_DIR)
        db = procs.redis()
        res["redis_version"] = redis_version(db.url)
        log(f"reference run: {plan.jobs} jobs x {plan.tokens} tokens, two workers, no fault")
        reference: dict[str, str] = {}
        res["reference"] = _guarded(res["errors"], "reference", fault_run, procs, db.url, plan, "ref", None, reference)
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            for n in range(args.runs):
                log(f"{sig.name} run {n + 1}/{args.runs}")
                r = _guarded(res["errors"], f"{sig.name} run {n + 1}", fault_run, procs, db.url, plan,
                             f"{sig.name.lower()}{n + 1}", sig, reference)
                r.setdefault("signal", sig.name)
                res[sig.name.lower()].append(r)
                log(f"  held {r.get('held')}, recovered in {_s(r.get('recovery_s'))} s, lost {r.get('lost')}, "
                    f"duplicated {r.get('duplicated')}, text != reference {r.get('mismatched')}")
        log(f"Redis restart: {plan.redis_jobs} jobs x {plan.redis_tokens} tokens, one worker")
        res["redis"] = _guarded(res["errors"], "Redis restart", redis_restart, procs, outdir, plan)
        log("poison job")
        res["poison"] = _guarded(res["errors"], "poison job", poison, procs, db.url, plan)

    res = run_bench("bench.reliability", args, argv, measure, out_prefix="reliability-", log=log, plan=asdict(plan),
                    errors=[], sigkill=[], sigstop=[], code=code_version())
    if res is None:
        return 130
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(res))
    log(f"wrote {args.out}; raw results and logs in {res['outdir']}")
    failed = [s for v, s in verdicts(res) if v != "PASS"]
    for s in failed:
        log(f"FAIL: {s}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
