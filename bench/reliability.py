"""`python -m bench.reliability` (`make reliability`): what becomes of accepted jobs when a
worker dies or hangs, when Redis restarts or fails over, and when a job kills every worker it
meets, with real processes (a private Redis, the API, hf workers on the tiny model); writes
docs/reliability.md, whose head describes the scenarios (`--only`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import redis
import requests

from bench.common import (
    OtherLoad,
    Processes,
    Stack,
    intro,
    make_log,
    marker,
    names,
    parser,
    prompt,
    publish,
    redis_version,
    run_bench,
    run_lines,
    table,
    verdict,
    verdict_lines,
)
from scripts import stack
from tasks import keys
from tasks.config import queue_for

MARKER = marker("bench.reliability")
INTRO = intro("Reliability", "bench.reliability")
BATCH = 16  # GENQ_MAX_BATCH_SIZE of every worker
TARGET_S = 60  # issue 7: a lost worker's jobs are done elsewhere within a minute
FINAL = ("succeeded", "failed", "cancelled")
DEFAULT_BEAT = {"GENQ_HEARTBEAT_INTERVAL": "2", "GENQ_HEARTBEAT_TTL": "10"}  # the defaults
QUICK_BEAT = {"GENQ_HEARTBEAT_INTERVAL": "0.5", "GENQ_HEARTBEAT_TTL": "3"}  # the tests' stacks'
SCENARIOS = ("reference", "sigkill", "sigstop", "redis", "sentinel", "poison")


@dataclass
class Plan:
    jobs: int  # per fault run
    tokens: int
    redis_jobs: int
    redis_tokens: int
    outage_s: float
    poison_tokens: int
    beat: dict
    sentinel_tokens: int  # long enough that jobs still run when the master dies


FULL = Plan(40, 64, 50, 200, 5.0, 480, DEFAULT_BEAT, 400)
QUICK = Plan(16, 32, 16, 64, 2.0, 480, QUICK_BEAT, 200)


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


class Fleet(Stack):
    """bench.common's stack of the tiny model (its API up, no worker yet), and what the scenarios
    read from Redis and the API."""

    def __init__(self, procs: Processes, redis_url: str, label: str, env: dict[str, str]):
        # Greedy texts are compared with the reference run's: float32, whose logits do not depend
        # on the batch a job runs in (bfloat16's do).
        env = {"GENQ_LOG_LEVEL": "INFO", "GENQ_DTYPE": "float32", **env}
        super().__init__(procs, redis_url, stack.TINY_MODEL_DIR, "hf", label, BATCH, **env)
        self.r = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
        self.http = requests.Session()
        try:
            self.start_api(1, ready_workers=0)
        except BaseException:
            self.stop()
            raise

    def ready(self, n: int, start: bool = True) -> None:
        """Start `n` workers (unless `start` is false) and wait until `n` are ready."""
        for _ in range(n if start else 0):
            self.start_worker()
        self.wait_ready(n, f"{n} ready workers", timeout=120)

    def named(self, name: str) -> stack.Proc:
        (w,) = [w for w in self.workers if f"-{w.pid}@" in name]
        return w

    def submit(self, prompts: list[str], tokens: int) -> list[str]:
        ids = []
        for p in prompts:
            body = {"prompt": p, "max_new_tokens": tokens, "ignore_eos": True}
            resp = self.http.post(self.base + "/v1/jobs", json=body, timeout=30)
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

    def wait_running(self, ids: list[str]) -> None:
        running = lambda: any(s == "running" for (s,) in self.fields(ids, "status"))  # noqa: E731
        stack.wait_until(running, 60, "jobs to run", [self.api, *self.workers])

    def view(self, job_id: str) -> dict:
        resp = self.http.get(f"{self.base}/v1/jobs/{job_id}", timeout=30)
        return resp.json() if resp.status_code == 200 else {"status": f"HTTP {resp.status_code}"}

    def fingerprint(self, job_id: str) -> list:
        """What a client sees of a job (record and result), the stored result, the token stream."""
        return [self.view(job_id), self.r.xrange(keys.done(job_id)), self.r.xrange(keys.stream(job_id))]

    def message_of(self, job_id: str) -> str:
        """Where a job's broker message is: a queue list, or none (taken by a worker, which
        holds it in memory only: kombu's ack emulation is off, or lost)."""
        for name in self.r.scan_iter(match=queue_for(self.name) + "*", _type="list"):
            if any(job_id in raw for raw in self.r.lrange(name, 0, -1)):
                return f"queued (list {name!r})"
        inflight = [k for k in self.r.scan_iter(match=keys.inflight("*")) if self.r.hexists(k, job_id)]
        return f"in no list; in flight on {inflight}" if inflight else "in no list and in no in-flight hash"

    def records(self, ids: list[str], first: dict[str, list]) -> dict[str, dict]:
        """Each job's record as first seen final, else as it is now."""
        return {i: first[i][0] if i in first else self.view(i) for i in ids}

    def lost(self, recs: dict[str, dict], ok=lambda r: r["status"] == "succeeded") -> dict:
        """The jobs whose record is not `ok`, with where their broker message is."""
        lost = [{**r, "id": i, "message": self.message_of(i)} for i, r in recs.items() if not ok(r)]
        return {"lost": len(lost), "lost_jobs": lost}

    def log_count(self, needle: str) -> int:
        return sum(
            (self.procs.logdir / f"{self.label}-worker{n or ''}.log").read_text(errors="replace").count(needle)
            for n in range(self.started)
        )

    def stop(self) -> None:
        for w in self.workers:
            w.signal(signal.SIGCONT)  # a stopped worker could not stop
        super().stop()
        self.http.close()
        self.r.close()


