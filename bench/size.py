"""`python -m bench.size`: a real quantized model as CPU users serve it, genqueue against
llama.cpp's own server, on the same GGUF file, in one run.

Systems (--systems): `genqueue` (API + one llamacpp worker: worker/engines/llamacpp.py;
`genqueue-split` with GENQ_LLAMACPP_KV=split, a KV stream per job as llama-server's slots),
`llama.cpp` (llama-server from the same build, continuous batching over --levels' largest
number of slots, `--jinja`), `genqueue-hf` (the hf engine on the file's float32 conversion,
as genqueue served a GGUF before the llamacpp engine), `vllm` (vLLM's OpenAI server on the
float32 conversion, from .venv-vllm; only when asked). Load: closed-loop clients sending chat
completions (64 tokens, EOS ignored, greedy) for --duration s per level; throughput in
requests/s and output tokens/s, latency percentiles, time to the first token of a streamed
answer (one client, idle server; the same question again, and a new one), and the server's
resident memory (its process tree, after the largest level). Writes docs/benchmarks-size.md.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from pathlib import Path

from bench.common import (
    ROOT,
    RedisTarget,
    Stack,
    fmt,
    int_list,
    intro,
    log,
    main_with_render,
    marker,
    names,
    parser,
    run_bench,
    run_lines,
    table,
    tree,
)
from bench.load import chat_bodies, measure_levels
from scripts import ggufmodels, stack
from worker.engines import llamacpp_lib

MARKER = marker("bench.size")
INTRO = intro("Benchmarks: real quantized models, genqueue and llama.cpp", "bench.size")
SYSTEMS = ("genqueue", "genqueue-split", "llama.cpp", "genqueue-hf", "vllm")
QUESTIONS = ("the sea", "the moon", "trains", "bread", "rain", "chess", "a forest")
MAX_TOKENS = 64
CONTEXT_PER_SLOT = 1024  # llama-server's -c is this times its slots


def rss_gib(pid: int | None) -> float:
    return sum(p.memory_info().rss for p in tree(pid)) / (1 << 30) if pid else 0.0


def first_token_s(port: int, model: str, n: int = 5, new: bool = False) -> float:
    """Median seconds to the first content of a streamed chat answer, one request at a time:
    the same question each time (a server that keeps prompts computes one token), or (`new`)
    another each time (only the chat template's system prompt is the same)."""
    got = []
    for i in range(n):
        ask = f"Tell me about {QUESTIONS[i % len(QUESTIONS)] if new else 'the sea'}."
        body = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": ask}], "max_tokens": 8}
            | {"stream": True, "temperature": 0}
        )
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        began = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        while line := resp.readline():
            if line.startswith(b"data: {") and _content(line):
                got.append(time.perf_counter() - began)
                break
        conn.close()
    got.sort()
    return got[len(got) // 2] if got else float("nan")


def _content(line: bytes) -> bool:
    """Whether an SSE chunk of a chat stream carries text (not the role's empty first chunk)."""
    try:
        choices = json.loads(line[len(b"data: ") :]).get("choices") or [{}]
    except ValueError:
        return False
    return bool((choices[0].get("delta") or {}).get("content"))


def llama_server(procs, gguf: Path, slots: int, threads: int):
    port = stack.free_port()
    argv = [str(llamacpp_lib.lib_dir() / "llama-server"), "-m", str(gguf), "-np", str(slots)]
    argv += ["-c", str(slots * CONTEXT_PER_SLOT), "--jinja", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-t", str(threads), "--no-webui"]
    proc = procs.start("llama-server", argv)
    stack.wait_until(lambda: stack.http_get(f"http://127.0.0.1:{port}/health")[0] == 200, 300, "llama-server", [proc])
    return proc, port


def vllm_server(procs, model_dir: Path, name: str, slots: int):
    port = stack.free_port()
    py = ROOT / ".venv-vllm" / "bin" / "python"
    argv = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port)]
    argv += ["--served-model-name", name, "--enforce-eager", "--max-num-seqs", str(slots), "--dtype", "float32"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    proc = procs.start("vllm-server", argv, env)
    stack.wait_until(lambda: stack.http_get(f"http://127.0.0.1:{port}/health")[0] == 200, 600, "vLLM", [proc])
    return proc, port


def measure(args, procs, res: dict, outdir: Path) -> None:
    gguf = ggufmodels.ensure(args.gguf)
    res["gguf"] = {"file": gguf.name, "mib": gguf.stat().st_size / (1 << 20)}
    if not llamacpp_lib.built():
        raise SystemExit(f"llama.cpp is not built in {llamacpp_lib.lib_dir()}: make llamacpp")
    levels, threads = int_list(args.ap, args.levels), os.cpu_count() or 2
    slots = max(levels)
    redis = RedisTarget(procs)
    res["systems"] = {}
    for system in names(args.ap, args.systems, SYSTEMS, "--systems"):
        log(f"-- {system}")
        if system.startswith("genqueue"):
            engine = "hf" if system == "genqueue-hf" else "llamacpp"
            model = gguf if engine == "llamacpp" else _converted(gguf)
            kv = {"GENQ_LLAMACPP_KV": "split"} if system == "genqueue-split" else {}
            s = Stack(procs, redis.url, model, engine, system.replace(".", ""), batch=slots, **kv)
            s.start_worker()
            s.start_api(1, what=f"the {engine} worker")
            name, port, pid, others = s.name, s.port, s.worker.popen.pid, [s.api.popen.pid]
        elif system == "llama.cpp":
            proc, port = llama_server(procs, gguf, slots, threads)
            name, pid, others, s = "llama", proc.popen.pid, [], proc
        else:
            name = "vllm"
            proc, port = vllm_server(procs, _converted(gguf), name, slots)
            pid, others, s = proc.popen.pid, [], proc
        first_token_s(port, name, 1, new=True)  # a first request, to warm up
        ttft, ttft_new = first_token_s(port, name), first_token_s(port, name, new=True)
        rows = measure_levels(
            system,
            port,
            levels,
            args,
            {"server": [pid, *others]},
            [pid, *others],
            path="/v1/chat/completions",
            bodies=chat_bodies(name, MAX_TOKENS),
            expect=b'"choices"',
        )
        res["systems"][system] = {"levels": rows, "ttft_s": ttft, "ttft_new_s": ttft_new, "rss_gib": rss_gib(pid)}
        log(f"{system}: TTFT {ttft:.3f} s ({ttft_new:.3f} s new), resident {res['systems'][system]['rss_gib']:.2f} GiB")
        if isinstance(s, Stack):
            s.stop()
        else:
            procs.stop(s)


def _converted(gguf: Path) -> Path:
    from worker import gguf as conv

    return conv.converted(str(gguf), os.path.expanduser("~/.cache/genqueue/gguf"))


def render(res: dict) -> str:
    out = [MARKER, "", "## Run", "", *run_lines(res)]
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in res.get("cpu_flags", []))
    out += [
        f"- CPU flags that matter here: {flags or '?'}",
        f"- Model: {res['gguf']['file']} ({res['gguf']['mib']:.0f} MiB)",
    ]
    out += [f"- Load: chat completions of {MAX_TOKENS} tokens (EOS ignored, greedy), closed loop", ""]
    systems = res["systems"]
    levels = [r["clients"] for r in next(iter(systems.values()))["levels"]]
    head = ["clients"] + [f"{s} tok/s" for s in systems]
    rows = []
    for i, level in enumerate(levels):
        row = [str(level)] + [fmt(v["levels"][i]["rate"] * MAX_TOKENS, 1) for v in systems.values()]
        rows.append(row)
    out += ["## Output tokens/s", "", table(head, rows), ""]
    ratios = []
    for ours in ("genqueue", "genqueue-split"):
        if ours in systems and "llama.cpp" in systems:
            ratios.append([f"{ours} / llama.cpp"])
            for i in range(len(levels)):
                a, b = systems[ours]["levels"][i]["rate"], systems["llama.cpp"]["levels"][i]["rate"]
                ratios[-1].append(fmt(a / b if b else float("nan"), 2) + "x")
    if ratios:
        out += [table(["ratio"] + [str(lv) for lv in levels], ratios), ""]
    head = ["system", "TTFT (1 client: same question, new question)", "p50 latency at each level", "resident memory"]
    rows = [
        [
            s,
            f"{v['ttft_s']:.3f} s, " + (f"{v['ttft_new_s']:.3f} s" if "ttft_new_s" in v else "?"),
            ", ".join(f"{r['p50']:.2f} s" for r in v["levels"]),
            f"{v['rss_gib']:.2f} GiB",
        ]
        for s, v in systems.items()
    ]
    out += ["## Latency and memory", "", table(head, rows), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = parser("bench.size", __doc__, levels="1,8,32", out="benchmarks-size.md", render=True, model=False)
    ap.add_argument("--gguf", choices=tuple(ggufmodels.MODELS), default="qwen05", help="the GGUF file")
    ap.add_argument(
        "--systems", default="genqueue,genqueue-split,llama.cpp,genqueue-hf", help=f"among {', '.join(SYSTEMS)}"
    )
    args = ap.parse_args(argv)
    args.ap = ap

    def run():
        from worker.engines.dtype import cpu_flags

        return run_bench(
            "bench.size",
            args,
            argv,
            lambda procs, res, outdir: measure(args, procs, res, outdir),
            cpu_flags=sorted(cpu_flags()),
        )

    return main_with_render(args, run, render, INTRO, MARKER)


if __name__ == "__main__":
    sys.exit(main())
