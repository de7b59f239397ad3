"""`python -m bench.placement`: both runs (placement off, then on) end to end on the tiny
checkpoint with two hf workers, briefly, only to show that the harness runs; no figure is
judged here (docs/benchmarks.md has the real model's)."""

from __future__ import annotations

import json
import re

import pytest

from scripts import stack
from tests.helpers import run_bench

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it


def test_bench_placement_quick_run(tiny_model, redis_url, tmp_path):
    page = tmp_path / "benchmarks-placement.md"
    argv = ["--model", "tiny", "--tenants", "3", "--system-tokens", "120", "--clients", "2", "--requests", "3"]
    argv += ["--new-tokens", "4", "--min-chars", "200", "--out", str(page)]
    rc, out, err = run_bench("bench.placement", *argv, timeout=240, env={"REDIS_URL": redis_url})
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    (outdir,) = re.findall(r"raw results and logs in (\S+)", err)
    res = json.loads((stack.ROOT / outdir / "results.json").read_text())
    assert [r["placement"] for r in res["runs"]] == [False, True]
    for r in res["runs"]:
        assert r["requests"] == 6 and r["errors"] == 0 and r["prompt_tokens"] > 120, r
    doc = page.read_text()
    assert "| on |" in doc and "| off |" in doc and res["machine"]["cpu_model"] in doc
