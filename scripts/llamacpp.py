"""llama.cpp for the `llamacpp` engine and the benchmarks: built once per machine from source.

No prebuilt llama.cpp is reachable here (PyPI has llama-cpp-python only as an sdist), so this
builds the llama.cpp that the `llama-cpp-python` sdist vendors: the shared libraries the
engine loads through llama-cpp-python's ctypes bindings (`libllama.so` and ggml's), and
`llama-server`, the peer bench.size measures against, from one build tree. It is built for
this CPU (`GGML_NATIVE`), so the build lives under a key of the CPU's flags in
`GENQ_LLAMA_CPP_HOME` (default ~/.cache/genqueue/llama.cpp): a machine with another CPU builds
its own, and a clean clone on the same machine finds it built. The Python bindings go into
the virtualenv without a library of their own (`LLAMA_BUILD=OFF`); the engine points them at
this build (`LLAMA_CPP_LIB_PATH`). About 15-25 min on 2 cores, once.

    python -m scripts.llamacpp build     # no-op when built; prints the library directory
    python -m scripts.llamacpp bindings  # pip-installs the Python bindings into this Python
    python -m scripts.llamacpp where     # the library directory (built or not)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from worker.engines.llamacpp_lib import BUILT, VERSION, build_dir, built, home, lib_dir

SDIST = f"llama_cpp_python-{VERSION}.tar.gz"


def sdist() -> Path:
    """The llama-cpp-python sdist, downloaded once into `home()`."""
    path = home() / SDIST
    if not path.is_file():
        home().mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
            + ["-d", str(home()), f"llama-cpp-python=={VERSION}"],
            check=True,
        )
    return path


def source() -> Path:
    """The unpacked sdist (its vendor/llama.cpp is what is built)."""
    src = home() / f"llama_cpp_python-{VERSION}"
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        with tarfile.open(sdist()) as tar:
            tar.extractall(home(), filter="data")
    return src


def build() -> Path:
    if built():
        return lib_dir()
    out = build_dir()
    cpp = source() / "vendor" / "llama.cpp"
    print(f"building llama.cpp {VERSION} for this CPU into {out} (once; 15-25 min on 2 cores)", flush=True)
    subprocess.run(
        ["cmake", "-S", str(cpp), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON"]
        + ["-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(out), "--target", "llama", "llama-server", "-j", jobs], check=True)
    if not built(out / "bin"):
        raise SystemExit(f"llama.cpp built, but {out / 'bin'} lacks one of {BUILT}")
    return out / "bin"


def bindings() -> None:
    """llama-cpp-python's Python modules, without building a library of their own."""
    env = {**os.environ, "CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"}
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", str(sdist())], check=True, env=env)


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "build"
    if what == "build":
        print(build())
    elif what == "bindings":
        bindings()
    elif what == "where":
        print(lib_dir())
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
