"""The README and docs/ stay true to the code: the configuration table, the two commands, every
relative link, the Python client examples (run against a live stack), and design essays kept
in docs/ rather than in module docstrings."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.stack import ROOT
from tasks.config import Settings

pytestmark = pytest.mark.tooling  # the project's tooling, not the product: `make test-core` skips it

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def env_name(field: str, info) -> str:
    alias = info.validation_alias
    return alias if isinstance(alias, str) else "GENQ_" + field.upper()


def test_every_setting_is_in_the_configuration_table():
    table = (DOCS / "configuration.md").read_text()
    documented = set(re.findall(r"`((?:GENQ_|REDIS_)[A-Z_]+)`", table))
    expected = {env_name(f, info) for f, info in Settings.model_fields.items()}
    assert expected - documented == set(), "undocumented settings"
    # Read by the worker and `make run` directly, not by Settings.
    launcher_only = {"GENQ_LOG_LEVEL", "GENQ_ENGINES"}
    assert documented - expected - launcher_only == set(), "documented settings that do not exist"


def test_the_two_commands_are_shown():
    assert "make run" in README and "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_stays_short():
    assert README.count("\n") <= 300


def test_module_docstrings_say_why_in_a_few_lines():
    """A module's docstring says why it exists; how it works at length belongs in docs/design.md."""
    long = []
    for package in ("tasks", "webapp", "worker", "genqueue"):
        for path in sorted((ROOT / package).rglob("*.py")):
            body = ast.parse(path.read_text()).body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                lines = body[0].end_lineno - body[0].lineno + 1
                if isinstance(body[0].value.value, str) and lines > 20:
                    long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert long == []


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but `-` and `_` dropped,
    spaces as `-`, a repeated one suffixed `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_points_at_something_that_exists(page):
    text = FENCE.sub("", page.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert broken == [], f"{page.name}: links to nothing"


def python_example(page: Path, section: str, needle: str) -> str:
    text = page.read_text().split(section, 1)[1].split("\n## ", 1)[0]
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", text, re.S) if needle in block]
    return example


def run_example(example: str, stack) -> str:
    """An example pasted into python with GENQ_URL naming a live stack; its output."""
    env = {**os.environ, "GENQ_URL": stack.base}
    env.pop("GENQ_API_KEY", None)
    out = subprocess.run(
        [sys.executable, "-c", example], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_readmes_client_example_runs_as_pasted(echo_stack):
    example = python_example(ROOT / "README.md", "## Three ways to call it", "from genqueue")
    out = run_example(example, echo_stack)
    assert out.rstrip().endswith("succeeded"), out


def test_the_python_client_example_runs_as_pasted(echo_stack):
    """docs/api.md's whole client example."""
    example = python_example(DOCS / "api.md", "## Python client and CLI", "from genqueue")
    out = run_example(example, echo_stack)
    assert out.rstrip().endswith("True"), out  # the stream's text is the job's
