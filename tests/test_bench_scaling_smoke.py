"""`python -m bench.scaling` end to end, quickly: 1 and 2 sim workers under one API process, the
load from a `bench.load` process; the page has a row per point with jobs done, Redis commands
counted and the projection. --no-write: docs/scaling.md is untouched."""

from __future__ import annotations

import pytest

from scripts import stack
from tests.helpers import digest, run_bench, table_rows

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it

DOC = stack.ROOT / "docs" / "scaling.md"


def test_bench_scaling_quick_run():
    before = digest(DOC)
    rc, out, err = run_bench(
        "bench.scaling",
        "--workers",
        "1,2",
        "--api-workers",
        "1",
        "--duration",
        "1",
        "--load-procs",
        "1",
        "--clients-per-worker",
        "4",
        "--no-write",
        "--retries",
        "0",
        timeout=180,
    )
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    rows = table_rows(out, "## Jobs/s, queue time and Redis commands")
    assert [(r[0], r[1], r[2]) for r in rows] == [("1", "1", "4"), ("2", "1", "8")], rows
    for r in rows:
        assert float(r[3]) > 0 and float(r[7]) > 5 and r[-1] == "0", r  # jobs/s, Redis commands per job, errors
    assert len(table_rows(out, "## Projection from the best point")) == 4
    assert digest(DOC) == before, "--no-write must not touch docs/scaling.md"
