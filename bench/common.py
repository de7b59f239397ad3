"""What every benchmark shares: prompts, statistics, CPU meters, the processes it starts (Redis,
an API and its workers), the page's helpers and `main`'s scaffolding (signals, bench/out/,
results.json, the page below its marker line). The HTTP load driver is bench/load.py; the
methods are described in docs/benchmarks.md, "The harnesses"."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import redis

from scripts import stack

ROOT = Path(__file__).resolve().parent.parent

#: Every request asks for exactly this many tokens (EOS is ignored), so tokens/s = 32 x req/s.
MAX_NEW_TOKENS = 32

#: Varied short prompts: 8-12 tokens each (BOS included) with the opt-125m dev tokenizer.
PROMPTS = (
    "Hello, my name is John and I work as a|The capital of France is a city that|def fibonacci(n): return the|"
    "Once upon a time, in a land far away|In 2050, computers will be able to|import os and sys, then read the file|"
    "The quick brown fox jumps over the lazy dog|My favourite recipe for soup is made with|Redis is an in-memory data "
    "store used for|The best way to learn a new language is|Write a short poem about the sea and|Explain how a queue "
    "works in simple terms|The weather today is cold, so I will|A good cup of coffee needs fresh beans and|class "
    "Parser: parse the input and return|Three things every programmer should know:"
).split("|")


def prompt(i: int) -> str:
    return PROMPTS[i % len(PROMPTS)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def pcts(values: list[float], prefix: str = "", qs=(50, 90, 99)) -> dict[str, float]:
    """{`prefix`p50: ..., `prefix`p90: ...} of `values`."""
    return {f"{prefix}p{q}": percentile(values, q) for q in qs}


def median(values: list[float]) -> float:
    return percentile(values, 50)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def system_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (f + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(ours: Callable[[], float], max_other: float, timeout: float, log=None, settle: float = 2.0) -> bool:
    """Wait until processes other than ours (`ours()`: their CPU seconds) have used at most
    `max_other` cores for `settle` seconds in a row, or `timeout` seconds have passed.
    Returns whether it got quiet. On a shared machine this keeps a burst of someone else's
    work out of a measurement instead of merely reporting it."""
    if timeout <= 0:
        return False
    deadline = time.monotonic() + timeout
    quiet_since, told = None, False
    meter = OtherLoad(ours)
    while True:
        time.sleep(0.5)
        other, t1 = meter(), time.monotonic()
        meter.restart()
        if other <= max_other:
            quiet_since = quiet_since or t1
            if t1 - quiet_since >= settle:
                return True
        else:
            quiet_since = None
            if log and not told:
                log(f"  other processes use {other:.2f} cores: waiting up to {timeout:g} s for a quiet machine")
                told = True
        if t1 >= deadline:
            if log:
                log("  the machine did not get quiet; measuring anyway")
            return False


# -- logging and CPU --------------------------------------------------------------------------


def make_log(tag: str) -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


log = make_log("bench")


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def tree(pid: int | None) -> list:
    """The process and all its descendants (psutil.Process objects); [] if it is gone."""
    if not pid:
        return []
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return []


def cpu_s(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def tree_cpu_s(pid: int | None) -> float:
    return cpu_s(tree(pid)) if pid else math.nan


class OtherLoad:
    """What processes other than ours (`ours()`: their CPU seconds) used since `restart()`:
    `seconds()` of CPU, or as a call, cores."""

    def __init__(self, ours: Callable[[], float] = own_cpu_s):
        self.ours = ours
        self.restart()

    def restart(self) -> None:
        self.b0, self.o0, self.t0 = system_busy_s(), self.ours(), time.monotonic()

    def seconds(self) -> float:
        return max(0.0, (system_busy_s() - self.b0) - (self.ours() - self.o0))

    def __call__(self) -> float:
        wall = time.monotonic() - self.t0
        return self.seconds() / wall if wall > 0 else math.nan


class CpuMeter:
    """CPU of named groups of processes (and of the rest of the machine) over a window, in
    cores; use as `on_window` of bench.load.closed_loop. A group is a pid (its process tree,
    looked up at each sample), a list of pids, or a callable returning psutil processes (called
    once as the window opens: each process counted once, e.g. a tree split in parts).
    `other` is what processes outside the groups and this one used meanwhile."""

    def __init__(self, groups: dict):
        self.groups, self.procs, self.start, self.result = groups, {}, {}, {}

    def _cpu(self, name) -> float:
        g = self.groups[name]
        if callable(g):
            return cpu_s(self.procs[name])
        pids = g if isinstance(g, (list, tuple)) else [g]
        return sum(tree_cpu_s(p) for p in pids if p) if any(pids) else math.nan

    def _sample(self) -> dict[str, float]:
        s = {name: self._cpu(name) for name in self.groups}
        s["client"] = own_cpu_s()
        s["_system"], s["_t"] = system_busy_s(), time.monotonic()
        return s

    def __call__(self, event: str) -> None:
        if event == "start":
            self.procs = {n: g() if callable(g) else None for n, g in self.groups.items()}
            self.start = self._sample()
            return
        end = self._sample()
        d = {k: end[k] - self.start[k] for k in end}
        wall, system = d.pop("_t"), d.pop("_system")
        ours = sum(v for v in d.values() if not math.isnan(v))
        d["other"] = max(0.0, system - ours)
        self.result = {k: v / wall for k, v in d.items()}
        self.result["_wall"] = wall
        self.result["_cpu_s"] = d


def quietest(attempt: Callable[[], dict], args, pids=(), log: Callable[[str], None] = log) -> dict:
    """Wait for a quiet machine (at most --quiet-wait s, where the benchmark has it), run
    `attempt`; again (up to --retries times) while the rest of the machine used more than
    --max-other-load cores during it; keep the quietest run. `pids`: our process trees, whose
    CPU is not "other"."""

    def ours() -> float:
        return own_cpu_s() + sum(tree_cpu_s(p) for p in pids if p)

    runs = []
    for i in range(1 + args.retries):
        wait_for_quiet(ours, args.max_other_load, getattr(args, "quiet_wait", 0.0), log)
        runs.append(attempt())
        if runs[-1]["cpu"].get("other", 0.0) <= args.max_other_load:
            break
        if i < args.retries:
            log(f"  other load above {args.max_other_load:g} cores: measuring again")
    best = min(runs, key=lambda x: x["cpu"].get("other", 0.0))
    best["attempts"] = len(runs)
    best["noisy"] = best["cpu"].get("other", 0.0) > args.max_other_load
    return best


# -- processes --------------------------------------------------------------------------------


class Processes:
    """Everything a benchmark starts, stopped in reverse order by `close()`."""

    def __init__(self, logdir: Path, log: Callable[[str], None] = log):
        self.logdir, self.log, self.items = logdir, log, []

    def add(self, item, first: bool = False):
        """Stop `item` with the rest (`first`: after them all, e.g. the Redis they use)."""
        self.items.insert(0 if first else len(self.items), item)
        return item

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None):
        return self.add(stack.Proc(name, argv, env, self.logdir / f"{name}.log"))

    def redis(self):
        return self.add(stack.PrivateRedis())

    def stop(self, item) -> None:
        item.stop()
        if item in self.items:
            self.items.remove(item)

    def run(self, name: str, argv: list[str], poll: float = 0.1):
        """Start a process, wait for it to exit, raise if it failed."""
        p = self.start(name, argv)
        while p.alive():
            time.sleep(poll)
        self.stop(p)
        if p.popen.returncode != 0:
            raise RuntimeError(f"{name} failed ({p.popen.returncode}):\n{p.tail()}")
        return p

    def close(self) -> bool:
        """Stop everything. SIGINT/SIGTERM arriving meanwhile do not cut this short (that would
        leave children running in their own sessions); returns whether one arrived."""
        got: list[int] = []
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
        try:
            while self.items:
                item = self.items.pop()
                try:
                    item.stop()
                except Exception as exc:  # keep stopping the rest
                    self.log(f"stopping {getattr(item, 'name', item)} failed: {exc!r}")
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        return bool(got)


class RedisTarget:
    """REDIS_URL when it answers, else a private redis-server of the benchmark's own."""

    def __init__(self, procs: Processes, private: bool = False):
        url = os.environ.get("REDIS_URL")
        self.proc = None
        if not private and stack.redis_answers(url):
            self.url, self.pid, self.kind = url, None, "REDIS_URL"
        else:
            self.proc = procs.redis()
            self.url, self.pid, self.kind = self.proc.url, self.proc.proc.pid, "private redis-server"
        self.version = redis_version(self.url)


