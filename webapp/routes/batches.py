"""OpenAI's Files and Batches endpoints (see webapp/batches.py for how a batch runs):

- `POST /v1/files` (multipart: `purpose=batch`, `file`), `GET /v1/files/{id}`,
  `GET /v1/files/{id}/content` (streamed), `DELETE /v1/files/{id}`;
- `POST /v1/batches` (`input_file_id`, `endpoint` `/v1/completions`, `completion_window` `24h`,
  `metadata`), `GET /v1/batches/{id}`, `GET /v1/batches` (`after`, `limit`),
  `POST /v1/batches/{id}/cancel`.

With API keys, files and batches belong to the key that made them: to any other, a 404.
"""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify, request, stream_with_context
from werkzeug.exceptions import RequestEntityTooLarge

from webapp import auth, ids
from webapp.batches import EXTENSION, BatchRequest, LineError, public_batch, public_file
from webapp.errors import APIError
from webapp.routes._body import parse

bp = Blueprint("batches", __name__, url_prefix="/v1")

# Room for the multipart envelope around the file itself.
MULTIPART_SLACK = 64 * 1024


def _batches():
    return current_app.extensions[EXTENSION]


def _owner() -> str:
    return auth.owner_name() or ""


@bp.errorhandler(LineError)
def _line_error(exc: LineError):
    resp = jsonify(exc.body())
    resp.status_code = exc.status
    return resp


@bp.post("/files")
def create_file():
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
    return _batches().files.create(upload.stream, upload.filename or "", _owner())


@bp.get("/files/<file_id>")
def get_file(file_id: str):
    return public_file(_batches().files.meta(file_id, _owner()))


@bp.get("/files/<file_id>/content")
def file_content(file_id: str):
    files = _batches().files
    files.meta(file_id, _owner())
    return current_app.response_class(
        stream_with_context(files.chunks(file_id)), mimetype="application/octet-stream"
    )


@bp.delete("/files/<file_id>")
def delete_file(file_id: str):
    return _batches().files.delete(file_id, _owner())


@bp.post("/batches")
def create_batch():
    req = parse(BatchRequest)
    return _batches().store.create(req, auth.current_owner())


@bp.get("/batches/<batch_id>")
def get_batch(batch_id: str):
    return public_batch(_batches().store.get(batch_id, _owner()))


@bp.get("/batches")
def list_batches():
    raw = request.args.get("limit", "20")
    # ASCII digits only: str.isdigit() takes '²' and '٣' too (int() fails on one, reads the other).
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 3) or not 1 <= int(raw) <= 100:
        raise APIError(400, "invalid_request", "limit: a whole number from 1 to 100", param="limit")
    after = request.args.get("after") or None
    if after is not None:
        ids.check("batch", after, param="after")
    return _batches().store.list(_owner(), after, int(raw))


@bp.post("/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    return _batches().store.cancel(batch_id, _owner())
