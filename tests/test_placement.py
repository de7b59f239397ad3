"""Cache-aware placement (tasks/placement.py): a job whose prompt starts like one a worker ran
lately goes to that worker's lane, unless the lane is busy; a lane never strands a job (restores
go to the shared queue, a gone worker's lane is drained into it, the reconciler counts a lane's
messages as queued). The digests are pure logic; the rest runs on a real Redis, real kombu
channels and, end to end, two real hf workers and the API."""

from __future__ import annotations

import json
import random
import signal
import threading
import uuid

import pytest
import redis

from scripts import stack as stackmod
from tasks import keys
from tasks.celery_app import PRIORITY_STEPS, job_message, make_celery
from tasks.config import Settings, queue_for
from tasks.kombu_compat import priority_lists, queue_key
from tasks.placement import Placement, digests
from tasks.registry import Registry
from tasks.schemas import ChatMessage, ChatOptions, JobSpec, SamplingParams
from tests.helpers import submit, take_and_give_back

STEPS = len(PRIORITY_STEPS)


def _spec(prompt: str = "", ids: list[int] | None = None, chat: list[tuple[str, str]] | None = None, **kw) -> JobSpec:
    return JobSpec(
        id=str(uuid.uuid4()),
        model=kw.pop("model", "m"),
        prompt=prompt,
        prompt_token_ids=ids,
        chat=ChatOptions(messages=[ChatMessage(role=r, content=c) for r, c in chat]) if chat else None,
        params=SamplingParams(),
        **kw,
    )


# -- the digests (pure) --------------------------------------------------------------------


def test_a_text_prompts_digests_are_its_leading_text_at_doublings_longest_first():
    system = "".join(random.Random(1).choice("abcdefgh ") for _ in range(1000))
    a, b = _spec(system + " question one?"), _spec(system + " and another, longer, question?")
    assert digests(_spec(system[:99]), 100) == []
    da, db = digests(a, 100), digests(b, 100)
    assert len(da) == 4  # 100, 200, 400, 800 characters of 1,014
    assert da == db  # both start with the same 1,000 characters
    assert digests(_spec(system[:500] + "x" * 514), 100)[-3:] == da[-3:]  # shared up to 400
    assert digests(_spec(system[:500] + "x" * 514), 100)[0] != da[0]
    assert digests(_spec(system, model="other"), 100) != digests(_spec(system), 100)
    assert digests(_spec(ids=list(range(100))), 100) == digests(_spec(ids=list(range(100)) + [7]), 100)
    assert len(digests(_spec(ids=list(range(100))), 100)) == 3  # 25, 50 and 100 ids


def test_a_conversations_digests_are_its_leading_messages_so_the_next_turn_finds_this_one():
    system = ("You are the support agent of a shop. " * 40).strip()
    turn1 = [("system", system), ("user", "Where is my order?")]
    turn2 = [*turn1, ("assistant", "It ships tomorrow."), ("user", "Thanks! And the invoice?")]
    first, second = digests(_spec(chat=turn1), 1000), digests(_spec(chat=turn2), 1000)
    assert len(first) == 2 and len(second) == 4
    assert set(first) <= set(second)  # the system prompt, and the whole first turn
    other = digests(_spec(chat=[("system", system + " Be brief."), ("user", "Where is my order?")]), 1000)
    assert not set(other) & set(first)
    assert digests(_spec(chat=[("system", "Be brief."), ("user", "hi")]), 1000) == []


# -- on a real Redis -------------------------------------------------------------------------


