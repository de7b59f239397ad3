"""In process, no queue, no HTTP: padded `model.generate` and our HFEngine at each of --batches
(bench.run's phase 2), or with --prefill-reps the prefill and decode step of one prompt
(bench.stream's floor); run as a subprocess while nothing else of the benchmark runs. Method:
docs/benchmarks.md, "The harnesses"::

    python -m bench.inproc --model DIR --batches 1,2,5 --reps 3 --out result.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import uuid

from bench.common import (
    MAX_NEW_TOKENS,
    PROMPTS,
    OtherLoad,
    mean,
    median,
    percentile,
    prompt,
    tree_cpu_s,
    wait_for_quiet,
)


def own_cpu_s() -> float:
    """CPU seconds of this process and its children (the generate process)."""
    return tree_cpu_s(os.getpid())


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_lm(model_dir: str, **tokenizer_kw):
    """(tokenizer, the model in float32 for inference)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    tok = AutoTokenizer.from_pretrained(model_dir, **tokenizer_kw)
    return tok, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


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
            other, t0 = OtherLoad(own_cpu_s), time.perf_counter()
            extras[name] = fn()
            t = time.perf_counter() - t0
            runs[name].append((t, other.seconds() / t))
            noisy = runs[name][-1][1] > max_other
    out = {}
    for name, r in runs.items():
        quiet = [t for t, o in r if o <= max_other]
        others = [o for _, o in r]
        out[name] = {"latency_s": median(quiet or [t for t, _ in r]), "runs_s": [t for t, _ in r], "runs_other": others}
        out[name] |= {"quiet_runs": len(quiet), "max_other": max_other, "extra": extras[name]}
        out[name]["other_load"] = mean(o for o in others if o <= max_other) if quiet else mean(others)
    return out


def _serve_generate(model_dir: str, conn) -> None:
    """The child process of the generate runs: loads the model, then for each batch size it
    receives runs padded `generate` once and answers with (padded prompt length, mean prompt
    tokens), or the error's text; None ends it."""
    import torch

    tok, lm = load_lm(model_dir, padding_side="left")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    conn.send("ready")
    while (b := conn.recv()) is not None:
        try:
            enc = tok([prompt(i) for i in range(b)], return_tensors="pt", padding=True)
            with torch.inference_mode():
                n = MAX_NEW_TOKENS
                out = lm.generate(**enc, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
            if (new := out.shape[1] - enc.input_ids.shape[1]) != MAX_NEW_TOKENS:
                raise RuntimeError(f"generate made {new} tokens per row, expected {MAX_NEW_TOKENS}")
            conn.send((int(enc.input_ids.shape[1]), float(enc.attention_mask.sum(1).float().mean())))
        except Exception as exc:  # the parent raises it
            conn.send(f"{type(exc).__name__}: {exc}")


def run_batches(model_dir: str, batches: list[int], reps: int, max_other: float, quiet_wait: float, log) -> dict:
    from tasks.config import Settings
    from tasks.schemas import JobSpec, SamplingParams
    from worker.engines.hf import HFEngine

    quiet_transformers()
    conn, child_conn = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=_serve_generate, args=(model_dir, child_conn))
    child.start()
    engine = None
    rows: dict[str, list] = {"generate": [], "engine": []}
    try:
        if not conn.poll(600) or conn.recv() != "ready":
            raise RuntimeError("the generate process did not start")
        # The engine as the worker builds it (its own copy of the weights), minus the token stream.
        size = max(64, max(batches))
        engine = HFEngine(Settings(model=model_dir, model_name="bench-inproc", engine="hf", max_batch_size=size))
        params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        for b in batches:

            def generate(b=b):
                conn.send(b)
                if isinstance(answer := conn.recv(), str):
                    raise RuntimeError(answer)
                return answer

            def hfengine():
                jobs = [
                    JobSpec(id=uuid.uuid4().hex, model="bench-inproc", prompt=prompt(i), params=params)
                    for i in range(b)
                ]
                results = [f.result(timeout=600) for f in [engine.submit(j) for j in jobs]]
                if bad := [r for r in results if r.completion_tokens != MAX_NEW_TOKENS]:
                    raise RuntimeError(f"engine made {bad[0].completion_tokens} tokens, expected {MAX_NEW_TOKENS}")
                return mean(r.batch_size for r in results)

            m = _measure({"generate": generate, "engine": hfengine}, reps, max_other, quiet_wait, log)
            for name, r in m.items():
                extra = r.pop("extra")
                if name == "engine":
                    r["batch_size_mean"] = extra
                else:
                    r["padded_prompt_len"], r["prompt_tokens_mean"] = extra
                r.update(batch=b, req_s=b / r["latency_s"], tok_s=b * MAX_NEW_TOKENS / r["latency_s"])
                rows[name].append(r)
                runs = ", ".join(f"{t:.2f}" for t in r["runs_s"])
                others = ", ".join(f"{o:.2f}" for o in r["runs_other"])
                log(f"{name:8s} batch {b:3d}: {r['latency_s']:.3f} s (runs {runs}; other load {others})")
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
    return rows


