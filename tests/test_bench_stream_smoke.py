"""`python -m bench.stream` end to end on the tiny checkpoint, quickly: the in-process prefill,
the stack (hf worker + API) and streaming clients at 1 and 2 streams; the printed report has the
expected sections and rows. --no-write: docs/benchmarks-streaming.md is untouched."""

from __future__ import annotations

import time

from scripts import stack
from tests.helpers import digest, run_bench, table_rows

DOC = stack.ROOT / "docs" / "benchmarks-streaming.md"


def test_bench_stream_quick_run(tiny_model, redis_url):
    before = digest(DOC)
    started = time.monotonic()
    # ~20-35 s expected alone; a machine busy with other work can take several times that.
    rc, out, err = run_bench("bench.stream", "--model", "tiny", "--levels", "1,2", "--duration", "2",
                             "--no-write", "--retries", "0", timeout=240, env={"REDIS_URL": redis_url})
    took = time.monotonic() - started
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    for heading in (
        "## Target",
        "## Streaming through the API",
        "## Where the time to first token goes",
        "## In-process reference",
    ):
        assert heading in out, heading
    assert "Command: `python -m bench.stream --model tiny --levels 1,2 --duration 2 --no-write --retries 0`" in out

    def rows(section: str) -> list[list[str]]:
        return table_rows(out, section)

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

    assert digest(DOC) == before, "--no-write must not touch docs/benchmarks-streaming.md"
    print(f"quick streaming benchmark: {took:.0f} s")
