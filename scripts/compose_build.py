"""`make test-compose`'s build settings (scripts/compose_check.py).

Building needs what pip needs (docs/deploying.md, "Building behind a mirror"): PIP_INDEX_URL,
PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_TRUSTED_HOST, PIP_CERT and TORCH_INDEX, from the
environment or else from `.env`. A find-links folder or `file://` index on this host (which a
build cannot see) is served over HTTP on 127.0.0.1 for the build's duration, and the builds
then use the host's network. TORCH_INDEX unset and PyTorch's CPU index not answering: torch
comes from pip's own index / find-links (TORCH_INDEX=), which must hold its "+cpu" wheel.
"""

from __future__ import annotations

import functools
import http.server
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parent.parent
TORCH_INDEX_DEFAULT = "https://download.pytorch.org/whl/cpu"
PIP_KEYS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST", "PIP_CERT", "TORCH_INDEX")
# Tried first for the HTTP server of local wheels: the same URL each run keeps the build
# arguments, hence BuildKit's cache of the dependency layers, the same.
WHEELS_PORT = 47385


class CheckFailed(Exception):
    """A check that did not hold; its message says what was seen."""


def say(msg: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- pip settings


def dotenv(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a compose .env file (comments, blanks and quotes as compose reads them)."""
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip().removeprefix("export ").strip()] = value
    return out


def local_dir(item: str) -> Path | None:
    """The folder a pip location names on this host (`/path`, `file:///path`), else None."""
    if item.startswith("file://"):
        return Path(unquote(urlparse(item).path))
    if item.startswith("/"):
        return Path(item)
    return None


def serve_local(settings: dict[str, str], port: int) -> tuple[dict[str, str], dict[str, Path]]:
    """Rewrite the local folders of find-links and indexes as URLs on http://127.0.0.1:port.

    Returns the settings to build with and what to serve (URL prefix -> folder). A find-links
    folder is served as it is; a `file://` index (`.../simple`) through its parent, so that
    links relative to the index's pages still resolve. A folder missing here is left out."""
    out, served = dict(settings), {}
    for key in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        items = []
        for item in settings.get(key, "").split():
            path = local_dir(item)
            if path is None:
                items.append(item)
                continue
            if not path.is_dir():
                say(f"pip: {key} {item} is not a folder here: left out")
                continue
            n = str(len(served))
            if key == "PIP_FIND_LINKS":
                served[n] = path
                items.append(f"http://127.0.0.1:{port}/{n}/")
            else:
                served[n] = path.parent
                items.append(f"http://127.0.0.1:{port}/{n}/{path.name}/")
        if key in settings:
            out[key] = " ".join(items)
    return out, served


class _Folders(http.server.SimpleHTTPRequestHandler):
    """Serves /<n>/... from folder n of `folders` (set per server with functools.partial)."""

    def __init__(self, *args, folders: dict[str, Path], **kwargs):
        self.folders = folders
        super().__init__(*args, **kwargs)

    def translate_path(self, path: str) -> str:
        first, _, rest = path.lstrip("/").partition("/")
        folder = self.folders.get(first)
        if folder is None:
            return "/nonexistent"
        self.directory = str(folder)
        return super().translate_path("/" + rest)

    def log_message(self, *args) -> None:
        pass


def start_wheel_server(folders: dict[str, Path]) -> tuple[http.server.ThreadingHTTPServer, int]:
    handler = functools.partial(_Folders, folders=folders)
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def answers(url: str, cafile: str | None) -> bool:
    import ssl

    try:
        ctx = ssl.create_default_context(cafile=cafile or None)
        with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:
            return resp.status < 400
    except Exception:
        return False


def build_settings(env: dict[str, str]) -> dict[str, str]:
    """The pip settings of the build: the environment's, else .env's (as compose reads them)."""
    from_file = dotenv(ROOT / ".env")
    settings = {k: env[k] if k in env else from_file[k] for k in PIP_KEYS if k in env or k in from_file}
    if "TORCH_INDEX" not in settings and not answers(TORCH_INDEX_DEFAULT + "/torch/", settings.get("PIP_CERT")):
        say(f"TORCH_INDEX: {TORCH_INDEX_DEFAULT} does not answer here: torch from pip's own index/find-links")
        settings["TORCH_INDEX"] = ""
    return settings
