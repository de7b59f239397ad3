"""`python -m bench.run` end to end on the tiny checkpoint, quickly: every phase runs (in-process
generate and HFEngine, the API with an hf worker, the echo engine with 1 and 2 API workers) and
the printed report has the expected tables and rows. --no-write: docs/benchmarks.md is untouched."""

from __future__ import annotations

import time

from scripts import stack
from tests.helpers import digest, run_bench, table_rows

DOC = stack.ROOT / "docs" / "benchmarks.md"


def test_bench_quick_run(tiny_model, redis_url):
    before = digest(DOC)
    started = time.monotonic()
    # ~30 s expected alone; a machine busy with other work can take several times that.
    # --quiet-wait 0 --retries 0: on a busy machine, do not wait for quiet (numbers don't matter here).
    rc, out, err = run_bench("bench.run", "--model", "tiny", "--levels", "1,2", "--duration", "2", "--no-write",
                             "--quiet-wait", "0", "--retries", "0", timeout=240, env={"REDIS_URL": redis_url})
    took = time.monotonic() - started
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
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
        return table_rows(out, section)

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

    assert digest(DOC) == before, "--no-write must not touch docs/benchmarks.md"
    print(f"quick benchmark: {took:.0f} s")  # ~30 s on the 2-core dev machine
