"""The README's configuration table and commands stay true to the code."""

from __future__ import annotations

import re

from scripts.stack import ROOT
from tasks.config import Settings

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
