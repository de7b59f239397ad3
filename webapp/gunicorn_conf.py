"""Gunicorn settings for the API, from the same environment as everything else.

gevent workers: a blocking call or an open stream spends its life waiting on Redis, so each
costs a greenlet rather than a thread, and a process holds thousands of them.
"""

from gevent import monkey

# Patch before anything imports ssl, sockets or threads (gunicorn would patch later, too late).
monkey.patch_all()

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
