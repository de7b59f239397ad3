"""Offline development checkpoints: random-weight decoders with a locally trained tokenizer.

`build()` writes a directory that `from_pretrained` loads like a hub checkpoint, with no model
hub: a real architecture (`--arch`, OPT by default) with random weights, and a byte-level BPE
tokenizer with OPT's special tokens and a chat template (`CHAT_TEMPLATE`). The text is
gibberish: these checkpoints exercise loading, batching, streaming and serving. The same arch,
shape and seed give the same weights; a build already in DIR is kept unless `--force`.

    python -m scripts.devmodels --shape tiny|opt-125m --out DIR [--arch opt] [--seed 0] [--force]

What they are (sizes, architectures, template): scripts/devmodel_archs.py, whose names this
module re-exports. How they are made: docs/design.md, "Offline development checkpoints".
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scripts import checkpoint_dirs
from scripts.devmodel_archs import (
    ARCHS,
    BOS_TOKEN_ID,
    CHAT_TEMPLATE,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    SHAPES,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB,
    model_config,
)

__all__ = [
    "ARCHS",
    "CHAT_TEMPLATE",
    "SHAPES",
    "TOKENIZER_VOCAB",
    "SPECIAL_TOKENS",
    "MARKER_NAME",
    "FORMAT_VERSION",
    "build",
    "ensure",
    "is_built",
    "main",
    "model_config",
]

#: Bump when the on-disk layout or the recipe changes: existing checkpoints are then rebuilt.
FORMAT_VERSION = 2

#: Marker file written (last) into every checkpoint built here.
MARKER_NAME = "genq-devmodel.json"

# Cap on training text per shape (characters).  The whole 3.11 stdlib is ~12.6M characters and
# trains the 50k tokenizer in a few seconds.
_CORPUS_CHARS: dict[str, int] = {"tiny": 2_000_000, "opt-125m": 16_000_000}

_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_NAME,
)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def build(shape: str, out: str | os.PathLike[str], seed: int = 0, force: bool = False, arch: str = "opt") -> Path:
    """Build an ``arch`` checkpoint of ``shape``'s size into ``out``; return its absolute path.

    Does nothing if ``out`` already holds a complete checkpoint of the same arch, shape, seed
    and format version, unless ``force``.  A checkpoint of another arch/shape/seed built by this
    module is replaced.  A non-empty directory that this module did not build raises
    ``FileExistsError`` (even with ``force``), so a mistyped ``out`` cannot delete anything else.
    """
    return _build(shape, out, seed, force, arch)[0]


def ensure(shape: str, out: str | os.PathLike[str], seed: int = 0, arch: str = "opt") -> Path:
    """Return ``out``, building the checkpoint first only if it is missing or different."""
    return build(shape, out, seed=seed, force=False, arch=arch)


def is_built(out: str | os.PathLike[str], shape: str, seed: int = 0, arch: str = "opt") -> bool:
    """True if ``out`` holds a complete ``arch`` checkpoint of ``shape``/``seed`` from this
    version."""
    out = Path(out)
    marker = _read_marker(out)
    if marker is None or arch not in ARCHS or shape not in SHAPES:
        return False
    return (
        marker.get("format_version") == FORMAT_VERSION
        and marker.get("arch", "opt") == arch
        and marker.get("shape") == shape
        and marker.get("seed") == seed
        and marker.get("config") == _jsonable(model_config(arch, shape)[2])
        and marker.get("tokenizer_target_vocab") == TOKENIZER_VOCAB.get(shape)
        and all((out / name).is_file() for name in _REQUIRED_FILES)
    )


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------


def _build(shape: str, out: str | os.PathLike[str], seed: int, force: bool, arch: str = "opt") -> tuple[Path, bool]:
    """``build``; also says whether this call wrote the checkpoint."""
    model_config(arch, shape)  # raises on an unknown arch or shape
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    out = Path(out).expanduser().absolute()
    if not force and is_built(out, shape, seed, arch):
        return out, False  # fast path: no lock, no writes (works on a read-only mount)
    _check_replaceable(out)  # fail early, before creating anything; re-checked under the lock
    out.parent.mkdir(parents=True, exist_ok=True)

    with checkpoint_dirs.lock(out) as exclusive:
        if exclusive:  # no other build of `out` can be running: clear up killed ones
            checkpoint_dirs.remove_leftovers(out)
        if not force and is_built(out, shape, seed, arch):
            return out, False  # another process built it while we waited for the lock
        _check_replaceable(out)

        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            _write_checkpoint(tmp, shape, seed, arch)
            checkpoint_dirs.set_permissions(tmp)
            checkpoint_dirs.swap_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out, True


def _write_checkpoint(dest: Path, shape: str, seed: int, arch: str = "opt") -> None:
    started = time.monotonic()
    corpus_info, tok_len = _write_tokenizer(dest, shape)
    n_params = _write_model(dest, shape, seed, arch)
    if tok_len > SHAPES[shape]["vocab_size"]:  # cannot happen with TOKENIZER_VOCAB <= vocab_size
        raise RuntimeError(f"tokenizer has {tok_len} tokens > model vocab {SHAPES[shape]['vocab_size']}")

    import tokenizers
    import torch
    import transformers

    marker = {
        "format_version": FORMAT_VERSION,
        "arch": arch,
        "shape": shape,
        "seed": seed,
        "config": _jsonable(model_config(arch, shape)[2]),
        "tokenizer_target_vocab": TOKENIZER_VOCAB[shape],
        "tokenizer_len": tok_len,
        "parameters": n_params,
        "corpus": corpus_info,
        "built_with": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "build_seconds": round(time.monotonic() - started, 2),
    }
    # Written last: its presence means the directory is complete.
    (dest / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def _write_model(dest: Path, shape: str, seed: int, arch: str = "opt") -> int:
    import torch
    import transformers
    from transformers import GenerationConfig

    config_class, model_class, kwargs = model_config(arch, shape)
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [model_class]
    # fork_rng: seeding here must not disturb the caller's global RNG state; and initialise in
    # float32 whatever default dtype the caller set, so the bytes depend on the seed alone.
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.set_default_dtype(torch.float32)
        try:
            # Architectures of the same shape (Llama, Mistral) must not share weights.
            torch.manual_seed(seed if arch == "opt" else seed + zlib.crc32(arch.encode()))
            model = getattr(transformers, model_class)(config)
        finally:
            torch.set_default_dtype(default_dtype)
    model = model.to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    with _quiet_progress_bars():
        # One file, like facebook/opt-125m (whose weights are ~500 MB in float32).
        model.save_pretrained(dest, safe_serialization=True, max_shard_size="20GB")
    return sum(p.numel() for p in model.parameters())


def _write_tokenizer(dest: Path, shape: str) -> tuple[dict[str, Any], int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts, corpus_info = _stdlib_corpus(_CORPUS_CHARS[shape])

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB[shape],
        special_tokens=list(SPECIAL_TOKENS),  # ids 0..3, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    # OPT prepends </s> (id 2) as BOS to every text; this is the template transformers itself
    # builds for add_bos_token=True, so the json and the tokenizer_config agree.
    tok.post_processor = processors.TemplateProcessing(
        single="</s>:0 $A:0",
        pair="</s>:0 $A:0 </s>:1 $B:1",
        special_tokens=[("</s>", BOS_TOKEN_ID)],
    )

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="</s>",
        eos_token="</s>",
        unk_token="</s>",  # as in facebook/opt-*; byte-level BPE never needs it
        pad_token="<pad>",
        add_bos_token=True,  # same template as the post_processor above
        add_eos_token=False,
        add_prefix_space=False,
        model_max_length=SHAPES[shape]["max_position_embeddings"],
        padding_side="right",
        truncation_side="right",
        clean_up_tokenization_spaces=False,  # decode must give back the text exactly
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(dest)

    # Name a class every transformers version knows: v5 writes "TokenizersBackend", which v4
    # (e.g. in a vLLM install) does not have.  v5 maps "PreTrainedTokenizerFast" to
    # TokenizersBackend; both load tokenizer.json as is.
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.update(add_bos_token=True, add_eos_token=False)  # as facebook/opt-* declares
    cfg["chat_template"] = CHAT_TEMPLATE  # where transformers 4 (vLLM's) looks for it
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return corpus_info, len(hf_tok)


def _stdlib_corpus(max_chars: int) -> tuple[list[str], dict[str, Any]]:
    """Deterministic training text: the stdlib's .py files (tests excluded), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        rel = Path(dirpath).relative_to(root)
        rel_paths.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    files = [root / r for r in sorted(rel_paths)]
    texts: list[str] = []
    digest = hashlib.sha256()
    n = 0
    for f in files:
        if n >= max_chars:
            break
        try:
            text = f.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        text = text[: max_chars - n]
        texts.append(text)
        digest.update(text.encode("utf-8"))
        n += len(text)
    if n < 100_000:
        raise RuntimeError(f"too little training text under {root} ({n} characters)")
    info = {
        "source": "python-stdlib",
        "python": sys.version.split()[0],
        "files": len(texts),
        "chars": n,
        "sha256": digest.hexdigest(),
    }
    return texts, info


