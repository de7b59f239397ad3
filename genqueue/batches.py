"""OpenAI's Batch API from Python: files (`/v1/files`) and batches (`/v1/batches`), and
`run_batch`, which uploads, follows with a progress bar and downloads in one call. `BatchAPI`
holds these methods of `Client` (a mixin: it sends through Client's `_json` and `_http`), so
that genqueue/client.py itself holds the jobs, chat and health API.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx

from genqueue import errors
from genqueue.errors import ConnectError, GenqError, WaitTimeout

BATCH_FINAL = ("completed", "failed", "expired", "cancelled")


class BatchAPI:
    """The files and batches methods of `Client` (see genqueue.client)."""

    base_url: str  # Client's, as are `_http` and `_json`
    _http: httpx.Client

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
                raise errors.of_response(resp)
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
