"""Run by tests/test_preloaded.py as `python -m tests.preload_probe`, forked from a fork server:
says what it found, then exits with PROBE_EXIT, or waits to be signalled."""

import os
import sys
import time

print("env", os.environ.get("PROBE_VALUE"), "cwd", os.getcwd(), flush=True)
print("session leader", os.getsid(0) == os.getpid(), flush=True)
print("preloaded", "torch" in sys.modules, "argv", sys.argv[1:], flush=True)
if os.environ.get("PROBE_WAIT"):
    time.sleep(600)
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
