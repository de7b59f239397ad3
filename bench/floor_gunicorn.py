"""Gunicorn settings for bench/floor_app.py: the HTTP server settings of genqueue's API
(webapp/gunicorn_conf.py: gevent, patched first, same connections, keep-alive, no access log),
without its hooks, which drive genqueue's own app."""

from gevent import monkey

monkey.patch_all()

import os  # noqa: E402

bind = f"127.0.0.1:{os.environ['GENQ_PORT']}"
workers = 1
worker_class = "gevent"
worker_connections = int(os.environ.get("GENQ_API_CONNECTIONS", "1000"))
timeout = 120
keepalive = 5
accesslog = None
errorlog = "-"
loglevel = "warning"
control_socket_disable = True
