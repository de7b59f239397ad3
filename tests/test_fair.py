"""Fair share between API keys inside one priority (tasks/fair.py): the weighted turn order
(pure), the lines on a real Redis (filled and drained in weighted turns, priorities first,
nothing lost with concurrent movers and consumers, the reconciler counting lined messages as
queued), and end to end with the API and a real hf worker on the tiny model: a key that floods
the queue does not make a calm key wait for the whole flood, and, with fair share off, does."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

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

    def submit(self, owner: str, n: int, weight: int = 1, step: int = 4, fair: bool = True) -> list[str]:
        specs = [
            JobSpec(id=f"{owner}-{uuid.uuid4().hex[:8]}", model="m", prompt="p", params=SamplingParams(), owner=owner)
            for _ in range(n)
        ]
        lists = [queue_key(self.name, step)] * n
        messages = [(k, json.dumps({"headers": {"id": s.id}})) for k, s in zip(lists, specs, strict=True)]
        push = self.fair.push_args(self.name, step, owner, weight) if fair else None
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


def _keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text("sk-flood-0000000000 name=flood\nsk-calm-00000000000 name=calm\n")
    return path


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "fifo"])
def test_a_calm_key_is_not_queued_behind_another_keys_flood(make_stack, tmp_path, fair):
    s = make_stack(
        GENQ_API_KEYS_FILE=str(_keys_file(tmp_path)),
        GENQ_FAIR_SHARE=str(fair).lower(),
        GENQ_MAX_BATCH_SIZE="4",
        GENQ_RECONCILE_INTERVAL="1",
    )
    s.start_api()
    worker = s.start_worker()
    s.wait_ready()

    def post(key: str) -> str:
        body = {"prompt": "Hello, my name is", "max_new_tokens": 8, "temperature": 0}
        resp = s.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 202, resp.text
        return resp.json()["id"]

    with ThreadPoolExecutor(8) as pool:
        flood = list(pool.map(lambda _: post("sk-flood-0000000000"), range(FLOOD)))
    calm = [post("sk-calm-00000000000") for _ in range(CALM)]
    cancelled = flood[-1]  # still waiting (in its line, with fair share): cancel it there
    assert s.post(f"/v1/jobs/{cancelled}/cancel", headers={"Authorization": "Bearer sk-flood-0000000000"}).ok

    def view(job_id: str, key: str) -> dict:
        resp = s.get(f"/v1/jobs/{job_id}?wait=60", headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200, resp.text
        return resp.json()

    calm_jobs = [view(j, "sk-calm-00000000000") for j in calm]
    flood_jobs = [view(j, "sk-flood-0000000000") for j in flood]
    assert [j["status"] for j in calm_jobs] == ["succeeded"] * CALM
    assert [j["status"] for j in flood_jobs] == ["succeeded"] * (FLOOD - 1) + ["cancelled"]
    assert flood_jobs[-1]["timings"]["started"] is None  # skipped, never run
    assert all(j["attempts"] == 1 for j in calm_jobs + flood_jobs[:-1])
    assert "published it again" not in worker.log.read_text()  # the reconciler took no lined job for lost

    starts = sorted(j["timings"]["started"] for j in flood_jobs[:-1])
    last_calm = max(j["timings"]["started"] for j in calm_jobs)
    behind = sum(t > last_calm for t in starts)  # flood jobs that started after the calm key's last
    if fair:
        assert behind >= 2 * FLOOD // 3, (behind, starts, last_calm)
    else:
        assert behind == 0, (behind, starts, last_calm)


def test_a_batchs_lines_are_fed_with_its_keys_weight():
    """The batch driver submits a batch's lines as its key, weight included (webapp/batches)."""
    from webapp.batches.driver import BatchDriver

    rec = {"owner": "heavy", "key_max_queued": "5", "key_max_new_tokens": "", "key_weight": "3"}
    key = BatchDriver._owner_key(None, rec)
    assert (key.name, key.max_queued, key.max_new_tokens, key.weight) == ("heavy", 5, None, 3)
    assert BatchDriver._owner_key(None, {**rec, "key_weight": ""}).weight == 1  # a batch made before weights
