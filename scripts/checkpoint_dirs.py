"""Writing a checkpoint directory so that no reader ever sees half of one: a build lock per
directory, a temporary directory beside it renamed into place, the leftovers of killed builds
removed. Shared by scripts/devmodels.py and scripts/realmodel.py, which check for themselves
that what they replace is theirs (each by its own marker file).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["lock", "remove_leftovers", "set_permissions", "swap_into_place"]


def remove_leftovers(out: Path) -> None:
    """Delete temp dirs of builds of ``out`` that were killed (we hold the build lock)."""
    for pattern in (f".{out.name}.tmp-*", f".{out.name}.old-*"):
        for leftover in out.parent.glob(pattern):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)


def swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``, replacing what is there (the caller checked that
    it may: an empty directory or a checkpoint of its own)."""
    if out.exists():
        # Move the old one aside first, so that a failed rename can put it back.
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / out.name)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old / out.name, out)
            shutil.rmtree(old, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def set_permissions(root: Path) -> None:
    """mkdtemp makes a 0700 directory; give the result ordinary permissions (per the umask)."""
    umask = 0o022
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                umask = int(line.split()[1], 8)
    os.chmod(root, 0o777 & ~umask)
    for f in root.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


@contextlib.contextmanager
def lock(out: Path) -> Iterator[bool]:
    """Serialise builds of the same ``out`` across processes (e.g. several workers starting).

    Yields True when the lock is real (POSIX flock), False where it is unavailable.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock
        yield False
        return
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