def redis_version(url: str) -> str:
    try:
        return redis.Redis.from_url(url).info("server").get("redis_version", "?")
    except redis.RedisError:
        return "?"


class Stack:
    """An API and its workers serving a model name of their own (own queue); `env`: more
    environment for both."""

    def __init__(self, procs: Processes, redis_url: str, model_dir, engine: str, label: str, batch: int = 64, **env):
        self.procs, self.engine, self.label = procs, engine, label
        self.name = f"bench-{label}-{uuid.uuid4().hex[:6]}"
        self.env = {"REDIS_URL": redis_url, "GENQ_MODEL": str(model_dir), "GENQ_MODEL_NAME": self.name}
        self.env |= {"GENQ_HOST": "127.0.0.1", "GENQ_MAX_BATCH_SIZE": str(batch), "GENQ_ENGINE": engine, **env}
        self.workers: list = []
        self.started, self.api, self.port = 0, None, 0  # started: workers so far (each logs to a file of its own)

    @property
    def worker(self):
        return self.workers[0] if self.workers else None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_worker(self, **env: str):
        n, self.started = self.started, self.started + 1
        w = self.procs.start(f"{self.label}-worker{n or ''}", stack.worker_argv(self.engine), {**self.env, **env})
        self.workers.append(w)
        return w

    def start_api(self, api_workers: int, ready_workers: int = 1, what: str = "a ready worker") -> None:
        self.port = stack.free_port()
        env = {**self.env, "GENQ_PORT": str(self.port), "GENQ_API_WORKERS": str(api_workers)}
        self.api = self.procs.start(f"{self.label}-api{api_workers}", stack.api_argv(), env)
        up = lambda: stack.http_get(self.base + "/healthz")[0] == 200  # noqa: E731
        stack.wait_until(up, 60, "the API", [self.api, *self.workers])
        if ready_workers:
            self.wait_ready(ready_workers, what)

    def wait_ready(self, n: int = 1, what: str = "a ready worker", timeout: float = 600) -> None:
        """Until the API's /readyz counts at least `n` live workers."""

        def ready() -> bool:
            code, body = stack.http_get(self.base + "/readyz")
            return code == 200 and len(json.loads(body).get("workers", [None])) >= n

        stack.wait_until(ready, timeout, what, [self.api, *self.workers])

    def stop_api(self) -> None:
        if self.api:
            self.procs.stop(self.api)
            self.api = None

    def stop(self) -> None:
        self.stop_api()
        while self.workers:
            self.procs.stop(self.workers.pop())


