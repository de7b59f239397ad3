"""API keys: who may call the API, under which name, within which limits. Keys come as
`Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's); they are
held only as SHA-256 digests, compared in constant time and never logged; the rest of the system
knows a key by its name. The keys file's format and every option: docs/api.md, "API keys"."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from flask import Flask, g, request

from tasks.config import Settings, is_loopback
from webapp.errors import error_response

# No key needed: health, metrics, and the OpenAPI document (the same for every caller, and
# what a client generator fetches first).
OPEN_PATHS = frozenset({"/healthz", "/health", "/readyz", "/metrics", "/openapi.json"})
NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
DIGEST = re.compile(r"sha256:([0-9a-fA-F]{64})")
LIMITS = ("max_queued", "max_new_tokens", "rpm", "tpm", "weight")
FLAGS = {"true": True, "false": False}


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes = field(repr=False)
    max_queued: int | None = None
    max_new_tokens: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    admin: bool = False
    weight: int = 1  # fair share's weight (tasks/fair.py)


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def default_name(d: bytes) -> str:
    return "key-" + d.hex()[:8]


def parse_line(line: str, where: str) -> ApiKey:
    """One keys-file line. Errors name the line, never the key."""
    secret, *options = line.split()
    m = DIGEST.fullmatch(secret)
    if secret.startswith("sha256:") and not m:
        raise ValueError(f"{where}: sha256: needs 64 hex digits")
    d = bytes.fromhex(m.group(1)) if m else digest(secret)
    opts: dict[str, str] = {}
    for opt in options:
        k, sep, v = opt.partition("=")
        if not sep or k not in ("name", "admin", *LIMITS) or k in opts:
            expected = ", ".join(f"{o}=" for o in ("name", *LIMITS, "admin"))
            raise ValueError(f"{where}: expected {expected} once each, got {k!r}")
        opts[k] = v
    name = opts.pop("name", None)
    name = default_name(d) if name is None else name
    if not NAME.fullmatch(name):
        raise ValueError(f"{where}: name: 1-64 letters, digits and _.@-")
    admin = opts.pop("admin", "false")
    if admin not in FLAGS:
        raise ValueError(f"{where}: admin: true or false")
    for k, v in opts.items():
        if not v.isdigit() or int(v) < 1:
            raise ValueError(f"{where}: {k}: a whole number from 1")
    return ApiKey(name, d, **{k: int(v) for k, v in opts.items()}, admin=FLAGS[admin])


def load_keys(settings: Settings) -> list[ApiKey]:
    """The keys of GENQ_API_KEYS and GENQ_API_KEYS_FILE. Configured but empty is an error, not
    an open API."""
    found: list[ApiKey] = []
    if settings.api_keys:
        for key in settings.api_keys.get_secret_value().split(","):
            if key.strip():
                d = digest(key.strip())
                found.append(ApiKey(default_name(d), d))
    if settings.api_keys_file:
        path = Path(settings.api_keys_file)
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                found.append(parse_line(line, f"{path} line {n}"))
    if settings.auth_enabled and not found:
        raise ValueError("GENQ_API_KEYS / GENQ_API_KEYS_FILE are set but hold no key")
    for attr, what in (("digest", "key"), ("name", "name")):
        values = [getattr(k, attr) for k in found]
        if len(set(values)) < len(values):
            raise ValueError(f"API keys: the same {what} twice")
    return found


class KeyTable:
    def __init__(self, keys: list[ApiKey]):
        self.keys = keys

    def find(self, presented: str) -> ApiKey | None:
        """The key whose digest matches, comparing with every key (constant time per key)."""
        d = digest(presented)
        match = None
        for key in self.keys:
            if hmac.compare_digest(key.digest, d):
                match = key
        return match


def _bearer() -> str | None:
    """The key the request presents: `Authorization: Bearer <key>`, or Anthropic's `x-api-key`
    header (what Anthropic's clients send for `api_key=`)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return request.headers.get("x-api-key", "").strip() or None
    return token.strip() or None


def init_app(app: Flask, settings: Settings) -> None:
    """Require a key on every route but OPEN_PATHS, if keys are configured."""
    keys = load_keys(settings)
    if not keys:
        return
    table = KeyTable(keys)

    @app.before_request
    def _authenticate():
        if request.path in OPEN_PATHS:
            return None
        token = _bearer()
        key = table.find(token) if token else None
        if key is None:
            challenge = 'Bearer realm="genqueue"' + (', error="invalid_token"' if token else "")
            message = "invalid API key" if token else "this API needs a key: send `Authorization: Bearer <key>`"
            return error_response(401, "unauthorized", message, {"WWW-Authenticate": challenge})
        g.genq_key = key
        return None


def current_owner() -> ApiKey | None:
    """The key of this request, or None when the API is open."""
    return g.get("genq_key")


def owner_name() -> str | None:
    key = current_owner()
    return key.name if key else None


def announce(settings: Settings, log: logging.Logger) -> None:
    """Once at start: which keys the API takes, or that it is open to the network without any.
    A bad keys file fails here, before any worker process starts."""
    if settings.auth_enabled:
        names = [k.name for k in load_keys(settings)]
        log.info("API keys required; %d key(s): %s", len(names), ", ".join(names))
    elif not is_loopback(settings.host):
        log.warning(
            "GENQ_HOST=%s opens the API to the network, and it has no API keys: anyone who reaches "
            "the port can submit, read and cancel jobs (set GENQ_API_KEYS or GENQ_API_KEYS_FILE)",
            settings.host,
        )
