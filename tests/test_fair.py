"""Fair share between API keys inside one priority (tasks/fair.py): the weighted turn order
(pure), the lines on a real Redis (filled and drained in weighted turns, priorities first,
nothing lost with concurrent movers and consumers, the reconciler counting lined messages as
queued), and end to end with the API and a real hf worker on the tiny model: a key that floods
the queue does not make a calm key wait for the whole flood, and, with fair share off, does."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from scripts import realmodel
from tasks import keys
from tasks.celery_app import PRIORITY_STEPS
from tasks.fair import FairLines, turns
from tasks.jobs import JobStore
from tasks.kombu_compat import queue_key
from tasks.schemas import JobSpec, SamplingParams

STEPS = len(PRIORITY_STEPS)

# -- the turn order (pure) -------------------------------------------------------------------


def test_equal_weights_take_turns_and_a_late_owner_goes_next():
    assert turns({}, {"a": 3, "b": 3}) == ["a", "b", "a", "b", "a", "b"]
    assert turns({}, {"a": 4, "b": 0}) == ["a"] * 4
    assert turns({}, {"b": 2, "a": 1, "c": 2}) == ["a", "b", "c", "b", "c"]  # ties go by name


def test_weight_two_gets_two_turns_for_each_of_weight_one():
    order = turns({"a": 2, "b": 1}, {"a": 20, "b": 20})
    first = order[:30]
    assert first.count("a") == 20 and first.count("b") == 10
    for n in range(3, 31, 3):  # in every prefix the shares hold to within one turn
        assert abs(order[:n].count("a") - 2 * n / 3) <= 1
    assert turns({"a": 3, "b": 1, "c": 1}, {"a": 30, "b": 30, "c": 30})[:25].count("a") == 15


# -- the lines, on a real Redis --------------------------------------------------------------


class Queue:
    """One queue's fair-share lines and lists, with a consumer that takes as a worker does:
    from the lowest priority step that has a message, then starts the job, refilling the lists
    in the start's call (worker/tasks.py)."""

    def __init__(self, client: redis.Redis, depth: int):
        self.r = client
        self.name = f"genq.test-fair-{uuid.uuid4().hex[:8]}"
        self.store = JobStore(client, ttl=600)
        self.fair = FairLines(client, STEPS, depth)

    def submit(self, owner: str, n: int, weight: int = 1, step: int = 4, fair: bool = True, cost: int = 1) -> list[str]:
        specs = [
            JobSpec(id=f"{owner}-{uuid.uuid4().hex[:8]}", model="m", prompt="p", params=SamplingParams(), owner=owner)
            for _ in range(n)
        ]
        lists = [queue_key(self.name, step)] * n
        messages = [(k, json.dumps({"headers": {"id": s.id}})) for k, s in zip(lists, specs, strict=True)]
        push = self.fair.push_args(self.name, step, owner, weight, cost) if fair else None
        assert self.store.create(specs, self.name, 100_000, None, messages, push)[0]
        return [s.id for s in specs]

    def take(self) -> str | None:
        for step in range(STEPS):
            raw = self.r.rpop(queue_key(self.name, step))
            if raw is not None:
                job_id = json.loads(raw)["headers"]["id"]
                assert self.store.start(job_id, "test-worker", "tag", self.fair.fill_args(self.name)).run
                return job_id
        return None

    def drain(self) -> list[str]:
        out = []
        while (job := self.take()) is not None:
            out.append(job)
        return out

    def listed(self) -> int:
        return sum(self.r.llen(queue_key(self.name, s)) for s in range(STEPS))


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def owners_of(ids: list[str]) -> str:
    return "".join(i.split("-", 1)[0] for i in ids)


def test_a_flood_waits_in_its_line_and_a_calm_owner_is_served_in_turn(client):
    q = Queue(client, depth=2)
    a = q.submit("a", 10)
    assert q.listed() == 2  # the list holds `depth`; the rest waits in a's line
    assert q.fair.waiting(q.name) == {"a": 8}
    assert q.fair.waiting_ids(q.name) == set(a[2:])
    b = q.submit("b", 3)
    assert q.fair.waiting(q.name) == {"a": 8, "b": 3}
    order = q.drain()
    assert sorted(order) == sorted(a + b)
    # a's two already on the list, then turns: a (joined first, ties go by name), b, a, b, ...
    assert owners_of(order) == "aaabababa" + "aaaa"
    assert order[:2] == a[:2] and [j for j in order if j.startswith("a")] == a  # FIFO within a line
    assert not client.exists(keys.fair_owners(q.name, 4), keys.fair_line(q.name, 4, "a"))


