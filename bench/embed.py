"""`python -m bench.embed`: sentences/s of an embedding model through the whole queue (8 clients
each sending requests of 32 inputs to POST /v1/embeddings: the API, Redis, one embed-engine
worker) against sentence-transformers' own `encode` in one process (batches of 64), the same
sentences, in the same run (issue 44's goal: >= 0.8x). Prints a markdown table and writes
bench/out/embed.json. Quick run: `python -m bench.embed --rounds 1 --requests 2`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

import requests

from bench.common import machine_facts, stop_on_signals
from scripts import embedmodels
from scripts import stack as stackmod

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "the a queue worker model vector search index passage query document team builds corpus retrieval "
    "answer question embed sentence meaning close far river stone lamp bright cold number seven under "
    "quiet over batch token forward padding length sorted budget redis celery job record result backend"
).split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """`n` sentences of 6 to 40 words (about 8-50 tokens), reproducible."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))).capitalize() + "." for _ in range(n)]


def in_process(model_dir: Path, texts: list[str], batch: int, rounds: int, threads: int) -> list[float]:
    """sentences/s of SentenceTransformer.encode over `texts`, each round."""
    import torch
    from sentence_transformers import SentenceTransformer

    if threads:
        torch.set_num_threads(threads)

    st = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    st.encode(texts[:batch], batch_size=batch)  # warm up
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        st.encode(texts, batch_size=batch)
        rates.append(len(texts) / (time.perf_counter() - t0))
    del st
    return rates


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
    ap.add_argument("--worker-env", action="append", default=[], metavar="K=V", help="an extra worker setting")
    args = ap.parse_args(argv)
    stop_on_signals()  # SIGTERM stops the stack below, as Ctrl-C does
    model_dir = embedmodels.ensure(args.model)
    texts = sentences(args.clients * args.inputs * args.requests)

    st_rates = in_process(model_dir, texts, args.batch, args.rounds, args.threads)
    print(f"encode: {[round(r, 1) for r in st_rates]} sentences/s", flush=True)

    redis = stackmod.PrivateRedis()
    procs: list[stackmod.Proc] = []
    name = f"bench-{args.model}"
    port = stackmod.free_port()
    env = {
        "REDIS_URL": redis.url,
        "GENQ_MODEL": str(model_dir),
        "GENQ_MODEL_NAME": name,
        "GENQ_PORT": str(port),
        "GENQ_HOST": "127.0.0.1",
        "GENQ_TORCH_THREADS": str(args.threads),
    }
    logs = ROOT / "bench" / "out"
    logs.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{port}"
    try:
        procs.append(stackmod.Proc("api", stackmod.api_argv(), env, logs / "embed-api.log"))
        wenv = {**env, **dict(kv.split("=", 1) for kv in args.worker_env)}
        procs.append(stackmod.Proc("worker", stackmod.worker_argv("hf"), wenv, logs / "embed-worker.log"))
        stackmod.wait_until(
            lambda: requests.get(f"{base}/readyz", timeout=5).status_code == 200, 300, "a ready worker", procs
        )
        time.sleep(2)  # every API process's list of live workers (cached for a second) has it
        through_api(
            base, name, texts[: args.clients * args.inputs], args.clients, args.inputs, args.encoding_format
        )  # warm up
        api_rates = []
        for _ in range(args.rounds):
            api_rates.append(through_api(base, name, texts, args.clients, args.inputs, args.encoding_format))
            print(f"API: {round(api_rates[-1], 1)} sentences/s", flush=True)
    finally:
        for proc in reversed(procs):
            proc.stop()
        redis.stop()

    res = {
        "model": args.model,
        "sentences": len(texts),
        "clients": args.clients,
        "inputs_per_request": args.inputs,
        "encode_batch": args.batch,
        "encoding_format": args.encoding_format,
        "encode_sentences_per_s": st_rates,
        "api_sentences_per_s": api_rates,
        "ratio": statistics.median(api_rates) / statistics.median(st_rates),
        "machine": machine_facts(),
        "worker_env": args.worker_env,
        "threads": args.threads,
    }
    (logs / "embed.json").write_text(json.dumps(res, indent=2))
    print(
        f"\n| model | through the API, {args.clients} clients x {args.inputs} inputs ({args.encoding_format}) "
        f"| encode, batch {args.batch} | ratio |"
    )
    print("|---|---|---|---|")
    print(
        f"| {args.model} | {statistics.median(api_rates):.1f} sentences/s | "
        f"{statistics.median(st_rates):.1f} sentences/s | {res['ratio']:.2f}x |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
