"""Files that are never half-written, and the timestamps in their names and contents.

No torch here: the launcher, the CLI and the report import this without paying for it.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional


@contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temp path beside ``path``; on success fsync it and rename it over ``path``.

    Readers never see half a file, and a failure leaves no temp file behind: on a full disk the
    partial file is removed at once (which frees the space for the one-line record of the
    failure), and the OSError names ``path``, not the temp file.
    """
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from e
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide results from other users
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        # torch's zip writer, closed while an exception unwinds through it, raises one of its
        # own over it ("enforce fail ... unexpected pos"): what happened is the first one, a
        # Ctrl-C during the write (the run was interrupted, not crashed) or its file's OSError
        stop = _first(e, lambda x: isinstance(x, KeyboardInterrupt))
        if stop is not None and stop is not e:
            raise stop from None
        cause = _first(e, lambda x: isinstance(x, OSError) and bool(x.errno))
        if cause is not None and cause.filename in (None, tmp):
            raise OSError(cause.errno, cause.strerror, path) from e
        raise


def _first(e: Optional[BaseException], test: Callable[[BaseException], bool]
           ) -> Optional[BaseException]:
    """The first exception that passes ``test`` in ``e`` and what it was raised from or while
    handling."""
    for _ in range(8):
        if e is None or test(e):
            return e
        e = e.__cause__ or e.__context__
    return None


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None, in dicts, lists and tuples at
    any depth: strict JSON has no NaN or Infinity tokens (JavaScript's JSON.parse, jq and most
    parsers refuse them), so a diverged run writes null where a value is not a number (and
    says why next to it where it matters, e.g. a result file's "diverged")."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def strict_dumps(obj: Any, **kw: Any) -> str:
    """``json.dumps`` of :func:`finite` ``(obj)``, refusing anything that is not strict JSON."""
    return json.dumps(finite(obj), allow_nan=False, **kw)


def atomic_write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as strict JSON (:func:`finite`), atomically: every JSON file labkit writes
    goes through here."""
    text = strict_dumps(obj, indent=1)  # before the temp file: a refusal leaves nothing behind
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text + "\n")


def now_str() -> str:
    """The one timestamp format of result files, run status and bench documents."""
    return time.strftime("%Y-%m-%d %H:%M:%S")


def folder_stamp() -> str:
    """The date-and-time prefix of run folder names (sorts in time order, no colons)."""
    return time.strftime("%Y-%m-%d_%H-%M-%S")