def test_taking_a_job_with_an_owner_refills_the_list_and_one_without_leaves_it(client):
    """A worker's start refills the lists only for a job that has an owner (tasks/fair.py
    FILL_OWNED): lines hold only such jobs. One without an owner (an API without keys) costs
    no look at the lines; should it share a queue with lined jobs, the heartbeat refills."""
    q = Queue(client, depth=1)
    (anon,) = q.submit("", 1, fair=False)  # no owner: straight onto the list, as the API does
    lined = q.submit("a", 2)  # the list is full: both wait in a's line
    assert q.listed() == 1 and q.fair.waiting(q.name) == {"a": 2}
    assert q.take() == anon
    assert q.listed() == 0 and q.fair.waiting(q.name) == {"a": 2}  # not refilled
    assert q.fair.fill(q.name) == 1  # the heartbeat's refill
    assert q.take() == lined[0]
    assert q.listed() == 1 and q.fair.waiting(q.name) == {}  # refilled by the owned job's start
    assert q.take() == lined[1]


def test_a_new_owner_joins_at_the_clock_and_goes_before_an_owner_that_had_turns(client):
    q = Queue(client, depth=1)
    q.submit("b", 6)
    taken = [q.take() for _ in range(4)]  # b has had turns: its score is ahead of the clock
    q.submit("a", 2)
    # b's fifth is on the list already; then a at the clock (3) before b (4), then a tie at 4.
    assert owners_of(taken + q.drain()) == "bbbb" + "b" + "aa" + "b"


def test_lines_are_served_in_the_weighted_turns_that_turns_computes(client):
    q = Queue(client, depth=1)
    q.submit("z", 1)  # fills the list: what follows waits in lines
    q.submit("a", 18, weight=2)
    q.submit("b", 18, weight=1)
    q.submit("c", 6, weight=1)
    order = owners_of(q.drain())
    assert order[0] == "z"
    expect = turns({"a": 2, "b": 1, "c": 1}, {"a": 18, "b": 18, "c": 6})
    assert order[1:] == "".join(expect)
    assert order[1:13].count("a") == 6 and order[1:13].count("b") == 3  # weight 2 vs 1


def test_turns_are_charged_the_tokens_each_job_asks_for():
    # A key of 16-token jobs has sixteen turns for each turn of a key of 256-token jobs.
    order = turns({}, {"flood": 5, "calm": 40}, costs={"flood": 256, "calm": 16})
    assert order[:18] == ["calm"] + ["flood"] + ["calm"] * 16
    assert turns({"calm": 2}, {"flood": 3, "calm": 3}, costs={"flood": 4, "calm": 8}) == [
        "calm",
        "flood",
        "calm",
        "flood",
        "calm",
        "flood",
    ]


def test_lines_charge_each_turn_its_jobs_tokens_as_turns_computes(client):
    q = Queue(client, depth=1)
    flood = q.submit("flood", 8, cost=256)  # its first goes onto the list, the rest in its line
    calm = q.submit("calm", 5, cost=16)
    order = q.drain()
    # The flood's first was on the list; then the lines in turns (both keys joined at the clock,
    # a tie goes by name): one 256-token turn of the flood to sixteen 16-token ones of calm.
    expect = turns({}, {"flood": 7, "calm": 5}, costs={"flood": 256, "calm": 16})
    assert [j.split("-")[0] for j in order] == ["flood", *expect]
    assert expect[:6] == ["calm", "flood", "calm", "calm", "calm", "calm"]
    assert [j for j in order if j.startswith("calm")] == calm and order[0] == flood[0]


def test_a_higher_priority_goes_first_whatever_the_lines_of_a_lower_one_hold(client):
    q = Queue(client, depth=2)
    low = q.submit("a", 12, step=8)
    high = q.submit("b", 5, step=0)
    order = q.drain()
    assert order[:5] == high and sorted(order[5:]) == sorted(low)


def test_without_fair_share_or_an_owner_the_queue_is_first_in_first_out(client):
    q = Queue(client, depth=2)
    a = q.submit("a", 6, fair=False)
    b = q.submit("b", 2, fair=False)
    assert q.listed() == 8 and q.fair.waiting(q.name) == {}
    assert q.drain() == a + b


