"""`python -m bench.run` end to end on the tiny checkpoint, quickly: every phase runs (in-process
generate and HFEngine, the API with an hf worker, the echo engine with 1 and 2 API workers) and
the printed report has the expected tables and rows. --no-write: docs/benchmarks.md is untouched."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from scripts import stack

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def test_bench_quick_run(tiny_model, redis_url):
    before = _digest(DOC)
    started = time.monotonic()
    proc = subprocess.Popen(
        # --quiet-wait 0 --retries 0: on a busy machine, do not wait for quiet (numbers don't matter here).
        [sys.executable, "-m", "bench.run", "--model", "tiny", "--levels", "1,2", "--duration", "2", "--no-write",
         "--quiet-wait", "0", "--retries", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "REDIS_URL": redis_url},
        start_new_session=True,
    )
    # ~30 s expected alone; a machine busy with other work can take several times that. Past the
    # limit, SIGTERM lets the benchmark stop its worker and API, then SIGKILL ends its group.
    out, err, ran_over = stack.communicate_or_stop(proc, timeout=240)
    assert not ran_over, f"bench.run ran over 240 s\n--- stderr\n{err[-5000:]}"
    took = time.monotonic() - started
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    for heading in (
        "## Targets",
        "## 1. API path",
        "### Where the time goes",
        "## 2. In-process padded `model.generate`",
        "## 3. In-process HFEngine",
        "## Side by side",
        "## 4. Echo engine through the API",
        "## 5. API memory",
    ):
        assert heading in out, heading
    assert "Command: `python -m bench.run --model tiny --levels 1,2 --duration 2 --no-write --quiet-wait 0 --retries 0`" in out

    def rows(section: str) -> list[list[str]]:
        body = out.split(section, 1)[1].split("\n#", 1)[0]
        table = [line for line in body.splitlines() if line.startswith("| ")][1:]  # no header
        return [[c.strip() for c in line.strip("|").split("|")] for line in table]

    api = rows("## 1. API path")
    assert [r[0] for r in api] == ["1", "2"]
    for r in api:
        assert int(r[1].rstrip("*")) >= 2 * int(r[0]), r  # >= min requests per client (3), less a margin
        assert float(r[2]) > 0 and r[8] == "0", r  # req/s, no errors
    assert [r[0] for r in rows("## 2. In-process padded")] == ["1", "2"]
    assert [r[0] for r in rows("## 3. In-process HFEngine")] == ["1", "2"]
    assert [r[0] for r in rows("## Side by side")] == ["1", "2"]
    echo = rows("## 4. Echo engine")
    assert [r[0] for r in echo] == ["1", "2"]
    assert all(float(r[3]) > 0 and r[7] == "0" for r in echo), echo
    assert "**total**" in out.split("## 5. API memory", 1)[1]
    # One verdict per target; level 32 is not measured in a quick run.
    assert "- **N/A** throughput at 32 clients" in out
    for target in ("latency at 1 client", "echo engine through the API", "API memory"):
        assert any(line.startswith(("- **PASS** " + target, "- **FAIL** " + target)) for line in out.splitlines()), target

    assert _digest(DOC) == before, "--no-write must not touch docs/benchmarks.md"
    print(f"quick benchmark: {took:.0f} s")  # ~30 s on the 2-core dev machine
