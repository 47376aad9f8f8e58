"""Write a file so that a crash at any moment leaves either the old file or the new one, never a torn one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """write(tmp) a temp file beside `path`, flush it to disk, then rename it over `path` (atomic on POSIX within one
    file system). The file gets the permissions a plain open() would give it: mkstemp's 0600 would hide checkpoints
    and adapters from the rest of a team."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        os.close(fd)
        write(tmp)
        with open(tmp, "rb") as f:  # the rename must not reach the disk before the data
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    mask = os.umask(0)  # (the only way to read it; set straight back)
    os.umask(mask)
    return mask
