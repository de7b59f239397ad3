"""What every benchmark phase shares: the prompts, the generation length, small statistics."""

from __future__ import annotations

import math

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
