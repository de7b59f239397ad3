"""The hf engine against an earlier version of itself, in one process, runs alternating.

    python -m bench.engine_ab --model .models/opt-125m --before 82cdf22 --batches 1,8,32 --reps 5

`--before` is a git commit: its worker/engines/hf.py is loaded as a module of its own (its
imports resolve against this tree), beside the current one. Each engine has its own copy of the
weights (float32). Per scenario, one warm-up run of each, then `reps` rounds in which each runs
once, in turn, so that load from the rest of a shared machine falls on both alike; the ratio is
taken per round (after / before) and the median reported, with the median tokens/s of each.

Scenarios: `batch B` submits B greedy jobs at once (max_new_tokens=32, ignore_eos) and waits
for all; `stagger N` submits N such jobs `--gap-ms` apart (jobs join a running batch, so
admission is measured too). Tokens/s = generated tokens / wall time. Both engines must produce
the same texts (checked every run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import uuid

from bench.common import MAX_NEW_TOKENS, median, prompt


def load_engine_class(commit: str):
    src = subprocess.run(["git", "show", f"{commit}:worker/engines/hf.py"], check=True,
                         capture_output=True, text=True).stdout
    path = tempfile.NamedTemporaryFile("w", suffix=f"_hf_{commit}.py", delete=False)
    path.write(src)
    path.close()
    spec = importlib.util.spec_from_file_location(f"hf_{commit}", path.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.HFEngine


def run_jobs(engine, n: int, gap_s: float, params, spec_cls) -> tuple[float, list[str]]:
    t0 = time.perf_counter()
    futures = []
    for i in range(n):
        futures.append(engine.submit(spec_cls(id=uuid.uuid4().hex, model="ab", prompt=prompt(i), params=params)))
        if gap_s:
            time.sleep(gap_s)
    results = [f.result(timeout=900) for f in futures]
    dt = time.perf_counter() - t0
    assert all(r.completion_tokens == MAX_NEW_TOKENS for r in results)
    return n * MAX_NEW_TOKENS / dt, [r.text for r in results]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_ab")
    ap.add_argument("--model", required=True)
    ap.add_argument("--before", required=True, help="git commit of the engine to compare with")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--stagger", type=int, default=32, help="jobs of the staggered scenario (0: none)")
    ap.add_argument("--gap-ms", type=float, default=25.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import torch
    from transformers.utils import logging as hf_logging

    from tasks.config import Settings
    from tasks.schemas import JobSpec, SamplingParams
    from worker.engines.hf import HFEngine

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    settings = Settings(model=args.model, model_name="ab", engine="hf", dtype="float32", max_batch_size=64)
    engines = {"before": load_engine_class(args.before)(settings), "after": HFEngine(settings)}
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    scenarios = [(f"batch {b}", b, 0.0) for b in (int(x) for x in args.batches.split(","))]
    if args.stagger:
        scenarios.append((f"stagger {args.stagger} x {args.gap_ms:g} ms", args.stagger, args.gap_ms / 1000))
    rows = []
    try:
        for name, n, gap in scenarios:
            for eng in engines.values():
                run_jobs(eng, n, gap, params, JobSpec)  # warm-up
            tps: dict[str, list[float]] = {k: [] for k in engines}
            ratios = []
            for rep in range(args.reps):
                order = list(engines) if rep % 2 == 0 else list(reversed(engines))
                texts = {}
                for k in order:
                    t, texts[k] = run_jobs(engines[k], n, gap, params, JobSpec)
                    tps[k].append(t)
                if texts["before"] != texts["after"]:
                    raise SystemExit(f"{name}: the engines' outputs differ")
                ratios.append(tps["after"][-1] / tps["before"][-1])
            row = {"scenario": name, "before_tok_s": median(tps["before"]), "after_tok_s": median(tps["after"]),
                   "ratio_median": median(ratios), "ratios": ratios, "runs": tps}
            rows.append(row)
            print(f"{name:24s} before {row['before_tok_s']:7.1f} tok/s  after {row['after_tok_s']:7.1f} tok/s  "
                  f"ratio {row['ratio_median']:.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})", flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
