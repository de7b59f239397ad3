"""Completion callbacks: a job's (or a batch's) `callback_url` gets one POST of its record, the
JSON of GET /v1/jobs/<id> (GET /v1/batches/<id>), once it ends.

The fact that a job ended and its callback's due entry are written together: the Lua of the
job's final transition (tasks/jobs.py) adds `job:<id>` to the due set (keys.CALLBACKS_DUE,
scored by when it is due) when the record has a `callback_url`; a batch's end adds `batch:<id>`
in the transaction that ends it (webapp/batches/store.py). A deliverer, a thread in every API
process (as the batch driver), claims each due entry by moving its score a lease ahead, in one
script: another process takes it up only once the lease has passed (its holder died). It
delivers up to GENQ_CALLBACK_CONCURRENCY at once (claiming no more than it has room for), so a
receiver that is slow to answer holds one delivery, not every other one behind it. It POSTs
the body signed `X-Genq-Signature: sha256=<hex HMAC-SHA256 of the body>` (GENQ_WEBHOOK_SECRET),
removes the entry on a 2xx, and otherwise moves it to the next try, backing off exponentially,
until GENQ_CALLBACK_DEADLINE after the end: delivered at least once, whichever process dies.

Where a callback may point is checked at submission (`check_url`): http or https, no
credentials in it, and a host of GENQ_CALLBACK_ALLOW where that is set; without it, only hosts
whose every address is public (not loopback, private, link-local, reserved).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from tasks import keys
from tasks.config import Settings
from webapp.errors import BROKER_ERRORS, APIError
from webapp.protocol.batches import Batch
from webapp.protocol.jobs import JobView

log = logging.getLogger(__name__)

SIGNATURE = "X-Genq-Signature"
# Where create_app keeps the app's deliverer (gunicorn's post_worker_init starts it).
EXTENSION = "genq_callbacks"
TICK_S = 0.2
# After a tick that found nothing due, the next comes later (an idle API's Redis commands).
IDLE_TICK_S = 1.0
# Entries one tick claims at most.
CLAIM_MAX = 16
# The first retry's delay, doubled each time, up to BACKOFF_MAX_S.
BACKOFF_S = 1.0
BACKOFF_MAX_S = 300.0

# Claims a due entry: moves its score to the lease's end if it is due (score <= now).
# KEYS: the due set. ARGV: member, now, lease end. Returns 1 if claimed.
_CLAIM = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if s and tonumber(s) <= tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[1])
  return 1
end
return 0
"""


def _invalid(param: str, why: str) -> APIError:
    return APIError(400, "invalid_request", f"{param}: {why}", param=param)


def allow_list(settings: Settings) -> list[str]:
    return [a.strip().lower() for a in settings.callback_allow.split(",") if a.strip()]


def allowed(host: str, port: int, allow: list[str]) -> bool:
    """Whether GENQ_CALLBACK_ALLOW lists the host: as `host`, `host:port`, or a `.suffix`
    (`*.suffix`) of it."""
    host = host.lower().rstrip(".")
    for entry in allow:
        if entry.startswith(("*.", ".")):
            suffix = entry.lstrip("*")
            if host.endswith(suffix) and len(host) > len(suffix):
                return True
        elif entry in (host, f"{host}:{port}", f"[{host}]:{port}", f"[{host}]"):
            return True
    return False


def public(host: str, port: int) -> bool:
    """Whether every address the host stands for is a public one (unknown: not)."""
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%", 1)[0]).is_global for i in infos)


def check_url(url: str | None, settings: Settings, param: str = "callback_url") -> None:
    """400 naming `param` unless `url` may be called back (None: no callback)."""
    if url is None:
        return
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise _invalid(param, "not a valid URL") from None
    if parts.scheme not in ("http", "https"):
        raise _invalid(param, "an http or https URL")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise _invalid(param, "must not carry credentials (user:password@)")
    host = parts.hostname
    if not host:
        raise _invalid(param, "needs a host")
    port = port or (443 if parts.scheme == "https" else 80)
    allow = allow_list(settings)
    if allowed(host, port, allow):
        return
    if allow:
        raise _invalid(param, f"the host {host!r} is not one GENQ_CALLBACK_ALLOW lists")
    if not public(host, port):
        raise _invalid(
            param, f"the host {host!r} is not a public address (list it in GENQ_CALLBACK_ALLOW to call it back)"
        )