def job_stats(r, model: str, t0: float, t1: float) -> dict:
    """Queue wait, run time and batch size of this model's jobs that finished in [t0, t1]."""
    from tasks import keys
    from tasks.jobs import DONE_RESULT

    prefix = keys.job("")
    ids = [k[len(prefix) :] for k in r.scan_iter(keys.job("*"), count=1000, _type="hash")]
    pipe = r.pipeline(transaction=False)
    for i in ids:
        pipe.hmget(keys.job(i), "model", "status", "created", "started", "finished")
    picked = []
    for i, (m, status, created, started, finished) in zip(ids, pipe.execute()):
        if m == model and status == "succeeded" and started and finished and t0 <= float(finished) <= t1:
            picked.append((i, float(created), float(started), float(finished)))
    batches = []
    if picked:
        for i, *_ in picked:
            pipe.xrevrange(keys.done(i), count=1)
        for done in pipe.execute():
            try:
                batches.append(json.loads(done[0][1][DONE_RESULT])["result"]["batch_size"])
            except (TypeError, ValueError, KeyError):
                pass
    queued = [s - c for _, c, s, _ in picked]
    out = {"jobs": len(picked), "queued_s": mean(queued), "queued_p50_s": median(queued)}
    out |= {"run_s": mean(f - s for _, _, s, f in picked), "total_s": mean(f - c for _, c, _, f in picked)}
    return out | {"batch_size_mean": mean(batches), "batch_size_max": max(batches, default=math.nan)}


# -- the report -------------------------------------------------------------------------------


def fmt(x, nd: int = 2, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{nd}f}{unit}"


def ms(x, nd: int = 1) -> str:
    return fmt(x * 1000 if x is not None else None, nd)


def noise(r: dict) -> str:
    """The "other load" cell: cores used outside the benchmark, tries, `!` if still above."""
    s = fmt(r["cpu"].get("other"))
    if r.get("attempts", 1) > 1:
        s += f" ({r['attempts']} tries)"
    return s + (" !" if r.get("noisy") else "")


def table(headers: list[str] | str, rows: list[list]) -> str:
    """A Markdown table; `headers` a list, or one string with `|` between them."""
    headers = headers.split("|") if isinstance(headers, str) else headers
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def verdict(ok: bool, what: str) -> tuple[str, str]:
    return ("PASS" if ok else "FAIL", what)


