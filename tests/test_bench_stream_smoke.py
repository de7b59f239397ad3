"""`python -m bench.stream` end to end on the tiny checkpoint, quickly: the in-process prefill,
the stack (hf worker + API) and streaming clients at 1 and 2 streams; the printed report has the
expected sections and rows. --no-write: docs/benchmarks-streaming.md is untouched."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from scripts import stack

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks-streaming.md"


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def test_bench_stream_quick_run(tiny_model, redis_url):
    before = _digest(DOC)
    started = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "bench.stream", "--model", "tiny", "--levels", "1,2", "--duration", "2",
            "--no-write", "--retries", "0",
        ],  # fmt: skip
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "REDIS_URL": redis_url},
        start_new_session=True,
    )
    # ~20-35 s expected alone; a machine busy with other work can take several times that. Past
    # the limit, SIGTERM lets the benchmark stop its worker and API, then SIGKILL ends its group.
    out, err, ran_over = stack.communicate_or_stop(proc, timeout=240)
    assert not ran_over, f"bench.stream ran over 240 s\n--- stderr\n{err[-5000:]}"
    took = time.monotonic() - started
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    for heading in (
        "## Target",
        "## Streaming through the API",
        "## Where the time to first token goes",
        "## In-process reference",
    ):
        assert heading in out, heading
    assert "Command: `python -m bench.stream --model tiny --levels 1,2 --duration 2 --no-write --retries 0`" in out

    def rows(section: str) -> list[list[str]]:
        body = out.split(section, 1)[1].split("\n#", 1)[0]
        table = [line for line in body.splitlines() if line.startswith("| ")][1:]  # no header
        return [[c.strip() for c in line.strip("|").split("|")] for line in table]

    streams = rows("## Streaming through the API")
    assert [r[0] for r in streams] == ["1", "2"]
    for r in streams:
        assert int(r[1].rstrip("*")) >= 2 * int(r[0]), r  # >= min requests per client (3), less a margin
        assert float(r[2]) > 0, r  # req/s
        assert float(r[4]) > 0 and float(r[7]) >= 0, r  # TTFT p50, ITL p50 (ms)
        assert r[12] == "0", r  # no errors
    parts = rows("## Where the time to first token goes")
    assert [r[0] for r in parts] == ["1", "2"]
    ref = rows("## In-process reference")
    assert ref[0][0].startswith("prefill") and float(ref[0][1]) > 0
    assert any(line.startswith(("- **PASS** TTFT at 1 stream", "- **FAIL** TTFT at 1 stream")) for line in out.splitlines())

    assert _digest(DOC) == before, "--no-write must not touch docs/benchmarks-streaming.md"
    print(f"quick streaming benchmark: {took:.0f} s")