def test_nothing_is_lost_or_doubled_with_concurrent_submitters_movers_and_consumers(redis_url):
    clients = [redis.Redis.from_url(redis_url, decode_responses=True) for _ in range(3)]
    q = Queue(clients[0], depth=3)
    created: list[str] = []
    taken: list[str] = []
    stop = threading.Event()

    def submitter(owner: str, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(40):
            created.extend(q.submit(owner, rng.randint(1, 4), weight=rng.randint(1, 3), step=rng.choice([0, 4, 8])))

    def consumer() -> None:
        while not stop.is_set():
            job = q.take()
            if job is None:
                time.sleep(0.001)
            else:
                taken.append(job)

    def mover(c: redis.Redis) -> None:
        fair = FairLines(c, STEPS, 3)
        while not stop.is_set():
            fair.fill(q.name)

    threads = [threading.Thread(target=consumer) for _ in range(3)]
    threads += [threading.Thread(target=mover, args=(c,)) for c in clients[1:]]
    for t in threads:
        t.start()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(submitter, "abcd", range(4)))
    deadline = time.monotonic() + 60
    while len(taken) < len(created) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert len(created) > 200
    assert sorted(taken) == sorted(created)  # count in == count out, none twice
    assert q.listed() == 0 and q.fair.waiting(q.name) == {}
    for c in clients:
        c.close()


def test_the_reconciler_counts_messages_in_lines_as_queued(client, redis_url):
    from tasks.celery_app import make_celery
    from tasks.config import Settings
    from tasks.registry import Registry
    from worker.recovery import Reaper

    q = Queue(client, depth=1)
    lined = q.submit("a", 3)[1:]
    app = make_celery(Settings(redis_url=redis_url))
    reaper = Reaper(app, q.store, Registry(client, 10), "me", q.name, fair=q.fair)
    try:
        assert set(lined) <= reaper._held(q.name)
        assert reaper._stuck(q.name, grace=0) == set()
        assert reaper.refill() == 0  # the list is full; once taken, the heartbeat's refill moves
        client.rpop(queue_key(q.name, 4))
        assert reaper.refill() == 1 and q.fair.waiting(q.name) == {"a": 1}
    finally:
        reaper.reset()


# -- end to end: the API, a real worker, the tiny model ---------------------------------------

FLOOD = 60
CALM = 3


FLOOD_KEY, CALM_KEY = "sk-flood-0000000000", "sk-calm-00000000000"


def _keys_file(tmp_path: Path, calm_weight: int = 1) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"{FLOOD_KEY} name=flood\n{CALM_KEY} name=calm weight={calm_weight}\n")
    return path


