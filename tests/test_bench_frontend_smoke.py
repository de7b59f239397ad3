"""`python -m bench.frontend --floor` end to end, quickly: genqueue's echo stack, the plain
Flask + Celery app of bench/floor_app.py and the HTTP floor (Flask alone) each serve the
closed-loop load without errors, and the CPU per request is reported for each. The figures
are not checked (that is what the benchmark is for), only that every side did its work:
a floor app that failed its requests, or a worker that never ran, would show here."""

from __future__ import annotations

import json

from tests.helpers import run_bench


def test_bench_frontend_with_floor(redis_url):
    rc, out, err = run_bench("bench.frontend", "--duration", "1.5", "--runs", "1", "--retries", "0", "--floor",
                             "--clients", "4", "--procs", "1", timeout=240, env={"REDIS_URL": redis_url})
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    res = json.loads(out)
    for key in ("runs", "floor_runs", "http_floor_runs"):
        (run,) = res[key]
        assert run["requests"] > 0 and run["errors"] == 0, (key, run)
        assert run["cpu_ms_per_request"]["api"] > 0, (key, run)
    # Jobs through a worker: genqueue's and Celery's do work and use Redis; Flask alone does neither.
    for key in ("runs", "floor_runs"):
        assert res[key][0]["cpu_ms_per_request"]["worker"] > 0 and res[key][0]["redis_commands_per_request"] > 5
    assert res["http_floor_runs"][0]["cpu_ms_per_request"]["worker"] == 0
    assert res["http_floor_runs"][0]["redis_commands_per_request"] < 1
    assert set(res["median_cpu_ms_per_request"]) == {
        "genqueue", "floor (plain Flask + Celery)", "HTTP floor (Flask alone)"}
