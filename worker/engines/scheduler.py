"""The hf engine's scheduler: which jobs run, which wait, which leave, and which rows step.

Plain Python (no torch, no model), tested alone (tests/test_scheduler.py). It holds the
running batch's rows (`rows`: worker/engines/rows.py, the one owner of their order, which the
KV cache and the runner follow), foreground jobs first, and decides between two decode steps:

- admission: every arrived job while rows are free, foreground ones first, then by priority,
  then across API keys in fair turns (`FairOrder`: start-time fair queueing on the tokens each
  job asks for, weighted by its key's weight), so the jobs a worker holds beyond its rows are
  not first-in, first-out;
- preemption: a foreground job that finds the batch full takes a background row's place at
  once (the background job with the fewest tokens goes back to waiting, keeping its tokens,
  and is prefilled again when a row frees: preemption by recompute, as vLLM's), so an
  interactive request never waits for a batch line to finish;
- reaping: cancelled jobs and jobs past their deadline leave, running or waiting;
- the background's cadence: while foreground rows run, background rows step only one decode
  step in `background_every` (on a CPU a step of 32 rows takes several times a step of one: docs/benchmarks.md).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tasks.schemas import JobSpec, Logprobs
from worker.engines.rows import Rows


@dataclass(eq=False)
class Seq:
    """One job in the engine, from submission to its result."""

    spec: JobSpec
    prompt_ids: list[int]
    max_new: int
    deadline: float  # the scheduler's clock: the job's own deadline or the worker's ceiling
    timeout_message: str
    future: Future = field(default_factory=Future)
    generator: Any = None  # the row's own torch.Generator (sampled jobs)
    out: list[int] = field(default_factory=list)
    batch_peak: int = 0
    # Output processing (worker/engines/output.py): `text` is the completion so far; tokens
    # from `prefix_off` on are decoded again each step (a token can complete a character its
    # predecessor began); `sent` characters and `events` token events are streamed.
    text: str = ""
    prefix_off: int = 0
    read_off: int = 0
    sent: int = 0
    events: int = 0
    stop_ids: frozenset[int] = frozenset()  # tokens that end the job, as EOS does
    # With the `logprobs` parameter: every token's so far (`lp`), those not yet streamed
    # (`lp_unsent`), and the characters the tokens so far take (`lp_offset`).
    lp: Logprobs | None = None
    lp_unsent: Logprobs | None = None
    lp_offset: int = 0
    background: bool = False  # priority > 0 (batch lines): sits steps out, can be preempted
    # With `prompt_logprobs`: per prompt position from the second, (token, its logprob, its
    # rank, the top (token, logprob) there), from the prefill (worker/engines/runner.py).
    prompt_lp: list | None = None
    # Prompt tokens whose keys/values came from the prefix cache at the first prefill
    # (worker/engines/prefix.py), reported as usage's cached_tokens.
    cached: int = 0
    looked: bool = False  # the prefix cache was asked for it (its first prefill)
    blocks: list[bytes] = field(default_factory=list)  # the digests of its tokens' full blocks, as named so far
    # Chunked prefill: this step feeds its tokens up to `chunk` only (None: all of them, and it
    # joins the batch); `prefilled`: how many its earlier chunks left in the prefix cache.
    chunk: int | None = None
    prefilled: int = 0
    tag: float = 0.0  # its start tag in the fair order (`FairOrder`)

    @property
    def fed(self) -> list[int]:
        """The tokens a prefill of this job feeds: its prompt and what it generated already."""
        return self.prompt_ids + self.out

    @property
    def longest(self) -> int:
        """The most tokens its row may hold: its prompt and every token it may generate."""
        return len(self.prompt_ids) + self.max_new

    @property
    def holdback(self) -> int:
        """Characters kept back from the stream: they may turn out to begin a stop string."""
        stops = self.spec.params.stop
        return max(map(len, stops)) - 1 if stops else 0


class FairOrder:
    """Start-time fair queueing of the jobs waiting for a row, across their owners (API keys):
    a job's tag is when its owner's previous job's share ends (or now, on the order's virtual
    clock, for an owner with none waiting), a job's share being the tokens it asks for over its
    owner's weight; the lowest tag goes first. tasks/fair.py orders the keys' lines the same way
    before a worker takes the jobs; this orders what it took."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.finish: dict[str | None, float] = {}

    def arrived(self, seq: Seq) -> None:
        owner = seq.spec.owner
        seq.tag = max(self.clock, self.finish.get(owner, 0.0))
        self.finish[owner] = seq.tag + seq.max_new / max(1, seq.spec.weight)

    def started(self, seq: Seq) -> None:
        if seq.tag > self.clock:
            self.clock = seq.tag
            self.finish = {o: f for o, f in self.finish.items() if f > self.clock}

    @staticmethod
    def key(seq: Seq) -> tuple:
        return (seq.background, seq.spec.priority, seq.tag)


