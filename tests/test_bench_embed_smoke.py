"""`python -m bench.embed` end to end on all-MiniLM-L6-v2, quickly: sentence-transformers'
encode in process, then the stack (an embed worker + the API) at 2 clients x 4 inputs; its
table has both rates and their ratio."""

from __future__ import annotations

import pytest

from tests.helpers import run_bench, table_rows

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it


def test_bench_embed_quick_run():
    rc, out, err = run_bench(
        "bench.embed",
        *("--clients", "2", "--inputs", "4", "--requests", "2", "--rounds", "1", "--threads", "1"),
        timeout=300,
    )
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    (row,) = table_rows("## x\n" + out[out.index("| model |") :], "## x")
    assert row[0] == "minilm" and float(row[1].split()[0]) > 0 and float(row[2].split()[0]) > 0, row
