"""`Preloaded` (scripts/processes.py): the tests' workers are forked from a server that imported
torch and transformers once. A child must still behave as the command started afresh would: its
own environment, working directory, session, log, arguments and exit status, and stop on a
signal. The probe (tests/preload_probe.py) says what it found."""

from __future__ import annotations

import signal
import sys
import time

from scripts import stack


def test_a_forked_child_runs_the_module_as_a_fresh_process_would(tmp_path, preloaded):
    """On the tests' own fork server (one a process: stopping it here would wait for the
    workers of the module-scoped stacks still running), which preloads torch."""
    log = tmp_path / "probe.log"
    argv = [sys.executable, "-m", "tests.preload_probe", "--flag", "x"]
    assert preloaded.runs(argv) and not preloaded.runs(["/bin/true"])
    proc = stack.Proc("probe", argv, {"PROBE_VALUE": "42", "PROBE_EXIT": "3"}, log, preloaded)
    assert proc.popen.wait(60) == 3
    text = log.read_text()
    assert f"env 42 cwd {stack.ROOT}" in text
    assert "session leader True" in text
    assert "preloaded True argv ['--flag', 'x']" in text

    waiting = stack.Proc("probe", argv, {"PROBE_WAIT": "1"}, tmp_path / "wait.log", preloaded)
    stack.wait_until(lambda: "argv" in (tmp_path / "wait.log").read_text(), 30, "the probe", [waiting])
    assert waiting.alive()
    started = time.monotonic()
    assert waiting.stop(timeout=10) == -signal.SIGTERM
    assert time.monotonic() - started < 10
