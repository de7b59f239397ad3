"""Safe retries: an `Idempotency-Key` request header on a submitting route (POST /v1/jobs,
/v1/completions, /v1/chat/completions, the teaching routes, /v1/files, /v1/batches).

Per owner (the API key's name, `""` on an open API) and for 24 h, the key stands for what the
first request with it created (its job ids, or its file or batch id) and for that request's
fingerprint: a SHA-256 of its route and its canonical body (JSON with sorted keys; a file's
bytes). A retry with the same fingerprint gets the same jobs (a blocking call waits for them, a
stream follows them); the same key with another body is a 409 `idempotency_key_reused`.

Two requests with one key never both create: the first claims the key (SET NX, its
fingerprint and a token of its own) before it creates anything, and stores what it created
after. A request that finds a claim without a result waits for it a little (WAIT_S), then
answers 409 `idempotency_key_in_use`. A request that fails before it created anything gives
its claim up (a retry may then create).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from flask import Flask, current_app, g, has_request_context, request

from tasks import keys
from webapp.errors import APIError

HEADER = "Idempotency-Key"
MAX_LEN = 255
TTL_S = 86_400
# A claim whose request died before it stored a result lapses after this long (a retry then
# creates anew); a stored result lasts TTL_S.
CLAIM_TTL_S = 60
# How long a request waits for another one holding its key to finish creating.
WAIT_S = 2.0
POLL_S = 0.05
EXTENSION = "genq_idempotency"

# Deletes a claim only while it is still the caller's own (no result stored). KEYS: the key.
# ARGV: the claim's value.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class IdempotencyStore:
    """The claims and results of Idempotency-Keys in Redis (keys.idempotency)."""

    def __init__(self, client: redis.Redis, ttl: int = TTL_S, wait_s: float = WAIT_S):
        self.r = client
        self.ttl = ttl
        self.wait_s = wait_s
        self._release = client.register_script(_RELEASE)

    def claim(self, owner: str, key: str, fp: str) -> tuple[str, str, dict[str, Any] | None]:
        """Claim `key` for a request of fingerprint `fp`: returns (Redis key, claim value,
        None) once claimed, or (…, …, the result stored) for a retry of a request that ended.
        409 for another body, or a claim still open after WAIT_S."""
        rkey = keys.idempotency(owner, key)
        mine = json.dumps({"fp": fp, "claim": uuid.uuid4().hex})
        deadline = time.monotonic() + self.wait_s
        while True:
            if self.r.set(rkey, mine, nx=True, ex=CLAIM_TTL_S):
                return rkey, mine, None
            raw = self.r.get(rkey)
            if raw is None:  # given up or expired meanwhile: claim again
                continue
            held = json.loads(raw)
            if held.get("fp") != fp:
                raise APIError(
                    409,
                    "idempotency_key_reused",
                    f"{HEADER} was used with another request (route or body) in the last 24 h; "
                    "use a new key for a new request",
                    param=HEADER,
                )
            if "result" in held:
                return rkey, mine, held["result"]
            if time.monotonic() >= deadline:
                raise APIError(
                    409,
                    "idempotency_key_in_use",
                    f"a request with this {HEADER} is still being created; retry shortly",
                    {"Retry-After": "1"},
                    param=HEADER,
                )
            time.sleep(POLL_S)

    def done(self, rkey: str, fp: str, result: dict[str, Any]) -> None:
        """Store what the claiming request created, for TTL_S."""
        self.r.set(rkey, json.dumps({"fp": fp, "result": result}), ex=self.ttl)

    def release(self, rkey: str, mine: str) -> None:
        self._release(keys=[rkey], args=[mine])


def init_app(app: Flask, client: redis.Redis) -> None:
    app.extensions[EXTENSION] = IdempotencyStore(client)


def header_key() -> str | None:
    """The request's Idempotency-Key (None: none, or no request); 400 for a bad one."""
    if not has_request_context():
        return None
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    if not raw.strip() or len(raw) > MAX_LEN or not raw.isprintable():
        raise APIError(
            400, "invalid_request", f"{HEADER}: 1 to {MAX_LEN} printable characters, not blank", param=HEADER
        )
    return raw


def canonical_digest(body: Any) -> str:
    """The SHA-256 of a parsed JSON body, whatever its key order and spacing."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def remember_body(body: Any) -> None:
    """Keep the digest of the request's parsed JSON body (webapp/routes/_body.py), for its
    fingerprint, where the request has an Idempotency-Key."""
    if has_request_context() and HEADER in request.headers:
        g.genq_body_digest = canonical_digest(body)


def fingerprint(body_digest: str | None = None) -> str:
    """The request's route and body (`body_digest`, or that of its JSON body) as one digest."""
    digest = body_digest if body_digest is not None else g.get("genq_body_digest", "")
    return hashlib.sha256(f"{request.method} {request.path}\n{digest}".encode()).hexdigest()


def once(
    owner: str, create: Callable[[], dict[str, Any]], body_digest: str | None = None
) -> tuple[dict[str, Any], bool]:
    """`create()` (what it made, as JSON), unless the request's Idempotency-Key already
    stands for what an earlier request with the same route and body made: then that, and
    True. Without the header: `create()`, and False."""
    key = header_key()
    if key is None:
        return create(), False
    store: IdempotencyStore = current_app.extensions[EXTENSION]
    fp = fingerprint(body_digest)
    rkey, mine, found = store.claim(owner, key, fp)
    if found is not None:
        return found, True
    try:
        made = create()
    except BaseException:
        store.release(rkey, mine)
        raise
    store.done(rkey, fp, made)
    return made, False