def wait_final(fleet: Fleet, ids: list[str], timeout: float, stall: float = 20) -> dict[str, list]:
    """Poll until every job is final, for at most `timeout` s, or `stall` s in which none ran
    or ended (those left will not end by themselves); returns each final job's fingerprint as
    first seen final (to tell later whether it changed)."""
    first: dict[str, list] = {}
    deadline = progress = time.monotonic()
    deadline += timeout
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


def duplicates(fleet: Fleet, ids: list[str], first: dict[str, list]) -> dict:
    """Jobs with more attempts than one lost worker explains, or whose record, result or token
    stream changed after they were first seen final: why, and the job as it is now."""
    dup = {}
    for i in (i for i in ids if i in first):
        now = fleet.fingerprint(i)
        why = [
            f"{what} changed after final" for what, a, b in zip(("record", "result", "stream"), first[i], now) if a != b
        ]
        if first[i][2] != now[2]:
            why.append(
                f"stream entries added {[e for e in now[2] if e not in first[i][2]][:5]}, "
                f"removed {[e for e in first[i][2] if e not in now[2]][:5]}"
            )
        if now[0].get("attempts", 0) > 2:
            why.append("attempts > 2")
        if why:
            dup[i] = {"why": why, "job": now[0]}
    return {"duplicated": len(dup), "duplicated_jobs": dup}


def prompts_for(n: int) -> list[str]:
    return [f"Job {i}: {prompt(i)}" for i in range(n)]