@pytest.fixture
def placed(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    queue = f"genq.test-{uuid.uuid4().hex[:6]}"
    workers = [f"genq-hf-{n}@{uuid.uuid4().hex[:6]}" for n in range(2)]
    yield Placement(client, STEPS, min_chars=100, max_waiting=2), queue, workers
    for w in workers:
        client.hdel(keys.LANES, w)
    for key in client.scan_iter(match=f"{queue}*"):
        client.delete(key)
    for key in client.scan_iter(match=keys.placed(queue, "*")):
        client.delete(key)
    client.close()


def test_a_job_goes_to_the_lane_of_the_live_worker_that_ran_its_prefix_unless_that_lane_is_busy(placed):
    p, queue, (a, b) = placed
    system = "Answer as the shop's agent would, with the order's number. " * 4
    assert p.choose(_spec(system + "first"), queue, [a, b]) is None  # nobody ran it yet
    assert p.record(_spec(system + "first"), queue, b) == 2
    assert p.choose(_spec(system + "second"), queue, [a, b]) == b
    assert p.choose(_spec(system + "second"), queue, [a]) is None  # b is not alive
    assert p.choose(_spec("short " + system[:50]), queue, [a, b]) is None  # below min_chars
    assert p.choose(_spec("Other rules. " + system), queue, [a, b]) is None  # another prefix
    # Two jobs wait in b's lane (one at another priority step): b is too busy; the shared queue.
    p.r.lpush(keys.lane(queue, b), "m1")
    assert p.choose(_spec(system + "third"), queue, [a, b]) == b
    p.r.lpush(queue_key(keys.lane(queue, b), 6), "m2")
    assert p.choose(_spec(system + "third"), queue, [a, b]) is None


def _pushed(p: Placement, lane: str, specs: list[JobSpec], step: int) -> None:
    app = make_celery(Settings(redis_url=_url(p.r)))
    for spec in specs:
        m = job_message(app, spec.model_copy(update={"priority": step - 4}), lane)
        p.r.lpush(m.key, m.payload)


def _url(r) -> str:
    kw = r.connection_pool.connection_kwargs
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def test_a_gone_workers_lane_is_drained_to_the_front_of_the_shared_queue_in_order_and_priority(placed):
    p, queue, (a, _) = placed
    r = p.r
    lane = keys.lane(queue, a)
    p.keep_lane(a, queue)
    r.lpush(queue, json.dumps({"headers": {"id": "already-shared"}}))
    urgent, normal = [_spec(f"u{i}") for i in range(2)], [_spec(f"n{i}") for i in range(3)]
    _pushed(p, lane, urgent, step=0)
    _pushed(p, lane, normal, step=4)
    assert p.lanes()[a] == queue
    assert p.drain(a) == 5
    assert not r.exists(lane) and not r.exists(queue_key(lane, 4))
    # Served from the right: the lane's oldest first, ahead of what the shared queue held.
    served = [json.loads(m)["headers"]["id"] for m in reversed(r.lrange(queue, 0, -1))]
    assert served == [s.id for s in urgent] + ["already-shared"]
    served = [json.loads(m)["headers"]["id"] for m in reversed(r.lrange(queue_key(queue, 4), 0, -1))]
    assert served == [s.id for s in normal]
    assert p.lanes()[a] == queue  # a worker gone for less than LANE_KEEP_S stays registered


def test_a_restore_from_a_lane_goes_to_the_shared_queue(placed, redis_url):
    p, queue, (a, _) = placed
    app = make_celery(Settings(redis_url=redis_url))
    spec = _spec("restored")
    lane = keys.lane(queue, a)
    m = job_message(app, spec, lane)
    p.r.lpush(m.key, m.payload)
    assert take_and_give_back(app, lane) == spec.id  # taken from the lane: its exchange is the lane's
    with app.connection_for_write() as conn:
        channel = conn.default_channel
    lists = priority_lists(channel, queue, PRIORITY_STEPS)
    assert [json.loads(x)["headers"]["id"] for k in lists for x in p.r.lrange(k, 0, -1)] == [spec.id]
    assert not any(p.r.exists(k) for k in priority_lists(channel, lane, PRIORITY_STEPS))


def test_the_reconciler_counts_a_lanes_messages_as_queued_and_drains_lanes_of_workers_gone(placed, store, redis_url):
    """Without the lanes in its look, a job waiting in a live worker's lane would be published
    a second time (its message in none of the shared queue's lists)."""
    from worker.recovery import Reaper

    p, queue, (a, b) = placed
    app = make_celery(Settings(redis_url=redis_url))
    spec = _spec("waits in a lane")
    m = job_message(app, spec, keys.lane(queue, a))
    assert store.create([spec], queue, 10, None, [(m.key, m.payload)])[0]
    p.keep_lane(a, queue)
    reaper = Reaper(app, store, Registry(store.r, 3), b, queue, placement=p)
    try:
        assert reaper._stuck(queue, grace=0) == set()
        store.r.hdel(keys.LANES, a)  # unregistered: the job's message is nowhere the reconciler looks
        assert reaper._stuck(queue, grace=0) == {spec.id}
        p.keep_lane(a, queue)
        assert reaper.drain_lanes(live={b}) == 1  # a is not alive
        assert [json.loads(x)["headers"]["id"] for x in store.r.lrange(queue_key(queue, 4), 0, -1)] == [spec.id]
        assert reaper._stuck(queue, grace=0) == set()
    finally:
        reaper.reset()
        store.r.delete(keys.job(spec.id), keys.queued(queue))


# -- end to end: two hf workers and the API ------------------------------------------------

TENANTS = 4
# Placement by prefixes of 200 characters and more: the tiny model's context is short.
PLACEMENT_ENV = {"GENQ_PLACEMENT_MIN_CHARS": "200", "GENQ_MAX_BATCH_SIZE": "8", "GENQ_RECONCILE_INTERVAL": "1"}


def _system(tenant: int) -> str:
    rng = random.Random(tenant)
    words = ["order", "refund", "parcel", "invoice", "customer", "warehouse", "policy", "agent", "ship"]
    return f"Tenant {tenant} rules: " + " ".join(rng.choice(words) for _ in range(60)) + "."


def _wait(s, job_id: str) -> dict:
    rec = s.get(f"/v1/jobs/{job_id}?wait=90", timeout=100).json()
    assert rec["status"] == "succeeded", rec
    return rec


def _two_workers(s) -> list[stackmod.Proc]:
    workers = [s.start_worker() for _ in range(2)]
    r = redis.Redis.from_url(s.env["REDIS_URL"], decode_responses=True)
    try:

        def laned() -> bool:
            names = [w["name"] for w in s.get("/readyz").json().get("workers", [])]
            return len(names) == 2 and all(r.hexists(keys.LANES, n) for n in names)

        stackmod.wait_until(laned, 90, "2 workers with lanes", s.procs)
    finally:
        r.close()
    return workers


def test_each_tenants_jobs_run_where_its_system_prompt_is_cached(make_stack):
    s = make_stack(**PLACEMENT_ENV)
    s.start_api()
    _two_workers(s)
    ran: dict[int, list[dict]] = {t: [] for t in range(TENANTS)}

    def tenant(t: int) -> None:
        for q in range(4):
            job = submit(s, prompt=f"{_system(t)} Question {q}: where is parcel {q}?", max_new_tokens=4)
            ran[t].append(_wait(s, job))

    threads = [threading.Thread(target=tenant, args=(t,)) for t in range(TENANTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    for t, recs in ran.items():
        assert len(recs) == 4, t
        # Without placement, two idle workers take a shared queue's jobs in turn.
        assert len({r["worker"] for r in recs}) == 1, (t, [r["worker"] for r in recs])
        first, *later = recs
        system_tokens = first["result"]["prompt_tokens"] - 16
        for r in later:
            assert r["result"]["cached_tokens"] >= system_tokens - 16, (t, r["result"])


def test_jobs_placed_on_a_worker_that_dies_run_on_the_other(make_stack):
    s = make_stack(**PLACEMENT_ENV)
    s.start_api()
    workers = _two_workers(s)
    first = _wait(s, submit(s, prompt=_system(0) + " Where is my parcel?", max_new_tokens=4))
    (victim,) = [w for w in workers if f"-{w.pid}@" in first["worker"]]
    queue = queue_for(s.name)
    r = redis.Redis.from_url(s.env["REDIS_URL"], decode_responses=True)
    try:
        victim.signal(signal.SIGKILL)
        victim.popen.wait(10)
        # The API still counts it alive for a heartbeat TTL: these go into its lane.
        jobs = [submit(s, prompt=_system(0) + f" And parcel {i}?", max_new_tokens=4) for i in range(3)]
        lane = keys.lane(queue, first["worker"])
        waiting = sum(r.llen(k) for k in (queue_key(lane, step) for step in PRIORITY_STEPS))
        assert waiting >= 1, "no job went to the dead worker's lane: this tests nothing"
        recs = [_wait(s, j) for j in jobs]
        assert all(rec["worker"] != first["worker"] and rec["attempts"] == 1 for rec in recs), recs
        assert not any(r.exists(queue_key(lane, step)) for step in PRIORITY_STEPS)
    finally:
        r.close()
