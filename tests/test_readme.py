"""The README's configuration table and commands stay true to the code."""

from __future__ import annotations

import re

import pytest

from scripts.stack import ROOT
from tasks.config import Settings

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it

README = (ROOT / "README.md").read_text()


def env_name(field: str, info) -> str:
    alias = info.validation_alias
    return alias if isinstance(alias, str) else "GENQ_" + field.upper()


def test_every_setting_is_in_the_configuration_table():
    table = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`((?:GENQ_|REDIS_)[A-Z_]+)`", table))
    expected = {env_name(f, info) for f, info in Settings.model_fields.items()}
    assert expected - documented == set(), "undocumented settings"
    # Read by the worker and `make run` directly, not by Settings.
    launcher_only = {"GENQ_LOG_LEVEL", "GENQ_ENGINES"}
    assert documented - expected - launcher_only == set(), "documented settings that do not exist"


def test_the_two_commands_are_shown():
    assert "make run" in README and "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def python_examples(section: str) -> list[str]:
    text = README.split(section, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_python_client_example_runs_as_pasted(echo_stack):
    """The README's client example, pasted into python with GENQ_URL naming a live stack."""
    import os
    import subprocess
    import sys

    (example,) = python_examples("## Python client and CLI")
    env = {**os.environ, "GENQ_URL": echo_stack.base}
    env.pop("GENQ_API_KEY", None)
    out = subprocess.run(
        [sys.executable, "-c", example], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.rstrip().endswith("True"), out.stdout  # the stream's text is the job's
