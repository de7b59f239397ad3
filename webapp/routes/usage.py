"""Usage per API key: `GET /v1/usage` (tasks/usage.py counts it)."""

from __future__ import annotations

from flask import Blueprint, request

from tasks.usage import read_usage
from webapp import auth
from webapp.errors import APIError
from webapp.openapi import Param, doc
from webapp.protocol.usage import KeyLimits, KeyUsage, UsageList
from webapp.service import current_service

bp = Blueprint("usage", __name__, url_prefix="/v1/usage")


@bp.get("")
@doc(
    response=UsageList,
    errors=(403, 503),
    params=(
        Param(
            "key",
            "query",
            {"type": "string"},
            "only this key's usage (by its name; `anonymous`: an open API's jobs); another key's needs an admin key",
        ),
    ),
)
def get_usage():
    """Tokens used per API key and model: a key sees its own, an admin key (`admin=true` in the
    keys file) and an open API see every key's."""
    key = auth.current_owner()
    asked = request.args.get("key")
    admin = key is None or key.admin
    if not admin and asked is not None and asked != key.name:
        raise APIError(403, "forbidden", "key: only an admin key sees another key's usage", param="key")
    only = asked if admin else key.name
    rows = [KeyUsage(**u.view()) for u in read_usage(current_service().r) if only is None or u.key == only]
    limits = KeyLimits(rpm=key.rpm, tpm=key.tpm) if key is not None else None
    return UsageList(data=rows, key=key and key.name, admin=admin, limits=limits).model_dump()
