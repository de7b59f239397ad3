"""`python -m bench.tools`: its rounds end to end on the tiny checkpoint, briefly, only to show
that the harness runs (the tiny model's figures mean nothing: no figure is judged here;
docs/benchmarks.md has the real model's)."""

from __future__ import annotations

import json
import re

import pytest

from bench import tools
from scripts import stack
from tests.helpers import run_bench

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it


def test_bench_tools_quick_run(tiny_model, redis_url):
    argv = ["--model", "tiny", "--levels", "1,2", "--rounds", "1", "--warmup", "0", "--per-client", "1"]
    rc, out, err = run_bench("bench.tools", *argv, timeout=300, env={"REDIS_URL": redis_url})
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    (outdir,) = re.findall(r"raw results and logs in (\S+)", err)
    res = json.loads((stack.ROOT / outdir / "results.json").read_text())
    assert [lv["clients"] for lv in res["levels"]] == [1, 2]
    for lv in res["levels"]:
        # every forced output parsed into a call; the other configurations generated as many tokens
        assert lv["requests"] == lv["clients"] and lv["calls"] == lv["requests"], lv
        (rnd,) = lv["rounds"]
        assert rnd["required"]["tokens"] == rnd["none"]["tokens"] == rnd["plain"]["tokens"] > lv["clients"], rnd
        assert all(rnd[c]["decode_per_token"] > 0 for c in tools.CONFIGS), rnd
    assert "| 1 | 1 (1 calls parsed) |" in out and res["machine"]["cpu_model"] in out


def test_required_bodies_force_one_call_and_the_others_ignore_eos():
    req = json.loads(tools.body("m", "required", 5, 64))
    assert req["tool_choice"] == "required" and req["parallel_tool_calls"] is False and "ignore_eos" not in req
    assert [t["function"]["name"] for t in req["tools"]] == ["get_weather", "get_time"]
    plain, none = json.loads(tools.body("m", "plain", 6, 9)), json.loads(tools.body("m", "none", 7, 9))
    assert "tools" not in plain and none["tool_choice"] == "none" and plain["ignore_eos"] and none["ignore_eos"]
    assert plain["max_tokens"] == 9 and len({json.dumps(b["messages"]) for b in (req, plain, none)}) == 3