def verdict_lines(title: str, verdicts: list[tuple[str, str]], none: str | None = None) -> list[str]:
    """A page's section of verdicts, one `- **PASS** what` line each; with `none` (what to say
    when there is no verdict) an overall line ends it."""
    out = ["", f"## {title}", "", *(f"- **{v}** {what}" for v, what in verdicts)]
    if none is not None and not verdicts:
        out.append(f"- None decided: {none}")
    elif none is not None:
        met = sum(v == "PASS" for v, _ in verdicts)
        failed = any(v == "FAIL" for v, _ in verdicts)
        out.append(f"- Overall: **{'FAIL' if failed else 'PASS'}** ({met} of {len(verdicts)} met)")
    return out


def marker(prog: str) -> str:
    """The line of a page below which `python -m prog` writes; what is above it is kept."""
    return f"<!-- generated by `python -m {prog}`: everything below this line is overwritten -->"


def intro(title: str, prog: str) -> str:
    """The head of a new page (an existing page keeps its own, above the marker)."""
    return f'# {title}\n\nWritten by `python -m {prog}`; docs/benchmarks.md, "The harnesses", says how it measures.\n'


def machine_facts() -> dict:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = {"nproc": nproc, "cpu_count": os.cpu_count(), "cpu_model": cpu_model}
    out |= {"ram_gib": psutil.virtual_memory().total / 2**30, "python": platform.python_version()}
    return out | {"kernel": platform.release(), "loadavg_start": os.getloadavg()}


def git_state() -> dict:
    """The commit measured and the code files that differ from it (the working tree is what runs)."""

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    status = git("status", "--porcelain", "--", "worker", "tasks", "webapp", "scripts", "bench").splitlines()
    dirty = [ln[3:] for ln in status if len(ln) > 3 and not ln.startswith("??")]
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or "?", "modified": dirty}


def run_lines(res: dict) -> list[str]:
    """The first lines of a page's "Run" section: command, date, code, machine."""
    m, g = res["machine"], res.get("git") or {"commit": "?", "modified": []}
    return [
        f"- Command: `{res['command']}`",
        f"- Date: {res['date']} (took {res['elapsed_s'] / 60:.1f} min); commit {g['commit']}"
        + (f", with uncommitted changes to {', '.join(g['modified'])}" if g["modified"] else ""),
        f"- Machine: {m['nproc']} CPUs (nproc), {m['cpu_model']}, {m['ram_gib']:.1f} GiB RAM, Linux {m['kernel']}; "
        f"load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at end "
        f"{', '.join(f'{x:.2f}' for x in res['loadavg_end'])}",
    ]


def write_doc(path: Path, intro: str, marker: str, generated: str) -> None:
    """Write `generated` (which starts with `marker`) below the hand-written part of the
    existing page (everything above the marker), or below `intro` for a new page."""
    if path.exists():
        old = path.read_text()
        if marker in old:
            intro = old.split(marker, 1)[0].rstrip() + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(intro + "\n" + generated)
    os.replace(tmp, path)


# -- main scaffolding -------------------------------------------------------------------------


MODELS = ("opt-125m", "tiny")
ARCHS = ("opt", "llama")


def checkpoint_dir(model: str, arch: str = "opt") -> Path:
    """Where the dev checkpoint of this size and architecture (scripts/devmodels.py) lives."""
    if arch == "opt":
        return stack.TINY_MODEL_DIR if model == "tiny" else ROOT / ".models" / model
    return ROOT / ".models" / (f"tiny-{arch}" if model == "tiny" else f"{arch}-{model.split('-')[-1]}-random")


def parser(
    prog: str,
    doc: str,
    *,
    levels: str | None = None,
    out: str | None = None,
    quiet_wait: bool = False,
    render: bool = False,
    model: bool = True,
    noise: bool = True,
) -> argparse.ArgumentParser:
    """The options benchmarks share; each option's help ends with its default."""
    ap = argparse.ArgumentParser(
        prog=f"python -m {prog}",
        description=doc.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    if model:
        ap.add_argument("--model", choices=MODELS, default="opt-125m", help="dev checkpoint to build and serve")
        ap.add_argument("--arch", choices=ARCHS, default="opt", help="its architecture (llama: a Llama of that size)")
    if levels is not None:
        ap.add_argument("--levels", default=levels, help="concurrent clients")
        ap.add_argument("--duration", type=float, default=20.0, help="seconds per level")
        ap.add_argument("--min-requests", type=int, default=3, help="requests each client completes per level")
    if noise:
        ap.add_argument(
            "--max-other-load", type=float, default=0.3, help="repeat a measurement when others used more cores"
        )
        ap.add_argument("--retries", type=int, default=2, help="repeats of a disturbed measurement")
    if quiet_wait:
        ap.add_argument(
            "--quiet-wait", type=float, default=90.0, help="seconds to wait for a quiet machine before each measurement"
        )
    if out is not None:
        ap.add_argument("--out", type=Path, default=ROOT / "docs" / out, help="the page to write")
        ap.add_argument("--no-write", action="store_true", help="print the report only")
    if render:
        ap.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="only write the page of an earlier run")
    return ap


