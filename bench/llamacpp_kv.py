"""`python -m bench.llamacpp_kv`: the llamacpp engine's decode speed with llama.cpp's KV cache
shared by the jobs (GENQ_LLAMACPP_KV=shared) and split into a stream per job (split), in one
process, the two engines taking turns (A/B interleaved, so that the load of a shared machine
falls on both alike).

Per level (--levels: jobs at once) and round, each engine runs the level's jobs twice, with
--short and --long new tokens (greedy, EOS ignored, chat prompts); decode tokens/s is the
difference of tokens over the difference of time, so prompts and start-up cancel out. Prints a
JSON line per measurement and the median of each engine and level, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from scripts import ggufmodels
from tasks.config import Settings
from tasks.schemas import JobSpec, SamplingParams
from worker.engines.llamacpp import LlamaCppEngine

TOPICS = ("the sea", "a cat", "the moon", "trains", "bread", "rain", "a forest", "chess")


def jobs(engine, n: int, new: int) -> list[JobSpec]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]
        ids = engine.tok.apply_chat_template(msgs, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        params = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0)
        out.append(
            JobSpec(
                id=f"b{time.monotonic_ns()}-{i}", model=engine.model, prompt="", prompt_token_ids=ids, params=params
            )
        )
    return out


def timed(engine, n: int, new: int) -> float:
    began = time.perf_counter()
    futures = [engine.submit(j) for j in jobs(engine, n, new)]
    for f in futures:
        assert f.result(timeout=600).completion_tokens == new
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default="qwen05", choices=tuple(ggufmodels.MODELS))
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=144)
    ap.add_argument("--batch", type=int, default=32, help="GENQ_MAX_BATCH_SIZE (the split's streams)")
    args = ap.parse_args(argv)
    path = str(ggufmodels.ensure(args.gguf))
    engines = {
        kv: LlamaCppEngine(Settings(model=path, model_name=kv, max_batch_size=args.batch, llamacpp_kv=kv))
        for kv in ("shared", "split")
    }
    got: dict[tuple[str, int], list[float]] = {}
    print(json.dumps({"load_start": os.getloadavg()}), flush=True)
    try:
        for level in map(int, args.levels.split(",")):
            for kv in engines:  # warm-up
                timed(engines[kv], level, args.short)
            for r in range(args.rounds):
                order = list(engines) if r % 2 == 0 else list(engines)[::-1]
                for kv in order:
                    eng = engines[kv]
                    short, long = timed(eng, level, args.short), timed(eng, level, args.long)
                    rate = level * (args.long - args.short) / (long - short)
                    got.setdefault((kv, level), []).append(rate)
                    print(json.dumps({"kv": kv, "jobs": level, "round": r, "decode_tok_s": round(rate, 2)}), flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    print(json.dumps({"load_end": os.getloadavg()}), flush=True)
    for level in map(int, args.levels.split(",")):
        a, b = (statistics.median(got[(kv, level)]) for kv in ("shared", "split"))
        print(f"{level} jobs: shared {a:.1f} tok/s, split {b:.1f} tok/s, split/shared {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
