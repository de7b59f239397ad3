"""One decode step of the hf engine's model, before and after the in-place KV cache, and at
different torch thread counts, interleaved step by step (so that load from the rest of a shared
machine falls on every variant alike)::

    python -m bench.decode_step --model .models/opt-125m --batches 1,8,32 --steps 24 [--threads 1,2]
    python -m bench.decode_step --model .models/opt-125m --batches 1,4,10,32,64 --steps 16 --packed
    python -m bench.decode_step --model .models/opt-125m --batches 10 --steps 12 --compile

- cache: transformers' DynamicCache (concatenated per layer at every step, as the engine did
  before) against worker/engines/kvcache.SlotKV (written in place), same prompt (8 random
  tokens per row), greedy; the chosen tokens must be identical. Median step time of each and
  the median of the per-step ratios.
- packed (with --packed, instead of the cache comparison): the same SlotKV decode step with
  PyTorch's `nn.Linear` and with the linears packed for oneDNN (worker/engines/packed.py), two
  copies of the model, interleaved; greedy tokens must be identical. Also one prefill of a
  quarter of the batch's rows (6 tokens each), as admission runs it.
- compile (with --compile): one forward of B one-token rows without a cache, as PyTorch's
  `nn.Linear`, packed (as above) and `torch.compile` of the plain model with inductor's
  "freezing" (which packs weights for oneDNN itself and fuses the rest), static shapes; the
  compile time of one shape and the median forward time of each, interleaved.
- threads (with --threads): the same forward (batch B, one token, no cache) at each thread
  count in turn.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

from bench.common import median


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_step")
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", default="", help="comma-separated thread counts to compare")
    ap.add_argument("--packed", action="store_true", help="nn.Linear against oneDNN-packed linears")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights' dtype for --packed and --compile")
    ap.add_argument("--compile", action="store_true", help="packed linears against torch.compile")
    args = ap.parse_args(argv)
    if args.packed:
        return packed(args)
    if args.compile:
        return compiled(args)

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from worker.engines.kvcache import SlotKV

    hf_logging.disable_progress_bar()
    lm = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    cfg = lm.config
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    batches = [int(x) for x in args.batches.split(",")]
    with torch.inference_mode():
        for b in batches:
            torch.manual_seed(b)
            ids = torch.randint(3, cfg.vocab_size - 100, (b, 8))
            mask0 = torch.ones(b, 8, dtype=torch.long)
            out = lm(input_ids=ids, attention_mask=mask0, use_cache=True, logits_to_keep=1)
            first = out.logits[:, -1].argmax(-1, keepdim=True)
            kv = SlotKV(cfg.num_hidden_layers, cfg.num_attention_heads,
                        cfg.hidden_size // cfg.num_attention_heads, torch.float32, b)
            kv.append(out.past_key_values, mask0)
            state = {"dynamic": [mask0, copy.deepcopy(out.past_key_values), first], "slot": [first]}

            def dynamic():
                mask, cache, nxt = state["dynamic"]
                mask = torch.nn.functional.pad(mask, (0, 1), value=1)
                o = lm(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
                state["dynamic"] = [mask, o.past_key_values, o.logits[:, -1].argmax(-1).view(-1, 1)]

            def slot():
                o = lm(input_ids=state["slot"][0], attention_mask=kv.step_mask(), past_key_values=kv.cache,
                       use_cache=True)
                kv.advance()
                state["slot"] = [o.logits[:, -1].argmax(-1).view(-1, 1)]

            times = {"dynamic": [], "slot": []}
            for i in range(args.steps):
                pair = (("dynamic", dynamic), ("slot", slot))
                for name, fn in pair if i % 2 == 0 else pair[::-1]:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                if not torch.equal(state["dynamic"][2], state["slot"][0]):
                    raise SystemExit(f"batch {b}: the two caches chose different tokens at step {i}")
            ratio = median([a / s for a, s in zip(times["dynamic"], times["slot"])])
            print(f"cache   batch {b:3d}: DynamicCache {median(times['dynamic']) * 1e3:7.1f} ms/step, "
                  f"SlotKV {median(times['slot']) * 1e3:7.1f} ms/step, speedup {ratio:.2f}x "
                  f"(median of {args.steps} interleaved steps)", flush=True)
        counts = [int(x) for x in args.threads.split(",") if x.strip()]
        default = torch.get_num_threads()
        for b in batches if counts else []:
            x = torch.randint(3, cfg.vocab_size - 100, (b, 1))
            times = {n: [] for n in counts}
            for i in range(args.steps):
                for n in counts if i % 2 == 0 else counts[::-1]:
                    torch.set_num_threads(n)
                    t0 = time.perf_counter()
                    lm(input_ids=x, use_cache=False)
                    times[n].append(time.perf_counter() - t0)
            torch.set_num_threads(default)
            print(f"threads batch {b:3d}: " + ", ".join(f"{n} thread(s) {median(t) * 1e3:7.1f} ms"
                                                      for n, t in times.items()), flush=True)
    return 0


def _plain_and_packed(args):
    """Two copies of the checkpoint in `--dtype`: PyTorch's linears, and packed ones."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from bench.common import cpu_model
    from worker.engines.packed import pack

    hf_logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    plain = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    fast = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_model()}, {args.dtype}; "
          f"linear layers: {pack(fast)}")
    return plain, fast