@dataclass
class Admission:
    """What `Scheduler.take` decided: rows to take out first (preempted, ascending), then jobs
    to prefill and join, then jobs of which this step prefills a chunk only (`Seq.chunk`; they
    wait again after it)."""

    preempt: list[int] = field(default_factory=list)
    admit: list[Seq] = field(default_factory=list)
    partial: list[Seq] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        capacity: int,
        background_every: int = 4,
        clock: Callable[[], float] = time.monotonic,
        prefill_budget: int = 0,
        chunk_block: int = 0,
        cached: Callable[[Seq], int] = lambda seq: 0,
        missing: Callable[[Seq], Hashable | None] = lambda seq: None,
        kv_columns: int = 0,
        prefill_share: float = 1.0,
        kv_cells: int = 0,
    ):
        self.capacity = capacity
        self.background_every = background_every
        self.clock = clock
        # Prompt tokens one step may feed (0: no bound), and the block a chunk is a multiple of
        # (0: prompts are never cut; a job whose prompt exceeds the budget then runs alone in
        # the budget of its step). `cached(seq)`: its tokens the prefix cache holds.
        self.prefill_budget, self.chunk_block, self.cached = prefill_budget, chunk_block, cached
        # `missing(seq)`: the first block of its prompt the cache lacks (None: none it could
        # use); of jobs that lack the same block, one step prefills one (`n`/`best_of` siblings,
        # a burst of the same system prompt) and the others find it cached a step later.
        self.missing = missing
        # The batch's KV cache holds rows x columns, the columns up to twice the longest row
        # (worker/engines/kvcache.py); `kv_columns` (0: no bound) bounds rows x twice the
        # longest a row may grow (its prompt and every token it may generate), so that what
        # arrives never takes the worker past its memory: a job that would waits for rows to
        # leave (one alone always runs).
        self.kv_columns = kv_columns
        # A KV cache whose cells the rows share (llama.cpp's, worker/engines/llamacpp.py):
        # `kv_cells` (0: no bound) bounds the sum of the rows' longest, the same way.
        self.kv_cells = kv_cells
        # While foreground rows decode (background rows, batch lines, have no reader waiting
        # on each token), the chunks of long prompts take at most `prefill_share` of the
        # engine's time: after a chunk of t seconds, the running rows are owed t * (1 - share) /
        # share seconds of steps without one (`owed`, paid off by the steps' time), so most of
        # a stream's inter-token gaps are decode steps and a chunk still runs at its full width
        # (a narrower chunk every step would cost nearly a step's weight reads each).
        self.prefill_share = prefill_share
        self.owed = 0.0
        self.rows = Rows()  # the running batch; the engine has the KV cache and runner follow it
        self.waiting: list[Seq] = []  # taken from the inbox, no row yet
        self.order = FairOrder()
        self.preemptions = 0
        self.steps = 0
        self._inbox: queue.SimpleQueue[Seq | None] = queue.SimpleQueue()
        self._cancel_lock = threading.Lock()
        self._cancelled: set[str] = set()

    @property
    def fg(self) -> int:
        """Foreground rows: the first `fg`."""
        return self.rows.fg

    # -- any thread ----------------------------------------------------------------------

    def submit(self, seq: Seq) -> None:
        self._inbox.put(seq)

    def cancel(self, job_id: str) -> None:
        with self._cancel_lock:
            self._cancelled.add(job_id)

    def wake(self) -> None:
        """Make a blocked `take` return (the engine is closing)."""
        self._inbox.put(None)

    # -- the engine's thread ---------------------------------------------------------------

    def take(self, timeout: float = 0.5) -> Admission:
        """Jobs to admit now, foreground ones first, as many as there are free rows; foreground
        jobs that find no free row take background rows' places. The rest wait for the next
        step. Blocks (up to `timeout`) only while nothing runs or waits."""
        pending, self.waiting = self.waiting, []
        if not self.rows and not pending:
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                return Admission()
            if item is None:
                return Admission()
            self.order.arrived(item)
            pending.append(item)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                break
            self.order.arrived(item)
            pending.append(item)
        plan = Admission()
        room = self.capacity - len(self.rows)
        short = sum(not s.background for s in pending) - room
        if short > 0 and self.fg < len(self.rows):
            plan.preempt = self._victims(short)
            pending[:0] = [self.rows[i] for i in plan.preempt]
            self.preemptions += len(plan.preempt)
            room += len(plan.preempt)
        self._admit(plan, sorted(pending, key=FairOrder.key), room)
        for seq in plan.admit:
            self.order.started(seq)
        return plan

    def _admit(self, plan: Admission, pending: list[Seq], room: int) -> None:
        """Admit in order while rows are free and the step's prompt tokens stay in the budget;
        then the first job that did not fit gets the budget's rest as a chunk (at least one
        block), so that short jobs never wait behind a long prompt's prefill, nor it forever."""
        budget = self.prefill_budget or float("inf")
        spent, over, computing = 0, [], set()
        rows, longest = len(self.rows), max((s.longest for s in self.rows), default=0)
        cells = sum(s.longest for s in self.rows)
        for seq in pending:
            seq.chunk = None
            block = self.missing(seq)
            grown = max(longest, seq.longest)
            fits = not self.kv_columns or not rows or (rows + 1) * 2 * grown <= self.kv_columns
            fits = fits and (not self.kv_cells or not rows or cells + seq.longest <= self.kv_cells)
            if not fits or (block is not None and block in computing):
                self.waiting.append(seq)
                continue
            have = self.cached(seq) if self.prefill_budget else 0
            need = len(seq.fed) - have
            # Whole where it fits; where nothing else is admitted, whole also when it cannot be
            # cut: prompts are not cut, or the cache lost the chunks it prefilled (too small).
            whole = not plan.admit and (not self.chunk_block or have < seq.prefilled)
            if room > 0 and (spent + need <= budget or whole):
                plan.admit.append(seq)
                room -= 1
                spent += need
                computing.add(block)
                rows, longest, cells = rows + 1, grown, cells + seq.longest
            else:
                over.append(seq)
        paced = self.fg > 0 and self.owed > 0  # foreground rows decode: their gaps are kept short
        for seq in over:
            cut = (
                not paced
                and self.chunk_block
                and seq.spec.params.prompt_logprobs is None
                and self.cached(seq) >= seq.prefilled
            )
            if room > 0 and not plan.partial and cut:
                block = self.chunk_block
                done = self.cached(seq) // block * block
                seq.chunk = done + max(block, (budget - spent) // block * block)
                if seq.chunk < len(seq.fed):
                    plan.partial.append(seq)
                    computing.add(self.missing(seq))
                    continue
                seq.chunk = None
            self.waiting.append(seq)

    def account(self, chunk_s: float, step_s: float) -> None:
        """After a step that took `step_s` seconds, `chunk_s` of them in chunks: what the
        running rows are owed before the next chunk (see `prefill_share`). Owed time does not
        go below nothing: steps without chunks waiting build no credit for a burst of them."""
        if self.prefill_share < 1:
            self.owed += chunk_s * (1 - self.prefill_share) / self.prefill_share
        self.owed = max(0.0, self.owed - (step_s - chunk_s))

    def _victims(self, n: int) -> list[int]:
        """Up to `n` background rows, those cheapest to take up again (fewest tokens)."""
        rows = range(self.fg, len(self.rows))
        cost = lambda i: len(self.rows[i].prompt_ids) + len(self.rows[i].out)  # noqa: E731
        return sorted(sorted(rows, key=cost)[:n])

    def reap(self, new: list[Seq], partial: list[Seq] | None = None) -> tuple[list[tuple[Seq, str]], list[int] | None]:
        """Cancelled jobs and jobs past their deadline, running, waiting or just admitted
        (`new` and `partial` lose them): (each with "cancelled" or "timeout", the rows to keep,
        or None when every row stays)."""
        with self._cancel_lock:
            cancelled, self._cancelled = self._cancelled, set()
        now = self.clock()
        gone: list[tuple[Seq, str]] = []

        def leaves(seq: Seq) -> bool:
            why = "cancelled" if seq.spec.id in cancelled else "timeout" if now > seq.deadline else None
            if why:
                gone.append((seq, why))
            return why is not None

        new[:] = [s for s in new if not leaves(s)]
        if partial is not None:
            partial[:] = [s for s in partial if not leaves(s)]
        self.waiting = [s for s in self.waiting if not leaves(s)]
        keep = [i for i, s in enumerate(self.rows) if not leaves(s)]
        return gone, keep if len(keep) < len(self.rows) else None

    def decode_rows(self) -> int:
        """How many rows (the first ones) this decode step feeds: every row, or only the
        foreground ones while they run beside background ones, but on one step in
        `background_every`."""
        self.steps += 1
        rows = len(self.rows)
        if 0 < self.fg < rows and self.steps % self.background_every:
            rows = self.fg
        for seq in self.rows[:rows]:
            seq.batch_peak = max(seq.batch_peak, rows)
        return rows

    def drain(self) -> list[Seq]:
        """Every job still held, running, waiting or in the inbox (the engine is closing)."""
        held, self.waiting = [*self.rows, *self.waiting], []
        self.rows.keep([])
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return held
            if item is not None:
                held.append(item)
