"""`python -m bench.stream` end to end on the tiny checkpoint, quickly: the in-process prefill,
the stack (hf worker + API) and streaming clients at 1 and 2 streams; the page has its tables.
--no-write: docs/benchmarks-streaming.md is untouched."""

from __future__ import annotations

import pytest

from scripts import stack
from tests.helpers import digest, run_bench, table_rows

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it

DOC = stack.ROOT / "docs" / "benchmarks-streaming.md"


def test_bench_stream_quick_run(tiny_model, redis_url):
    before = digest(DOC)
    rc, out, err = run_bench(
        "bench.stream",
        "--model",
        "tiny",
        "--levels",
        "1,2",
        "--duration",
        "1",
        "--prefill-reps",
        "1",
        "--no-write",
        "--retries",
        "0",
        timeout=240,
        env={"REDIS_URL": redis_url},
    )
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    streams = table_rows(out, "## Streaming through the API")
    assert [r[0] for r in streams] == ["1", "2"]
    for r in streams:
        assert float(r[2]) > 0 and float(r[3]) > 0 and float(r[6]) >= 0, r  # req/s, TTFT p50, ITL p50
        assert r[10] == "0", r  # no errors
    parts = table_rows(out, "## Where the time to first token goes")
    assert [r[0] for r in parts] == ["1", "2"] and all(int(r[-1]) > 0 for r in parts), parts
    assert float(table_rows(out, "## In-process reference")[0][1]) > 0
    assert any(
        line.startswith(("- **PASS** TTFT at 1 stream", "- **FAIL** TTFT at 1 stream")) for line in out.splitlines()
    )
    assert digest(DOC) == before, "--no-write must not touch docs/benchmarks-streaming.md"