# --------------------------------------------------------------------------------------------
# Helpers (the lock, temp dir and swap: scripts/checkpoint_dirs.py)
# --------------------------------------------------------------------------------------------


def _read_marker(out: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((out / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _check_replaceable(out: Path) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise FileExistsError(f"{out} exists and is not a directory; refusing to replace it")
    if any(out.iterdir()) and _read_marker(out) is None:
        raise FileExistsError(
            f"{out} is a non-empty directory not built by scripts.devmodels (no {MARKER_NAME}); "
            "refusing to replace it -- remove it or choose another --out"
        )


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj)) if obj is not None else None


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.devmodels",
        description="Build a random-weight decoder checkpoint with a locally trained byte-level BPE "
        "tokenizer, loadable offline with AutoTokenizer/AutoModelForCausalLM.from_pretrained.",
    )
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the size (opt-125m: that model's)")
    parser.add_argument("--arch", default="opt", choices=sorted(ARCHS), help="the architecture (default opt)")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error("--seed must be >= 0")

    started = time.monotonic()
    try:
        out, built = _build(args.shape, args.out, args.seed, args.force, args.arch)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if built:
        action = f"built in {time.monotonic() - started:.1f}s"
    else:
        action = "up to date (use --force to rebuild)"

    marker = _read_marker(out) or {}
    cfg = SHAPES[args.shape]
    print(f"devmodel {args.arch} {args.shape} (seed {args.seed}) at {out}: {action}")
    print(
        f"{args.arch} {marker.get('parameters', 0) / 1e6:.1f}M params, hidden {cfg['hidden_size']}, "
        f"{cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads, "
        f"max_pos {cfg['max_position_embeddings']}, model vocab {cfg['vocab_size']}, "
        f"tokenizer {marker.get('tokenizer_len', '?')} tokens, float32 safetensors"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
