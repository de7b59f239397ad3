"""`python -m bench.reliability --runs 1 --quick` end to end: every scenario runs (the reference,
a worker SIGKILLed and one SIGSTOPped mid-batch, a Redis restart, a poison job), the page it
writes has its tables, and the killed and hung workers lost or duplicated no job. Written to a temporary file:
docs/reliability.md is untouched."""

from __future__ import annotations

import time

import pytest

from tests.helpers import run_bench, table_rows as _rows

LIMIT_S = 420


@pytest.mark.timeout(LIMIT_S + 120)  # above ours, which includes the grace for stopping
def test_reliability_quick_run(tiny_model, tmp_path):
    page = tmp_path / "reliability.md"
    started = time.monotonic()
    # ~2 min alone on 2 cores.
    rc, out, err = run_bench("bench.reliability", "--runs", "1", "--quick", "--out", str(page), timeout=LIMIT_S)
    doc = page.read_text() if page.exists() else ""
    # Exit 1 is a verdict that failed, written into the page (a job lost or run twice, a
    # recovery past a minute): the harness itself must work either way, and the assertions
    # below check the verdicts that matter.
    assert rc in (0, 1), f"exit {rc}\n--- page\n{doc[:6000]}\n--- stderr\n{err[-5000:]}"

    assert f"- Command: `python -m bench.reliability --runs 1 --quick --out {page}`" in doc
    assert "## Verdict" in doc
    faults = _rows(doc, "## A worker killed (SIGKILL) or hung (SIGSTOP) mid-batch")
    assert [r[0] for r in faults] == ["SIGKILL", "SIGSTOP"]
    for r in faults:
        assert r[1] == "1" and float(r[6]) < 60, r  # one run each; recovered within a minute
        assert r[9:12] == ["0", "0", "0"], r  # lost, duplicated, text unlike the reference
    per_run = _rows(doc, "Per run:")
    assert [r[0] for r in per_run] == ["SIGKILL", "SIGSTOP"]
    assert per_run[1][11] == "2", per_run[1]  # the woken worker serves again
    (redis_row,) = _rows(doc, "## Redis restart")
    assert redis_row[0].isdigit(), redis_row
    answers = _rows(doc, "The API's answers:")
    assert {(r[1], r[2], r[3]) for r in answers if r[0] == "while down"} == {
        ("GET /v1/jobs/<id>", "503", "broker_unavailable"),
        ("GET /readyz", "503", "broker_unavailable"),
        ("POST /v1/jobs", "503", "broker_unavailable"),
    }
    assert [r[0] for r in _rows(doc, "## Poison job")] == ["1", "2", "3"]
    assert "status `failed` after 3 attempts" in doc and "error `worker_lost`" in doc
    print(f"quick reliability run: {time.monotonic() - started:.0f} s")
