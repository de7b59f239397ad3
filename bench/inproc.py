"""The in-process phases: padded `model.generate` and our HFEngine, no queue, no HTTP.

Run by bench.run as a subprocess of its own while nothing else of the benchmark runs, so the
model gets the CPU to itself (as far as a shared machine allows: the "other load" column says
how much CPU the rest of the machine used meanwhile)::

    python -m bench.inproc --model DIR --batches 1,2,5 --reps 3 --out result.json

For each batch size b: one warm-up run of each, then timed runs of the two in turn until each
has `reps` runs not disturbed by other load (at most 2 x reps); the median is reported.
- generate: b prompts, left-padded into one tensor, one `model.generate(do_sample=False,
  max_new_tokens=32, min_new_tokens=32)` call (EOS cannot end a row early), in a child process
  of its own.
- engine: HFEngine (worker/engines/hf.py) as the worker builds it; b jobs submitted at once
  (greedy, max_new_tokens=32, ignore_eos), timed until the last future resolves.

The two never share a process: the engine runs the model on its own thread, and a second
thread of the same process that runs torch ops (generate on the main thread) gives GNU OpenMP
two thread teams on 2 cores, which then stop spinning between ops and slowed every step of both
(docs/benchmarks.md, "One thread runs the model").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import uuid

from bench.common import MAX_NEW_TOKENS, mean, median, prompt, system_busy_s, tree_cpu_s, wait_for_quiet


def own_cpu_s() -> float:
    """CPU seconds of this process and its children (the generate process)."""
    return tree_cpu_s(os.getpid())


def _measure(fns: dict, reps: int, max_other: float, quiet_wait: float, log) -> dict:
    """Warm each fn up once, then time them in turn (so a burst of other load on the shared
    machine hits all of them alike) until each has `reps` runs during which the rest of the
    machine used at most `max_other` cores, or 2 x reps runs in all. The median is taken over
    the quiet runs (over all runs if none was quiet). After a disturbed run, waits (up to
    `quiet_wait` s) for the machine to calm down before the next."""
    extras = {name: fn() for name, fn in fns.items()}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    noisy = False
    for _ in range(2 * reps):
        quiet = {n: sum(o <= max_other for _, o in r) for n, r in runs.items()}
        if all(q >= reps for q in quiet.values()):
            break
        for name, fn in fns.items():
            if quiet[name] >= reps:
                continue
            if noisy:
                wait_for_quiet(own_cpu_s, max_other, quiet_wait, log)
            b0, c0, t0 = system_busy_s(), own_cpu_s(), time.perf_counter()
            extras[name] = fn()
            t = time.perf_counter() - t0
            runs[name].append((t, max(0.0, (system_busy_s() - b0) - (own_cpu_s() - c0)) / t))
            noisy = runs[name][-1][1] > max_other
    out = {}
    for name, r in runs.items():
        quiet = [t for t, o in r if o <= max_other]
        out[name] = {
            "latency_s": median(quiet or [t for t, _ in r]),
            "runs_s": [t for t, _ in r],
            "runs_other": [o for _, o in r],
            "quiet_runs": len(quiet),
            "max_other": max_other,
            "other_load": mean(o for t, o in r if o <= max_other) if quiet else mean(o for _, o in r),
            "extra": extras[name],
        }
    return out


def _serve_generate(model_dir: str, conn) -> None:
    """The child process of the generate runs: loads the model, then for each batch size it
    receives runs padded `generate` once and answers with (padded prompt length, mean prompt
    tokens), or the error's text; None ends it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    conn.send("ready")
    while (b := conn.recv()) is not None:
        try:
            enc = tok([prompt(i) for i in range(b)], return_tensors="pt", padding=True)
            with torch.inference_mode():
                out = lm.generate(
                    **enc,
                    do_sample=False,
                    max_new_tokens=MAX_NEW_TOKENS,
                    min_new_tokens=MAX_NEW_TOKENS,
                    pad_token_id=pad,
                )
            new = out.shape[1] - enc.input_ids.shape[1]
            if new != MAX_NEW_TOKENS:
                raise RuntimeError(f"generate made {new} tokens per row, expected {MAX_NEW_TOKENS}")
            conn.send((int(enc.input_ids.shape[1]), float(enc.attention_mask.sum(1).float().mean())))
        except Exception as exc:  # the parent raises it
            conn.send(f"{type(exc).__name__}: {exc}")


def run_batches(model_dir: str, batches: list[int], reps: int, max_other: float, quiet_wait: float, log) -> dict:
    from transformers.utils import logging as hf_logging

    from tasks.config import Settings
    from tasks.schemas import JobSpec, SamplingParams
    from worker.engines.hf import HFEngine

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    conn, child_conn = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=_serve_generate, args=(model_dir, child_conn))
    child.start()
    engine = None
    gen_rows, eng_rows = [], []
    try:
        if not conn.poll(600) or conn.recv() != "ready":
            raise RuntimeError("the generate process did not start")
        # The engine as the worker builds it (its own copy of the weights), minus the token stream.
        settings = Settings(
            model=model_dir, model_name="bench-inproc", engine="hf", max_batch_size=max(64, max(batches))
        )
        engine = HFEngine(settings)
        params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        for b in batches:

            def generate(b=b):
                conn.send(b)
                answer = conn.recv()
                if isinstance(answer, str):
                    raise RuntimeError(answer)
                return answer

            def hfengine():
                futures = [
                    engine.submit(JobSpec(id=uuid.uuid4().hex, model="bench-inproc", prompt=prompt(i), params=params))
                    for i in range(b)
                ]
                results = [f.result(timeout=600) for f in futures]
                bad = [r for r in results if r.completion_tokens != MAX_NEW_TOKENS]
                if bad:
                    raise RuntimeError(f"engine made {bad[0].completion_tokens} tokens, expected {MAX_NEW_TOKENS}")
                return mean(r.batch_size for r in results)

            m = _measure({"generate": generate, "engine": hfengine}, reps, max_other, quiet_wait, log)
            for name, rows in (("generate", gen_rows), ("engine", eng_rows)):
                r = m[name]
                extra = r.pop("extra")
                if name == "engine":
                    r["batch_size_mean"] = extra
                else:
                    r["padded_prompt_len"], r["prompt_tokens_mean"] = extra
                r.update(batch=b, req_s=b / r["latency_s"], tok_s=b * MAX_NEW_TOKENS / r["latency_s"])
                rows.append(r)
                log(
                    f"{name:8s} batch {b:3d}: {r['latency_s']:.3f} s (runs "
                    + ", ".join(f"{t:.2f}" for t in r["runs_s"])
                    + "; other load "
                    + ", ".join(f"{o:.2f}" for o in r["runs_other"])
                    + ")"
                )
    finally:
        if engine is not None:
            engine.close()
        try:
            conn.send(None)
        except OSError:
            pass  # it is gone already
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    return {"generate": gen_rows, "engine": eng_rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.inproc")
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", required=True, help="comma-separated batch sizes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--max-other-load",
        type=float,
        default=0.3,
        help="runs during which the rest of the machine used more cores are repeated",
    )
    ap.add_argument(
        "--quiet-wait", type=float, default=90.0, help="after a disturbed run, wait up to this long for a quiet machine"
    )
    args = ap.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",") if x.strip()]

    def log(msg: str) -> None:
        print(f"[inproc] {msg}", file=sys.stderr, flush=True)

    import torch
    import transformers

    result = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "max_other_load": args.max_other_load,
        **run_batches(args.model, batches, args.reps, args.max_other_load, args.quiet_wait, log),
    }
    with open(args.out, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
