"""`python -m bench.vllm`: the hf system end to end on the tiny checkpoint, quickly (vLLM's two
starts take minutes: the vLLM engine itself is tested in test_vllm.py), with the chat endpoint
beside completions; and the page's goals and ratios from a results file of all three systems."""

from __future__ import annotations

import pytest

from bench import vllm
from tests.helpers import run_bench, table_rows

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it


def test_bench_vllm_hf_quick_run(tiny_model, redis_url, tmp_path):
    page = tmp_path / "benchmarks-vllm.md"
    argv = [
        "--model",
        "tiny",
        "--systems",
        "hf",
        "--levels",
        "1,2",
        "--duration",
        "1",
        "--retries",
        "0",
        "--dtypes",
        "auto",
        "--quiet-wait",
        "0",
        "--chat-clients",
        "2",
        "--out",
        str(page),
    ]
    rc, out, err = run_bench("bench.vllm", *argv, timeout=240, env={"REDIS_URL": redis_url})
    assert rc == 0, f"exit {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    doc = page.read_text()
    assert doc.startswith(vllm.INTRO) and vllm.MARKER in doc
    side = table_rows(doc, "## Side by side")
    assert [r[0] for r in side] == ["1", "2"] and all(float(r[1]) > 0 for r in side), side
    (chat,) = table_rows(doc, "## Chat vs completions at 2 clients")
    assert chat[0] == "hf" and float(chat[2]) > 0 and float(chat[4]) > 0 and chat[-1] == "0", chat  # [4]: same tokens
    assert "/work/" not in doc and "/tmp/" not in doc.replace(str(page), "")


def level(clients: int, rate: float, p50: float) -> dict:
    return {
        "clients": clients,
        "requests": 10,
        "rate": rate,
        "p50": p50,
        "p90": p50,
        "p99": p50,
        "errors": 0,
        "capped": False,
        "cpu": {"other": 0.0},
        "jobs": {"queued_s": 0.01, "batch_size_mean": clients},
    }


def test_page_goals_and_ratios():
    system = {"dtype": "float32", "dtype_why": "rule", "startup_s": 1, "text": "x", "env": {}, "command": "vllm"}
    res = {
        "command": "python -m bench.vllm",
        "date": "2026-01-01 00:00 UTC",
        "elapsed_s": 60,
        "machine": {
            "nproc": 2,
            "cpu_model": "cpu",
            "ram_gib": 1,
            "kernel": "k",
            "python": "3",
            "loadavg_start": [0, 0, 0],
        },
        "loadavg_end": [0, 0, 0],
        "cpu": {"auto": "float32", "auto_why": "-"},
        "args": {"duration": 1, "min_requests": 3, "api_workers": 1, "chat_clients": 0},
        "hf_env": "-",
        "vllm_env": "-",
        "model_dir": ".models/x",
        "params_m": 1.0,
        "systems": {
            "hf": {**system, "levels": [level(10, 3.0, 1.0), level(32, 5.0, 2.0)]},
            "vllm": {**system, "levels": [level(10, 2.0, 1.0), level(32, 4.0, 3.0)]},
            "server": {**system, "levels": [level(10, 2.5, 1.0), level(32, 4.0, 2.0)]},
        },
    }
    goals = dict((s, v) for v, s in vllm.verdicts(res))
    assert goals["hf engine, req/s at 10 clients: 3.00 / 2.50 = 1.20 x (goal >= 1.0 x)"] == "PASS"
    assert goals["hf engine, req/s at 32 clients: 5.00 / 4.00 = 1.25 x (goal >= 1.2 x)"] == "PASS"
    assert goals["vLLM engine, req/s at 10 clients: 0.80 x (goal >= 0.9 x)"] == "FAIL"
    assert goals["vLLM engine, p50 at 32 clients: 1.50 x (goal <= 1.1 x)"] == "FAIL"
    page = vllm.render(res)
    assert "- Overall: **FAIL** (4 of 6 met)" in page
    rows = table_rows(page, "## Side by side")
    assert rows[0][-2:] == ["1.20", "0.80"] and rows[1][-2:] == ["1.25", "1.00"], rows


def test_rounds_ratio_is_the_median_of_the_rounds_ratios():
    """--rounds: each goal is decided on the median of the rounds' ratios (each round's figures
    measured seconds apart), not on the ratio of the systems' median rounds."""
    res = {
        "systems": {
            "hf": {"rounds": [[level(32, 4.0, 1.0)], [level(32, 9.0, 1.0)], [level(32, 6.0, 1.0)]]},
            "server": {"rounds": [[level(32, 2.0, 1.0)], [level(32, 10.0, 1.0)], [level(32, 5.0, 1.0)]]},
        }
    }
    for s in res["systems"].values():
        s["levels"] = [vllm.median_row([r[0] for r in s["rounds"]])]
    assert [r["rate"] for r in (res["systems"]["hf"]["levels"][0], res["systems"]["server"]["levels"][0])] == [6.0, 5.0]
    assert vllm.round_ratios(res, "hf", 32) == [2.0, 0.9, 1.2]
    assert vllm.level_ratio(res, "hf", 32) == 1.2  # the medians' ratio would be 6 / 5 as well; the rounds decide
    ((verdict, what),) = vllm.verdicts(res)
    assert verdict == "PASS" and "median of 3 rounds' ratios (2.00, 0.90, 1.20) = 1.20 x" in what, what
    res["systems"]["hf"]["rounds"][2][0]["rate"] = 5.5  # rounds' ratios 2.0, 0.9, 1.1: the median fails
    assert vllm.verdicts(res)[0][0] == "FAIL"


def test_arguments_that_measure_nothing_are_refused(capsys):
    for argv in (["--hf-workers", "0"], ["--rounds", "-1"], ["--systems", "hf,hf"]):
        try:
            vllm.parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 2, argv
        else:
            raise AssertionError(f"accepted {argv}")
    assert "--hf-workers takes 1 or more" in capsys.readouterr().err
    assert vllm.parse_args(["--hf-workers", "2"]).hf_workers == 2
