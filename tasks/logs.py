"""Logging for the API and the workers alike: plain text by default, one JSON object per line
with `GENQ_LOG_FORMAT=json` (what a log shipper parses without regexes).

One configuration (`configure`) serves every process: webapp/gunicorn_conf.py applies it in
gunicorn's arbiter (and sends gunicorn's own lines through it), a worker in worker/__main__.py,
`make run`'s launcher in scripts/stack.py. Python's warnings go through it too, so that with
JSON every line is JSON from the first one.

`job_event` writes the log's record of a job: one line per step of its life (queued in the API,
running and finished in a worker) with its id, model, owner, queue time, tokens and finish
reason, and never its prompt or text (user data). In JSON the fields are keys of their own; in
text they follow the event as key=value pairs.
"""

from __future__ import annotations

import json
import logging
import time

JOBS = logging.getLogger("genq.jobs")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "genq", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def config(fmt: str = "text", level: str = "INFO") -> dict:
    """A `logging.config.dictConfig` dict: every line to stderr through one handler."""
    formatter = {"()": "tasks.logs.JsonFormatter"} if fmt == "json" else {"format": TEXT_FORMAT}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"genq": formatter},
        "handlers": {"genq": {"class": "logging.StreamHandler", "formatter": "genq", "stream": "ext://sys.stderr"}},
        "root": {"level": level.upper(), "handlers": ["genq"]},
    }


def configure(fmt: str = "text", level: str = "INFO") -> None:
    """Apply `config` to this process, with Python's warnings as log records (`py.warnings`)."""
    import logging.config

    logging.config.dictConfig(config(fmt, level))
    logging.captureWarnings(True)


def libraries_as_json(level: str = "INFO", transformers: bool = True) -> None:
    """A worker's libraries that write lines of their own, through our handler instead (call
    before they load a model): vLLM, in this process and the engine processes it spawns (by its
    VLLM_LOGGING_CONFIG_PATH), Celery's notices on stdout, and transformers (its own stderr
    handler; imported here when `transformers`)."""
    import os
    import tempfile

    vllm = {
        **config("json", level),
        "loggers": {"vllm": {"handlers": ["genq"], "level": level.upper(), "propagate": False}},
    }
    del vllm["root"]
    path = os.path.join(tempfile.gettempdir(), f"genq-vllm-logging-{level.upper()}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(vllm, fh)
    os.replace(path + ".tmp", path)
    os.environ.setdefault("VLLM_LOGGING_CONFIG_PATH", path)
    # Celery writes its shutdown notices ("worker: Warm shutdown") straight to stdout.
    from celery.apps import worker as celery_worker

    celery_worker.safe_say = lambda msg, f=None: logging.getLogger("celery.apps.worker").info(str(msg).strip())
    if not transformers:
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


def native_stderr_as_json(logger: str = "native") -> None:
    """Lines that native code writes straight to file descriptor 2 (xgrammar's and torch's C++
    warnings, which no Python handler sees) as log records too: fd 2 becomes a pipe that a
    thread reads line by line, and this process's handlers write to the stderr it had. A line
    that already is a JSON object (a child process's own record, which inherits the pipe)
    passes as it is. Call after `configure("json")`."""
    import os
    import sys
    import threading

    read, write = os.pipe()
    saved = os.dup(2)
    out = os.fdopen(saved, "w", buffering=1, encoding="utf-8", errors="replace")
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
            handler.setStream(out)
    sys.stderr = out
    os.dup2(write, 2)
    os.close(write)
    log = logging.getLogger(logger)

    def pump() -> None:
        with os.fdopen(read, "rb") as pipe:
            for raw in pipe:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if not line.strip():
                    continue
                if line.startswith("{"):
                    try:
                        json.loads(line)
                    except ValueError:
                        pass
                    else:
                        out.write(line + "\n")
                        continue
                log.warning("%s", line)

    threading.Thread(target=pump, name="genq-native-stderr", daemon=True).start()


def _text(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def job_event(event: str, job_id: str, **fields) -> None:
    """One line for one step of a job's life; fields that are None are left out."""
    if not JOBS.isEnabledFor(logging.INFO):
        return
    fields = {k: v for k, v in fields.items() if v is not None}
    pairs = " ".join(f"{k}={_text(v)}" for k, v in fields.items())
    JOBS.info(
        "job %s %s %s", event, job_id, pairs, extra={"genq": {"event": f"job.{event}", "job_id": job_id, **fields}}
    )
