"""`python -m bench.run` end to end on the tiny checkpoint, quickly: every phase runs (in-process
generate and HFEngine, the API with an hf worker, the echo engine) and the page has its tables
and a verdict per target. --no-write: docs/benchmarks.md is untouched."""

from __future__ import annotations

import os

import pytest

from scripts import stack
from tests.helpers import digest, run_bench, table_rows
from worker.engines import dtype as dtype_rule

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it

DOC = stack.ROOT / "docs" / "benchmarks.md"


def test_bench_quick_run(tiny_model, redis_url):
    before = digest(DOC)
    rc, out, err = run_bench(
        "bench.run",
        "--model",
        "tiny",
        "--levels",
        "1,2",
        "--duration",
        "1",
        "--reps",
        "1",
        "--echo-api-workers",
        "1",
        "--echo-duration",
        "1",
        "--no-write",
        "--quiet-wait",
        "0",
        "--retries",
        "0",
        timeout=240,
        env={"REDIS_URL": redis_url},
    )
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    api = table_rows(out, "## 1. API path")
    assert [r[0] for r in api] == ["1", "2"]
    assert all(float(r[2]) > 0 and r[11] == "0" for r in api), api  # req/s, no errors
    inproc = table_rows(out, "## 2. In process")
    assert [r[0] for r in inproc] == ["1", "2"] and all(float(r[1]) > 0 and float(r[2]) > 0 for r in inproc), inproc
    (echo,) = table_rows(out, "## 3. Echo engine")
    assert float(echo[2]) > 0 and echo[9] == "0", echo
    assert float(table_rows(out, "## 4. API memory")[0][1]) > 0
    assert "- **N/A** throughput at 32 clients" in out  # level 32 is not measured in a quick run
    for target in ("latency at 1 client", "echo engine through the API", "API memory"):
        assert any(line.startswith(("- **PASS** " + target, "- **FAIL** " + target)) for line in out.splitlines()), (
            target
        )
    # Each side's dtype: generate as the teaching server ran it, the engine as GENQ_DTYPE resolves here.
    dtype, _ = dtype_rule.resolve(os.environ.get("GENQ_DTYPE", "auto"))
    assert "`model.generate` in float32" in out and f"the HFEngine and the worker in **{dtype}**" in out
    assert digest(DOC) == before, "--no-write must not touch docs/benchmarks.md"