def sign(body: bytes, secret: str) -> str:
    """The X-Genq-Signature of a body (GitHub's X-Hub-Signature-256 scheme)."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def backoff(attempts: int) -> float:
    return min(BACKOFF_S * 2 ** max(attempts - 1, 0), BACKOFF_MAX_S)


class CallbackDeliverer:
    """Delivers due callbacks, from every API process (a thread; a greenlet under gevent)."""

    def __init__(self, service, settings: Settings):
        self.service = service
        self.r = service.r
        self.settings = settings
        self.lease_s = settings.callback_timeout + 5
        self.stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._claim = self.r.register_script(_CLAIM)
        self._local = threading.local()  # a requests session per delivering thread
        self._warned = 0.0
        self.concurrency = settings.callback_concurrency
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="genq-callback")
        self._lock = threading.Lock()
        self._inflight = 0  # deliveries claimed and not yet done

    def start(self) -> None:
        if self.settings.webhook_secret is None:
            log.warning("GENQ_WEBHOOK_SECRET is not set: completion callbacks go unsigned")
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self.run, name="genq-callbacks", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self._pool.shutdown(wait=False)

    def run(self) -> None:
        pause = TICK_S
        while not self.stopped.wait(pause):
            pause = TICK_S
            try:
                pause = TICK_S if self.tick() or self._inflight else IDLE_TICK_S
            except BROKER_ERRORS as exc:
                if time.monotonic() - self._warned > 30:
                    self._warned = time.monotonic()
                    log.warning("callbacks: Redis unavailable: %s", exc)
            except Exception:
                log.exception("callbacks: tick failed")

    def tick(self) -> int:
        """Claim the entries due now, as many as there is room for, and start delivering them;
        returns how many were claimed."""
        room = min(CLAIM_MAX, self.concurrency - self._inflight)
        if room <= 0:
            return 0
        now = time.time()
        tried = 0
        for member in self.r.zrangebyscore(keys.CALLBACKS_DUE, "-inf", now, start=0, num=room):
            if self._claim(keys=[keys.CALLBACKS_DUE], args=[member, now, now + self.lease_s]):
                tried += 1
                with self._lock:
                    self._inflight += 1
                self._pool.submit(self._deliver_one, member)
        return tried

    def _deliver_one(self, member: str) -> None:
        try:
            self.deliver(member)
        except BROKER_ERRORS as exc:  # the entry stays due: its lease passes, it is tried again
            log.warning("callbacks: Redis unavailable delivering %s: %s", member, exc)
        except Exception:
            log.exception("callbacks: delivering %s failed", member)
        finally:
            with self._lock:
                self._inflight -= 1

    def _record(self, member: str) -> tuple[dict[str, str], dict[str, Any] | None, float]:
        """The entry's record, its callback body (None: it is gone), and when it ended."""
        kind, _, ident = member.partition(":")
        if kind == "batch":
            rec = self.r.hgetall(keys.batch(ident))
            if not rec:
                return rec, None, 0.0
            return rec, Batch.from_record(rec).model_dump(mode="json"), float(rec.get(f"{rec['status']}_at") or 0)
        rec = self.r.hgetall(keys.job(ident))
        if not rec:
            return rec, None, 0.0
        return rec, JobView.answer(self.service.view(ident)), float(rec.get("finished") or 0)

    def deliver(self, member: str) -> bool:
        """POST one claimed entry; True once delivered (or dropped: its record is gone)."""
        rec, payload, ended = self._record(member)
        url = rec.get("callback_url")
        if payload is None or not url:
            self._forget(member)
            return True
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "genqueue-callback", "X-Genq-Delivery": member}
        secret = self.settings.webhook_secret
        if secret is not None:
            headers[SIGNATURE] = sign(body, secret.get_secret_value())
        error = ""
        try:
            check_url(url, self.settings)  # again: where its host points may have changed
            resp = self._session().post(
                url, data=body, headers=headers, timeout=self.settings.callback_timeout, allow_redirects=False
            )
            if 200 <= resp.status_code < 300:
                self._forget(member)
                log.info("callback %s delivered to %s", member, url)
                return True
            error = f"HTTP {resp.status_code}"
        except APIError as exc:
            error = exc.message
        except requests.RequestException as exc:
            error = type(exc).__name__
        attempts = self.r.hincrby(keys.CALLBACKS_ATTEMPTS, member, 1)
        now = time.time()
        if now > (ended or now) + self.settings.callback_deadline:
            log.warning("callback %s to %s dropped after %d attempts (%s)", member, url, attempts, error)
            self._forget(member)
            return True
        log.info(
            "callback %s to %s failed (%s); attempt %d, next in %.0f s", member, url, error, attempts, backoff(attempts)
        )
        self.r.zadd(keys.CALLBACKS_DUE, {member: now + backoff(attempts)}, xx=True)
        return False

    def _session(self) -> requests.Session:
        if (http := getattr(self._local, "http", None)) is None:
            http = self._local.http = requests.Session()
        return http

    def _forget(self, member: str) -> None:
        pipe = self.r.pipeline()
        pipe.zrem(keys.CALLBACKS_DUE, member)
        pipe.hdel(keys.CALLBACKS_ATTEMPTS, member)
        pipe.execute()
