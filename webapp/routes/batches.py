"""OpenAI's Files and Batches endpoints (webapp/batches/; how a batch runs: docs/design.md):

- `POST /v1/files` (multipart: `purpose=batch`, `file`), `GET /v1/files/{id}`,
  `GET /v1/files/{id}/content` (streamed), `DELETE /v1/files/{id}`;
- `POST /v1/batches` (`input_file_id`, `endpoint` `/v1/completions`, `/v1/chat/completions` or
  `/v1/embeddings`, `completion_window` `24h`, `metadata`), `GET /v1/batches/{id}`, `GET /v1/batches` (`after`, `limit`),
  `POST /v1/batches/{id}/cancel`.

With API keys, files and batches belong to the key that made them: to any other, a 404.
"""

from __future__ import annotations

import hashlib

from flask import Blueprint, current_app, jsonify, request, stream_with_context
from werkzeug.exceptions import RequestEntityTooLarge

from webapp import auth, callbacks, idempotency, ids
from webapp.batches import current_batches
from webapp.batches.files import LineError
from webapp.errors import APIError
from webapp.openapi import IDEMPOTENCY, Param, doc
from webapp.protocol.batches import Batch, BatchList, BatchRequest, File, FileDeleted, FileUpload
from webapp.routes._body import parse

bp = Blueprint("batches", __name__, url_prefix="/v1")

# Room for the multipart envelope around the file itself.
MULTIPART_SLACK = 64 * 1024


def _owner() -> str:
    return auth.owner_name() or ""


@bp.errorhandler(LineError)
def _line_error(exc: LineError):
    resp = jsonify(exc.body())
    resp.status_code = exc.status
    return resp


@bp.post("/files")
@doc(params=(IDEMPOTENCY,), form=FileUpload, response=File, errors=(400, 409, 413, 503))
def create_file():
    """Upload a batch's input file (JSONL); each line is checked, the first bad one named."""
    settings = current_app.config["GENQ"]
    limit = settings.max_file_bytes
    request.max_content_length = limit + MULTIPART_SLACK
    try:
        purpose = request.form.get("purpose")
        upload = request.files.get("file")
    except RequestEntityTooLarge:
        raise APIError(
            413, "file_too_large", f"the file is over {limit} bytes (GENQ_MAX_FILE_BYTES)", param="file"
        ) from None
    if purpose != "batch":
        raise APIError(400, "invalid_request", "purpose: must be 'batch'", param="purpose")
    if upload is None:
        raise APIError(400, "invalid_request", "file: required (a multipart file field)", param="file")
    files = current_batches().files
    digest = _upload_digest(upload) if idempotency.header_key() is not None else None
    made: dict = {}

    def create() -> dict:
        made["file"] = files.create(upload.stream, upload.filename or "", _owner())
        return {"id": made["file"].id}

    # A retry with the same Idempotency-Key and file gets the first upload's file.
    found, replayed = idempotency.once(_owner(), create, digest)
    file = File.from_record(files.meta(found["id"], _owner())) if replayed else made["file"]
    return file.model_dump(mode="json")


def _upload_digest(upload) -> str:
    """The upload's purpose, name and bytes as one digest (the stream rewound after)."""
    h = hashlib.sha256(f"batch\n{upload.filename or ''}\n".encode())
    while chunk := upload.stream.read(1 << 20):
        h.update(chunk)
    upload.stream.seek(0)
    return h.hexdigest()


@bp.get("/files/<file_id>")
@doc(response=File, errors=(404, 503))
def get_file(file_id: str):
    """A file's metadata."""
    return File.from_record(current_batches().files.meta(file_id, _owner())).model_dump(mode="json")


@bp.get("/files/<file_id>/content")
@doc(media_type="application/octet-stream", errors=(404, 503))
def file_content(file_id: str):
    """A file's content (JSONL), streamed."""
    files = current_batches().files
    files.meta(file_id, _owner())
    return current_app.response_class(stream_with_context(files.content(file_id)), mimetype="application/octet-stream")


@bp.delete("/files/<file_id>")
@doc(response=FileDeleted, errors=(404, 503))
def delete_file(file_id: str):
    """Delete a file."""
    return current_batches().files.delete(file_id, _owner()).model_dump(mode="json")


@bp.post("/batches")
@doc(params=(IDEMPOTENCY,), body=BatchRequest, response=Batch, errors=(400, 404, 409, 503))
def create_batch():
    """Start a batch of the requests of an uploaded file."""
    req = parse(BatchRequest)
    callbacks.check_url(req.callback_url, current_app.config["GENQ"])
    store, made = current_batches().store, {}

    def create() -> dict:
        made["batch"] = store.create(req, auth.current_owner())
        return {"id": made["batch"].id}

    # A retry with the same Idempotency-Key and body gets the first request's batch.
    found, replayed = idempotency.once(_owner(), create)
    current_batches().driver.wake()
    batch = Batch.from_record(store.get(found["id"], _owner())) if replayed else made["batch"]
    return batch.model_dump(mode="json")


@bp.get("/batches/<batch_id>")
@doc(response=Batch, errors=(404, 503))
def get_batch(batch_id: str):
    """A batch: its status, counts, usage and, once it ended, its output and error files."""
    return Batch.from_record(current_batches().store.get(batch_id, _owner())).model_dump(mode="json")


@bp.get("/batches")
@doc(
    response=BatchList,
    errors=(400, 404, 503),
    params=(
        Param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100}, "how many (20 by default)"),
        Param("after", "query", {"type": "string"}, "the batches older than this one (a batch id)"),
    ),
)
def list_batches():
    """The caller's batches, newest first."""
    raw = request.args.get("limit", "20")
    # ASCII digits only: str.isdigit() takes '²' and '٣' too (int() fails on one, reads the other).
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 3) or not 1 <= int(raw) <= 100:
        raise APIError(400, "invalid_request", "limit: a whole number from 1 to 100", param="limit")
    after = request.args.get("after") or None
    if after is not None:
        ids.check("batch", after, param="after")
    return current_batches().store.list(_owner(), after, int(raw)).model_dump(mode="json")


@bp.post("/batches/<batch_id>/cancel")
@doc(response=Batch, errors=(404, 409, 503))
def cancel_batch(batch_id: str):
    """Cancel a batch: what has not started is not run; it ends once what runs has finished."""
    return current_batches().store.cancel(batch_id, _owner()).model_dump(mode="json")
