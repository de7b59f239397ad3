"""What one client may hold of the API while it sends a request body (issue 33).

gunicorn cuts slow headers, but once a request's headers are in, the app reads its body for as
long as the client takes: 2,100 connections sending a byte every 10 s held every slot of the
API's processes. This WSGI middleware gives the whole body a deadline (`GENQ_BODY_TIMEOUT`, and a
second more for each MiB that arrives: 408 `body_timeout`, the connection closed) and bounds the bodies one client sends at once, per API
process, by its address and by its API key (`GENQ_MAX_BODIES_PER_CLIENT`: 429 `too_many_bodies`
at once, the body never read). Only bodies in flight count: a client's long-polls and streams do
not. It also refuses a body that ends before its `Content-Length` (the client closed its side):
400 `invalid_body`, nothing of it reaches a route. The address is the peer's (REMOTE_ADDR), not a
forwarded one: behind a proxy, the proxy should limit its clients.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import gevent

from webapp.errors import BodyCutShort, BodyTimeout, error_body

# A body that arrives at least this fast (bytes/s) never meets its deadline (a large upload).
MIN_BODY_RATE = 1 << 20


class _Body:
    """`wsgi.input` read under a deadline for the whole body (none: `deadline` None), and
    checked for its length; `arrived()` is called once, when the whole body is in."""

    def __init__(self, stream, deadline: float | None, length: int | None, arrived):
        self.stream, self.deadline, self.length, self.got = stream, deadline, length, 0
        self.arrived = arrived

    def _call(self, method, *args):
        if self.deadline is None:
            data = method(*args)
        else:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise BodyTimeout()
            with gevent.Timeout(left, BodyTimeout):
                data = method(*args)
            self.deadline += len(data) / MIN_BODY_RATE
        self.got += len(data)
        wanted = args[0] if args and args[0] is not None and args[0] >= 0 else None
        if self.length is not None and self.got < self.length and not data and wanted != 0:
            raise BodyCutShort(f"{self.got} of its {self.length} bytes arrived")
        if (self.length is not None and self.got >= self.length) or (not data and wanted != 0):
            self.arrived()
        return data

    def read(self, size=-1):
        data = self._call(self.stream.read, size)
        if (size is None or size < 0) and self.length is not None and self.got < self.length:
            raise BodyCutShort(f"{self.got} of its {self.length} bytes arrived")
        return data

    def readline(self, size=-1):
        return self._call(self.stream.readline, size)

    def readlines(self, hint=-1):
        return list(iter(self.readline, b""))

    def __iter__(self):
        return iter(self.readline, b"")


class BodyGuard:
    def __init__(self, app, timeout: float, per_client: int):
        self.app, self.timeout, self.per_client = app, timeout, per_client
        self.reading: Counter[tuple[str, str]] = Counter()  # bodies in flight, per client

    def __call__(self, environ, start_response):
        length = environ.get("CONTENT_LENGTH") or ""
        chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        if not chunked and length in ("", "0"):
            return self.app(environ, start_response)  # no body
        clients = [("addr", environ.get("REMOTE_ADDR") or "")]
        if environ.get("HTTP_AUTHORIZATION"):
            clients.append(("key", environ["HTTP_AUTHORIZATION"]))
        if self.per_client and any(self.reading[c] >= self.per_client for c in clients):
            return _refuse(
                start_response,
                429,
                "too_many_bodies",
                f"this client is sending {self.per_client} request bodies at once already "
                "(GENQ_MAX_BODIES_PER_CLIENT); send the next one when one has arrived",
                [("Retry-After", "1")],
            )
        for c in clients:
            self.reading[c] += 1
        held = [True]

        def arrived() -> None:
            """The body is in: the client no longer holds one of its bodies in flight (a
            blocking request that then waits for its jobs counts no more)."""
            if held[0]:
                held[0] = False
                for c in clients:
                    self.reading[c] -= 1
                    if not self.reading[c]:
                        del self.reading[c]

        try:
            size = None if chunked else int(length)
        except ValueError:
            size = None
        deadline = time.monotonic() + self.timeout if self.timeout else None
        environ["wsgi.input"] = _Body(environ["wsgi.input"], deadline, size, arrived)
        try:
            return self.app(environ, start_response)
        finally:
            arrived()


def _refuse(start_response, status: int, code: str, message: str, headers=()) -> list[bytes]:
    body = json.dumps(error_body(status, code, message)).encode()
    reason = {400: "Bad Request", 408: "Request Timeout", 429: "Too Many Requests"}[status]
    start_response(
        f"{status} {reason}",
        [("Content-Type", "application/json"), ("Content-Length", str(len(body))), ("Connection", "close"), *headers],
    )
    return [body]
