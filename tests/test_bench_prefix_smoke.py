"""`python -m bench.prefix`: its three loads end to end against the hf system on the tiny
checkpoint, briefly, only to show that the harness runs (vLLM's server takes minutes to start
and the tiny model's figures mean nothing: no figure is judged here); the goals' verdicts and
the page from a results file of both systems; the deterministic texts."""

from __future__ import annotations

import json
import re

import pytest

from bench import prefix
from scripts import stack
from tests.helpers import run_bench, table_rows

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it


def test_bench_prefix_hf_quick_run(tiny_model, redis_url, tmp_path):
    page = tmp_path / "benchmarks-prefix.md"
    argv = [
        "--model",
        "tiny",
        "--systems",
        "hf",
        "--loads",
        "a,b,c,d",
        "--short-levels",
        "2",
        "--short-tokens",
        "8",
        "--duration",
        "1",
        "--dtypes",
        "auto",
        "--clients",
        "4",
        "--system-tokens",
        "100",
        "--conv-clients",
        "2",
        "--conv-each",
        "2",
        "--turns",
        "3",
        "--turn1-tokens",
        "40",
        "--turn-tokens",
        "8",
        "--streams",
        "2",
        "--stream-tokens",
        "16",
        "--long-tokens",
        "200",
        "--retries",
        "0",
        "--quiet-wait",
        "0",
        "--out",
        str(page),
    ]
    rc, out, err = run_bench("bench.prefix", *argv, timeout=240, env={"REDIS_URL": redis_url})
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    doc = page.read_text()
    assert doc.startswith(prefix.INTRO) and prefix.MARKER in doc
    (outdir,) = re.findall(r"raw results and logs in (\S+)", err)
    res = json.loads((stack.ROOT / outdir / "results.json").read_text())
    assert res["machine"]["cpu_model"] and res["machine"]["cpu_model"] in doc
    hf = res["systems"]["hf"]
    assert hf["a"]["requests"] > 0 and hf["a"]["errors"] == 0, hf["a"]
    assert [t["turn"] for t in hf["b"]["turns"]] == [1, 2, 3] and hf["b"]["errors"] == 0, hf["b"]
    assert all(t["n"] == 2 for t in hf["b"]["turns"]), hf["b"]["turns"]  # 2 counted conversations
    assert hf["c"]["alone"]["gaps"] > 0 and hf["c"]["beside"]["gaps"] > 0 and hf["c"]["long"]["done"] >= 1, hf["c"]
    assert hf["c"]["errors"] == 0, hf["c"]
    ((d,),) = [hf["d"]["levels"]]
    assert d["clients"] == 2 and d["requests"] > 0 and d["errors"] == 0, d
    (row,) = table_rows(doc, "## a. Shared system prompt")
    assert row[0] == "hf" and float(row[1]) > 0, row
    # Without vLLM's server, load a decides nothing; b and c are decided (whatever the verdict).
    goals = doc.split("## Goals", 1)[1].split("##", 1)[0]
    assert "a. shared" not in goals and "b. multi-turn" in goals and "c. ITL" in goals, goals


def result(rate, ttft, turn1, turn_last, itl_alone, itl_beside) -> dict:
    cpu = {"cpu": {"other": 0.0}, "attempts": 1, "noisy": False}
    turns = [
        {"turn": t, "n": 4, "ttft_p50": v, "ttft_p90": v, "prompt_tokens": 100.0 * t, "cached_tokens": None}
        for t, v in ((1, turn1), (2, turn1), (3, turn_last))
    ]
    return {
        "dtype": "float32",
        "dtype_why": "set",
        "startup_s": 5,
        "env": {"GENQ_DTYPE": "float32"},
        "command": "vllm.entrypoints.openai.api_server --model m",
        "a": {
            "rate": rate,
            "ttft_p50": ttft,
            "ttft_p90": ttft,
            "p50": 1.0,
            "requests": 40,
            "errors": 0,
            "cached_tokens": 1400.0,
            "prompt_tokens": 1550.0,
            **cpu,
        },
        "b": {"turns": turns, "ratio": turn_last / turn1, "errors": 0},
        "c": {
            "streams": 4,
            "alone": {"itl_p50": itl_alone, "itl_p90": itl_alone},
            "beside": {"itl_p50": itl_beside, "itl_p90": itl_beside},
            "ratio": itl_beside / itl_alone,
            "long": {"done": 3, "ttft_p50": 2.0},
            "errors": 0,
            **cpu,
        },
        "d": {"levels": [{"clients": n, "rate": rate * n / 10, "p50": 1.0, "errors": 0, **cpu} for n in (10, 32)]},
    }