def pick_victim(fleet: Fleet, ids: list[str], tokens: int) -> tuple[str, list[str]]:
    """Mid-batch: once jobs run, the worker running most of them as soon as one of its jobs
    has a quarter of its tokens (or 10 s passed); returns its name and the jobs it runs."""
    fleet.wait_running(ids)
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
    other = OtherLoad(ours_cpu_s)
    fleet = Fleet(procs, redis_url, label, plan.beat)
    out: dict = {"signal": sig.name if sig else None}
    try:
        fleet.ready(2)
        prompts = prompts_for(plan.jobs)
        t0 = time.time()  # submitted; with a signal, when it was sent
        ids = fleet.submit(prompts, plan.tokens)
        if sig:
            name, held = pick_victim(fleet, ids, plan.tokens)
            victim = fleet.named(name)
            victim.signal(sig)
            t0 = time.time()
            if sig == signal.SIGKILL:
                victim.popen.wait(10)
            out.update(victim=name, held=len(held))
        first = wait_final(fleet, ids, 120)
        recs = fleet.records(ids, first)
        out.update(jobs=len(ids), **fleet.lost(recs))
        recs = list(recs.values())
        texts = [r.get("result", {}).get("text") for r in recs]
        finished = [r["timings"]["finished"] for r in recs if r["status"] == "succeeded"]
        out["all_done_s"] = max(finished) - t0 if finished and not out["lost"] else None
        if sig is None:
            reference.update(zip(prompts, texts))
        out["mismatched"] = sum(reference.get(p) != t for p, t in zip(prompts, texts)) if reference else None
        if sig:
            moved = [r for r in recs if r.get("attempts", 0) > 1]
            restarted = [r["timings"]["started"] - t0 for r in moved]
            done = moved and all(r["status"] == "succeeded" for r in moved)
            out.update(moved=len(moved), moved_not_held=sum(r["id"] not in held for r in moved))
            out["restarted_s"] = min(restarted) if restarted else None
            out["recovery_s"] = max(r["timings"]["finished"] - t0 for r in moved) if done else None
        if sig == signal.SIGSTOP:  # awake again: whatever it writes now must be discarded
            victim.signal(signal.SIGCONT)
            woke = time.monotonic()
            while fleet.log_count("superseded; dropping it") < out["moved"] and time.monotonic() - woke < 30:
                time.sleep(0.2)
            out["dropped_on_wake"] = fleet.log_count("superseded; dropping it")
            time.sleep(3)  # what it generated meanwhile would be written by now
            out["back_after_wake"] = len(json.loads(stack.http_get(fleet.base + "/readyz")[1]).get("workers", []))
        out.update(duplicates(fleet, ids, first))
        return out
    finally:
        out["other_load"] = other()
        fleet.stop()


def _counts(codes) -> dict[str, int]:
    codes = list(codes)
    return {str(c): codes.count(c) for c in sorted(set(codes))}


def redis_restart(procs: Processes, outdir: Path, plan: Plan) -> dict:
    """One worker, jobs queued and running; Redis SIGKILLed, probed, restarted (same port, dir)."""
    other = OtherLoad(ours_cpu_s)
    data = outdir / "redis-data"
    db = procs.add(stack.PrivateRedis(data), first=True)  # make run's: AOF, appendfsync everysec
    fleet = Fleet(procs, db.url, "redis", plan.beat)
    out: dict = {"jobs": plan.redis_jobs, "tokens": plan.redis_tokens}
    try:
        fleet.ready(1)
        ids = fleet.submit(prompts_for(plan.redis_jobs), plan.redis_tokens)
        fleet.wait_running(ids)
        out["at_kill"] = _counts(s for (s,) in fleet.fields(ids, "status"))
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
                    latency = time.monotonic() - t
                    probes.append(
                        {
                            "what": what,
                            "code": code,
                            "error": err,
                            "latency_s": latency,
                            "at_s": t - t_kill,
                            "down": not stop_on_ok,
                        }
                    )
                    if stop_on_ok and what.startswith("GET /v1") and code == 200:
                        return
                if until is not None and time.monotonic() > until or time.monotonic() - t_kill > 120:
                    return
                time.sleep(0.25)

        probe(t_kill + plan.outage_s)
        port = db.port
        procs.stop(db)  # the lock and the port (the dir stays: durable)
        db = procs.add(stack.PrivateRedis(data), first=True)
        t_up, t_up_wall = time.monotonic(), time.time()
        out.update(outage_s=t_up - t_kill, same_port=db.port == port)
        if db.port != port:
            raise RuntimeError(f"Redis came back on port {db.port}, not {port}")
        probe(None, stop_on_ok=True)
        if probes[-1]["code"] != 200:
            raise RuntimeError(f"the API did not answer 200 within 120 s of the kill: {probes[-1]}")
        out["api_back_s"] = probes[-1]["at_s"] - out["outage_s"]
        first = wait_final(fleet, ids, 180)
        recs = fleet.records(ids, first)
        good = lambda r: r["status"] == "succeeded" and r["result"]["completion_tokens"] == plan.redis_tokens  # noqa: E731
        ok = [r for r in recs.values() if good(r)]
        out.update(succeeded=len(ok), **fleet.lost(recs, good), **duplicates(fleet, ids, first))
        out.update(attempts_over_1=sum(r.get("attempts", 0) > 1 for r in recs.values()), probes=probes)
        out["worker_alive"] = fleet.workers[0].alive()
        out["last_done_s"] = max(r["timings"]["finished"] for r in ok) - t_up_wall if ok else None
        return out
    finally:
        out["other_load"] = other()
        fleet.stop()
        procs.stop(db)
        shutil.rmtree(data, ignore_errors=True)


