"""The running batch's rows, in the one order that everything per row follows.

Row i of the batch is one job (`Seq`) here, one row of the KV cache's buffers
(worker/engines/kvcache.py) and one row of the runner's state (its next tokens and logits
processors, worker/engines/runner.py). `Rows` is the only place a row moves: rows leave
(`keep`: the last rows move into the holes the others leave, so that only the movers are copied)
and the foreground rows go first (`partition`), and each move is made here and, identically, in
every follower (`follow`); jobs join after the running rows (`join`, once the runner's forward
has put their keys/values there). Plain Python: the scheduler is tested with it alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

# A job in the engine (worker/engines/scheduler.py `Seq`): only its `background` is read here.
Seq = Any


class Follower(Protocol):
    """Per-row state that moves with the rows."""

    def move(self, order: list[int]) -> None:
        """Row i is now old row order[i]; rows not in `order` are gone."""

    def swap(self, a: list[int], b: list[int]) -> None:
        """Rows a[i] and b[i] (disjoint) exchange places."""


def fill_holes(keep: list[int], rows: int) -> list[int]:
    """The order after only the rows in `keep` (ascending, of `rows`) stay: the rows past the
    new count move into the holes, the others stay where they are."""
    count = len(keep)
    order = list(range(count))
    kept = set(keep)
    holes = [i for i in range(count) if i not in kept]
    movers = [i for i in keep if i >= count]
    for h, m in zip(holes, movers, strict=True):
        order[h] = m
    return order


class Rows:
    def __init__(self) -> None:
        self.seqs: list[Seq] = []
        self.fg = 0  # the first `fg` rows are foreground jobs'
        self._followers: list[Follower] = []

    def follow(self, follower: Follower) -> None:
        self._followers.append(follower)

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Iterator[Seq]:
        return iter(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i]

    def join(self, seqs: list[Seq]) -> None:
        """Jobs whose rows the forward just added after the running ones; foreground first again."""
        self.seqs.extend(seqs)
        self.partition()

    def keep(self, keep: list[int]) -> None:
        """Only the rows in `keep` (ascending) stay; foreground first again."""
        if len(keep) == len(self.seqs):
            return
        order = fill_holes(keep, len(self.seqs))
        for f in self._followers:
            f.move(order)
        self.seqs = [self.seqs[i] for i in order]
        self.partition()

    def leave(self, gone: set[Seq]) -> None:
        """The rows of the jobs in `gone` leave."""
        if gone:
            self.keep([i for i, s in enumerate(self.seqs) if s not in gone])

    def partition(self) -> tuple[list[int], list[int]]:
        """Put the foreground rows first: swap each foreground row past the foreground count
        with a background row before it. Returns the pairs swapped."""
        fg = [i for i, s in enumerate(self.seqs) if not s.background]
        self.fg = len(fg)
        late = [i for i in fg if i >= self.fg]
        early = [i for i in range(self.fg) if self.seqs[i].background]
        if late:
            for a, b in zip(late, early, strict=True):
                self.seqs[a], self.seqs[b] = self.seqs[b], self.seqs[a]
            for f in self._followers:
                f.swap(late, early)
        return late, early
