"""`python -m bench.observability` end to end, quickly: one round of the echo path with and
without metrics prints its table (the numbers do not matter here)."""

from __future__ import annotations

from tests.helpers import run_bench


def test_bench_observability_quick_run(tiny_model):
    rc, out, err = run_bench("bench.observability", "--rounds", "1", "--echo-duration", "2",
                             "--configs", "off,metrics", "--quiet-wait", "0", "--retries", "0", timeout=180)
    assert rc == 0, err[-4000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line}
    assert {"off", "metrics"} <= set(rows), out
    assert float(rows["off"][1]) > 0 and float(rows["metrics"][1]) > 0
    assert rows["metrics"][3].endswith(")") and "%" in rows["metrics"][3]  # paired ratio and its range