def _outage(answers: list[tuple[float, int]], ok: int) -> tuple[float | None, float | None]:
    """(time of the first answer other than `ok`, time of the first `ok` after it)."""
    bad = next((t for t, c in answers if c != ok), None)
    back = next((t for t, c in answers if bad is not None and t > bad and c == ok), None)
    return bad, back


def sentinel_failover(procs: Processes, plan: Plan, min_replicas: int) -> dict:
    """Redis Sentinel (scripts/redis_servers.py `SentinelRedis`: a master, a replica, three sentinels,
    down-after 1 s); two workers and the API know only the sentinels. Jobs queued and running,
    a client submitting short jobs all along; the master SIGKILLed; the API probed until it
    serves and takes jobs again. `min_replicas`: the master's `min-replicas-to-write`."""
    from tasks import redis_conn
    from tasks.config import Settings

    other = OtherLoad(ours_cpu_s)
    sen = procs.add(stack.SentinelRedis(min_replicas_to_write=min_replicas), first=True)
    env = {**plan.beat, "GENQ_REDIS_SENTINELS": sen.sentinels_env, "GENQ_REDIS_MASTER": sen.master_name}
    fleet = Fleet(procs, "redis://127.0.0.1:1/0", f"sentinel{min_replicas}", env)  # REDIS_URL: nowhere
    fleet.r.close()
    settings = Settings(redis_sentinels=sen.sentinels_env, redis_master=sen.master_name)
    fleet.r = redis_conn.client(settings, decode_responses=True, socket_timeout=5)
    out: dict = {"min_replicas_to_write": min_replicas, "jobs": plan.redis_jobs, "tokens": plan.sentinel_tokens}
    accepted: list[tuple[float, str]] = []  # (monotonic time of the 202, id) of the steady client's jobs
    posts: list[tuple[float, int]] = []
    stop = threading.Event()

    def steady() -> None:
        http = requests.Session()
        while not stop.is_set():
            t = time.monotonic()
            try:
                resp = http.post(fleet.base + "/v1/jobs", json={"prompt": "steady", "max_new_tokens": 4}, timeout=10)
                code = resp.status_code
                if code == 202:
                    accepted.append((time.monotonic(), resp.json()["id"]))
            except (requests.RequestException, ValueError):
                code = 0
            posts.append((t, code))
            stop.wait(0.05)
        http.close()

    client = threading.Thread(target=steady, daemon=True)
    try:
        fleet.ready(2)
        pids = [w.pid for w in fleet.workers]
        ids = fleet.submit(prompts_for(plan.redis_jobs), plan.sentinel_tokens)
        fleet.wait_running(ids)
        client.start()
        stack.wait_until(lambda: len(accepted) >= 10, 30, "the client's jobs", [fleet.api, *fleet.workers])
        out["at_kill"] = _counts(s for (s,) in fleet.fields(ids, "status"))
        replica = sen.port("replica")
        sen.proc("master").signal(signal.SIGKILL)
        t_kill, t_kill_wall = time.monotonic(), time.time()
        probes: list[tuple[float, int]] = []
        while time.monotonic() - t_kill < 60:
            t = time.monotonic()
            try:
                code = fleet.http.get(f"{fleet.base}/v1/jobs/{ids[0]}", timeout=10).status_code
            except requests.RequestException:
                code = 0
            probes.append((t - t_kill, code))
            if out.get("promoted_s") is None and sen.master_port() == replica:
                out["promoted_s"] = time.monotonic() - t_kill
            if code == 200 and out.get("promoted_s") is not None and any(c != 200 for _, c in probes):
                break
            time.sleep(0.1)
        out["api_first_503_s"], out["api_back_s"] = _outage(probes, 200)
        out["probe_codes"] = _counts(c for _, c in probes)
        time.sleep(5.0)
        stop.set()
        client.join(15)
        after_kill = [(t - t_kill, c) for t, c in posts if t > t_kill]
        out["post_codes_after_kill"] = _counts(c for _, c in after_kill)
        out["accepting_again_s"] = _outage(after_kill, 202)[1]
        steady_before = [i for t, i in accepted if t < t_kill]
        out["steady_before"] = len(steady_before)
        out["steady_last_s_before"] = sum(1 for t, _ in accepted if t_kill - 1.0 <= t < t_kill)
        every = ids + [i for _, i in accepted]
        first = wait_final(fleet, every, 180)
        recs = fleet.records(every, first)
        ok = [r for r in recs.values() if r.get("status") == "succeeded"]
        started = [r["timings"]["started"] - t_kill_wall for r in ok if r["timings"]["started"] > t_kill_wall]
        before = len(ids) + len(steady_before)
        out.update(accepted_before=before, accepted_after=len(every) - before, succeeded=len(ok), probes=probes)
        out.update(fleet.lost(recs, lambda r: r.get("status") == "succeeded"), **duplicates(fleet, every, first))
        out.update(attempts_over_1=sum(r.get("attempts", 0) > 1 for r in recs.values()))
        out.update(
            worker_started_s=min(started) if started else None, workers_alive=sum(w.alive() for w in fleet.workers)
        )
        out.update(
            workers_same=[w.pid for w in fleet.workers] == pids, unrecoverable=fleet.log_count("Unrecoverable error")
        )
        return out
    finally:
        stop.set()
        out["other_load"] = other()
        fleet.stop()
        procs.stop(sen)


