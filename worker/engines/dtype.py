"""`GENQ_DTYPE=auto`: the weights' dtype that is fastest on this CPU, and why.

bfloat16 halves the bytes a decode step reads, which wins wherever the CPU computes in bf16
natively (AMX, AVX512-BF16). Elsewhere PyTorch converts to float32 and back around every
matmul, and bfloat16 ran slower than float32 there except at batch 1 (docs/benchmarks.md,
"hf engine: bfloat16 without native bf16"). So `auto` picks bfloat16 only on native bf16
hardware, else float32; a GPU (vLLM's CUDA build) keeps vLLM's own `auto`.
"""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo flags that mean bf16 matmuls run natively (oneDNN uses them).
NATIVE_BF16 = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (Linux); empty where /proc/cpuinfo cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return set()


def resolve(setting: str, flags: set[str] | None = None, gpu: bool = False) -> tuple[str, str]:
    """(dtype, reason) for GENQ_DTYPE. Only `auto` is decided; the rest are taken as given."""
    if setting != "auto":
        return setting, "set by GENQ_DTYPE"
    if gpu:
        return "auto", "GPU: the engine's own choice"
    flags = cpu_flags() if flags is None else flags
    native = [f for f in NATIVE_BF16 if f in flags]
    if native:
        return "bfloat16", f"auto: the CPU computes bf16 natively ({', '.join(native)})"
    return "float32", "auto: no native bf16 on this CPU (no AMX or AVX512-BF16); bfloat16 would be slower at batch"
