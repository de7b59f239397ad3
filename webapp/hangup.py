"""Whether a blocking request's client has hung up, so that a long wait (a blocking job, a
stream) stops waiting for nobody (webapp/service.py, webapp/sse.py)."""

from __future__ import annotations

import select
import socket
from collections.abc import Callable


class ClientGone(Exception):
    """The client of a blocking call closed its connection."""


def client_gone(environ: dict | None) -> Callable[[], bool] | None:
    """A check whether this request's client has closed its connection, or None where the
    server does not tell (gunicorn puts the client socket in the environ; the test client and
    other servers do not). A readable socket that reads end-of-file (or fails) is closed; one
    that merely has the client's next request waiting is not, nor one that cannot be peeked
    at (TLS)."""
    sock = (environ or {}).get("gunicorn.socket")
    if sock is None:
        return None

    def gone() -> bool:
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and not sock.recv(1, socket.MSG_PEEK)
        except ValueError:
            return False
        except OSError:
            return True

    return gone
