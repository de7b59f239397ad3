"""`python -m bench.fair`: both modes (fair share on, off) end to end on the tiny checkpoint,
briefly, only to show that the harness runs and tells the modes apart; docs/benchmarks.md has
the full run's figures."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_bench

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it


def test_bench_fair_quick_run(tiny_model, tmp_path):
    out = tmp_path / "fair.json"
    argv = ["--flood", "24", "--calm", "3", "--warm", "4", "--pace", "0", "--flood-tokens", "32"]
    argv += ["--calm-tokens", "8", "--before", "0", "--out", str(out)]
    rc, stdout, err = run_bench("bench.fair", *argv, timeout=300)
    assert rc == 0, f"exit {rc}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{err[-5000:]}"
    on, off = json.loads(out.read_text())["results"]
    assert on["fair_share"] and not off["fair_share"]
    # First in, first out: a calm job waits for every flood job queued before it (those the
    # worker took at once excepted); fair share: for the one committed to the list and a row.
    assert on["flood_started_ahead_max"] <= 2 and off["flood_started_ahead_max"] >= 12, (on, off)
    assert "| on |" in stdout and "| off |" in stdout
