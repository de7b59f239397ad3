"""`python -m bench.embed`: sentences/s of an embedding model through the whole queue (8 clients
each sending requests of 32 inputs to POST /v1/embeddings: the API, Redis, one embed-engine
worker) against sentence-transformers' own `encode` in one process (batches of 64) and, with
`--vllm`, vLLM's pooling server on the same checkpoint (`--runner pooling`, the same clients on
its /v1/embeddings), the same sentences, in the same run, the systems alternating within each
round (issue 44's goals: >= 0.8x encode, >= 1.2x vLLM). Every server's vectors are checked
against encode's first (cosine >= 0.999). Prints a markdown table and writes
bench/out/embed.json. Quick run: `python -m bench.embed --rounds 1 --requests 2`.

`--batch-lines N` measures a Batch API run instead: N `/v1/embeddings` lines of one input
each through a private Redis, the API and one embed worker: wall time, lines/s, Redis memory
(`INFO memory` before, after, and its peak) and the API's and worker's peak RSS; the output
file is checked (N lines, every custom_id once, some vectors against encode's). Writes
bench/out/embed-batch.json.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import shlex
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import redis as redislib
import requests

from bench.common import machine_facts, stop_on_signals
from scripts import embedmodels
from scripts import stack as stackmod

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "bench" / "out"
WORDS = (
    "the a queue worker model vector search index passage query document team builds corpus retrieval "
    "answer question embed sentence meaning close far river stone lamp bright cold number seven under "
    "quiet over batch token forward padding length sorted budget redis celery job record result backend"
).split()
MIN_COSINE = 0.999
CHECKED = 64  # sentences whose vectors each server must match encode's on
VLLM_KV_CACHE_GIB = "1"  # as bench.vllm: vLLM's CPU backend reserves this much at start


def sentences(n: int, seed: int = 0) -> list[str]:
    """`n` sentences of 6 to 40 words (about 8-50 tokens), reproducible."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))).capitalize() + "." for _ in range(n)]


class Encoder:
    """sentence-transformers' own encode, in this process."""

    def __init__(self, model_dir: Path, batch: int, threads: int, dtype: str = "float32"):
        import torch
        from sentence_transformers import SentenceTransformer

        if threads:
            torch.set_num_threads(threads)
        self.batch = batch
        self.st = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
        self.st.to(getattr(torch, dtype))

    def vectors(self, texts: list[str]) -> np.ndarray:
        return self.st.encode(texts, batch_size=self.batch)

    def rate(self, texts: list[str]) -> float:
        """sentences/s of encode over `texts`."""
        t0 = time.perf_counter()
        self.vectors(texts)
        return len(texts) / (time.perf_counter() - t0)


def decode(item: dict) -> np.ndarray:
    emb = item["embedding"]
    if isinstance(emb, str):
        return np.frombuffer(base64.b64decode(emb), dtype=np.float32)
    return np.asarray(emb, dtype=np.float32)


def cosines(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))


def check_vectors(base: str, model: str, texts: list[str], ref: np.ndarray, fmt: str, what: str) -> float:
    """The lowest cosine between the server's vectors for `texts` and encode's; exits below MIN_COSINE."""
    resp = requests.post(
        f"{base}/v1/embeddings", json={"model": model, "input": texts, "encoding_format": fmt}, timeout=600
    )
    resp.raise_for_status()
    data = sorted(resp.json()["data"], key=lambda d: d["index"])
    got = np.stack([decode(d) for d in data])
    if got.shape != ref.shape:
        raise SystemExit(f"{what}: vectors of shape {got.shape}, encode's {ref.shape}")
    low = float(cosines(got, ref).min())
    if low < MIN_COSINE:
        raise SystemExit(f"{what}: a vector's cosine with encode's is {low:.6f} < {MIN_COSINE}")
    return low