def int_list(ap: argparse.ArgumentParser, text: str, what: str = "--levels") -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        ap.error(f"{what} takes comma-separated integers")
    if not values or min(values) < 1:
        ap.error(f"{what} needs positive integers")
    return values


def names(ap: argparse.ArgumentParser, text: str, choices, what: str) -> list[str]:
    """Comma-separated distinct names among `choices`, in the order given."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out or any(x not in choices for x in out) or len(set(out)) != len(out):
        ap.error(f"{what} takes distinct names among {', '.join(choices)}")
    return out


def module_argv(module: str, **flags) -> list[str]:
    """`python -m module --flag value ...` with this interpreter (`a_b=1`: `--a-b 1`)."""
    argv = [sys.executable, "-m", module]
    for k, v in flags.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt, even where a non-interactive shell started
    this in the background with SIGINT ignored; SIGHUP too unless the caller ignores it (nohup)."""
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _raise_interrupt)


def run_bench(prog: str, args, raw_argv: list[str] | None, measure, *, out_prefix="", log=log, **extra) -> dict | None:
    """What every benchmark's main does around its measurements: signals stop everything, an
    output folder bench/out/<prefix><timestamp>/ for logs and results.json, the run's facts
    (command, date, machine, arguments; with --model the checkpoint, built if needed), then
    `measure(procs, res, outdir)` fills `res`; whatever it started is stopped on every exit.
    Returns `res`, or None when interrupted."""
    raw_argv = sys.argv[1:] if raw_argv is None else raw_argv
    stop_on_signals()
    started = time.monotonic()
    outdir = ROOT / "bench" / "out" / f"{out_prefix}{time.strftime('%Y%m%d-%H%M%S')}"
    outdir.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "command": " ".join([f"python -m {prog}", *map(shlex.quote, raw_argv)]).replace(str(ROOT) + "/", ""),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_facts(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "git": git_state(),
        **extra,
    }
    if getattr(args, "model", None):
        from scripts import devmodels

        arch = getattr(args, "arch", "opt")
        log(f"checkpoint {args.model} ({arch}): building if needed")
        model_dir = devmodels.ensure(args.model, checkpoint_dir(args.model, arch), arch=arch)
        params = json.loads((model_dir / devmodels.MARKER_NAME).read_text()).get("parameters", 0)
        res.update(
            model=args.model, arch=arch, model_dir_abs=str(model_dir), model_dir=os.path.relpath(model_dir, ROOT)
        )
        res["params_m"] = params / 1e6
    procs = Processes(outdir, log)
    interrupted = False
    try:
        measure(procs, res, outdir)
    except KeyboardInterrupt:
        log("interrupted; stopping everything")
        interrupted = True
    finally:
        interrupted |= procs.close()  # a signal during the clean-up waits for its end
    if interrupted:
        return None
    res.update(loadavg_end=os.getloadavg(), elapsed_s=time.monotonic() - started, outdir=os.path.relpath(outdir, ROOT))
    (outdir / "results.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def publish(res: dict | None, args, render: Callable[[dict], str], intro: str, marker: str, log=log) -> int:
    """Print the page (the generated part below `marker`) and, unless --no-write, write it
    below the hand-written part of --out."""
    if res is None:
        return 130
    report = render(res).replace(str(ROOT) + "/", "")  # no machine's paths in the page
    print(intro + "\n" + report, flush=True)
    if not args.no_write:
        write_doc(args.out, intro, marker, report)
        log(f"wrote {args.out}")
    if "outdir" in res:
        log(f"raw results and logs in {res['outdir']}")
    return 0


def main_with_render(args, run: Callable[[], dict | None], render, intro: str, marker: str, log=log) -> int:
    """--render RESULTS_JSON: the report of an earlier run; else run and publish."""
    if getattr(args, "render", None):
        return publish(json.loads(args.render.read_text()), args, render, intro, marker, log)
    return publish(run(), args, render, intro, marker, log)
