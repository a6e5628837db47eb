"""Files that are never half-written, and the timestamps in their names and contents.

No torch here: the launcher, the CLI and the report import this without paying for it.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temp path beside ``path``; on success fsync it and rename it over ``path``.

    Readers never see half a file, and a failure leaves no temp file behind.
    """
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide results from other users
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str, obj: Any) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def now_str() -> str:
    """The one timestamp format of result files, run status and bench documents."""
    return time.strftime("%Y-%m-%d %H:%M:%S")


def folder_stamp() -> str:
    """The date-and-time prefix of run folder names (sorts in time order, no colons)."""
    return time.strftime("%Y-%m-%d_%H-%M-%S")
