"""Child processes that never outlive what started them: `Proc` (a child in a session of its
own, stopped with SIGTERM then SIGKILL, killed with its parent even by SIGKILL), the launcher's
own tie to its parent (`stop_with_parent`), and the waits and ports the launcher, the tests and
the benchmarks share. scripts/stack.py re-exports every name; docs/design.md, "The launcher".
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "ROOT",
    "Preloaded",
    "Proc",
    "communicate_or_stop",
    "free_port",
    "http_get",
    "port_is_free",
    "stop_with_parent",
    "wait_until",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a server could listen there (as redis-server does, with SO_REUSEADDR: the
    connections of a Redis that just died linger in TIME_WAIT on its port)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in a forked child
except (OSError, AttributeError):  # not Linux: children may outlive a killed parent
    _prctl = None


def _die_with_parent():
    """A preexec_fn: the child gets SIGKILL when its parent dies, or at once if it already has.

    The kernel ties this to the *thread* that forked, so only children started from the main
    thread get it (one started from a short-lived thread would die with that thread)."""
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent, kill = os.getpid(), int(signal.SIGKILL)

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, kill)
        if os.getppid() != parent:
            os.kill(os.getpid(), kill)

    return preexec


def stop_with_parent() -> int:
    """The launcher itself gets SIGTERM (and so stops everything it started, as on Ctrl-C) when
    the process that started it dies, even by SIGKILL: `make run`'s make (the Makefile execs
    the launcher, so make is its parent). Returns the parent's pid, which the launcher's loop
    also watches (not Linux: no prctl; a parent that died before the prctl call)."""
    parent = os.getppid()
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    return parent


class Preloaded:
    """A fork server (multiprocessing's) that imported `modules` once, and children forked from
    it that run `python -m <module> ...` as a process started afresh would, less the time of
    those imports: the tests start ~100 workers, and importing torch and transformers is ~4 s
    of each start (docs/benchmarks.md, "`make test` wall time"). Only modules whose import
    reads no setting of ours belong in `modules`: a child gets its own environment after the
    fork. The fork server is multiprocessing's, one a process: the first `Preloaded` to start
    it says what it imports, and `stop()` ends it for every one, waiting for its children
    (they hold it open), so only once they are all stopped (the test session's end)."""

    def __init__(self, modules: list[str]):
        self.modules = modules
        self.ctx: multiprocessing.context.ForkServerContext | None = None

    def runs(self, argv: list[str]) -> bool:
        """Whether `argv` is `python -m <module> ...` of this interpreter (what a child of the
        fork server can run)."""
        return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m"

    def warm(self) -> None:
        """Start the fork server, if not yet: its imports (~5 s) run beside what the caller does
        next (an API's start), and the first child waits only for what is left of them."""
        if self.ctx is None:
            self.ctx = multiprocessing.get_context("forkserver")
            self.ctx.set_forkserver_preload(self.modules)
            from multiprocessing import forkserver

            forkserver.ensure_running()

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> _Forked:
        self.warm()
        process = self.ctx.Process(target=_run_module, args=(argv, env, str(log)), daemon=True)
        process.start()
        return _Forked(process, argv)

    def stop(self) -> None:
        if self.ctx is None:
            return
        from multiprocessing import forkserver, resource_tracker

        forkserver._forkserver._stop()
        resource_tracker._resource_tracker._stop()
        self.ctx = None


class _Forked:
    """The part of `subprocess.Popen` that `Proc` uses, for a child of a `Preloaded` server:
    returned once the child leads a session of its own (as `start_new_session=True`)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, argv: list[str]):
        self.process, self.args, self.pid, self.returncode = process, argv, process.pid, None
        deadline = time.monotonic() + 10
        while self.poll() is None and _pgid(self.pid) != self.pid and time.monotonic() < deadline:
            time.sleep(0.002)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _run_module(argv: list[str], env: dict[str, str], log: str) -> None:
    """In a child of the fork server: what `Popen(argv, env=env, cwd=ROOT, stdout=log,
    stderr=STDOUT, stdin=DEVNULL, start_new_session=True)` with `_die_with_parent` would do,
    then `python -m argv[2] argv[3:]`."""
    os.setsid()
    if _prctl is not None:  # the fork server's death (it dies with the tests) kills this one
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    sys.argv = [argv[0], *argv[3:]]
    import atexit

    try:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # multiprocessing's child ends in os._exit, which runs none


class Proc:
    """A child process in its own process group, stopped with SIGTERM, then SIGKILL; it dies
    with the process that started it. With `preloaded` (and a `log`), `python -m` commands of
    this interpreter are forked from that server instead of started afresh."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        log: Path | None = None,
        preloaded: Preloaded | None = None,
    ):
        self.name = name
        self.log = log
        if preloaded is not None and log is not None and preloaded.runs(argv):
            self.popen = preloaded.start(argv, {**os.environ, **(env or {})}, log)
            return
        out = open(log, "ab") if log else None
        self.popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )
        if out:
            out.close()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        # Children that outlived the leader (none expected) go too.
        self.signal(signal.SIGKILL)
        return self.popen.returncode

    def tail(self, lines: int = 40) -> str:
        if not self.log or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def communicate_or_stop(popen: subprocess.Popen, timeout: float, grace: float = 60.0) -> tuple[str, str, bool]:
    """`popen.communicate()`, but past `timeout` the child gets SIGTERM (so that it stops what
    it started) and, `grace` seconds later, its process group SIGKILL (start it with
    start_new_session=True); so does a child left running by an exception here. Returns
    stdout, stderr and whether it ran over."""
    try:
        try:
            return (*popen.communicate(timeout=timeout), False)
        except subprocess.TimeoutExpired:
            popen.send_signal(signal.SIGTERM)
        try:
            return (*popen.communicate(timeout=grace), True)
        except subprocess.TimeoutExpired:
            _killpg(popen.pid)
            return (*popen.communicate(), True)
    finally:
        if popen.poll() is None:
            _killpg(popen.pid)
            popen.wait()


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_until(check, timeout: float, what: str, procs: list[Proc] = ()) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited while waiting for {what}:\n{p.tail()}")
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs)
            raise TimeoutError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.1)
