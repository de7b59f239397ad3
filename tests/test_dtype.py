"""GENQ_DTYPE=auto: bfloat16 only where the CPU computes it natively, float32 elsewhere."""

from __future__ import annotations

from worker.engines import dtype

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu vme sse2 avx2 avx512f {extra}
bogomips\t: 4890.85
"""


def test_flags_are_read_from_cpuinfo():
    assert {"avx2", "avx512f", "amx_bf16"} <= dtype.cpu_flags(CPUINFO.format(extra="amx_bf16"))
    assert dtype.cpu_flags("no flags here") == set()


def test_auto_picks_bfloat16_only_on_native_bf16():
    for native in ("amx_bf16", "avx512_bf16"):
        chosen, why = dtype.resolve("auto", dtype.cpu_flags(CPUINFO.format(extra=native)))
        assert chosen == "bfloat16" and native in why
    chosen, why = dtype.resolve("auto", dtype.cpu_flags(CPUINFO.format(extra="")))
    assert chosen == "float32" and "no native bf16" in why


def test_an_explicit_dtype_and_a_gpu_are_left_alone():
    assert dtype.resolve("bfloat16", set()) == ("bfloat16", "set by GENQ_DTYPE")
    assert dtype.resolve("float32", {"amx_bf16"})[0] == "float32"
    assert dtype.resolve("auto", set(), gpu=True)[0] == "auto"


def test_the_hf_engine_loads_the_weights_auto_chooses(tiny_model, caplog):
    import torch

    from tasks.config import Settings
    from worker.engines.hf import HFEngine

    chosen, why = dtype.resolve("auto")
    with caplog.at_level("INFO", logger="worker.engines.hf"):
        eng = HFEngine(Settings(model=str(tiny_model), dtype="auto", max_batch_size=2))
    try:
        assert eng.lm.dtype == getattr(torch, chosen)
        assert f"weights in {chosen} ({why})" in caplog.text
    finally:
        eng.close()
