"""Jobs that survive: a dead or hung worker's jobs finish on another worker within a minute,
exactly once; a Redis restart loses nothing; a job that kills every worker it meets fails
after GENQ_MAX_ATTEMPTS instead of taking the fleet down; the queue cap is exact.

All of it with real processes: Redis, gunicorn, Celery workers on the tiny model, and signals.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid

import pytest
import redis

from scripts import stack as stackmod
from tasks import keys
from tasks.jobs import JobStore
from tasks.schemas import JobSpec, JobStatus, SamplingParams
from tasks.streams import Restart, StreamEnd, TokenEvent, follow
from tests.helpers import KillableRedis, joined, queued_job, stream, submit
from worker.publisher import StreamPublisher

# The default heartbeat (the other test stacks beat faster, to be quick).
DEFAULT_BEAT = {"GENQ_HEARTBEAT_INTERVAL": "2", "GENQ_HEARTBEAT_TTL": "10"}
RECOVERY_LIMIT_S = 60
# Long enough that a worker is still running jobs when the signal comes (the tiny model
# generates 64 tokens in about 0.2 s a job here: the whole batch could end before the signal).
TOKENS = 256


def _prompts(n: int) -> list[str]:
    return [f"Recovery {i}: the quick brown fox" for i in range(n)]


def _records(s, ids: list[str]) -> dict[str, dict]:
    return {job_id: s.get(f"/v1/jobs/{job_id}").json() for job_id in ids}


def _wait_final(s, ids: list[str], timeout: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        recs = _records(s, ids)
        if all(r["status"] not in ("queued", "running") for r in recs.values()):
            return recs
        if time.monotonic() > deadline:
            return recs
        time.sleep(0.5)


def _broker_state(url: str, recs: dict[str, dict]) -> str:
    """What Redis holds for the jobs that did not end well: for a failure message."""
    r = redis.Redis.from_url(url, decode_responses=True)
    try:
        bad = {j: rec for j, rec in recs.items() if rec["status"] != "succeeded"}
        lines = [f"{j}: {r.hgetall(keys.job(j))}" for j in bad]
        for key in r.scan_iter(match="genq.*"):
            if r.type(key) == "list":
                lines.append(f"{key}: {[j for j in bad if any(j in m for m in r.lrange(key, 0, -1))]}")
        for key in r.scan_iter(match=keys.inflight("*")):
            lines.append(f"{key}: {r.hgetall(key)}")
        return "\n".join(lines)
    finally:
        r.close()


def _start_workers(s, n: int) -> list[stackmod.Proc]:
    workers = [s.start_worker() for _ in range(n)]
    stackmod.wait_until(lambda: len(s.get("/readyz").json().get("workers", [])) == n, 90, f"{n} workers", s.procs)
    return workers


def _freeze_busiest(s, ids: list[str], workers: list[stackmod.Proc]) -> stackmod.Proc:
    """Once jobs run: every worker frozen (SIGSTOP), and the one running most of the jobs. The
    caller signals it and continues the others (`_thaw`). Frozen first, looked at after: on a
    fast machine the tiny model ends a batch between an HTTP look and a signal."""
    while True:
        stackmod.wait_until(
            lambda: any(r["status"] == "running" for r in _records(s, ids).values()), 60, "jobs to run", s.procs
        )
        for w in workers:
            w.signal(signal.SIGSTOP)
        found: dict[str, int] = {}
        for rec in _records(s, ids).values():
            if rec["status"] == "running":
                found[rec["worker"]] = found.get(rec["worker"], 0) + 1
        if found:
            name = max(found, key=found.get)
            (proc,) = [w for w in workers if f"-{w.pid}@" in name]
            return proc
        _thaw(workers)  # they ended their jobs between the look and the freeze: again


def _thaw(workers: list[stackmod.Proc], but: stackmod.Proc | None = None) -> None:
    for w in workers:
        if w is not but:
            w.signal(signal.SIGCONT)


def _held(s, ids: list[str], victim: stackmod.Proc) -> set[str]:
    """The jobs `victim` was running when it was killed or stopped (read right after the signal:
    their records say so until recovery acts, a heartbeat TTL later). Not those it ran when
    a look before the signal: a running worker can finish them all in between."""
    mark = f"-{victim.pid}@"
    held = {j for j, rec in _records(s, ids).items() if rec["status"] == "running" and mark in rec["worker"]}
    assert held, "the worker held no job when the signal came"
    return held


def _submit_batch(s, prompts: list[str], sampled: int = 0) -> list[str]:
    ids = []
    for i, prompt in enumerate(prompts):
        extra = {"temperature": 1.0} if i < sampled else {}
        ids.append(submit(s, prompt=prompt, max_new_tokens=TOKENS, ignore_eos=True, **extra))
    return ids


def _assert_done_once(recs: dict[str, dict], moved: set[str], survivor: str) -> None:
    assert all(r["status"] == "succeeded" for r in recs.values()), [
        (r["status"], r.get("error")) for r in recs.values() if r["status"] != "succeeded"
    ]
    for rec in recs.values():
        assert rec["result"]["completion_tokens"] == TOKENS
        assert rec["result"]["worker"] == rec["worker"]
        assert rec["attempts"] in (1, 2), rec
        if rec["attempts"] == 2:
            assert rec["worker"] == survivor, rec
    # Jobs the lost worker was running were run again on the survivor (those that it had not
    # finished before the signal: at least one, as the signal comes mid-batch).
    assert sum(recs[j]["attempts"] == 2 for j in moved) >= 1


def test_a_killed_workers_jobs_finish_elsewhere_within_a_minute(make_stack, reference):
    s = make_stack(GENQ_MAX_BATCH_SIZE="16", **DEFAULT_BEAT)
    s.start_api()
    workers = _start_workers(s, 2)
    prompts = _prompts(40)
    ids = _submit_batch(s, prompts)
    victim = _freeze_busiest(s, ids, workers)
    victim.signal(signal.SIGKILL)
    killed = time.monotonic()
    moved = _held(s, ids, victim)
    _thaw(workers, but=victim)
    victim.popen.wait(10)
    (survivor,) = [w for w in workers if w is not victim]

    recs = _wait_final(s, ids, RECOVERY_LIMIT_S)
    assert time.monotonic() - killed <= RECOVERY_LIMIT_S, "not all jobs finished within a minute"
    names = {w["name"] for w in s.get("/readyz").json()["workers"]}
    (survivor_name,) = [n for n in names if f"-{survivor.pid}@" in n]
    _assert_done_once(recs, moved, survivor_name)
    # Greedy: the same text as a run that lost no worker.
    for prompt, job_id in zip(prompts, ids):
        assert recs[job_id]["result"]["text"] == reference(prompt, TOKENS), prompt
    # A restarted job's stream replays without a seam: one attempt's tokens, numbered once.
    again = next(j for j in ids if recs[j]["attempts"] == 2)
    events = stream(s, again)
    assert [e["event"] for e in events] == ["token"] * TOKENS + ["done"]
    assert joined(events) == recs[again]["result"]["text"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_live_reader_never_gets_two_attempts_mixed(make_stack, dtype):
    """Readers of greedy and sampled (unseeded) jobs read while the worker running them is
    SIGKILLed; the jobs finish on the other worker. In bfloat16 a greedy re-run in another
    batch can take other tokens; a sampled one does. Each reader (raw SSE, and the client's
    TokenStream) ends with the text of one attempt: the job's result's."""
    from genqueue.client import Client
    from genqueue.client import Restart as ClientRestart

    s = make_stack(GENQ_DTYPE=dtype, GENQ_MAX_BATCH_SIZE="16")
    s.start_api()
    workers = _start_workers(s, 2)
    n = 480  # longest the tiny model's context takes: the batch still runs when the signal comes
    ids = [
        submit(s, prompt=p, max_new_tokens=n, ignore_eos=True, **({"temperature": 1.0} if i % 2 else {}))
        for i, p in enumerate(_prompts(16))
    ]
    raw: dict[str, list[dict]] = {j: [] for j in ids}
    texts: dict[str, dict] = {}
    client = Client(s.base, timeout=60)

    def read_raw(job_id: str) -> None:
        with s.http.get(f"{s.base}/v1/jobs/{job_id}/stream", stream=True, timeout=90) as resp:
            current: dict = {}
            for line in resp.iter_lines(decode_unicode=True):
                if line == "" and "data" in current:
                    raw[job_id].append(current)
                    current = {}
                elif line and not line.startswith(":"):
                    field, _, value = line.partition(": ")
                    current[field] = value

    def read_client(job_id: str) -> None:
        ts = client.stream(job_id)
        restarts = sum(isinstance(piece, ClientRestart) for piece in ts)
        texts[job_id] = {"text": ts.text, "restarts": restarts}

    threads = [threading.Thread(target=f, args=(j,), daemon=True) for j in ids for f in (read_raw, read_client)]
    for t in threads:
        t.start()
    try:
        # Once readers have a few tokens of a running job (a replay has something to disagree
        # with), both workers are frozen at once and the one holding most of the jobs read so
        # far is killed. Looking the records up first, with the workers running, could find
        # the batch over: on a fast machine the tiny model ends it in ~1.5 s.
        def reading() -> bool:
            return any(len(ev) >= 3 and ev[-1].get("event") == "token" for ev in list(raw.values()))

        stackmod.wait_until(reading, 60, "tokens read", s.procs)
        for w in workers:
            w.signal(signal.SIGSTOP)
        try:
            read_now = {j: len(raw[j]) for j in ids}  # at least this much was read before the kill
            recs = _records(s, ids)

            def reads(w: stackmod.Proc) -> int:
                mark = f"-{w.pid}@"
                return sum(read_now[j] > 0 for j, r in recs.items() if r["status"] == "running" and mark in r["worker"])

            victim = max(workers, key=reads)
            victim.signal(signal.SIGKILL)
            moved = _held(s, ids, victim)  # it runs no more: its records say what it held
        finally:
            for w in workers:
                w.signal(signal.SIGCONT)
        recs = _wait_final(s, ids, RECOVERY_LIMIT_S)
        for t in threads:
            t.join(30)
    finally:
        client.close()
    assert all(r["status"] == "succeeded" for r in recs.values()), recs
    assert any(recs[j]["attempts"] == 2 and read_now[j] > 0 for j in moved), "no reader read a re-run job"
    for i, job_id in enumerate(ids):
        final = recs[job_id]["result"]["text"]
        events = raw[job_id]
        restarts = [k for k, e in enumerate(events) if e.get("event") == "restart"]
        after = events[restarts[-1] + 1 :] if restarts else events
        assert len(restarts) <= recs[job_id]["attempts"] - 1
        assert [e["event"] for e in after] == ["token"] * n + ["done"], (job_id, [e["event"] for e in events])
        assert joined(after) == final, (dtype, job_id)  # one attempt's tokens, the result's
        assert texts[job_id]["text"] == final, (dtype, job_id)
        sampled = i % 2 == 1
        if sampled and job_id in moved and recs[job_id]["attempts"] == 2 and read_now[job_id] >= 3:
            # Its new attempt took other tokens: the readers were told to start over.
            assert restarts and texts[job_id]["restarts"] == 1, job_id


def test_a_hung_worker_is_given_up_and_writes_nothing_when_it_wakes(make_stack, redis_url):
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    s = make_stack(GENQ_MAX_BATCH_SIZE="16", **DEFAULT_BEAT)
    s.start_api()
    workers = _start_workers(s, 2)
    # Sampled jobs too: their new attempt's tokens differ, so a late write would show.
    ids = _submit_batch(s, _prompts(40), sampled=8)
    victim = _freeze_busiest(s, ids, workers)  # it stays stopped
    stopped = time.monotonic()
    moved = _held(s, ids, victim)
    _thaw(workers, but=victim)
    try:
        recs = _wait_final(s, ids, RECOVERY_LIMIT_S)
        assert time.monotonic() - stopped <= RECOVERY_LIMIT_S, "not all jobs finished within a minute"
        (survivor,) = [w for w in workers if w is not victim]
        survivor_name = next(r["worker"] for r in recs.values() if f"-{survivor.pid}@" in r["worker"])
        _assert_done_once(recs, moved, survivor_name)
        streams = {j: joined(stream(s, j)) for j in moved}
        for j in moved:
            assert streams[j] == recs[j]["result"]["text"]
        entries = {j: r.xrange(keys.stream(j)) for j in moved}
    finally:
        victim.signal(signal.SIGCONT)

    # Awake again: it drops the jobs it had (they are another attempt's now) and writes nothing.
    log = s.logs / f"{s.name}-worker{workers.index(victim)}.log"
    stackmod.wait_until(lambda: "superseded" in log.read_text(), 30, "the woken worker to drop its jobs", s.procs)
    time.sleep(3)  # what it had generated meanwhile would have been written by now
    assert _records(s, ids) == recs
    assert {j: joined(stream(s, j)) for j in moved} == streams
    assert {j: r.xrange(keys.stream(j)) for j in moved} == entries  # not one entry more
    r.close()
    # And it serves again.
    stackmod.wait_until(lambda: len(s.get("/readyz").json().get("workers", [])) == 2, 30, "the woken worker", s.procs)


@pytest.mark.timeout(480)
def test_a_redis_restart_loses_no_job(make_stack, tmp_path):
    db = KillableRedis(tmp_path, fsync="everysec")  # as `make run`'s private Redis
    s = make_stack(REDIS_URL=db.url, GENQ_MAX_BATCH_SIZE="16")
    try:
        s.start_api()
        s.start_worker()
        s.wait_ready()
        ids = [submit(s, prompt=p, max_new_tokens=100, ignore_eos=True) for p in _prompts(50)]
        stackmod.wait_until(lambda: any(r["status"] == "running" for r in _records(s, ids).values()), 30, "jobs to run")
        db.kill()
        answers = [s.get(f"/v1/jobs/{ids[0]}", timeout=10), s.post("/v1/jobs", json={"prompt": "x"}, timeout=10)]
        time.sleep(3)
        db.start()
        recs = _wait_final(s, ids, 300)  # on a busy 2-core machine, 4 batches of 16 take minutes
        assert [r["status"] for r in recs.values()] == ["succeeded"] * 50, _broker_state(db.url, recs)
        assert all(r["result"]["completion_tokens"] == 100 for r in recs.values())
        for resp in answers:
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "broker_unavailable"
        assert s.procs[-1].alive(), "the worker must ride out a Redis restart"
    finally:
        s.stop()
        db.stop()


def test_jobs_whose_messages_went_astray_run_all_the_same(make_stack, redis_url):
    """What a Redis restart, a dropped connection or a dead worker can leave behind: queued
    jobs whose message is gone (lost with a Redis that restarted, never published by an API
    that died, or taken by a worker that died before starting the job: without ack emulation
    a taken message is in that worker's memory only), and a job recorded running on a worker
    that is gone without a trace. The workers find all of them and run them."""
    from tasks.config import queue_for

    s = make_stack(GENQ_RECONCILE_INTERVAL="1")
    s.start_api()  # no worker yet: the jobs wait
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        lost = [submit(s, prompt=p, max_new_tokens=8, ignore_eos=True) for p in _prompts(3)]
        received = submit(s, prompt="received, never started", max_new_tokens=8, ignore_eos=True)
        stranded = submit(s, prompt="stranded on a vanished worker", max_new_tokens=8, ignore_eos=True)
        queue = queue_for(s.name)
        lists = [k for k in r.scan_iter(match=f"{queue}*") if r.type(k) == "list"]
        for key in lists:
            for raw in r.lrange(key, 0, -1):
                r.lrem(key, 1, raw)
        gone = f"genq-hf-0@vanished-{uuid.uuid4().hex[:6]}"
        r.hset(keys.job(stranded), mapping={"status": "running", "attempts": 1, "worker": gone, "tag": "t0"})
        r.zrem(keys.queued(queue), stranded)
        r.hset(keys.inflight(gone), stranded, "t0")
        s.start_worker()
        recs = _wait_final(s, [*lost, received, stranded], 90)
        for job in [*lost, received]:
            assert recs[job]["status"] == "succeeded" and recs[job]["attempts"] == 1, recs[job]
            assert recs[job]["result"]["completion_tokens"] == 8
        assert recs[stranded]["status"] == "succeeded" and recs[stranded]["attempts"] == 2, recs[stranded]
        assert not r.exists(keys.inflight(gone))
        worker_log = s.procs[-1].log.read_text()
        republished = [ln for ln in worker_log.splitlines() if "had lost its message; published it again" in ln]
        assert all(any(j in ln for ln in republished) for j in [*lost, received]), republished
    finally:
        r.close()
        s.stop()


def test_a_job_that_kills_every_worker_fails_after_max_attempts(make_stack):
    s = make_stack(GENQ_MAX_BATCH_SIZE="4", GENQ_MAX_ATTEMPTS="3")
    s.start_api()
    job = submit(s, prompt="poison", max_new_tokens=480, ignore_eos=True)
    for attempt in (1, 2, 3):
        worker = s.start_worker()

        def running_here() -> bool:
            rec = s.get(f"/v1/jobs/{job}").json()
            return rec["status"] == "running" and rec["attempts"] == attempt and f"-{worker.pid}@" in rec["worker"]

        stackmod.wait_until(running_here, 120, f"attempt {attempt}", s.procs)  # a busy machine loads slowly
        worker.signal(signal.SIGKILL)
        worker.popen.wait(10)
        s.procs.remove(worker)
    s.start_worker()  # finds the third run's worker dead: no fourth run
    rec = s.get(f"/v1/jobs/{job}?wait=60").json()
    assert rec["status"] == "failed" and rec["attempts"] == 3, rec
    assert rec["error"]["code"] == "worker_lost" and "3 attempts" in rec["error"]["message"]
    # The fleet is still up.
    s.wait_ready()
    resp = s.post("/basic_generate", json={"prompt": "Hello", "max_new_tokens": 4}, timeout=60)
    assert resp.status_code == 200


@pytest.mark.timeout(150)
def test_innocent_jobs_beside_a_poison_job_are_not_charged_for_it(make_stack, redis_url):
    """GENQ_MAX_ATTEMPTS=3; a poison job, whose worker is SIGKILLed whenever it generates (as a
    job that crashes its worker), and six innocent jobs beside it, one worker at a time (a
    fresh one after each kill). Its first deaths, shared with the innocent jobs, are forgiven
    to all; then every one of them runs alone, and the poison job is charged for each worker it
    kills alone: it fails worker_lost, and every innocent job succeeds, its successful run the
    only one that counts. (Before: every job was charged for every death, and the innocent
    ones failed worker_lost with it.)"""
    from worker.engines.sim import sim_tokens

    s = make_stack(GENQ_ENGINE="sim", GENQ_SIM_STEP_MS="20", GENQ_MAX_BATCH_SIZE="8", GENQ_MAX_ATTEMPTS="3")
    s.start_api()  # no worker yet: all seven wait, and the first worker starts them together
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    n = 100  # 2 s a job at 20 ms a step: the innocent ones still run when the poison one generates
    poison = submit(s, prompt="poison pill", max_new_tokens=n)
    prompts = [f"innocent {i} job" for i in range(6)]
    innocents = [submit(s, prompt=p, max_new_tokens=n) for p in prompts]
    kills = []
    try:
        worker = s.start_worker()
        while r.hget(keys.job(poison), "status") != "failed":
            mark = f"-{worker.pid}@"

            def generating() -> bool:
                rec = r.hgetall(keys.job(poison))
                if rec.get("status") == "failed":
                    return True
                # The stream holds this attempt's tokens only (emptied when it started).
                started_here = rec.get("status") == "running" and mark in rec.get("worker", "")
                if not (started_here and any("i" in f for _, f in r.xrange(keys.stream(poison)))):
                    return False
                # And every innocent job not done has started here too: a worker killed
                # between receiving a re-delivered job and starting it leaves it to the
                # visibility timeout (the reconciler looks only for queued ones), which is
                # another matter than this test's.
                others = [r.hgetall(keys.job(j)) for j in innocents]
                return all(o["status"] == "succeeded" or mark in o.get("worker", "") for o in others)

            stackmod.wait_until(generating, 60, f"the poison job to generate (kill {len(kills) + 1})", s.procs)
            if r.hget(keys.job(poison), "status") == "failed":
                break
            beside = [
                j
                for j in innocents
                if mark in (r.hget(keys.job(j), "worker") or "") and r.hget(keys.job(j), "status") == "running"
            ]
            worker.signal(signal.SIGKILL)
            worker.popen.wait(10)
            s.procs.remove(worker)
            kills.append(beside)
            assert len(kills) <= 8, "the poison job was never charged"
            worker = s.start_worker()
        recs = _wait_final(s, [poison, *innocents], 60)
        state = _broker_state(redis_url, {j: v for j, v in recs.items() if j != poison})
    finally:
        r.close()
    bad = recs[poison]
    assert bad["status"] == "failed" and bad["error"]["code"] == "worker_lost", bad
    assert bad["attempts"] - bad["attempts_forgiven"] == 3 and "3 attempts" in bad["error"]["message"], bad
    assert bad["attempts"] == len(kills)
    assert len(kills[0]) == 6, "the innocent jobs were not running beside the poison one"
    for prompt, job in zip(prompts, innocents):
        rec = recs[job]
        assert rec["status"] == "succeeded", (rec, state)
        assert rec["result"]["text"] == "".join(sim_tokens(prompt, n))
        assert rec["attempts"] - rec["attempts_forgiven"] == 1, rec  # only its successful run counts
        assert rec["attempts"] >= 2  # it was lost with the poison job at least once


def test_the_queue_cap_is_exact_under_concurrent_submissions(make_stack):
    s = make_stack(GENQ_MAX_QUEUE_DEPTH="50", GENQ_API_WORKERS="2")
    s.start_api()  # no worker: everything accepted stays queued
    codes: list[int] = []

    def post():
        for _ in range(10):
            codes.append(s.post("/v1/jobs", json={"prompt": "x"}).status_code)

    threads = [threading.Thread(target=post) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes.count(202) == 50 and codes.count(429) == 50, sorted(set(codes))


# -- the fence and the restart marker, against a real Redis, without a model -----------------


def test_a_superseded_attempt_cannot_finish_the_job(store):
    # Worker names of its own: other tests' jobs on the session's Redis sit in "w1"'s in-flight set.
    job, w1, w2 = queued_job(store), f"w1-{uuid.uuid4().hex[:8]}", f"w2-{uuid.uuid4().hex[:8]}"
    first = store.start(job, w1, "tag-1")
    second = store.start(job, w2, "tag-2")
    assert (first.run, first.number, second.run, second.number) == (True, 1, True, 2)
    assert store.r.hgetall(keys.inflight(w1)) == {} and store.r.hgetall(keys.inflight(w2)) == {job: "tag-2"}
    assert store.finish(job, JobStatus.succeeded, fence=1) == (False, JobStatus.running)
    assert store.finish(job, JobStatus.succeeded, fence=2) == (True, JobStatus.running)
    assert store.r.hgetall(keys.inflight(w2)) == {}


def test_a_job_out_of_attempts_fails_when_delivered_again(store):
    job = queued_job(store)
    for n in (1, 2, 3):
        assert store.start(job, f"w{n}", f"t{n}").run
    fourth = store.start(job, "w4", "t4")
    assert (fourth.run, fourth.exhausted) == (False, True)
    rec = store.get(job)
    assert rec["status"] == "failed" and json.loads(rec["error"])["code"] == "worker_lost"


def _publish(store: JobStore, job: str, attempt: int, tokens: list[str], finish: bool = False) -> None:
    pub = StreamPublisher(store.r, 600, 100)
    pub.attempts[job] = attempt
    events = [(job, TokenEvent(i, t)) for i, t in enumerate(tokens)]
    if finish:
        events.append((job, TokenEvent(len(tokens), "", finish="length", usage={})))
    pub.emit(events, [])
    pub.close()


def _take(it, n: int) -> list:
    out = []
    while len(out) < n:
        item = next(it)
        if item is not None:
            out.append(item[1])
    return out


@pytest.mark.parametrize("second", ["sampled", "same", "diverging"])
def test_readers_never_mix_two_attempts_tokens(store, second):
    """A new attempt's tokens: other ones (a sampled job), the same ones (a greedy replay), or
    the same at first and then others (a greedy job re-run in another batch in bfloat16)."""
    job = queued_job(store, temperature=1.0) if second == "sampled" else queued_job(store)
    store.start(job, "w1", "t1")
    _publish(store, job, 1, ["a", "b", "c"])
    reader = follow(store.r, [job], store.get)
    assert [e.text for e in _take(reader, 3)] == ["a", "b", "c"]

    store.start(job, "w2", "t2")  # the first worker was given up for dead
    _publish(store, job, 1, ["d"])  # it wakes and writes: fenced off
    tokens = {"sampled": ["A", "B", "C", "D"], "same": ["a", "b", "c", "d"], "diverging": ["a", "b", "X", "Y"]}[second]
    _publish(store, job, 2, tokens, finish=True)
    store.finish(job, JobStatus.succeeded, fence=2)

    rest = [e for _, e in (item for item in reader if item is not None)]
    late = [e for _, e in (item for item in follow(store.r, [job], store.get, {job: "1"}) if item is not None)]
    assert not any(isinstance(e, StreamEnd) for e in rest + late)
    if second == "same":
        # The same tokens again: the reader skips what it has and sees no seam.
        assert [e.text for e in rest] == ["d", ""]
    else:
        # Told to start over, then the second attempt alone, with ids that name it: never
        # "abc" followed by the new attempt's "XY" or "D".
        assert isinstance(rest[0], Restart) and rest[0].attempt == 2
        assert [e.text for e in rest[1:]] == tokens + [""]
        assert [e.event_id for e in rest[1:]] == ["2:0", "2:1", "2:2", "2:3", "2:4"]
    # A reader resuming from the first attempt's id 1 has no tokens of it to compare with
    # (the stream holds the second attempt's only): it is told to start over too.
    assert isinstance(late[0], Restart) and [e.text for e in late[1:]] == tokens + [""]
    # One resuming within the second attempt goes on from its id.
    again = [e for _, e in (item for item in follow(store.r, [job], store.get, {job: "2:1"}) if item is not None)]
    assert [e.text for e in again] == tokens[2:] + [""]


def test_two_workers_sweeping_one_dead_worker_recover_each_job_once(store, redis_url):
    """Every live worker sweeps, and several stacks may share one Redis: a second sweeper that
    read the dead worker's in-flight hash before the first one published its job again, while
    a consumer has just popped the new message (in no list, not started: without ack emulation
    it is in that consumer's memory only), must not publish the job again: that ran a job
    three times (CI, attempts 3). And should that consumer die before it starts the job, the
    dead worker's entry is still there, and the job is published again once its last
    publication is 30 s old (the reconciler finds the entry). Real Redis, real kombu channel."""
    from tasks.celery_app import PRIORITY_STEPS, make_celery, publish_job
    from tasks.config import Settings
    from tasks.kombu_compat import priority_lists
    from tasks.registry import Registry
    from worker.recovery import Reaper

    queue = f"genq.test-{uuid.uuid4().hex[:6]}"
    spec = JobSpec(id=str(uuid.uuid4()), model="m", prompt="p", params=SamplingParams())
    assert store.create([spec], queue, 10)[0]
    app = make_celery(Settings(redis_url=redis_url))
    dead = f"genq-hf-0@dead-{uuid.uuid4().hex[:6]}"
    sweepers = [Reaper(app, store, Registry(store.r, 3), f"genq-hf-{n}@alive") for n in (1, 2)]
    channel = sweepers[0]._channel()
    lists = priority_lists(channel, queue, PRIORITY_STEPS)

    def listed() -> list[str]:
        return [json.loads(m)["headers"]["id"] for k in lists for m in store.r.lrange(k, 0, -1)]

    try:
        # The dead worker had taken the job's message and started it.
        publish_job(app, spec, queue)
        (key,) = [k for k in lists if store.r.llen(k)]
        store.r.rpop(key)
        assert store.start(spec.id, dead, "t1").number == 1

        late = store.r.hgetall(keys.inflight(dead))  # the second sweeper's look, made first
        assert late == {spec.id: "t1"}
        assert sweepers[0].recover(dead) == 1  # what its sweep does for a stale worker
        assert listed() == [spec.id]
        for k in lists:  # a live consumer pops it: for a moment it is in no list, not started
            store.r.delete(k)
        restored = [sweepers[1]._recover_one(keys.inflight(dead), job, t) for job, t in late.items()]
        assert restored == [False] and listed() == [], "published a second time"
        # That consumer dies before it starts the job: the entry is still there, and once the
        # last publication is 30 s old (here: its mark deleted), the job is published again.
        assert store.r.hgetall(keys.inflight(dead)) == late
        store.r.delete(keys.republishing(spec.id, 1))
        assert sweepers[1]._recover_one(keys.inflight(dead), spec.id, "t1") and listed() == [spec.id]
        # A live worker starts it: the dead worker's entry goes with that start.
        assert store.start(spec.id, "genq-hf-1@alive", "t2").number == 2
        assert not store.r.exists(keys.inflight(dead))
    finally:
        for sweeper in sweepers:
            sweeper.reset()
        store.r.delete(*lists, keys.inflight("genq-hf-1@alive"))


def test_a_worker_takes_the_jobs_it_ended_off_its_hash_in_one_call(store):
    """A worker's store (`me`) leaves the entry of a job it ends on its own attempt, and takes
    all such entries off in one HDEL on its next heartbeat, or once FORGET_BATCH have ended
    (`forget_ended`); one that another process moves (a give-up, a cancel) goes at once."""
    me = f"genq-hf-0@me-{uuid.uuid4().hex[:6]}"
    mine = JobStore(store.r, store.ttl, store.max_attempts, me=me)
    ended, failed, cancelled = (queued_job(store) for _ in range(3))
    for job in (ended, failed, cancelled):
        assert mine.start(job, me, "t").number == 1
    assert mine.succeed(ended, 1, '{"r": 1}') is True
    assert mine.finish(failed, JobStatus.failed, fence=1) == (True, JobStatus.running)
    assert store.cancel(cancelled) == (True, JobStatus.running)  # the API's: at once
    assert store.r.hgetall(keys.inflight(me)).keys() == {ended, failed}
    assert mine.forget_ended() == 2 and not store.r.exists(keys.inflight(me))
    assert mine.forget_ended() == 0
    # A job another worker gives up for this one (fenced, but not by its own worker) goes at once.
    lost = queued_job(store)
    assert mine.start(lost, me, "t").number == 1
    other = JobStore(store.r, store.ttl, store.max_attempts, me="genq-hf-1@other")
    assert other.give_up(lost, 1) and not store.r.exists(keys.inflight(me))
    # Once FORGET_BATCH jobs have ended, the one that makes them so takes them off itself.
    from tasks.jobs import FORGET_BATCH

    jobs = [queued_job(store) for _ in range(FORGET_BATCH + 1)]
    for job in jobs:
        assert mine.start(job, me, "t").number == 1
    for job in jobs[: FORGET_BATCH - 1]:
        assert mine.succeed(job, 1, '{"r": 1}') is True
    assert len(store.r.hkeys(keys.inflight(me))) == FORGET_BATCH + 1
    assert mine.succeed(jobs[FORGET_BATCH - 1], 1, '{"r": 1}') is True
    assert store.r.hkeys(keys.inflight(me)) == [jobs[-1]]


def _reaper(store, redis_url, name: str):
    from tasks.celery_app import make_celery
    from tasks.config import Settings
    from tasks.registry import Registry
    from worker.recovery import Reaper

    app = make_celery(Settings(redis_url=redis_url))
    return Reaper(app, store, Registry(store.r, 3), name)


def test_a_lost_attempt_is_forgiven_once_and_a_job_lost_again_is_published_at_once(store, redis_url):
    """A worker lost with two jobs in flight: both are forgiven, once each, however often
    recovery looks, and whichever of them is left in its hash when the other has started
    again (the count is taken at the first look: CI once charged the one left). A job lost
    again on its next attempt is published again at once, not 30 s after its last publication
    (the claim is per lost attempt)."""
    from tasks.celery_app import PRIORITY_STEPS
    from tasks.kombu_compat import priority_lists

    queue = f"genq.test-{uuid.uuid4().hex[:6]}"
    specs = [JobSpec(id=str(uuid.uuid4()), model="m", prompt=f"p{i}", params=SamplingParams()) for i in range(2)]
    assert store.create(specs, queue, 10)[0]
    a, b = (spec.id for spec in specs)
    dead, dead2 = (f"genq-hf-0@dead-{uuid.uuid4().hex[:6]}" for _ in range(2))
    reaper = _reaper(store, redis_url, f"genq-hf-1@alive-{uuid.uuid4().hex[:6]}")
    lists = priority_lists(reaper._channel(), queue, PRIORITY_STEPS)
    try:
        for job in (a, b):
            assert store.start(job, dead, "t").number == 1
        # Another sweeper holds a's claim: this look publishes b only (forgiven: lost beside a).
        store.r.set(keys.republishing(a, 1), "another sweeper")
        assert reaper.recover(dead) == 1
        assert store.get(b)["forgiven"] == "1" and not store.get(a).get("forgiven")
        # b starts again elsewhere (off the dead worker's hash); the other sweeper died.
        assert store.start(b, f"genq-hf-2@w-{uuid.uuid4().hex[:6]}", "t").number == 2
        store.r.delete(*lists, keys.republishing(a, 1))
        assert store.r.hkeys(keys.inflight(dead)) == [a]
        assert reaper.recover(dead) == 1  # a alone is left, but it was lost beside b: forgiven
        assert store.get(a)["forgiven"] == "1"
        # Its message is lost again before it starts: published again, not forgiven twice.
        store.r.delete(*lists, keys.republishing(a, 1))
        assert reaper.recover(dead) == 1 and store.get(a)["forgiven"] == "1"
        # a starts on a worker that is lost too, while attempt 1's claim still holds:
        # published at once (attempt 2's claim), and charged (it was alone there).
        store.r.delete(*lists)
        assert store.start(a, dead2, "t").number == 2
        assert reaper.recover(dead2) == 1
        rec = store.get(a)
        assert rec["status"] == "running" and rec["forgiven"] == "1"
    finally:
        reaper.reset()
        store.r.delete(*lists, keys.lost(dead), keys.lost(dead2), keys.inflight(dead), keys.inflight(dead2))


def test_a_superseded_attempt_ending_leaves_the_newer_attempt_running():
    """One worker can hold two messages of one job (one thought lost and published again while
    this worker could not start it: a Redis failover). The older attempt, superseded, ends
    while the newer runs: its end must not take the job off the worker's running jobs, or the
    reconciler takes the newer attempt for lost and publishes the job a third time
    (bench.reliability's Sentinel failover once ran a job three times)."""
    from worker.tasks import _not_running

    running = {"job": "message-2"}
    _not_running(running, "job", "message-1")  # attempt 1 (message 1), superseded, ends
    assert running == {"job": "message-2"}
    _not_running(running, "job", "message-2")
    assert running == {}
