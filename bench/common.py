"""What every benchmark phase shares: the prompts, the generation length, small statistics."""

from __future__ import annotations

import math
import os
import time
from typing import Callable

#: Every request asks for exactly this many tokens (EOS is ignored), so tokens/s = 32 x req/s.
MAX_NEW_TOKENS = 32

#: Varied short prompts: 8-12 tokens each (BOS included) with the opt-125m dev tokenizer.
PROMPTS = [
    "Hello, my name is John and I work as a",
    "The capital of France is a city that",
    "def fibonacci(n): return the",
    "Once upon a time, in a land far away",
    "In 2050, computers will be able to",
    "import os and sys, then read the file",
    "The quick brown fox jumps over the lazy dog",
    "My favourite recipe for soup is made with",
    "Redis is an in-memory data store used for",
    "The best way to learn a new language is",
    "Write a short poem about the sea and",
    "Explain how a queue works in simple terms",
    "The weather today is cold, so I will",
    "A good cup of coffee needs fresh beans and",
    "class Parser: parse the input and return",
    "Three things every programmer should know:",
]


def prompt(i: int) -> str:
    return PROMPTS[i % len(PROMPTS)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return percentile(values, 50)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def system_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (f + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(ours: Callable[[], float], max_other: float, timeout: float, log=None,
                   settle: float = 2.0) -> bool:
    """Wait until processes other than ours (`ours()`: their CPU seconds) have used at most
    `max_other` cores for `settle` seconds in a row, or `timeout` seconds have passed.
    Returns whether it got quiet. On a shared machine this keeps a burst of someone else's
    work out of a measurement instead of merely reporting it."""
    if timeout <= 0:
        return False
    deadline = time.monotonic() + timeout
    quiet_since, told = None, False
    b0, o0, t0 = system_busy_s(), ours(), time.monotonic()
    while True:
        time.sleep(0.5)
        b1, o1, t1 = system_busy_s(), ours(), time.monotonic()
        other = max(0.0, (b1 - b0) - (o1 - o0)) / (t1 - t0)
        b0, o0, t0 = b1, o1, t1
        if other <= max_other:
            quiet_since = quiet_since or t1
            if t1 - quiet_since >= settle:
                return True
        else:
            quiet_since = None
            if log and not told:
                log(f"  other processes use {other:.2f} cores: waiting up to {timeout:g} s for a quiet machine")
                told = True
        if t1 >= deadline:
            if log:
                log("  the machine did not get quiet; measuring anyway")
            return False