def through_api(base: str, model: str, texts: list[str], clients: int, per_request: int, fmt: str) -> float:
    """sentences/s of `clients` threads sending `texts` in requests of `per_request` inputs,
    the vectors asked for as `fmt` (base64: what OpenAI's Python client asks for)."""
    chunks = [texts[i : i + per_request] for i in range(0, len(texts), per_request)]
    lock, errors = threading.Lock(), []

    def client(k: int) -> None:
        with requests.Session() as http:
            for chunk in chunks[k::clients]:
                resp = http.post(
                    f"{base}/v1/embeddings", json={"model": model, "input": chunk, "encoding_format": fmt}, timeout=600
                )
                if resp.status_code != 200:
                    with lock:
                        errors.append(resp.text[:300])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[0]}")
    return len(texts) / elapsed


def start_genqueue(model_dir: Path, name: str, args, procs: list, redis_url: str) -> str:
    """The API and one embed worker on `redis_url`, appended to `procs`; their base URL once ready."""
    port = stackmod.free_port()
    env = {
        "REDIS_URL": redis_url,
        "GENQ_MODEL": str(model_dir),
        "GENQ_MODEL_NAME": name,
        "GENQ_PORT": str(port),
        "GENQ_HOST": "127.0.0.1",
        "GENQ_TORCH_THREADS": str(args.threads),
        "GENQ_DTYPE": args.dtype,
    }
    base = f"http://127.0.0.1:{port}"
    procs.append(stackmod.Proc("api", stackmod.api_argv(), env, LOGS / "embed-api.log"))
    wenv = {**env, **dict(kv.split("=", 1) for kv in args.worker_env)}
    procs.append(stackmod.Proc("worker", stackmod.worker_argv("hf"), wenv, LOGS / "embed-worker.log"))
    stackmod.wait_until(
        lambda: requests.get(f"{base}/readyz", timeout=5).status_code == 200, 300, "a ready worker", procs
    )
    time.sleep(2)  # every API process's list of live workers (cached for a second) has it
    return base


def vllm_argv(model_dir: Path, port: int, dtype: str = "float32") -> list[str]:
    """vLLM's OpenAI server as bench.vllm starts it (eager), as a pooling model."""
    argv = [stackmod.worker_argv("vllm")[0], "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--runner", "pooling", "--enforce-eager", "--dtype", dtype, "--host", "127.0.0.1"]
    return argv + ["--port", str(port), "--disable-log-stats", "--disable-uvicorn-access-log"]


