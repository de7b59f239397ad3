"""Gunicorn settings for the API, from the same environment as everything else.

Threads, not processes, carry concurrency: blocking calls spend their time waiting on Redis,
so one process holds many of them cheaply.
"""

from tasks.config import get_settings

_s = get_settings()

bind = f"{_s.host}:{_s.port}"
workers = _s.api_workers
worker_class = "gthread"
threads = _s.api_threads
timeout = int(_s.max_wait) + 30
graceful_timeout = 30
keepalive = 5
accesslog = None
errorlog = "-"
loglevel = "info"
