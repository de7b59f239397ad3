"""OpenAI's Batch API on the job queue: files (`files.py`), batches (`store.py`: with the file
store, all their Redis), the driver that runs them (`driver.py`), the check of their input
(`validation.py`) and their output lines (`output.py`). The wire formats are
webapp/protocol/batches.py, the routes webapp/routes/batches.py; how a batch runs:
docs/design.md, "Batches"."""

from __future__ import annotations

from flask import Flask, current_app

from tasks.config import Settings
from webapp.batches.driver import BatchDriver
from webapp.batches.files import FileStore
from webapp.batches.store import BatchStore

EXTENSION = "genq_batches"


class Batches:
    """What the routes and the driver share, one per app (app.extensions[EXTENSION])."""

    def __init__(self, service, settings: Settings):
        self.files = FileStore(service.r, settings)
        self.store = BatchStore(service.r, settings, self.files)
        self.driver = BatchDriver(service, self.store)


def init_app(app: Flask, settings: Settings) -> None:
    app.extensions[EXTENSION] = Batches(app.extensions["genq"], settings)


def current_batches() -> Batches:
    return current_app.extensions[EXTENSION]


def start_driver(app: Flask) -> None:
    """Start the app's batch driver (gunicorn's post_worker_init: once per API process)."""
    app.extensions[EXTENSION].driver.start()