def start_vllm(
    model_dir: Path, procs: list, dtype: str = "float32", extra_env: dict[str, str] | None = None
) -> tuple[str, str, float, str]:
    """vLLM's pooling server, appended to `procs`: (base URL, its model id, start-up s, command)."""
    port = stackmod.free_port()
    argv = vllm_argv(model_dir, port, dtype)
    log = LOGS / "embed-vllm.log"
    log.unlink(missing_ok=True)
    t0 = time.monotonic()
    env = {"VLLM_CPU_KVCACHE_SPACE": VLLM_KV_CACHE_GIB, "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    proc = stackmod.Proc("vllm", argv, env, log)
    procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    try:
        stackmod.wait_until(lambda: stackmod.http_get(base + "/v1/models", timeout=5)[0] == 200, 600, "vLLM", [proc])
    except BaseException:
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        print(f"vLLM's pooling server did not start; the end of {log}:\n{tail}", flush=True)
        raise
    model = json.loads(stackmod.http_get(base + "/v1/models")[1])["data"][0]["id"]
    cmd = " ".join(f"{k}={v}" for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", **(extra_env or {})}.items())
    cmd += " python " + shlex.join("PORT" if x == str(port) else x for x in argv[1:])
    return base, model, time.monotonic() - t0, cmd


def compare(args, model_dir: Path, texts: list[str]) -> dict:
    enc = Encoder(model_dir, args.batch, args.threads, args.dtype)
    enc.vectors(texts[: args.batch])  # warm up
    ref = enc.vectors(texts[:CHECKED])
    redis = stackmod.PrivateRedis()
    procs: list[stackmod.Proc] = []
    name = f"bench-{args.model}"
    LOGS.mkdir(parents=True, exist_ok=True)
    systems: dict[str, dict] = {"encode": {}}
    try:
        gq = start_genqueue(model_dir, name, args, procs, redis.url)
        systems["genqueue"] = {"base": gq, "model": name}
        if args.vllm:
            venv = dict(kv.split("=", 1) for kv in args.vllm_env)
            vbase, vmodel, startup, cmd = start_vllm(model_dir, procs, args.dtype, venv)
            systems["vllm"] = {"base": vbase, "model": vmodel, "startup_s": startup, "command": cmd}
            print(f"vLLM's pooling server ready after {startup:.0f} s", flush=True)
        warm = texts[: args.clients * args.inputs]
        for kind, s in systems.items():
            if kind == "encode":
                continue
            s["min_cosine"] = check_vectors(s["base"], s["model"], texts[:CHECKED], ref, args.encoding_format, kind)
            print(f"{kind}: vectors match encode's (lowest cosine {s['min_cosine']:.6f})", flush=True)
            through_api(s["base"], s["model"], warm, args.clients, args.inputs, args.encoding_format)  # warm up
        order = list(systems)
        rounds = []
        for r in range(args.rounds):
            row: dict[str, float] = {}
            for kind in order[r % len(order) :] + order[: r % len(order)]:  # each round starts elsewhere
                if kind == "encode":
                    row[kind] = enc.rate(texts)
                else:
                    s = systems[kind]
                    row[kind] = through_api(
                        s["base"], s["model"], texts, args.clients, args.inputs, args.encoding_format
                    )
                print(f"round {r + 1}, {kind}: {row[kind]:.1f} sentences/s", flush=True)
            row["load"] = round(psutil.getloadavg()[0], 2)
            rounds.append(row)
    finally:
        for proc in reversed(procs):
            proc.stop()
        redis.stop()
    med = {k: statistics.median(row[k] for row in rounds) for k in systems}
    res = {
        "model": args.model,
        "sentences": len(texts),
        "clients": args.clients,
        "inputs_per_request": args.inputs,
        "encode_batch": args.batch,
        "encoding_format": args.encoding_format,
        "rounds": rounds,
        "median": med,
        "ratio": med["genqueue"] / med["encode"],
        "round_ratios": [row["genqueue"] / row["encode"] for row in rounds],
        "systems": {k: {x: v for x, v in s.items() if x != "base"} for k, s in systems.items()},
        "machine": machine_facts(),
        "worker_env": args.worker_env,
        "threads": args.threads,
        "dtype": args.dtype,
        "vllm_env": args.vllm_env,
    }
    if args.vllm:
        res["vllm_ratio"] = med["genqueue"] / med["vllm"]
        res["vllm_round_ratios"] = [row["genqueue"] / row["vllm"] for row in rounds]
    (LOGS / "embed.json").write_text(json.dumps(res, indent=2))
    print_compare(res)
    return res


def print_compare(res: dict) -> None:
    vllm = "vllm" in res["median"]
    med, rounds = res["median"], res["rounds"]

    def cell(kind: str) -> str:
        return f"{med[kind]:.1f} ({', '.join(f'{row[kind]:.1f}' for row in rounds)})"

    head = f"| model | through the API, {res['clients']} clients x {res['inputs_per_request']} inputs ({res['encoding_format']})"
    head += f" | encode, batch {res['encode_batch']} | ratio |"
    line = f"| {res['model']} | {cell('genqueue')} sentences/s | {cell('encode')} sentences/s | {res['ratio']:.2f}x |"
    if vllm:
        head += " vLLM pooling server | genqueue / vLLM |"
        line += f" {cell('vllm')} sentences/s | {res['vllm_ratio']:.2f}x |"
    print("\n" + head)
    print("|" + "---|" * head.count(" | ") + "---|")
    print(line)
    per_round = ", ".join(f"{x:.2f}" for x in res["round_ratios"])
    print(f"\nper round, genqueue / encode: {per_round}")
    if vllm:
        print(f"per round, genqueue / vLLM: {', '.join(f'{x:.2f}' for x in res['vllm_round_ratios'])}")


class Peaks(threading.Thread):
    """Samples, every `every` s until stopped, the RSS of each named process tree and Redis's
    used_memory, keeping each one's peak."""

    def __init__(self, pids: dict[str, int], r: redislib.Redis, every: float = 0.5):
        super().__init__(daemon=True)
        self.pids, self.r, self.every = pids, r, every
        self.peak: dict[str, int] = dict.fromkeys([*pids, "redis_used_memory"], 0)
        self.done = threading.Event()

    def sample(self) -> None:
        for name, pid in self.pids.items():
            try:
                root = psutil.Process(pid)
                rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
            except psutil.Error:
                continue
            self.peak[name] = max(self.peak[name], rss)
        mem = self.r.info("memory")["used_memory"]
        self.peak["redis_used_memory"] = max(self.peak["redis_used_memory"], mem)

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.sample()


def redis_memory(r: redislib.Redis) -> dict:
    info = r.info("memory")
    return {k: info[k] for k in ("used_memory", "used_memory_peak", "used_memory_rss")} | {"keys": r.dbsize()}


def batch_run(args, model_dir: Path) -> dict:
    """A Batch API run of `args.batch_lines` embeddings lines, one input each."""
    n = args.batch_lines
    texts = sentences(n, seed=1)
    redis = stackmod.PrivateRedis()
    procs: list[stackmod.Proc] = []
    name = f"bench-{args.model}"
    LOGS.mkdir(parents=True, exist_ok=True)
    r = redislib.Redis.from_url(redis.url)
    body_extra = {} if args.batch_format == "float" else {"encoding_format": args.batch_format}
    lines = "".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": name, "input": t, **body_extra},
            }
        )
        + "\n"
        for i, t in enumerate(texts)
    ).encode()
    res: dict = {"model": args.model, "lines": n, "input_bytes": len(lines), "format": args.batch_format}
    try:
        base = start_genqueue(model_dir, name, args, procs, redis.url)
        api, worker = procs
        res["redis_before"] = redis_memory(r)
        peaks = Peaks({"api_rss": api.pid, "worker_rss": worker.pid}, r)
        peaks.sample()
        res["rss_before"] = dict(peaks.peak)
        peaks.start()
        t_up = time.perf_counter()
        up = requests.post(f"{base}/v1/files", files={"file": ("in.jsonl", lines)}, data={"purpose": "batch"})
        up.raise_for_status()
        res["upload_s"] = time.perf_counter() - t_up
        del lines
        t0 = time.perf_counter()
        batch = requests.post(
            f"{base}/v1/batches",
            json={"input_file_id": up.json()["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"},
        ).json()
        last = 0.0
        while batch.get("status") not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(1)
            batch = requests.get(f"{base}/v1/batches/{batch['id']}", timeout=60).json()
            if time.perf_counter() - last > 60:
                last = time.perf_counter()
                counts = batch.get("request_counts") or {}
                print(f"{time.perf_counter() - t0:.0f} s: {batch.get('status')} {counts}", flush=True)
        wall = time.perf_counter() - t0
        peaks.done.set()
        peaks.join()
        peaks.sample()
        res |= {"status": batch["status"], "request_counts": batch.get("request_counts"), "wall_s": wall}
        res |= {"lines_per_s": n / wall, "peaks": peaks.peak, "redis_after": redis_memory(r)}
        res["batch"] = {k: batch.get(k) for k in ("created_at", "in_progress_at", "finalizing_at", "completed_at")}
        if batch["status"] != "completed":
            raise SystemExit(f"the batch ended {batch['status']}: {batch}")
        res["check"] = check_output(base, batch, texts, model_dir, args)
    finally:
        for proc in reversed(procs):
            proc.stop()
        redis.stop()
    res["machine"] = machine_facts()
    (LOGS / "embed-batch.json").write_text(json.dumps(res, indent=2))
    print_batch(res)
    return res


def check_output(base: str, batch: dict, texts: list[str], model_dir: Path, args) -> dict:
    """The output file has one line per input line, each custom_id once, a 200 each; some
    vectors (every 1000th line and 20 random ones) equal encode's."""
    n = len(texts)
    rng = random.Random(7)
    spot = set(range(0, n, max(1, n // 100))) | {rng.randrange(n) for _ in range(20)}
    seen = bytearray(n)
    got: dict[int, np.ndarray] = {}
    count = bad = 0
    t0 = time.perf_counter()
    with requests.get(f"{base}/v1/files/{batch['output_file_id']}/content", stream=True, timeout=600) as resp:
        resp.raise_for_status()
        for raw in resp.iter_lines():
            if not raw:
                continue
            count += 1
            line = json.loads(raw)
            i = int(line["custom_id"].removeprefix("line-"))
            if seen[i] or line["error"] is not None or line["response"]["status_code"] != 200:
                bad += 1
            seen[i] = 1
            if i in spot:
                got[i] = decode(line["response"]["body"]["data"][0])
    read_s = time.perf_counter() - t0
    missing = n - sum(seen)
    enc = Encoder(model_dir, args.batch, args.threads, args.dtype)
    idx = sorted(got)
    low = float(cosines(np.stack([got[i] for i in idx]), enc.vectors([texts[i] for i in idx])).min()) if idx else 0.0
    out = {"lines": count, "missing": missing, "bad": bad, "spot_checked": len(idx), "min_cosine": low}
    out["read_s"] = read_s
    print(f"output: {out}", flush=True)
    if count != n or missing or bad or low < MIN_COSINE or len(idx) != len(spot):
        raise SystemExit(f"the output file is wrong: {out}")
    return out


def print_batch(res: dict) -> None:
    mib = 2**20
    pk, rb, ra = res["peaks"], res["redis_before"], res["redis_after"]
    print(
        "\n| model | lines | wall time | lines/s | Redis used_memory before / after | Redis used_memory_peak "
        "before / after | API RSS before / peak | worker RSS before / peak |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {res['model']} | {res['lines']} | {res['wall_s']:.0f} s | {res['lines_per_s']:.1f} | "
        f"{rb['used_memory'] / mib:.1f} / {ra['used_memory'] / mib:.1f} MiB | "
        f"{rb['used_memory_peak'] / mib:.1f} / {ra['used_memory_peak'] / mib:.1f} MiB | "
        f"{res['rss_before']['api_rss'] / mib:.0f} / {pk['api_rss'] / mib:.0f} MiB | "
        f"{res['rss_before']['worker_rss'] / mib:.0f} / {pk['worker_rss'] / mib:.0f} MiB |"
    )
    print(f"Redis keys before / after: {rb['keys']} / {ra['keys']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.embed", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="minilm", choices=sorted(embedmodels.MODELS))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--inputs", type=int, default=32, help="inputs per request")
    ap.add_argument("--requests", type=int, default=8, help="requests per client and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--encoding-format", default="base64", choices=["base64", "float"])
    ap.add_argument("--batch", type=int, default=64, help="encode's batch size")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads of encode and of the worker alike (0: torch's default)"
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the weights' dtype in every system alike (encode, genqueue's GENQ_DTYPE, vLLM's --dtype)",
    )
    ap.add_argument("--worker-env", action="append", default=[], metavar="K=V", help="an extra worker setting")
    ap.add_argument(
        "--vllm", action="store_true", help="also vLLM's pooling server (.venv-vllm) on the same checkpoint"
    )
    ap.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="K=V",
        help="an extra setting of vLLM's server (VLLM_CPU_OMP_THREADS_BIND=0-1: its engine on both cores)",
    )
    ap.add_argument("--batch-lines", type=int, default=0, help="measure a Batch API run of this many lines instead")
    ap.add_argument(
        "--batch-format",
        default="float",
        choices=["float", "base64"],
        help="the lines' encoding_format (float: none given, OpenAI's default)",
    )
    args = ap.parse_args(argv)
    stop_on_signals()  # SIGTERM stops the stack below, as Ctrl-C does
    model_dir = embedmodels.ensure(args.model)
    if args.batch_lines:
        batch_run(args, model_dir)
        return 0
    compare(args, model_dir, sentences(args.clients * args.inputs * args.requests))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
