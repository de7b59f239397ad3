"""`Client`: the genqueue API from Python (on httpx).

    from genqueue import Client
    c = Client()                                   # GENQ_URL, GENQ_API_KEY, else 127.0.0.1:8000
    job_id = c.submit("Hello, my name is", max_new_tokens=16)
    print(c.wait(job_id)["result"]["text"])
    for token in c.stream(c.submit("Once upon a time", max_new_tokens=64)):
        print(token, end="", flush=True)

Errors are exceptions of genqueue.errors (all `GenqError`); see there. Here: jobs, chat,
embeddings and health; the files and batches methods in genqueue/batches.py (`BatchAPI`), token streams in
genqueue/streams.py (`TokenStream`, `Restart`).
"""

from __future__ import annotations

import array
import base64
import os
import re
import sys
import time
from typing import Any

import httpx

from genqueue import errors
from genqueue.batches import BATCH_FINAL, BatchAPI
from genqueue.errors import BadRequest, ConnectError, GenqError, WaitTimeout
from genqueue.streams import Restart, TokenStream

__all__ = ["ACTIVE", "BATCH_FINAL", "DEFAULT_URL", "Client", "Restart", "TokenStream", "result_text"]

DEFAULT_URL = "http://127.0.0.1:8000"
ACTIVE = ("queued", "running")  # every other status is final


