"""A GGUF file as the model: `GENQ_MODEL=path/to/model.gguf` serves it, converted once.

The engines load checkpoints (config, safetensors, tokenizer) as a hub download gives them.
A GGUF file (llama.cpp's format: weights, often quantized, with the tokenizer and the chat
template inside) is turned into one by transformers' own GGUF loader (the `gguf` package):
dequantized to float32, saved beside its tokenizer, in `GENQ_GGUF_CACHE` under the file's
name, size and modification time, so that the next start (and every worker of the machine)
finds it there. Only the architectures transformers' GGUF loader knows convert (Llama, Mistral,
Qwen2/3, Phi-3, Gemma, GPT-2, ... : its `GGUF_SUPPORTED_ARCHITECTURES`); another is an error
at start that says so. The served name, without GENQ_MODEL_NAME, is the file's stem
(tasks/config.py `served_model`).

Two workers that start at once may both convert; each writes a directory of its own and moves
it into place, the second finding the first's there and keeping it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

MARKER = "genq-gguf.json"


def is_gguf(model: str) -> bool:
    return model.lower().endswith(".gguf")


def cache_dir_of(gguf: Path, cache: str | Path) -> Path:
    st = gguf.stat()
    return Path(cache).expanduser().absolute() / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"


def converted(model: str, cache: str | Path) -> Path:
    """The checkpoint of the GGUF file `model`: from the cache, or converted into it first."""
    gguf = Path(model).expanduser().absolute()
    if not gguf.is_file():
        raise FileNotFoundError(f"GENQ_MODEL={model}: no such GGUF file")
    out = cache_dir_of(gguf, cache)
    if (out / MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    started = time.monotonic()
    log.warning("converting %s into a checkpoint at %s (once; later starts load that)", gguf, out)
    try:
        facts = convert(gguf, tmp)
        facts.update(source=str(gguf), seconds=round(time.monotonic() - started, 1))
        (tmp / MARKER).write_text(json.dumps(facts, indent=2) + "\n")
        try:
            tmp.rename(out)
        except OSError:  # another worker's conversion got there first
            if not (out / MARKER).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.warning("converted %s in %.1f s", gguf.name, time.monotonic() - started)
    return out


def convert(gguf: Path, dest: Path) -> dict:
    """Load the GGUF with transformers (dequantized to float32) and save it as safetensors with
    its tokenizer into `dest`; returns facts about it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ValueError as exc:  # "GGUF model with architecture x is not supported yet."
        raise ValueError(f"{gguf.name}: transformers cannot load this GGUF file: {exc}") from None
    # The weights are plain float32 tensors now; without this the saved config would name the
    # GGUF quantizer and from_pretrained(dest) would look for the .gguf file.
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(dest, max_shard_size="20GB")
    save_tokenizer(tok, dest, model.config.max_position_embeddings)
    c = model.config
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "model_type": c.model_type,
        "max_position_embeddings": c.max_position_embeddings,
        "chat_template": bool(tok.chat_template),
        "tokenizer_len": len(tok),
        "pid": os.getpid(),
    }


def save_tokenizer(tok, dest: Path, max_len: int) -> None:
    """Save `tok` (read from a GGUF file) into `dest` so that any transformers loads it with its
    chat template: name a class every transformers version knows (v5 writes
    TokenizersBackend), keep the template in tokenizer_config.json too (transformers 4 reads it
    there), and drop what the GGUF loading left in (load-time flags, an unbounded length)."""
    tok.save_pretrained(dest)
    path = dest / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=max_len, clean_up_tokenization_spaces=False)
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def tokenizer_of(model: str, cache: str | Path) -> Path:
    """A directory with the tokenizer (and chat template) of the GGUF file `model` alone, for an
    engine that runs the file itself (worker/engines/llamacpp.py): from the cache, or saved into
    it first (seconds: no weights are read)."""
    from transformers import AutoConfig, AutoTokenizer

    gguf = Path(model).expanduser().absolute()
    if not gguf.is_file():
        raise FileNotFoundError(f"GENQ_MODEL={model}: no such GGUF file")
    out = cache_dir_of(gguf, cache).with_name(cache_dir_of(gguf, cache).name + "-tokenizer")
    if (out / "tokenizer_config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        save_tokenizer(tok, tmp, cfg.max_position_embeddings)
        try:
            tmp.rename(out)
        except OSError:  # another worker's got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
