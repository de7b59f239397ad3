"""tasks/kombu_compat.py is written against the kombu and Celery it names: the versions
requirements.txt pins and the ones installed. Moving a pin means reading that module again."""

from __future__ import annotations

import re
from pathlib import Path

import celery
import kombu

from tasks import kombu_compat

ROOT = Path(__file__).resolve().parent.parent


def test_the_versions_it_names_are_the_pinned_and_installed_ones():
    reqs = (ROOT / "requirements.txt").read_text()
    pins = dict(re.findall(r"^(kombu|celery)(?:\[[^\]]*\])?==(\S+)", reqs, re.MULTILINE))
    assert pins == {"kombu": kombu_compat.KOMBU_VERSION, "celery": kombu_compat.CELERY_VERSION}
    assert (kombu.__version__, celery.__version__) == (kombu_compat.KOMBU_VERSION, kombu_compat.CELERY_VERSION)
    assert f"kombu {kombu_compat.KOMBU_VERSION} and celery {kombu_compat.CELERY_VERSION}" in kombu_compat.__doc__
