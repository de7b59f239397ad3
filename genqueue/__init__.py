"""genqueue's Python client and `genq` command line (see docs/api.md: "Python client and CLI")."""

from genqueue.client import Client, Restart, TokenStream, result_text
from genqueue.errors import (
    AuthError,
    BadRequest,
    BatchError,
    Conflict,
    ConnectError,
    GenqError,
    JobCancelled,
    JobError,
    NotFound,
    RateLimited,
    ServerError,
    WaitTimeout,
)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Restart",
    "TokenStream",
    "result_text",
    "GenqError",
    "BadRequest",
    "AuthError",
    "NotFound",
    "Conflict",
    "RateLimited",
    "ServerError",
    "ConnectError",
    "WaitTimeout",
    "JobError",
    "JobCancelled",
    "BatchError",
]
