"""Child processes that never outlive what started them: `Proc` (a child in a session of its
own, stopped with SIGTERM then SIGKILL, killed with its parent even by SIGKILL), the launcher's
own tie to its parent (`stop_with_parent`), and the waits and ports the launcher, the tests and
the benchmarks share. scripts/stack.py re-exports every name; docs/design.md, "The launcher".
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "ROOT",
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


class Proc:
    """A child process in its own process group, stopped with SIGTERM, then SIGKILL; it dies
    with the process that started it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None):
        self.name = name
        self.log = log
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