class Client(BatchAPI):
    """A client of one genqueue API.

    `base_url`: default `GENQ_URL`, else http://127.0.0.1:8000 (a trailing `/v1` is dropped,
    so the OpenAI base URL works too). `api_key`: default `GENQ_API_KEY`; sent as
    `Authorization: Bearer <key>`. `timeout`: seconds for connecting and for each response
    (waits add their own length). `max_reconnects`: how many times in a row a token stream
    reconnects after a dropped connection before it gives up. `transport`: an httpx transport
    (tests)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 30.0,
        *,
        max_reconnects: int = 8,
        transport: httpx.BaseTransport | None = None,
    ):
        url = (base_url or os.environ.get("GENQ_URL") or DEFAULT_URL).rstrip("/")
        self.base_url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.api_key = api_key if api_key is not None else (os.environ.get("GENQ_API_KEY") or None)
        self.timeout = timeout
        self.max_reconnects = max_reconnects
        self.wait_step = 20.0  # seconds per GET ?wait= (at most the server's GENQ_MAX_WAIT)
        headers = {"User-Agent": "genqueue-client"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- HTTP --------------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.TimeoutException as exc:
            raise ConnectError(None, "timeout", f"{method} {self.base_url}{path}: no answer in time ({exc})") from exc
        except httpx.TransportError as exc:
            raise ConnectError(None, "connection_error", f"cannot reach {self.base_url}: {exc}") from exc
        if resp.status_code >= 400:
            raise errors.of_response(resp)
        return resp

    def _json(self, method: str, path: str, **kw) -> Any:
        return self._request(method, path, **kw).json()

    # -- jobs --------------------------------------------------------------------------------

    def submit(self, prompt: str, idempotency_key: str | None = None, **params: Any) -> str:
        """Queue a job (POST /v1/jobs) and return its id. `params`: the job's fields
        (`max_new_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`, `model`,
        `callback_url`, ...); None values are left out. `idempotency_key`: sent as the
        `Idempotency-Key` header, so that submitting again with it (after a timeout, say)
        returns the same job instead of queueing another."""
        body = {"prompt": prompt, **{k: v for k, v in params.items() if v is not None}}
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else None
        return self._json("POST", "/v1/jobs", json=body, headers=headers)["id"]

    def get(self, job_id: str) -> dict:
        """The job as it is now (GET /v1/jobs/{id}): status, timings, result or error."""
        return self._json("GET", f"/v1/jobs/{job_id}")

    def wait(self, job_id: str, timeout: float | None = None) -> dict:
        """Block until the job has ended (succeeded, failed, cancelled, ...) and return it, with
        long polls (GET ?wait=). `timeout`: seconds, None for as long as it takes; past it
        `WaitTimeout` (the job goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            step = self.wait_step if left is None else max(0.0, min(self.wait_step, left))
            try:
                job = self._json(
                    "GET", f"/v1/jobs/{job_id}", params={"wait": f"{step:.3f}"}, timeout=self.timeout + step
                )
            except BadRequest as exc:
                limit = _wait_limit(exc)
                if limit is None or limit >= self.wait_step:
                    raise
                self.wait_step = max(limit, 0.1)  # the server allows shorter waits only
                continue
            if job.get("status") not in ACTIVE:
                return job
            if left is not None and left <= step:
                raise WaitTimeout(
                    None,
                    "wait_timeout",
                    f"job {job_id} is still {job.get('status')} after {timeout:g} s",
                    job_id=job_id,
                    job=job,
                )

    def cancel(self, job_id: str) -> dict:
        """Cancel a queued or running job (POST /v1/jobs/{id}/cancel); returns the job.
        `Conflict` (409) if it has already ended."""
        return self._json("POST", f"/v1/jobs/{job_id}/cancel")

    def complete(self, prompt: str, timeout: float | None = None, **params: Any) -> str:
        """Submit, wait and return the completion's text. Raises `JobError`/`JobCancelled` if
        the job fails; on `WaitTimeout` (or Ctrl-C) the job is cancelled."""
        job_id = self.submit(prompt, **params)
        try:
            job = self.wait(job_id, timeout)
        except (WaitTimeout, KeyboardInterrupt):
            self._cancel_quietly(job_id)
            raise
        return result_text(job)

    def chat(self, messages: str | list[dict], timeout: float | None = None, **params: Any) -> str:
        """The assistant's reply to a conversation (POST /v1/chat/completions, blocking):
        `messages` as OpenAI's (`[{"role": "user", "content": "..."}]`), or a str (one user
        message). `params`: the request's other fields (`model`, `max_tokens`, `temperature`,
        ...); None values are left out. `timeout`: seconds for the answer (default: no limit).
        With `tools`, a reply of tool calls alone has no content (None): `chat_completion`
        returns the whole answer, its `message.tool_calls` among it."""
        return self.chat_completion(messages, timeout, **params)["choices"][0]["message"]["content"]

    def chat_completion(self, messages: str | list[dict], timeout: float | None = None, **params: Any) -> dict:
        """The whole answer of POST /v1/chat/completions (see `chat`)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body = {"messages": messages, **{k: v for k, v in params.items() if v is not None}}
        limit = httpx.Timeout(self.timeout, read=timeout)
        return self._json("POST", "/v1/chat/completions", json=body, timeout=limit)

    def embed(self, inputs: str | list[str] | list[list[int]], timeout: float | None = None, **params: Any) -> list:
        """The embedding vectors of `inputs` (POST /v1/embeddings, blocking): for a str, its
        vector (a list of floats); for a list of texts (or of token-id lists), one vector each,
        in order. `params`: the request's other fields (`model`, `dimensions`,
        `truncate_prompt_tokens`, `priority`, ...); None values are left out. The vectors
        travel as base64 float32 (a quarter of the bytes of JSON floats). `timeout`: seconds
        for the answer (default: no limit)."""
        body = self.embeddings(inputs, timeout, encoding_format="base64", **params)
        vectors = [_floats(d["embedding"]) for d in sorted(body["data"], key=lambda d: d["index"])]
        return vectors[0] if isinstance(inputs, str) else vectors

    def embeddings(self, inputs: str | list, timeout: float | None = None, **params: Any) -> dict:
        """The whole answer of POST /v1/embeddings (`data`, `usage`, ...; see `embed`)."""
        body = {"input": inputs, **{k: v for k, v in params.items() if v is not None}}
        limit = httpx.Timeout(self.timeout, read=timeout)
        return self._json("POST", "/v1/embeddings", json=body, timeout=limit)

    def stream(self, job_id: str, last_event_id: str | int | None = None) -> TokenStream:
        """The job's tokens as they are generated (GET /v1/jobs/{id}/stream, SSE): an iterator
        of `str`, which reconnects by itself with `Last-Event-ID` after a dropped connection
        (no gap, no duplicate). If the job started over on another worker it yields a
        `Restart` (discard the text so far). A job that fails or is cancelled raises
        `JobError`/`JobCancelled`. See `TokenStream`."""
        return TokenStream(self, job_id, last_event_id)

    def _open_stream(self, job_id: str, last_event_id: str | None) -> httpx.Response:
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        # The server sends a keep-alive every 2 s: a longer silence is a dead connection.
        timeout = httpx.Timeout(self.timeout, read=max(10.0, min(self.timeout, 60.0)))
        req = self._http.build_request("GET", f"/v1/jobs/{job_id}/stream", headers=headers, timeout=timeout)
        try:
            resp = self._http.send(req, stream=True)
        except httpx.TransportError as exc:
            raise ConnectError(None, "connection_error", f"cannot reach {self.base_url}: {exc}") from exc
        if resp.status_code >= 400:
            try:
                resp.read()
            finally:
                resp.close()
            raise errors.of_response(resp)
        return resp

    def _cancel_quietly(self, job_id: str) -> None:
        try:
            self.cancel(job_id)
        except GenqError:
            pass

    # -- health ------------------------------------------------------------------------------

    def ready(self) -> dict:
        """GET /readyz: `{"status": "ready", "model", "workers"}`; `ServerError` (503) with
        the reason when no worker with a loaded model serves the default model."""
        return self._json("GET", "/readyz")

    def workers(self) -> list[dict]:
        """The live workers serving the default model (from /readyz): `name`, `engine`,
        `capacity`, `host`, `model`. `ServerError` (503 `not_ready`) when there is none."""
        ready = self.ready()
        return [{"model": ready.get("model"), **w} for w in ready.get("workers", [])]


def result_text(job: dict) -> str:
    """A finished job's completion text; `JobError`/`JobCancelled` unless it succeeded."""
    if job.get("status") != "succeeded":
        raise errors.job_error(job.get("id", "?"), job.get("error"), job, job.get("status"))
    return job["result"]["text"]


def _floats(b64: str) -> list[float]:
    """A vector from base64 little-endian float32 (OpenAI's `encoding_format: base64`)."""
    values = array.array("f", base64.b64decode(b64))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _wait_limit(exc: BadRequest) -> float | None:
    """The longest ?wait= the server takes, from its 400 (`wait: ... from 0 to N`)."""
    m = re.match(r"wait: .* to ([0-9.]+)", exc.message)
    return float(m.group(1)) if m else None
