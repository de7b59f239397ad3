"""Where the llama.cpp build that the `llamacpp` engine loads lives (scripts/llamacpp.py
builds it): one build per CPU (it is compiled for the CPU's own instructions), under
GENQ_LLAMA_CPP_HOME (default ~/.cache/genqueue/llama.cpp); LLAMA_CPP_LIB_PATH, llama-cpp-python's
own variable, names another. Light imports only: the build script imports this too."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from worker.engines.dtype import cpu_flags

VERSION = "0.3.36"  # llama-cpp-python; its sdist vendors the llama.cpp that is built
#: What a complete build has (the engine's libraries and the benchmark's server).
BUILT = ("libllama.so", "libggml.so", "llama-server")


def home() -> Path:
    return Path(os.environ.get("GENQ_LLAMA_CPP_HOME", "~/.cache/genqueue/llama.cpp")).expanduser()


def cpu_key(cpuinfo: str | None = None) -> str:
    """A short digest of the CPU's feature flags: a native build runs only where they match."""
    return hashlib.sha256(" ".join(sorted(cpu_flags(cpuinfo))).encode()).hexdigest()[:12]


def build_dir() -> Path:
    return home() / f"{VERSION}-{cpu_key()}"


def lib_dir() -> Path:
    """Where the engine's libraries and llama-server are (LLAMA_CPP_LIB_PATH overrides)."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    return Path(override) if override else build_dir() / "bin"


def built(where: Path | None = None) -> bool:
    where = where or lib_dir()
    return all((where / name).exists() for name in BUILT)
