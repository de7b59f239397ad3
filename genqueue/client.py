"""`Client`: the genqueue API from Python (on httpx).

    from genqueue import Client
    c = Client()                                   # GENQ_URL, GENQ_API_KEY, else 127.0.0.1:8000
    job_id = c.submit("Hello, my name is", max_new_tokens=16)
    print(c.wait(job_id)["result"]["text"])
    for token in c.stream(c.submit("Once upon a time", max_new_tokens=64)):
        print(token, end="", flush=True)

Errors are exceptions of genqueue.errors (all `GenqError`); see there.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx

from genqueue import errors
from genqueue.errors import BadRequest, ConnectError, GenqError, ServerError, WaitTimeout

DEFAULT_URL = "http://127.0.0.1:8000"
ACTIVE = ("queued", "running")  # every other status is final
BATCH_FINAL = ("completed", "failed", "expired", "cancelled")


class Restart:
    """Yielded by `TokenStream` when the job started over on another worker (its worker died
    while it sampled): the tokens yielded before it are void; those after it are the new
    attempt's, from its first. (A greedy or seeded job gives the same tokens again, so the
    server resumes it without a seam and no Restart is yielded.)"""

    def __init__(self, attempt: int):
        self.attempt = attempt

    def __repr__(self) -> str:
        return f"Restart(attempt={self.attempt})"


class Client:
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
            raise _error_of(resp)
        return resp

    def _json(self, method: str, path: str, **kw) -> Any:
        return self._request(method, path, **kw).json()

    # -- jobs --------------------------------------------------------------------------------

    def submit(self, prompt: str, **params: Any) -> str:
        """Queue a job (POST /v1/jobs) and return its id. `params`: the job's fields
        (`max_new_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`, `model`, ...);
        None values are left out."""
        body = {"prompt": prompt, **{k: v for k, v in params.items() if v is not None}}
        return self._json("POST", "/v1/jobs", json=body)["id"]

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
        ...); None values are left out. `timeout`: seconds for the answer (default: no limit)."""
        return self.chat_completion(messages, timeout, **params)["choices"][0]["message"]["content"]

    def chat_completion(self, messages: str | list[dict], timeout: float | None = None, **params: Any) -> dict:
        """The whole answer of POST /v1/chat/completions (see `chat`)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body = {"messages": messages, **{k: v for k, v in params.items() if v is not None}}
        limit = httpx.Timeout(self.timeout, read=timeout)
        return self._json("POST", "/v1/chat/completions", json=body, timeout=limit)

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
            raise _error_of(resp)
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

    # -- files and batches (OpenAI's Batch API) ----------------------------------------------

    def upload_file(self, data: str | os.PathLike | bytes, filename: str | None = None) -> dict:
        """POST /v1/files with `purpose=batch`: a JSONL file (a path, or its bytes)."""
        if isinstance(data, bytes):
            files = {"file": (filename or "batch.jsonl", data, "application/jsonl")}
            return self._json("POST", "/v1/files", data={"purpose": "batch"}, files=files)
        path = Path(data)
        with path.open("rb") as fh:
            files = {"file": (filename or path.name, fh, "application/jsonl")}
            return self._json("POST", "/v1/files", data={"purpose": "batch"}, files=files)

    def create_batch(
        self,
        input_file_id: str,
        endpoint: str = "/v1/completions",
        completion_window: str = "24h",
        metadata: dict | None = None,
    ) -> dict:
        body = {"input_file_id": input_file_id, "endpoint": endpoint, "completion_window": completion_window}
        if metadata:
            body["metadata"] = metadata
        return self._json("POST", "/v1/batches", json=body)

    def get_batch(self, batch_id: str) -> dict:
        return self._json("GET", f"/v1/batches/{batch_id}")

    def cancel_batch(self, batch_id: str) -> dict:
        return self._json("POST", f"/v1/batches/{batch_id}/cancel")

    def file_lines(self, file_id: str) -> Iterator[dict]:
        """The JSON lines of a file (GET /v1/files/{id}/content), read as they arrive."""
        req = self._http.build_request("GET", f"/v1/files/{file_id}/content")
        try:
            resp = self._http.send(req, stream=True)
        except httpx.TransportError as exc:
            raise ConnectError(None, "connection_error", f"cannot reach {self.base_url}: {exc}") from exc
        try:
            if resp.status_code >= 400:
                resp.read()
                raise _error_of(resp)
            for line in resp.iter_lines():
                if line.strip():
                    yield json.loads(line)
        except httpx.TransportError as exc:
            raise ConnectError(None, "connection_error", f"file {file_id}: {exc}") from exc
        finally:
            resp.close()

    def batch_results(self, batch: dict, order: dict[str, int] | None = None) -> list[dict]:
        """The output lines of a batch that has ended (its output file, then its error file),
        `{id, custom_id, response {status_code, request_id, body}, error}`, sorted by `order`
        (custom_id -> input position) when given."""
        lines: list[dict] = []
        for key in ("output_file_id", "error_file_id"):
            if batch.get(key):
                lines.extend(self.file_lines(batch[key]))
        if order:
            lines.sort(key=lambda line: order.get(line.get("custom_id"), len(order)))
        return lines

    def run_batch(
        self,
        path_or_rows: str | os.PathLike | Iterable[Any],
        *,
        model: str | None = None,
        output: str | os.PathLike | None = None,
        progress: bool = True,
        poll_interval: float = 1.0,
        timeout: float | None = None,
        metadata: dict | None = None,
        endpoint: str | None = None,
        completion_window: str = "24h",
        cancel_on_interrupt: bool = True,
    ) -> list[dict]:
        """Run a batch the OpenAI way and return its output lines in input order.

        `path_or_rows`: a JSONL file of OpenAI batch lines (`{custom_id, method, url, body}`,
        uploaded as it is), or rows: each a batch line (a dict with `body`; `custom_id`,
        `method` and `url` filled in when missing), a completions body (a dict with `prompt`)
        or a prompt (a str); `model` goes into the bodies of rows that name none. `endpoint`:
        the batch's (`/v1/completions` or `/v1/chat/completions`; default: the `url` of a
        file's lines, else /v1/completions).

        Uploads the file, creates the batch, polls `GET /v1/batches/{id}` every
        `poll_interval` s with a tqdm progress bar (on stderr) driven by `request_counts`, then
        downloads the output and error files. `output`: also write the lines there (JSONL).
        A line succeeded when its `error` is null and `response.status_code` is 200.

        Raises `BatchError` (with `.batch` and the partial `.results`) if the batch failed,
        expired or was cancelled; `WaitTimeout` after `timeout` s (the batch goes on). Ctrl-C
        cancels the batch unless `cancel_on_interrupt=False`."""
        if isinstance(path_or_rows, (str, os.PathLike)):
            order, endpoint = _custom_ids_of(path_or_rows), endpoint or _endpoint_of(path_or_rows)
            file = self.upload_file(path_or_rows)
        else:
            endpoint = endpoint or "/v1/completions"
            data, order = _batch_file(path_or_rows, model, endpoint)
            file = self.upload_file(data)
        batch = self.create_batch(file["id"], endpoint, completion_window, metadata)
        batch = self._follow_batch(batch, progress, poll_interval, timeout, cancel_on_interrupt)
        results = self.batch_results(batch, order)
        if output is not None:
            with open(output, "w", encoding="utf-8") as fh:
                for line in results:
                    fh.write(json.dumps(line, ensure_ascii=False) + "\n")
        if batch["status"] != "completed":
            raise errors.BatchError(None, batch["status"], _batch_problem(batch), batch=batch, results=results)
        return results

    def _follow_batch(
        self, batch: dict, progress: bool, poll_interval: float, timeout: float | None, cancel: bool
    ) -> dict:
        from tqdm import tqdm

        deadline = None if timeout is None else time.monotonic() + timeout
        bar = tqdm(total=None, unit="req", desc=batch["id"], disable=not progress, file=sys.stderr, dynamic_ncols=True)
        seen = 0
        try:
            while True:
                counts = batch.get("request_counts") or {}
                total = counts.get("total") or None
                if total and bar.total != total:
                    bar.total = total
                    bar.refresh()
                done = (counts.get("completed") or 0) + (counts.get("failed") or 0)
                bar.set_postfix(failed=counts.get("failed") or 0, status=batch.get("status"), refresh=False)
                if done > seen:
                    bar.update(done - seen)
                    seen = done
                else:
                    bar.refresh()
                if batch.get("status") in BATCH_FINAL:
                    return batch
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeout(
                        None,
                        "wait_timeout",
                        f"batch {batch['id']} is still {batch.get('status')} after {timeout:g} s",
                        batch=batch,
                    )
                time.sleep(poll_interval)
                batch = self.get_batch(batch["id"])
        except KeyboardInterrupt:
            if cancel:
                try:
                    self.cancel_batch(batch["id"])
                    print(f"\ncancelled batch {batch['id']}", file=sys.stderr)
                except GenqError:
                    pass
            raise
        finally:
            bar.close()


class TokenStream:
    """An iterator of a job's tokens (`str`), from `Client.stream`.

    After a dropped connection (or a 5xx, or Redis briefly gone on the server) it reconnects
    with `Last-Event-ID`, up to `client.max_reconnects` times in a row, with backoff. A job
    that started over on another worker with other tokens than those received (a sampled one,
    or a greedy one whose re-run took other tokens) yields a `Restart`: drop the text so far;
    the new attempt's tokens follow from its first.
    After the last token: `finish_reason`, `usage` (`prompt_tokens`, `completion_tokens` and
    `cached_tokens`, the prompt tokens served from the engine's prefix cache, also the attribute
    `cached_tokens`); at any time `text` (the current attempt's text so far), `last_event_id`,
    `reconnects`, `restarts`. A failed or cancelled job raises
    `JobError`/`JobCancelled`. After an exception, iterating again resumes where it stopped.
    `close()` (or `with`) closes the connection."""

    def __init__(self, client: Client, job_id: str, last_event_id: str | int | None = None):
        self.client = client
        self.job_id = job_id
        self.last_event_id = None if last_event_id is None else str(last_event_id)
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.done = False
        self.reconnects = 0
        self.restarts = 0
        self._connections = 0
        self._gen: Iterator | None = None

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens the engine's prefix cache served (None before the last token)."""
        return None if self.usage is None else self.usage["cached_tokens"]

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> str | Restart:
        if self._gen is None:
            if self.done:
                raise StopIteration
            self._gen = self._tokens()
        try:
            return next(self._gen)
        except BaseException:
            self._gen = None
            raise

    def read(self) -> str:
        """Consume the stream and return the final text (of the last attempt)."""
        for _ in self:
            pass
        return self.text

    def close(self) -> None:
        if self._gen is not None:
            self._gen.close()
            self._gen = None

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _tokens(self) -> Iterator[str | Restart]:
        failures, why = 0, ""
        while not self.done:
            if failures:
                if failures > self.client.max_reconnects:
                    raise ConnectError(None, "connection_error", f"stream of job {self.job_id}: {why}")
                time.sleep(min(0.2 * 2 ** (failures - 1), 5.0))
            try:
                resp = self.client._open_stream(self.job_id, self.last_event_id)
            except (ConnectError, ServerError) as exc:
                failures, why = failures + 1, str(exc)
                if failures > self.client.max_reconnects:
                    raise
                continue
            if self._connections:
                self.reconnects += 1
            self._connections += 1
            why = "the stream ended before the job's last token"
            try:
                for kind, event_id, data in _sse_events(resp.iter_lines()):
                    if kind == "token":
                        failures = 0
                        piece = json.loads(data)["text"]
                        self.last_event_id = event_id
                        self.text += piece
                        yield piece
                    elif kind == "done":
                        body = json.loads(data)
                        self.last_event_id = event_id
                        self.finish_reason, self.usage = body.get("finish_reason"), body.get("usage")
                        if self.usage is not None:  # an older server sends no cached_tokens
                            self.usage.setdefault("cached_tokens", 0)
                        self.done = True
                        if body.get("text"):
                            self.text += body["text"]
                            yield body["text"]
                        return
                    elif kind == "restart":
                        failures = 0
                        attempt = json.loads(data).get("attempt", 0)
                        # Resume from the new attempt's first token (no Last-Event-ID: the
                        # server skips to the newest attempt without another restart event).
                        self.last_event_id = None
                        self.text = ""
                        self.restarts += 1
                        yield Restart(attempt)
                    elif kind == "error":
                        error = (json.loads(data) or {}).get("error") or {}
                        if error.get("code") == "broker_unavailable":
                            why = error.get("message", "broker_unavailable")
                            break  # Redis is back soon and the job goes on: reconnect
                        self.done = True
                        raise errors.job_error(self.job_id, error)
            except httpx.TransportError as exc:
                why = f"{type(exc).__name__}: {exc}"  # a dropped connection: reconnect
            finally:
                resp.close()
            failures += 1


def result_text(job: dict) -> str:
    """A finished job's completion text; `JobError`/`JobCancelled` unless it succeeded."""
    if job.get("status") != "succeeded":
        raise errors.job_error(job.get("id", "?"), job.get("error"), job, job.get("status"))
    return job["result"]["text"]


def _error_of(resp: httpx.Response) -> GenqError:
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    return errors.from_response(resp.status_code, body, resp.headers)


def _wait_limit(exc: BadRequest) -> float | None:
    """The longest ?wait= the server takes, from its 400 (`wait: ... from 0 to N`)."""
    m = re.match(r"wait: .* to ([0-9.]+)", exc.message)
    return float(m.group(1)) if m else None


def _sse_events(lines: Iterable[str]) -> Iterator[tuple[str, str | None, str]]:
    """(event, id, data) of each server-sent event (comments and keep-alives skipped)."""
    kind, event_id, data = "message", None, []
    for line in lines:
        if line == "":
            if data:
                yield kind, event_id, "\n".join(data)
            kind, event_id, data = "message", None, []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            kind = value
        elif field == "id":
            event_id = value
        elif field == "data":
            data.append(value)


def _batch_line(row: Any, i: int, model: str | None, endpoint: str) -> dict:
    if isinstance(row, str):
        row = {"prompt": row}
    if not isinstance(row, dict):
        raise TypeError(f"batch row {i}: a prompt (str) or a dict, not {type(row).__name__}")
    line = dict(row) if "body" in row else {"body": dict(row)}
    line.setdefault("custom_id", f"request-{i}")
    line.setdefault("method", "POST")
    line.setdefault("url", endpoint)
    if model is not None and isinstance(line["body"], dict):
        line["body"] = {"model": model, **line["body"]}
    return line


def _batch_file(rows: Iterable[Any], model: str | None, endpoint: str) -> tuple[bytes, dict[str, int]]:
    buf, order = io.StringIO(), {}
    for i, row in enumerate(rows):
        line = _batch_line(row, i, model, endpoint)
        order.setdefault(line["custom_id"], i)
        buf.write(json.dumps(line, ensure_ascii=False) + "\n")
    return buf.getvalue().encode(), order


def _custom_ids_of(path: str | os.PathLike) -> dict[str, int]:
    """custom_id -> line position in a JSONL batch file (lines that do not parse are left to
    the server, which names them)."""
    order: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            try:
                cid = json.loads(line).get("custom_id")
            except (ValueError, AttributeError):
                continue
            if isinstance(cid, str):
                order.setdefault(cid, i)
    return order


def _endpoint_of(path: str | os.PathLike) -> str:
    """The `url` of a JSONL batch file's first line that has one (/v1/completions if none)."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                url = json.loads(line).get("url")
            except (ValueError, AttributeError):
                continue
            if isinstance(url, str):
                return url
    return "/v1/completions"


def _batch_problem(batch: dict) -> str:
    data = ((batch.get("errors") or {}).get("data")) or []
    detail = "; ".join(
        (f"line {e['line']}: " if e.get("line") is not None else "") + str(e.get("message") or e.get("code"))
        for e in data[:5]
    )
    return f"batch {batch.get('id')} {batch.get('status')}" + (f": {detail}" if detail else "")
