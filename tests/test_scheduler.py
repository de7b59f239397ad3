"""The hf engine's scheduler alone: no model, no torch (the engine tests run it with both)."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from tasks.schemas import JobSpec, SamplingParams
from worker.engines.rows import Rows, fill_holes
from worker.engines.scheduler import Scheduler, Seq


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def seq(
    name: str,
    background: bool = False,
    tokens: int = 1,
    deadline: float = 1e9,
    owner: str | None = None,
    weight: int = 1,
    max_new: int = 8,
    priority: int | None = None,
) -> Seq:
    prio = priority if priority is not None else 1 if background else 0
    spec = JobSpec(id=name, model="m", prompt="p", priority=prio, params=SamplingParams(), owner=owner, weight=weight)
    return Seq(spec, list(range(tokens)), max_new, deadline, "late", background=background)


def run(s: Scheduler, *seqs: Seq):
    """Submit, take, and join what was admitted (as the engine does after its prefill)."""
    for x in seqs:
        s.submit(x)
    plan = s.take(timeout=0)
    if plan.preempt:
        s.rows.keep([i for i in range(len(s.rows)) if i not in plan.preempt])
    s.rows.join(plan.admit)
    return plan


def names(seqs) -> list[str]:
    return [x.spec.id for x in seqs]


def test_the_scheduler_imports_no_torch():
    code = "import sys, worker.engines.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_admits_foreground_first_while_rows_are_free_and_the_rest_wait():
    s = Scheduler(capacity=2)
    plan = run(s, seq("bg", background=True), seq("a"), seq("b"))
    assert names(plan.admit) == ["a", "b"] and names(s.waiting) == ["bg"]
    assert s.take(timeout=0).admit == []  # no free row
    s.rows.keep([1])  # "a" finished
    assert names(s.take(timeout=0).admit) == ["bg"]


def test_a_foreground_job_preempts_the_cheapest_background_row():
    s = Scheduler(capacity=3)
    run(s, seq("long", True, tokens=50), seq("short", True, tokens=3), seq("mid", True, tokens=10))
    plan = run(s, seq("fg"))
    assert [names(s.rows)[i] for i in range(len(s.rows))][0] == "fg"  # foreground first
    assert plan.preempt == [1] and names(plan.admit) == ["fg"] and names(s.waiting) == ["short"]
    assert s.preemptions == 1
    # The preempted row comes back before other background jobs once a row frees.
    s.submit(seq("later", True))
    s.rows.keep([0, 1])
    assert names(s.take(timeout=0).admit) == ["short"]


def test_no_preemption_of_foreground_rows():
    s = Scheduler(capacity=1)
    run(s, seq("a"))
    plan = run(s, seq("b"))
    assert plan.preempt == [] and plan.admit == [] and names(s.waiting) == ["b"]


def test_reap_cancelled_and_late_jobs_running_waiting_or_new():
    clock = Clock()
    s = Scheduler(capacity=2, clock=clock)
    run(s, seq("run", deadline=5), seq("gone"), seq("wait", deadline=5))
    s.cancel("gone")
    new = [seq("new", deadline=5)]
    clock.now = 6
    gone, keep = s.reap(new)
    assert sorted((x.spec.id, why) for x, why in gone) == [
        ("gone", "cancelled"),
        ("new", "timeout"),
        ("run", "timeout"),
        ("wait", "timeout"),
    ]
    assert keep == [] and new == [] and s.waiting == []
    s.rows.keep(keep)  # as the engine does
    assert s.reap([]) == ([], None)  # nothing more: every row stays


class Mirror:
    """A follower of the rows (as the KV cache and the runner are) holding their names."""

    def __init__(self):
        self.names: list[str] = []
        self.swaps: list[tuple[list[int], list[int]]] = []

    def move(self, order: list[int]) -> None:
        self.names = [self.names[i] for i in order]

    def swap(self, a: list[int], b: list[int]) -> None:
        self.swaps.append((a, b))
        for x, y in zip(a, b):
            self.names[x], self.names[y] = self.names[y], self.names[x]


def test_joining_rows_go_foreground_first_and_followers_swap_the_same():
    rows, mirror = Rows(), Mirror()
    rows.follow(mirror)
    joining = [seq("b1", True), seq("f1"), seq("b2", True), seq("f2")]
    mirror.names += names(joining)  # the forward put their keys/values after the running rows
    rows.join(joining)
    assert names(rows) == ["f2", "f1", "b2", "b1"] and rows.fg == 2
    assert mirror.swaps == [([3], [0])] and mirror.names == names(rows)
    assert rows.partition() == ([], [])


def test_every_follower_ends_every_step_in_the_rows_order():
    """The one owner of the batch's order: after any joins and leaves (the last rows move into
    the holes, foreground rows go first), a follower that applied the same moves holds the
    same rows, in the same order."""
    rng = random.Random(31)
    for trial in range(200):
        rows, mirror = Rows(), Mirror()
        rows.follow(mirror)
        made = 0
        for _ in range(rng.randrange(1, 12)):
            if rows and rng.random() < 0.5:
                keep = sorted(rng.sample(range(len(rows)), rng.randrange(len(rows) + 1)))
                rows.keep(keep)
            else:
                joining = [seq(f"j{made + k}", background=rng.random() < 0.5) for k in range(rng.randrange(1, 4))]
                made += len(joining)
                mirror.names += names(joining)
                rows.join(joining)
            assert mirror.names == names(rows), trial
            assert all(not r.background for r in rows[: rows.fg]) and all(r.background for r in rows[rows.fg :])
        assert fill_holes([0, 2, 5], 6) == [0, 5, 2]  # the last row into the first hole


def test_background_rows_step_once_in_background_every_while_foreground_runs():
    s = Scheduler(capacity=4, background_every=3)
    run(s, seq("b", True), seq("f"))
    steps = [s.decode_rows() for _ in range(6)]
    assert steps == [1, 1, 2, 1, 1, 2]
    assert s.rows[0].batch_peak == 2 and s.rows[1].batch_peak == 2
    s.rows.keep([1])  # the foreground job finished: the background one steps every time
    assert [s.decode_rows() for _ in range(3)] == [1, 1, 1]


def test_drain_returns_every_job_held():
    s = Scheduler(capacity=1)
    run(s, seq("a"), seq("b"))
    s.submit(seq("c"))
    assert sorted(names(s.drain())) == ["a", "b", "c"] and len(s.rows) == 0


def test_a_step_s_prompt_tokens_stay_in_the_budget_and_the_rest_is_a_chunk():
    """Jobs that fit are admitted whole, in order; the first that does not gets the budget's
    rest as a chunk of whole blocks (at least one), and what follows waits."""
    s = Scheduler(capacity=8, prefill_budget=64, chunk_block=16)
    long, short, other = seq("long", tokens=200), seq("short", tokens=10), seq("other", tokens=60)
    plan = run(s, long, short, other)
    assert names(plan.admit) == ["short"] and names(plan.partial) == ["long"] and long.chunk == 48
    assert names(s.waiting) == ["other"]


def test_a_chunk_continues_from_what_the_cache_holds():
    held = {"long": 48}
    s = Scheduler(capacity=8, prefill_budget=32, chunk_block=16, cached=lambda q: held.get(q.spec.id, 0))
    long = seq("long", tokens=100)
    long.prefilled = 48
    assert run(s, long).partial == [long] and long.chunk == 80
    held["long"], long.prefilled = 80, 80
    plan = run(s, long)  # 20 tokens left: whole
    assert plan.admit == [long] and long.chunk is None


def test_while_rows_decode_chunks_take_at_most_their_share_of_the_time():
    """After a chunk of 0.3 s (share 0.5) the running rows get 0.3 s of steps without one, in
    which short jobs still join; then the next chunk; an idle batch waits for nothing."""
    held = {}
    s = Scheduler(16, prefill_budget=32, chunk_block=16, cached=lambda q: held.get(q.spec.id, 0), prefill_share=0.5)
    stream, long = seq("stream", tokens=4), seq("long", tokens=200)
    run(s, stream)
    assert run(s, long).partial == [long] and long.chunk == 32
    held["long"], long.prefilled, long.chunk = 32, 32, None
    s.waiting[:0] = [long]  # as the engine puts it back after its chunk
    s.account(chunk_s=0.3, step_s=0.33)  # the chunk, and the stream's decode in the same step
    assert s.owed == pytest.approx(0.27)
    for _ in range(8):
        plan = run(s, short := seq(f"short{_}", tokens=8))
        assert plan.admit == [short] and not plan.partial and names(s.waiting) == ["long"]
        s.account(chunk_s=0.0, step_s=0.03)
    assert s.owed == pytest.approx(0.03)
    assert not run(s).partial
    s.account(chunk_s=0.0, step_s=0.05)  # paid off, and no credit beyond it
    assert s.owed == 0.0
    plan = run(s)
    assert plan.partial == [long] and long.chunk == 64


def test_chunk_pacing_waits_only_for_running_foreground_rows_and_is_off_at_share_1():
    for share, rows in ((0.5, None), (0.5, "background"), (1.0, "foreground")):
        s = Scheduler(capacity=8, prefill_budget=32, chunk_block=16, prefill_share=share)
        if rows:
            run(s, seq("row", background=rows == "background", tokens=4))
        long = seq("long", tokens=200)
        assert run(s, long).partial == [long]
        long.chunk, s.waiting[:0] = None, [long]
        s.account(chunk_s=10.0, step_s=10.0)
        assert s.owed == (10.0 if share < 1 else 0.0)
        assert run(s).partial == [long], (share, rows)


def test_without_chunks_a_long_prompt_runs_alone_in_its_step():
    s = Scheduler(capacity=8, prefill_budget=32)
    a, b = seq("a", tokens=100), seq("b", tokens=100)
    assert names(run(s, a, b).admit) == ["a"] and names(s.waiting) == ["b"]


def test_a_prompt_whose_chunks_the_cache_lost_is_prefilled_whole():
    s = Scheduler(capacity=8, prefill_budget=32, chunk_block=16, cached=lambda q: 16)
    long = seq("long", tokens=100)
    long.prefilled = 64  # its chunks went beyond what the cache holds now
    plan = run(s, long)
    assert plan.admit == [long] and not plan.partial


def test_jobs_that_lack_the_same_block_are_prefilled_one_step_apart():
    """`n`/`best_of` siblings and bursts of one system prompt: one job computes the shared
    blocks, the others wait a step and find them cached; other prompts are not held."""
    first = {"a": "sys", "b": "sys", "c": "other", "d": None, "e": None}
    s = Scheduler(capacity=8, missing=lambda q: first[q.spec.id])
    a, b, c, d, e = (seq(n, tokens=40) for n in "abcde")
    assert names(run(s, a, b, c, d, e).admit) == ["a", "c", "d", "e"] and names(s.waiting) == ["b"]
    first["b"] = None  # a's blocks are in the cache now
    assert names(run(s).admit) == ["b"]


def test_jobs_wait_while_their_rows_could_take_the_kv_cache_past_its_budget():
    """rows x twice the longest a row may grow stays within `kv_columns`; one job alone always
    runs; jobs that fit are not held behind one that does not."""
    s = Scheduler(capacity=8, kv_columns=2 * 3 * 48)  # three rows of 40 + 8 tokens
    jobs = [seq(f"j{i}", tokens=40) for i in range(4)]  # max_new 8: 48 each
    assert names(run(s, *jobs).admit) == ["j0", "j1", "j2"] and names(s.waiting) == ["j3"]
    huge = Scheduler(capacity=8, kv_columns=10)
    assert names(run(huge, seq("big", tokens=100)).admit) == ["big"]
    assert names(run(huge, seq("next", tokens=1)).admit) == []


# -- the fair order of the jobs a worker holds beyond its rows -------------------------------


def admit_one_at_a_time(s: Scheduler) -> list[str]:
    """Free the one row after each step and take the next job: the order of admission."""
    order = []
    while True:
        plan = s.take(timeout=0)
        if not plan.admit:
            return order
        order += names(plan.admit)
        s.rows.join(plan.admit)
        s.rows.keep([])


def test_waiting_jobs_of_keys_take_turns_by_the_tokens_they_ask_for():
    s = Scheduler(capacity=1)
    flood = [seq(f"f{i}", owner="flood", max_new=256) for i in range(4)]
    calm = [seq(f"c{i}", owner="calm", max_new=16) for i in range(3)]
    for x in flood + calm:  # the flood arrived first: first in, first out would run it all first
        s.submit(x)
    # f0 first (a tie at the clock goes to the first arrived), then calm's three (16 tokens
    # each) before the flood's second (256 tokens after its first).
    assert admit_one_at_a_time(s) == ["f0", "c0", "c1", "c2", "f1", "f2", "f3"]


def test_a_heavier_key_gets_its_weight_in_turns_and_priority_comes_before_turns():
    s = Scheduler(capacity=1)
    for i in range(6):
        s.submit(seq(f"a{i}", owner="a", weight=3))
        s.submit(seq(f"b{i}", owner="b", weight=1))
    s.submit(seq("urgent", owner="b", priority=-5))  # arrives last, a higher priority
    order = admit_one_at_a_time(s)
    # a's turns come every 8/3 tokens, b's every 8 (a tie goes to the first arrived).
    assert order == ["urgent", "a0", "b0", "a1", "a2", "b1", "a3", "a4", "a5", "b2", "b3", "b4", "b5"]
    assert sum(x.startswith("a") for x in order[1:9]) == 6  # three turns for each of b's


def test_a_key_that_comes_back_goes_next_and_is_not_charged_for_its_past():
    s = Scheduler(capacity=1)
    for i in range(6):
        s.submit(seq(f"f{i}", owner="flood", max_new=100))

    def one() -> str:
        plan = s.take(timeout=0)
        s.rows.join(plan.admit)
        s.rows.keep([])
        return names(plan.admit)[0]

    order = [one()]
    for i in range(3):  # the calm key sends one job now and then; each goes next
        s.submit(seq(f"c{i}", owner="calm", max_new=100))
        order += [one(), one()]
    assert order == ["f0", "c0", "f1", "c1", "f2", "c2", "f3"]
    assert admit_one_at_a_time(s) == ["f4", "f5"]