def packed(args) -> int:
    import torch

    from worker.engines.kvcache import SlotKV

    plain, fast = _plain_and_packed(args)
    dtype = plain.dtype
    cfg = plain.config
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    print("| batch | nn.Linear ms/step | packed ms/step | speedup (median of per-step ratios) | "
          "prefill rows x 6 tokens | nn.Linear ms | packed ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for b in [int(x) for x in args.batches.split(",")]:
            torch.manual_seed(b)
            ids = torch.randint(3, cfg.vocab_size - 100, (b, 8))
            mask = torch.ones(b, 8, dtype=torch.long)
            state = {}
            for name, lm in (("plain", plain), ("packed", fast)):
                out = lm(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
                kv = SlotKV(cfg.num_hidden_layers, heads, head_dim, dtype, b)
                kv.append(out.past_key_values, mask)
                state[name] = {"lm": lm, "kv": kv, "next": out.logits[:, -1].argmax(-1, keepdim=True), "t": []}
            for i in range(args.steps):
                for name in ("plain", "packed") if i % 2 == 0 else ("packed", "plain"):
                    st = state[name]
                    t0 = time.perf_counter()
                    o = st["lm"](input_ids=st["next"], attention_mask=st["kv"].step_mask(),
                                 past_key_values=st["kv"].cache, use_cache=True)
                    st["kv"].advance()
                    st["next"] = o.logits[:, -1].argmax(-1, keepdim=True)
                    st["t"].append(time.perf_counter() - t0)
                if not torch.equal(state["plain"]["next"], state["packed"]["next"]):
                    raise SystemExit(f"batch {b}: packed linears chose different tokens at step {i}")
            rows = max(1, b // 4)
            pre = {"plain": [], "packed": []}
            for i in range(max(4, args.steps // 2)):
                for name in ("plain", "packed") if i % 2 == 0 else ("packed", "plain"):
                    t0 = time.perf_counter()
                    state[name]["lm"](input_ids=ids[:rows, :6], attention_mask=mask[:rows, :6], use_cache=True,
                                      logits_to_keep=1)
                    pre[name].append(time.perf_counter() - t0)
            a, p = state["plain"]["t"], state["packed"]["t"]
            ratio = median([x / y for x, y in zip(a, p)])
            print(f"| {b} | {median(a) * 1e3:.1f} | {median(p) * 1e3:.1f} | {ratio:.2f}x | {rows} | "
                  f"{median(pre['plain']) * 1e3:.1f} | {median(pre['packed']) * 1e3:.1f} |", flush=True)
    return 0


def compiled(args) -> int:
    import torch
    import torch._inductor.config as inductor

    inductor.freezing = True
    plain, fast = _plain_and_packed(args)
    with torch.no_grad():
        for b in [int(x) for x in args.batches.split(",")]:
            x = torch.randint(3, plain.config.vocab_size - 100, (b, 1))
            graph = torch.compile(lambda ids: plain(input_ids=ids, use_cache=False).logits, dynamic=False)
            t0 = time.perf_counter()
            graph(x)
            compile_s = time.perf_counter() - t0
            runs = {
                "nn.Linear": lambda: plain(input_ids=x, use_cache=False).logits,
                "packed": lambda: fast(input_ids=x, use_cache=False).logits,
                "torch.compile": lambda: graph(x),
            }
            ref = runs["nn.Linear"]()
            diffs = {k: float((f() - ref).abs().max()) for k, f in runs.items()}
            times = {k: [] for k in runs}
            for i in range(args.steps):
                for name, fn in runs.items() if i % 2 == 0 else list(runs.items())[::-1]:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            print(f"batch {b}: compile {compile_s:.1f} s; " + ", ".join(
                f"{k} {median(t) * 1e3:.1f} ms (max |diff| {diffs[k]:.1e})" for k, t in times.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
