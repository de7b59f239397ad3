"""Structured output's cost per decode step: the hf engine's logits processing and sampling for
a batch of 32 rows with 0, 1, 8 and 32 of them under a JSON schema (xgrammar bitmasks), at two
vocabulary widths; the configurations' steps alternate, each figure the median over rounds.
Findings and method: docs/benchmarks.md, "structured output's cost per decode step"::

    .venv/bin/python -m bench.structured [--rounds 7] [--steps 50]

`--tools`: the schema of `tool_choice: "required"` over bench/tools.py's two tools, with
SmolLM2-135M-Instruct's tokenizer and vocabulary (scripts/realmodel.py) instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoTokenizer

from scripts import stack
from tasks.schemas import SamplingParams, StructuredOutput
from worker.engines.logits import RowProcessors
from worker.engines.sampling import sample

ROWS = 32
FIELDS = {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}
FIELDS |= {"color": {"enum": ["red", "green", "blue"]}, "name": {"type": "string", "maxLength": 12}}
SCHEMA = {"type": "object", "properties": FIELDS, "required": list(FIELDS), "additionalProperties": False}


def batch(tok, vocab: int, constrained: int, schema=SCHEMA) -> tuple[list[SamplingParams], RowProcessors | None]:
    so = StructuredOutput(json_schema=json.dumps(schema))
    params = [
        SamplingParams(temperature=1.0, seed=i, structured_outputs=so if i < constrained else None) for i in range(ROWS)
    ]
    procs = RowProcessors.build(params, [[2]] * ROWS, [0] * ROWS, tok.eos_token_id, vocab, tokenizer=tok)
    return params, procs


def step(params, procs, gens, logits) -> None:
    chosen = logits if procs is None else procs.apply(logits)
    tokens = sample(chosen, params, gens)
    if procs is not None:
        procs.update(tokens)
        for m in procs.matchers or ():
            if m is not None and m.is_terminated():
                m.reset()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--tools", action="store_true", help="the required tool call's schema, SmolLM2's vocabulary")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from scripts import devmodels, realmodel

    schema, vocabs = SCHEMA, (4096, 50272)
    if args.tools:
        from bench.tools import TOOLS
        from webapp.protocol.tools import Tool, required_schema

        schema = required_schema([Tool.model_validate(t) for t in TOOLS], parallel=False)
        path = realmodel.ensure()
        tok, vocabs = (
            AutoTokenizer.from_pretrained(path),
            (json.loads((path / "config.json").read_text())["vocab_size"],),
        )
    else:
        tok = AutoTokenizer.from_pretrained(devmodels.ensure("tiny", stack.TINY_MODEL_DIR))
    print(f"rows={ROWS} steps/round={args.steps} rounds={args.rounds} torch threads=1")
    for vocab in vocabs:
        configs = {k: batch(tok, vocab, k, schema) for k in (0, 1, 8, 32)}
        gens = [torch.Generator().manual_seed(i) for i in range(ROWS)]
        logits = torch.randn(ROWS, vocab)
        times: dict[int, list[float]] = {k: [] for k in configs}
        t0 = time.perf_counter()
        for params, procs in configs.values():  # compile and warm up
            step(params, procs, gens, logits)
        compile_s = time.perf_counter() - t0
        for _ in range(args.rounds):
            for k, (params, procs) in configs.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(params, procs, gens, logits)
                times[k].append((time.perf_counter() - t0) / args.steps)
        base = statistics.median(times[0])
        print(f"vocab {vocab} (first steps, compiling the schema once: {compile_s * 1e3:.1f} ms)")
        for k, ts in times.items():
            med = statistics.median(ts)
            print(
                f"  {k:2d} of {ROWS} rows constrained: {med * 1e3:7.3f} ms/step  ({med / base:5.2f}x the unconstrained)"
            )


if __name__ == "__main__":
    main()
