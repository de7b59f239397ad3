"""An in-process FAKE of OpenAI's Batch API (the five endpoints the client uses, and cancel),
for the client's and the CLI's unit tests of `run_batch` / `genq batch`, which need no stack.
It is not the server (that is webapp/batches/): it answers each line itself (the completion is
the prompt upper-cased) and moves a batch on by `step` lines per GET, so that progress can be
watched. Shapes follow OpenAI's documentation. The output file lists lines in reverse order, as
a real server may finish them in any order: the client must put them back in input order.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

from flask import Flask, jsonify, request
from werkzeug.serving import WSGIRequestHandler, make_server


class FakeBatchServer:
    def __init__(self, step: int = 3, api_key: str | None = None):
        self.step = step
        self.api_key = api_key
        self.files: dict[str, dict] = {}
        self.batches: dict[str, dict] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Authorization
        self.lock = threading.Lock()
        self.app = self._app()
        self.server = make_server("127.0.0.1", 0, self.app, threaded=True, request_handler=_Quiet)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(10)

    # -- the app ----------------------------------------------------------------------------

    def _app(self) -> Flask:
        app = Flask("fake_batch")

        def error(status: int, code: str, message: str, param: str | None = None, line: int | None = None):
            body = {"error": {"code": code, "message": message, "type": "invalid_request_error", "param": param}}
            if line is not None:
                body["error"]["line"] = line
            return jsonify(body), status

        @app.before_request
        def _auth():
            self.requests.append((request.method, request.path, request.headers.get("Authorization")))
            if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return error(401, "unauthorized", "missing or wrong API key")

        @app.post("/v1/files")
        def create_file():
            if request.form.get("purpose") != "batch":
                return error(400, "invalid_request", "purpose: must be 'batch'", "purpose")
            upload = request.files.get("file")
            if upload is None:
                return error(400, "invalid_request", "file: required", "file")
            raw = upload.read()
            lines = []
            for n, text in enumerate(raw.decode().splitlines(), 1):
                if not text.strip():
                    continue
                try:
                    lines.append(json.loads(text))
                except ValueError:
                    return error(400, "invalid_request", f"line {n}: not valid JSON", "file", n)
            file = {
                "id": f"file-{uuid.uuid4().hex[:12]}",
                "object": "file",
                "bytes": len(raw),
                "created_at": int(time.time()),
                "filename": upload.filename,
                "purpose": "batch",
            }
            with self.lock:
                self.files[file["id"]] = {**file, "_content": raw, "_lines": lines}
            return jsonify(file)

        @app.get("/v1/files/<file_id>/content")
        def file_content(file_id: str):
            f = self.files.get(file_id)
            if f is None:
                return error(404, "not_found", f"no file {file_id!r}")
            return app.response_class(f["_content"], mimetype="application/jsonl")

        @app.post("/v1/batches")
        def create_batch():
            body = request.get_json()
            f = self.files.get(body.get("input_file_id"))
            if f is None:
                return error(404, "not_found", f"no file {body.get('input_file_id')!r}", "input_file_id")
            if body.get("endpoint") != "/v1/completions":
                return error(400, "invalid_request", "endpoint: only /v1/completions", "endpoint")
            if body.get("completion_window") != "24h":
                return error(400, "invalid_request", "completion_window: only 24h", "completion_window")
            batch = {
                "id": f"batch_{uuid.uuid4().hex[:12]}",
                "object": "batch",
                "endpoint": body["endpoint"],
                "errors": None,
                "input_file_id": f["id"],
                "completion_window": "24h",
                "status": "validating",
                "output_file_id": None,
                "error_file_id": None,
                "created_at": int(time.time()),
                "in_progress_at": None,
                "completed_at": None,
                "cancelled_at": None,
                "request_counts": {"total": 0, "completed": 0, "failed": 0},
                "metadata": body.get("metadata"),
            }
            with self.lock:
                self.batches[batch["id"]] = {**batch, "_todo": list(f["_lines"]), "_out": [], "_err": []}
            return jsonify(batch)

        @app.get("/v1/batches/<batch_id>")
        def get_batch(batch_id: str):
            with self.lock:
                b = self.batches.get(batch_id)
                if b is None:
                    return error(404, "not_found", f"no batch {batch_id!r}")
                self._advance(b)
                return jsonify(_public(b))

        @app.post("/v1/batches/<batch_id>/cancel")
        def cancel_batch(batch_id: str):
            with self.lock:
                b = self.batches.get(batch_id)
                if b is None:
                    return error(404, "not_found", f"no batch {batch_id!r}")
                if b["status"] in ("validating", "in_progress"):
                    b["status"] = "cancelling"
                return jsonify(_public(b))

        return app

    def _advance(self, b: dict) -> None:
        counts = b["request_counts"]
        if b["status"] == "validating":
            b["status"], b["in_progress_at"] = "in_progress", int(time.time())
            counts["total"] = len(b["_todo"])
            return
        if b["status"] == "in_progress":
            for line in b["_todo"][: self.step]:
                out = _answer(line)
                (b["_err"] if out["response"]["status_code"] != 200 else b["_out"]).append(out)
            b["_todo"] = b["_todo"][self.step :]
            counts["completed"], counts["failed"] = len(b["_out"]), len(b["_err"])
            if not b["_todo"]:
                b["status"] = "finalizing"
            return
        if b["status"] in ("finalizing", "cancelling"):
            b["output_file_id"] = self._store(reversed(b["_out"]))
            b["error_file_id"] = self._store(b["_err"]) if b["_err"] else None
            if b["status"] == "finalizing":
                b["status"], b["completed_at"] = "completed", int(time.time())
            else:
                b["status"], b["cancelled_at"] = "cancelled", int(time.time())

    def _store(self, lines) -> str:
        raw = "".join(json.dumps(line) + "\n" for line in lines).encode()
        file_id = f"file-{uuid.uuid4().hex[:12]}"
        self.files[file_id] = {"id": file_id, "_content": raw, "_lines": []}
        return file_id


class _Quiet(WSGIRequestHandler):
    def log_request(self, *args, **kwargs) -> None:
        pass


def _answer(line: dict) -> dict:
    """The output line for one input line: the prompt upper-cased, or a 400 as the completions
    route would give it."""
    request_id = f"req_{uuid.uuid4().hex[:12]}"
    body = line.get("body") or {}
    prompt = body.get("prompt")
    if line.get("url") != "/v1/completions" or not isinstance(prompt, str) or not prompt:
        status = 400
        out = {"error": {"code": "invalid_request", "message": "prompt: required", "type": "invalid_request_error"}}
    else:
        status = 200
        out = {
            "id": f"cmpl-{uuid.uuid4().hex[:12]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "fake"),
            "choices": [{"index": 0, "text": prompt.upper(), "finish_reason": "length", "logprobs": None}],
        }
    return {
        "id": f"batch_req_{uuid.uuid4().hex[:12]}",
        "custom_id": line.get("custom_id"),
        "response": {"status_code": status, "request_id": request_id, "body": out},
        "error": None,
    }


def _public(b: dict) -> dict:
    return {k: v for k, v in b.items() if not k.startswith("_")}