def _post(s, key: str, tokens: int, priority: int = 0) -> str:
    body = {"prompt": "Hello, my name is", "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    resp = s.post("/v1/jobs", json={**body, "priority": priority}, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def _final(s, job_id: str, key: str) -> dict:
    for _ in range(10):
        resp = s.get(f"/v1/jobs/{job_id}?wait=60", headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200, resp.text
        if resp.json()["status"] not in ("queued", "running"):
            return resp.json()
    raise AssertionError(f"job {job_id} did not end")


def _ahead(job: dict, others: list[dict]) -> int:
    """How many of `others` started while `job` waited (created to started)."""
    t = job["timings"]
    return sum(t["created"] < (o["timings"]["started"] or 0) < t["started"] for o in others)


def _flood_stack(make_stack, tmp_path, calm_weight: int = 1, **env: str):
    s = make_stack(
        GENQ_API_KEYS_FILE=str(_keys_file(tmp_path, calm_weight)),
        GENQ_MAX_BATCH_SIZE="2",
        GENQ_RESERVED_SLOTS="2",  # two jobs waiting in the worker beyond its rows: ordered there
        GENQ_MAX_QUEUE_DEPTH="1000",
        **env,
    )
    s.start_api()
    worker = s.start_worker()
    s.wait_ready()
    return s, worker


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_a_calm_keys_jobs_start_at_the_next_free_rows_not_after_the_flood_handed_out(make_stack, tmp_path, model):
    """One worker of 2 rows and 2 reserved slots (the tiny model, and the real default model);
    a flood of long jobs, then a calm key's 8-token jobs one after another, and a flood job
    of a higher priority. What may start ahead of a calm job: the one message on the list, the
    worker's two reserved jobs (they were there before it) and the rows' own race. First in,
    first out (GENQ_FAIR_DEPTH 4 and turns by job count, as before) let 4-7 go ahead of each."""
    env = {"GENQ_MODEL": str(realmodel.ensure())} if model == "smollm2" else {}  # the real default model
    s, _ = _flood_stack(make_stack, tmp_path, **env)
    # Flood jobs long enough to outlast the calm ones on a quiet machine (64 tokens of the tiny
    # model took 0.06 s: the flood was over before the calm key came).
    n, tokens = (16, 96) if model == "smollm2" else (30, 400)
    with ThreadPoolExecutor(8) as pool:
        flood = list(pool.map(lambda _: _post(s, FLOOD_KEY, tokens), range(n)))
    time.sleep(0.2)  # the flood is under way
    calm = []
    for _ in range(4):
        calm.append(_post(s, CALM_KEY, 8))
        time.sleep(0.3)
    urgent = _post(s, FLOOD_KEY, 8, priority=-4)
    calm_jobs = [_final(s, j, CALM_KEY) for j in calm]
    urgent_job = _final(s, urgent, FLOOD_KEY)
    flood_jobs = [s.get(f"/v1/jobs/{j}", headers={"Authorization": f"Bearer {FLOOD_KEY}"}).json() for j in flood]
    assert all(j["status"] == "succeeded" for j in calm_jobs + [urgent_job])
    ahead = [_ahead(j, flood_jobs) for j in calm_jobs]
    assert max(ahead) <= 3, ahead
    assert sum(ahead) <= 10, ahead  # the later calm jobs go ahead of the flood's turns (cost in tokens)
    assert _ahead(urgent_job, flood_jobs) <= 3  # a higher priority goes before the turns
    unstarted = sum(j["timings"]["started"] is None for j in flood_jobs)
    assert unstarted >= n // 3, unstarted  # the calm jobs ended while the flood was still waiting


@pytest.mark.parametrize("weight", [1, 3])
def test_two_keys_that_both_flood_get_their_weights_share_no_more(make_stack, tmp_path, weight):
    """Both keys ask for more than the worker can run, the calm key faster than the other; each
    gets its weight's share of the turns (jobs of equal tokens) while both wait, no more."""
    s, _ = _flood_stack(make_stack, tmp_path, weight)
    flood = [_post(s, FLOOD_KEY, 16) for _ in range(24)]
    with ThreadPoolExecutor(8) as pool:
        calm = list(pool.map(lambda _: _post(s, CALM_KEY, 16), range(40)))
    jobs = {j: _final(s, j, FLOOD_KEY) for j in flood} | {j: _final(s, j, CALM_KEY) for j in calm}
    assert all(j["status"] == "succeeded" for j in jobs.values())
    order = sorted(jobs, key=lambda j: jobs[j]["timings"]["started"])
    middle = order[8:32]  # both keys waiting: past what was handed out before the calm key came
    share = sum(j in calm for j in middle) / len(middle)
    expect = weight / (weight + 1)
    assert abs(share - expect) <= 0.13, (share, expect)


def test_a_killed_workers_reserved_jobs_go_back_before_the_flood(make_stack, tmp_path):
    """A worker holding (running or reserved) jobs of both keys is SIGKILLed: its jobs are
    published again and run on the next worker ahead of the flood's lined jobs but those the new
    worker took before it could put them back, none lost, none run twice to the end."""
    # A new worker serves the queue for a heartbeat TTL before it may judge the dead one and
    # put its jobs back (worker/__main__.py, Heartbeat): with the stacks' 3 s and 200-token jobs
    # of ~0.7 s (an AVX2 machine, 2026-12-07) it ran all nine lined jobs first, also when it
    # started afresh (and at a10c2b8). So a TTL of 1.5 s here and 500-token jobs (~1.4 s): what
    # goes ahead is its 2 rows and 2 reserved jobs, and the 2 reserved jobs it takes when its
    # first rows free, before it may judge (TTL + a TTL of its own beats, ~3 s).
    s, victim = _flood_stack(make_stack, tmp_path, GENQ_RECONCILE_INTERVAL="1", GENQ_HEARTBEAT_TTL="1.5")
    flood = [_post(s, FLOOD_KEY, 500) for _ in range(3)]  # the worker takes these three at once,
    calm = [_post(s, CALM_KEY, 500) for _ in range(2)]  # then one of these (the other: the list)
    flood += [_post(s, FLOOD_KEY, 500) for _ in range(9)]  # and these wait in the flood's line
    store = JobStore(redis.Redis.from_url(s.env["REDIS_URL"], decode_responses=True), ttl=600)
    held = lambda: [j for j in flood + calm if (store.get(j) or {}).get("status") == "running"]  # noqa: E731
    deadline = time.monotonic() + 60
    while len(held()) < 4 and time.monotonic() < deadline:  # 2 rows + 2 reserved
        time.sleep(0.05)
    lost = held()
    assert len(lost) == 4 and calm[0] in lost, lost
    victim.signal(signal.SIGKILL)
    victim.popen.wait(10)
    s.start_worker()
    jobs = {j: _final(s, j, FLOOD_KEY) for j in flood} | {j: _final(s, j, CALM_KEY) for j in calm}
    assert all(j["status"] == "succeeded" for j in jobs.values()), {j: r["status"] for j, r in jobs.items()}
    assert all(jobs[j]["attempts"] == 2 for j in lost) and all(jobs[j]["attempts"] == 1 for j in jobs if j not in lost)
    lined = [jobs[j]["timings"]["started"] for j in flood[3:]]
    again = jobs[calm[0]]["timings"]["started"]
    assert sum(t < again for t in lined) <= 6, (again, sorted(lined))  # not behind the flood's line
