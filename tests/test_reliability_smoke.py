"""`python -m bench.reliability --quick` end to end, quickly: a worker SIGKILLed mid-batch and
a Redis restart on the tiny model; no job is lost or run twice and the page has its tables.
The other scenarios share the same harness (and the recovery mechanisms have tests of their
own: test_recovery.py, test_outage.py). --no-write: docs/reliability.md is untouched."""

from __future__ import annotations

import pytest

from scripts import stack
from tests.helpers import digest, run_bench, table_rows

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it

DOC = stack.ROOT / "docs" / "reliability.md"


def test_reliability_quick_run(tiny_model):
    before = digest(DOC)
    rc, out, err = run_bench(
        "bench.reliability", "--runs", "1", "--quick", "--only", "sigkill,redis", "--no-write", timeout=300
    )
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-6000:]}\n--- stderr\n{err[-5000:]}"
    assert "- **PASS** jobs lost: 0" in out and "- **PASS** jobs duplicated: 0" in out
    (kill,) = table_rows(out, "## A worker killed (SIGKILL) or hung (SIGSTOP) mid-batch")
    assert kill[0] == "SIGKILL" and int(kill[2]) > 0 and kill[7:9] == ["0", "0"], kill  # held, lost, duplicated
    (redis_row,) = table_rows(out, "## Redis restart")
    assert redis_row[0] == redis_row[1] and redis_row[2] == "0", redis_row  # all succeeded, none lost
    answers = table_rows(out, "The API's answers:")
    assert {(r[1], r[2]) for r in answers if r[0] == "while down"} == {
        ("GET /v1/jobs/<id>", "503"),
        ("GET /readyz", "503"),
        ("POST /v1/jobs", "503"),
    }
    assert digest(DOC) == before, "--no-write must not touch docs/reliability.md"