def run_prefill(model_dir: str, reps: int) -> dict:
    """The floor of time to first token: one forward over one prompt (`use_cache=True,
    logits_to_keep=1`) + argmax, `reps` passes over the prompts; and of inter-token latency:
    one decode step at batch 1 on the cache."""
    import torch

    tok, lm = load_lm(model_dir)
    encs = [tok(p, return_tensors="pt") for p in PROMPTS]

    def prefill(enc):
        out = lm(input_ids=enc.input_ids, attention_mask=enc.attention_mask, use_cache=True, logits_to_keep=1)
        return out, out.logits[:, -1, :].argmax(-1)

    with torch.inference_mode():
        for e in encs[:4]:  # warm-up
            prefill(e)
        pre, other_s = [], 0.0
        for e in [e for _ in range(reps) for e in encs]:
            other, t0 = OtherLoad(), time.perf_counter()
            prefill(e)
            pre.append(time.perf_counter() - t0)
            other_s += other.seconds()
        tok_t = []
        for p in PROMPTS:
            t0 = time.perf_counter()
            tok(p)
            tok_t.append(time.perf_counter() - t0)
        steps = []  # decode steps at batch 1: prefill, then MAX_NEW_TOKENS - 1 steps on the cache
        for e in encs[:4]:
            out, nxt = prefill(e)
            cache, mask = out.past_key_values, e.attention_mask
            for _ in range(MAX_NEW_TOKENS - 1):
                mask = torch.nn.functional.pad(mask, (0, 1), value=1)
                t0 = time.perf_counter()
                o = lm(input_ids=nxt.view(1, 1), attention_mask=mask, past_key_values=cache, use_cache=True)
                nxt = o.logits[:, -1, :].argmax(-1)
                steps.append(time.perf_counter() - t0)
                cache = o.past_key_values
    out = {"prompt_tokens": [int(e.input_ids.shape[1]) for e in encs], "prefill_samples": len(pre)}
    out |= {"prefill_median_s": median(pre), "prefill_p10_s": percentile(pre, 10), "prefill_p90_s": percentile(pre, 90)}
    out |= {"tokenize_median_s": median(tok_t), "decode_step_median_s": median(steps)}
    out |= {"decode_step_p90_s": percentile(steps, 90), "other_load": other_s / sum(pre) if pre else float("nan")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.inproc", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", help="comma-separated batch sizes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-other-load", type=float, default=0.3, help="repeat runs during which others used more cores")
    ap.add_argument("--quiet-wait", type=float, default=90.0, help="after a disturbed run, seconds to wait for quiet")
    ap.add_argument("--prefill-reps", type=int, help="instead of --batches: passes of the prefill over the prompts")
    args = ap.parse_args(argv)
    if not args.batches and not args.prefill_reps:
        ap.error("--batches or --prefill-reps")

    def log(msg: str) -> None:
        print(f"[inproc] {msg}", file=sys.stderr, flush=True)

    import torch
    import transformers

    result = {"torch": torch.__version__, "transformers": transformers.__version__}
    result["torch_threads"] = torch.get_num_threads()
    if args.prefill_reps:
        result.update(run_prefill(args.model, args.prefill_reps))
    else:
        batches = [int(x) for x in args.batches.split(",") if x.strip()]
        result.update(torch_interop_threads=torch.get_num_interop_threads(), max_other_load=args.max_other_load)
        result.update(run_batches(args.model, batches, args.reps, args.max_other_load, args.quiet_wait, log))
    with open(args.out, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