def test_goals_and_page():
    args = {
        "loads": ["a", "b", "c"],
        "api_workers": 1,
        "clients": 16,
        "new_tokens": 32,
        "duration": 30,
        "min_requests": 2,
        "conv_clients": 4,
        "conv_each": 3,
        "turns": 3,
        "turn1_tokens": 300,
        "turn_tokens": 64,
        "streams": 4,
        "stream_tokens": 64,
        "long_clients": 1,
        "long_new_tokens": 8,
        "short_tokens": 64,
        "short_levels": [10, 32],
    }
    res = {
        "command": "python -m bench.prefix",
        "date": "2026-01-01 00:00 UTC",
        "elapsed_s": 60,
        "machine": {
            "nproc": 2,
            "cpu_model": "Some CPU",
            "ram_gib": 1,
            "kernel": "k",
            "python": "3",
            "loadavg_start": [0, 0, 0],
        },
        "loadavg_end": [0, 0, 0],
        "cpu": {"auto": "float32", "auto_why": "-"},
        "args": args,
        "hf_env": "-",
        "vllm_env": "-",
        "model_dir": ".models/m",
        "model_desc": "m",
        "texts": {"system_tokens": 1510, "long_tokens": 4005},
        "systems": {
            "hf": result(6.0, 0.30, 0.20, 0.29, 0.050, 0.090),
            "server": result(5.0, 0.25, 0.20, 0.50, 0.040, 0.100),
        },
    }
    goals = {what: v for v, what in prefix.verdicts(res)}
    assert goals["a. shared system prompt, req/s: 6.00 / 5.00 = 1.20 x vLLM's (goal >= 1.2 x)"] == "PASS"
    assert goals["a. shared system prompt, TTFT p50: 0.300 s vs vLLM's 0.250 s = 1.20 x (goal <= vLLM's)"] == "FAIL"
    (b,) = [w for w in goals if w.startswith("b.")]
    assert goals[b] == "PASS" and "1.45 x (goal <= 1.5 x); vLLM's server: 2.50 x" in b, b
    (c,) = [w for w in goals if w.startswith("c.")]
    assert goals[c] == "PASS" and "90.0 / 50.0 ms = 1.80 x (goal <= 2.0 x)" in c, c
    res["systems"]["hf"]["c"]["ratio"] = 2.01
    assert [v for v, w in prefix.verdicts(res) if w.startswith("c.")] == ["FAIL"]
    res["systems"]["server"]["d"]["levels"][1]["rate"] = 6.0 * 32 / 10 / 1.199  # 1.199 x: not 1.2
    d = [(v, w) for v, w in prefix.verdicts(res) if w.startswith("d.")]
    assert d == [
        ("PASS", "d. short prompts at 10 clients, req/s: 6.00 / 5.00 = 1.20 x vLLM's (goal >= 1.2 x)"),
        ("FAIL", "d. short prompts at 32 clients, req/s: 19.20 / 16.01 = 1.20 x vLLM's (goal >= 1.2 x)"),
    ]
    page = prefix.render(res)
    assert "- Overall: **FAIL** (3 of 6 met)" in page and "Some CPU" in page
    rows = table_rows(page, "## a. Shared system prompt")
    assert [r[0] for r in rows] == ["hf", "vLLM server", "hf / vLLM"] and rows[2][1] == "1.20", rows
    rows = table_rows(page, "## b. Multi-turn")
    assert [r[0] for r in rows] == ["1", "2", "3", "last / first"] and rows[0][2] == "n/a / 100", rows
    rows = table_rows(page, "## d. Short prompts")
    assert [r[:3] for r in rows[:2]] == [["hf", "10", "6.00"], ["hf", "32", "19.20"]], rows


def test_texts_are_deterministic_and_sized(tiny_model):
    sizer = prefix.Sizer(tiny_model)
    system = prefix.system_prompt(sizer, 300)
    assert system == prefix.system_prompt(sizer, 300) and "Rules:" in system and "Tools" in system
    assert 300 <= sizer.count(system) <= 360
    doc = prefix.document(sizer, 200, 1, "Case file 1.")
    assert doc.startswith("Case file 1.") and 200 <= sizer.count(doc) <= 260
    assert len(set(prefix.questions())) == 64


@pytest.mark.parametrize(
    "argv",
    [
        ["--loads", "a,e"],
        ["--short-levels", "10,0"],
        ["--systems", "hf,vllm"],
        ["--turns", "0"],
        ["--hf-env", "GENQ_X"],
        ["--duration", "0"],
    ],
)
def test_arguments_that_measure_nothing_are_refused(argv):
    with pytest.raises(SystemExit) as exc:
        prefix.parse_args(argv)
    assert exc.value.code == 2