def poison(procs: Processes, redis_url: str, plan: Plan) -> dict:
    """GENQ_MAX_ATTEMPTS=3; whichever worker runs the job is SIGKILLed and replaced, each attempt."""
    other = OtherLoad(ours_cpu_s)
    fleet = Fleet(procs, redis_url, "poison", {**plan.beat, "GENQ_MAX_ATTEMPTS": "3"})
    out: dict = {"attempts_seen": []}
    try:
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
            fleet.workers.remove(victim)
            procs.stop(victim)
            fleet.start_worker()  # as make run restarts a worker that died
            seen = {"attempt": attempt, "started_s": rec["timings"]["started"] - t0, "killed_s": killed - t0}
            out["attempts_seen"].append(seen)
        stack.wait_until(lambda: fleet.fields([job], "status")[0][0] in FINAL, 90, "the poison job to end", [fleet.api])
        rec = fleet.view(job)
        out.update(
            status=rec["status"],
            attempts=rec["attempts"],
            error=rec.get("error"),
            failed_s=rec["timings"]["finished"] - t0,
            after_last_kill_s=rec["timings"]["finished"] - t0 - out["attempts_seen"][-1]["killed_s"],
        )
        fleet.ready(2, start=False)
        body = {"prompt": "Hello", "max_new_tokens": 4}
        out["fleet_after"] = fleet.http.post(fleet.base + "/basic_generate", json=body, timeout=60).status_code
        return out
    finally:
        out["other_load"] = other()
        fleet.stop()


