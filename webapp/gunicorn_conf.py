"""Gunicorn settings for the API, from the same environment as everything else.

gevent workers: a blocking call or an open stream spends its life waiting on Redis, so each
costs a greenlet rather than a thread, and a process holds thousands of them.
"""

import os

from gevent import monkey

from tasks import logs  # the standard library only: nothing here needs patching

# Warnings as log lines from the first one (patching warns that gunicorn imported ssl first).
logs.configure(os.environ.get("GENQ_LOG_FORMAT", "text"), os.environ.get("GENQ_LOG_LEVEL", "INFO"))
# Patch before anything imports ssl, sockets or threads (gunicorn would patch later, too late).
monkey.patch_all()

import glob  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

from gunicorn import glogging, util  # noqa: E402

from tasks.config import get_settings  # noqa: E402

_s = get_settings()

bind = f"{_s.host}:{_s.port}"
workers = _s.api_workers
worker_class = "gevent"
worker_connections = _s.api_connections
timeout = int(_s.max_wait) + 30
graceful_timeout = 30
keepalive = 5
accesslog = None
errorlog = "-"
loglevel = "info"
# gunicorn's control socket has one default path per user: two APIs on one machine would share it.
control_socket_disable = True
# The app's lines and gunicorn's own through one handler, as text or JSON (GENQ_LOG_FORMAT).
# Not gunicorn's `logconfig_dict`: that turns its access log on, a line per request.
logs.configure(_s.log_format, os.environ.get("GENQ_LOG_LEVEL", "INFO"))


class _Logger(glogging.Logger):
    def setup(self, cfg):
        super().setup(cfg)
        self.error_log.handlers.clear()
        self.error_log.propagate = True


logger_class = _Logger


def _json_error(sock, status_int, reason, mesg):
    """gunicorn's own error answers as the API's JSON errors (webapp/errors.py's shape), not
    HTML: requests it refuses before the app sees them (a request line or header it cannot
    parse) and a malformed chunked body the app left unread, found as gunicorn drains it."""
    kind = "invalid_request_error" if status_int < 500 else "server_error"
    error = {"code": reason.lower().replace(" ", "_"), "message": mesg or reason, "type": kind, "param": None}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    util.write_nonblock(sock, head.encode("latin-1") + body)


# No setting chooses the body of these (gunicorn.workers.base.Worker.handle_error calls this).
util.write_error = _json_error

# Prometheus multiprocess mode (webapp/metrics.py): every API process writes its counts to files
# in one directory, which /metrics adds up. Set here in the arbiter, before any process imports
# prometheus_client: a directory of our own unless PROMETHEUS_MULTIPROC_DIR names one, emptied
# at start either way (counts an earlier run left there would be added in).
_own_metrics_dir = None
if _s.api_metrics:
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        _own_metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="genq-metrics-")
    os.makedirs(os.environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
    for _path in glob.glob(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "*.db")):
        os.remove(_path)
    from prometheus_client import values  # noqa: E402  (importing `webapp` may have loaded it)

    values.ValueClass = values.get_value_class()


def child_exit(server, worker):
    """A dead API process's open-stream gauge no longer counts (its counters still do)."""
    if _s.api_metrics:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    if _own_metrics_dir:
        shutil.rmtree(_own_metrics_dir, ignore_errors=True)


def post_worker_init(worker):
    """Every API process drives the batches (webapp/batches/driver.py; their state is all in Redis)
    and delivers the callbacks due (webapp/callbacks.py)."""
    from webapp import batches, callbacks

    batches.start_driver(worker.wsgi)
    worker.wsgi.extensions[callbacks.EXTENSION].start()


def when_ready(server):
    """Once, in the arbiter: which API keys it takes, or a warning that it is open."""
    from webapp import auth

    auth.announce(_s, server.log)
