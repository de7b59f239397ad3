"""Redis commands per blocking job, counted on a real stack (issue 34, item 5): the API, an echo
worker and everything they run beside the jobs (heartbeats, idle polls, the cancel watch) on a
Redis of their own, whose `INFO commandstats` (every command, those Lua scripts run included)
is read before and after a batch of blocking `/basic_generate` jobs. A regression guard: the
count per job must stay at or below what docs/benchmarks.md ("Redis commands per job")
records. Run with `-s` to see the breakdown per command.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from scripts import stack as stackmod

JOBS = 120
CLIENTS = 4
# The most Redis commands one blocking job may cost, all clients counted (docs/benchmarks.md).
MAX_COMMANDS_PER_JOB = 60


def commandstats(r: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}


@pytest.fixture(scope="module")
def costed(tiny_model, stack_logs):
    """An echo stack on a Redis of its own, with the default heartbeat: nothing else's commands
    are counted."""
    from conftest import Stacks

    db = stackmod.PrivateRedis()
    stacks = Stacks(db.url, tiny_model, stack_logs)
    try:
        s = stacks(GENQ_ENGINE="echo", GENQ_HEARTBEAT_INTERVAL="2", GENQ_HEARTBEAT_TTL="10")
        s.start_api()
        s.start_worker()
        s.wait_ready()
        s.redis = redis.Redis.from_url(db.url, decode_responses=True)
        yield s
        s.redis.close()
    finally:
        stacks.stop()
        db.stop()


def run_jobs(s, n: int) -> None:
    def one(i: int) -> None:
        resp = s.post("/basic_generate", json={"prompt": f"count {i}", "max_new_tokens": 8})
        assert resp.status_code == 200, resp.text
        assert resp.json()["generated_text"]

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(one, range(n)))


def per_job(costed) -> tuple[float, dict[str, float]]:
    run_jobs(costed, 2 * CLIENTS)  # warm up: scripts loaded, connections open
    before = commandstats(costed.redis)
    run_jobs(costed, JOBS)
    after = commandstats(costed.redis)
    calls = {k: n - before.get(k, 0) for k, n in after.items()}
    calls.pop("info", None)  # this test's own look
    breakdown = {k: n / JOBS for k, n in sorted(calls.items(), key=lambda kv: -kv[1]) if n > 0}
    return sum(breakdown.values()), breakdown


def test_redis_commands_per_blocking_job(costed):
    total, breakdown = per_job(costed)
    print(f"\n{total:.1f} Redis commands per job: " + ", ".join(f"`{k}` {v:.2f}" for k, v in breakdown.items()))
    assert total <= MAX_COMMANDS_PER_JOB, (total, breakdown)
    # What every job needs, whoever sends it: its record written, started and finished in Lua
    # (one call each), its message pushed and popped, its done stream.
    assert breakdown.get("evalsha", 0) >= 3 and breakdown.get("brpop", 0) >= 1 and breakdown.get("xadd", 0) >= 1