def _s(x, nd=1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _yes(x) -> str:
    return {True: "yes", False: "no"}.get(x, "?")


def verdicts(res: dict) -> list[tuple[str, str]]:
    """(PASS/FAIL, what) for what this run's scenarios can decide."""
    faults = res["sigkill"] + res["sigstop"]
    counted = [r for r in [res["reference"], *faults, res["redis"], *res.get("sentinel", [])] if r]
    lost, dup = (sum(r.get(k, 0) for r in counted) for k in ("lost", "duplicated"))
    ok = lambda c: "PASS" if c else "FAIL"  # noqa: E731
    out = [(ok(lost == 0), f"jobs lost: {lost}"), (ok(dup == 0), f"jobs duplicated: {dup}")]
    if faults:
        worst = [r.get("recovery_s") for r in faults]
        what = (
            f"a lost worker's jobs all succeeded elsewhere within {TARGET_S} s of the signal (worst: "
            f"{_s(max((v for v in worst if v is not None), default=None))} s)"
        )
        out.append(verdict(all(v is not None and v <= TARGET_S for v in worst), what))
        if res["reference"]:
            out.append(verdict(all(r.get("mismatched") == 0 for r in faults), "greedy texts equal the reference run's"))
    if p := res["poison"]:
        died = p.get("status") == "failed" and (p.get("error") or {}).get("code") == "worker_lost"
        what = "the poison job failed with worker_lost after 3 attempts, the fleet stayed up"
        out.append((ok(died and p.get("fleet_after") == 200), what))
    return out + [("FAIL", f"every scenario ran to its end ({len(res['errors'])} did not)")] * bool(res["errors"])


def findings(res: dict) -> list[str]:
    runs = [("reference run", res["reference"]), ("Redis restart", res["redis"])]
    runs[1:1] = [(f"{r['signal']} run {n + 1}", r) for k in ("sigkill", "sigstop") for n, r in enumerate(res[k])]
    sentinel = "Sentinel failover (min-replicas-to-write {})"
    runs += [(sentinel.format(r.get("min_replicas_to_write")), r) for r in res.get("sentinel", [])]
    out = []
    for label, r in runs:
        for j in (r or {}).get("lost_jobs", []):
            out.append(
                f"- {label}: job `{j['id']}` **lost**: status `{j['status']}`, attempts {j.get('attempts')}, "
                f"worker `{j.get('worker', '-')}`; its broker message: {j['message']}"
            )
        for i, d in (r or {}).get("duplicated_jobs", {}).items():
            out.append(
                f"- {label}: job `{i}` **duplicated**: {'; '.join(d['why'])} (status `{d['job'].get('status')}`, "
                f"attempts {d['job'].get('attempts')})"
            )
    return out


def render(res: dict) -> str:
    plan, a, beat = res["plan"], res["args"], res["plan"]["beat"]
    L = [MARKER, "", "## Latest run", "", *run_lines(res)]
    L.append(
        f"- Redis {res['redis_version']}; hf workers on the tiny model, GENQ_MAX_BATCH_SIZE={BATCH}, "
        f"GENQ_DTYPE=float32, GENQ_HEARTBEAT_INTERVAL={beat['GENQ_HEARTBEAT_INTERVAL']} s, "
        f"GENQ_HEARTBEAT_TTL={beat['GENQ_HEARTBEAT_TTL']} s"
        + (" (the defaults)" if beat == DEFAULT_BEAT else " (--quick: the tests' fast heartbeat)")
        + f"; {a['runs']} run(s) per fault; scenarios: {', '.join(a['only'])}"
    )
    L += verdict_lines("Verdict", verdicts(res))
    found = findings(res)
    L += ["", "Lost and duplicated jobs:", "", *found] if found else ["", "No job was lost or duplicated."]
    L += ["", "Errors:", ""] + [f"- {e}" for e in res["errors"]] if res["errors"] else []
    if faults := [(n, r) for k in ("sigkill", "sigstop") for n, r in enumerate(res[k])]:
        ref = (
            res["reference"]
            and f"; reference run: all done {_s(res['reference'].get('all_done_s'))} s after submission"
        )
        L += ["", "## A worker killed (SIGKILL) or hung (SIGSTOP) mid-batch", ""]
        L += [f"Two workers, {plan['jobs']} jobs of {plan['tokens']} tokens; seconds from the signal{ref or ''}.", ""]
        hdr = "signal|run|held|run again|restarted s|recovered s|all done s|lost|duplicated|text ≠ reference"
        rows = []
        for n, r in faults:
            rows.append([r["signal"], n + 1, r.get("held", "?"), r.get("moved", "?")])
            rows[-1] += [_s(r.get(k)) for k in ("restarted_s", "recovery_s", "all_done_s")]
            mismatched = "-" if r.get("mismatched") is None else r["mismatched"]
            rows[-1] += [r.get("lost", "?"), r.get("duplicated", "?"), mismatched]
            rows[-1] += [r.get("back_after_wake", "-"), _s(r["other_load"])]
        L.append(table(hdr + "|workers after SIGCONT|other load", rows))
    if rd := res["redis"]:
        L += ["", "## Redis restart", ""]
        L += [f"One worker, {rd.get('jobs')} jobs of {rd.get('tokens')} tokens; seconds after Redis was back:", ""]
        hdr = "jobs|succeeded|lost|duplicated|outage s|API answers again s|all done s|worker survived"
        row = [rd.get("jobs"), *(rd.get(k, "?") for k in ("succeeded", "lost", "duplicated"))]
        row += [_s(rd.get(k)) for k in ("outage_s", "api_back_s", "last_done_s")] + [_yes(rd.get("worker_alive"))]
        L.append(table(hdr, [row]))
        groups: dict[tuple, list[dict]] = {}
        for pr in rd.get("probes", []):
            key = ("while down" if pr["down"] else "after", pr["what"], pr["code"], pr["error"])
            groups.setdefault(key, []).append(pr)
        rows = [[*k[:3], k[3] or "-", len(v), _s(max(x["latency_s"] for x in v), 2)] for k, v in groups.items()]
        L += ["", "The API's answers:", "", table("when|request|status|error code|answers|slowest s", rows)]
    if sn := res.get("sentinel"):
        L += ["", "## Redis Sentinel failover", ""]
        L += [f"{sn[0].get('jobs')} jobs of {sn[0].get('tokens')} tokens; seconds from the kill of the master:", ""]
        hdr = "min-replicas-to-write|jobs at kill|accepted before kill (last 1 s)|replica promoted s|first 503 s"
        hdr += "|API serves again s|POST accepted again s|a worker starts a job s|accepted after|succeeded|lost"
        rows = []
        for r in sn:
            at_kill = " ".join(f"{k} {v}" for k, v in (r.get("at_kill") or {}).items())
            before = f"{r.get('accepted_before', '?')} ({r.get('steady_last_s_before', '?')})"
            rows.append([r.get("min_replicas_to_write"), at_kill, before, _s(r.get("promoted_s"))])
            rows[-1] += [_s(r.get("api_first_503_s"), 2), _s(r.get("api_back_s")), _s(r.get("accepting_again_s"))]
            rows[-1] += [_s(r.get("worker_started_s")), r.get("accepted_after", "?"), r.get("succeeded", "?")]
            rows[-1] += [r.get(k, "?") for k in ("lost", "attempts_over_1", "duplicated")]
            rows[-1] += [_yes(r.get("workers_same")), _s(r["other_load"])]
        L.append(table(hdr + "|attempts > 1|duplicated|workers same pids|other load", rows))
        L += ["", "The API's answers to the probe, and to the client's POSTs after the kill (status: count):", ""]
        L += [
            f"- min-replicas-to-write {r.get('min_replicas_to_write')}: GET {r.get('probe_codes')}, "
            f"POST {r.get('post_codes_after_kill')}"
            for r in sn
        ]
    if po := res["poison"]:
        err = po.get("error") or {}
        L += ["", "## Poison job", ""]
        L.append(
            f"Status `{po.get('status')}` after {po.get('attempts')} attempts, {_s(po.get('failed_s'))} s after "
            f"submission, error `{err.get('code')}`; a new job afterwards: HTTP {po.get('fleet_after')}."
        )
    L.append("")
    return "\n".join(L)


def parse_args(argv: list[str] | None):
    ap = parser("bench.reliability", __doc__, out="reliability.md", model=False, noise=False)
    ap.add_argument("--runs", type=int, default=5, help="runs of each fault, SIGKILL and SIGSTOP")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"fewer, shorter jobs and the tests' fast heartbeat ({QUICK.jobs} x {QUICK.tokens} tokens, "
        f"TTL {QUICK.beat['GENQ_HEARTBEAT_TTL']} s): a smoke test, not a measurement",
    )
    ap.add_argument("--only", default=",".join(SCENARIOS), help="scenarios to run")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    args.only = names(ap, args.only, SCENARIOS, "--only")
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
    for k in ignored:  # the settings are the benchmark's own (the page says which)
        del os.environ[k]
    if ignored:
        log(f"ignoring {', '.join(ignored)} from the environment")

    def measure(procs: Processes, res: dict, outdir: Path) -> None:
        from scripts import devmodels

        devmodels.ensure("tiny", stack.TINY_MODEL_DIR)
        db = procs.redis()
        res["redis_version"] = redis_version(db.url)
        errors, reference = res["errors"], {}
        if "reference" in args.only:
            log(f"reference run: {plan.jobs} jobs x {plan.tokens} tokens, two workers, no fault")
            res["reference"] = _guarded(errors, "reference", fault_run, procs, db.url, plan, "ref", None, reference)
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            for n in range(args.runs if sig.name.lower() in args.only else 0):
                log(f"{sig.name} run {n + 1}/{args.runs}")
                label = f"{sig.name.lower()}{n + 1}"
                r = _guarded(errors, f"{sig.name} run {n + 1}", fault_run, procs, db.url, plan, label, sig, reference)
                r.setdefault("signal", sig.name)
                res[sig.name.lower()].append(r)
                log(f"  held {r.get('held')}, recovered in {_s(r.get('recovery_s'))} s, lost {r.get('lost')}")
        if "redis" in args.only:
            log(f"Redis restart: {plan.redis_jobs} jobs x {plan.redis_tokens} tokens, one worker")
            res["redis"] = _guarded(errors, "Redis restart", redis_restart, procs, outdir, plan)
        for m in (0, 1) if "sentinel" in args.only else ():
            what = f"Sentinel failover (min-replicas-to-write {m})"
            log(f"{what}: {plan.redis_jobs} jobs x {plan.sentinel_tokens} tokens, two workers")
            r = _guarded(errors, what, sentinel_failover, procs, plan, m)
            r.setdefault("min_replicas_to_write", m)
            res["sentinel"].append(r)
            log(
                f"  API back {_s(r.get('api_back_s'))} s after the kill, lost {r.get('lost')}, dup. {r.get('duplicated')}"
            )
        if "poison" in args.only:
            log("poison job")
            res["poison"] = _guarded(errors, "poison job", poison, procs, db.url, plan)

    empty = dict(errors=[], sigkill=[], sigstop=[], reference=None, redis=None, sentinel=[], poison=None)
    facts = {"out_prefix": "reliability-", "log": log, "plan": asdict(plan), **empty}
    res = run_bench("bench.reliability", args, argv, measure, **facts)
    if publish(res, args, render, INTRO, MARKER, log):
        return 130
    failed = [s for v, s in verdicts(res) if v != "PASS"]
    for s in failed:
        log(f"FAIL: {s}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
