"""A rank whose machine ran out of something, or whose loader stopped delivering: which
resource, where, and what to change.

The exceptions these failures raise say little to a user, and differently each time: a full
disk is ``OSError: [Errno 28]`` (or, from torch's own writer, an "enforce fail" about a file
position), a full /dev/shm a worker's ``unable to write to file </torch_...>``, a worker killed
by the kernel a ``DataLoader worker (pid 123) is killed by signal: Bus error``, a stopped or
stuck worker (after ``--loader-timeout``) ``DataLoader timed out after 120 seconds``, the GPU
``torch.OutOfMemoryError``. :func:`translate` turns each into labkit.core.errors.Exhausted with
one line; labkit.training.rank raises it in place of the original (which stays chained, so the
rank's log keeps the whole traceback). A rank killed by SIGKILL says nothing: the launcher
explains it (labkit.launch.failures).
"""
from __future__ import annotations

import errno
import os
import re
from typing import Iterator, Optional

from labkit.core.errors import Exhausted
from labkit.core.resources import free_disk, free_memory, free_shm, size

from .workers import oom_killed

_FULL = {errno.ENOSPC, errno.EDQUOT}
_WORKER = re.compile(r"DataLoader worker \(pids?\(?s?\)? ?([\d, ]+)\)? (?:is killed by signal: "
                     r"([^.]+)|exited unexpectedly)")
_SHM = re.compile(r"unable to (write to file|allocate shared memory)|/torch_\d+|shm", re.I)
_HOST = re.compile(r"DefaultCPUAllocator: (can't|not enough memory)", re.I)
_STALLED = re.compile(r"DataLoader timed out after ([\d.]+) seconds")  # its ``timeout``
_SIGNALS = {"Bus error": "SIGBUS", "Killed": "SIGKILL", "Segmentation fault": "SIGSEGV",
            "Terminated": "SIGTERM"}


def chain(e: BaseException) -> Iterator[BaseException]:
    """``e`` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def translate(e: BaseException, method: str, rank: int, at: str, out: Optional[str]
              ) -> Optional[Exhausted]:
    """Exhausted("<method> failed: rank R: <what ran out, where> <at>: <what to change>"), or
    None when ``e`` is not the machine running out of something."""
    for x in chain(e):
        what = _what(x, at, out)
        if what is not None:
            return Exhausted(method, f"rank {rank}: {what}")
    return None


def _what(e: BaseException, at: str, out: Optional[str]) -> Optional[str]:
    text = str(e)
    if isinstance(e, OSError) and e.errno in _FULL:
        if e.filename and ("/torch_" in str(e.filename) or str(e.filename).startswith("/dev/shm")):
            return _shm_full(at)
        return _disk_full(e.filename or out, at)
    if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch
        return _gpu(text, at)
    if isinstance(e, MemoryError) or _HOST.search(text):
        return (f"host memory ran out {at} ({size(free_memory() or 0)} available now): lower "
                f"--batch-size, --nproc or --workers")
    m = _WORKER.search(text)
    if m:
        return _worker(m.group(1).strip(), m.group(2), at)
    m = _STALLED.search(text)
    if m:
        return _stalled(float(m.group(1)), at)
    if "DataLoader worker" in text and ("No space left" in text or _SHM.search(text)):
        return _shm_full(at)
    return None


def _disk_full(path: Optional[str], at: str) -> str:
    where = os.path.abspath(path) if path else "the output folder"
    free = free_disk(path) if path else None
    return (f"the disk is full: no space left on device writing {where} {at} "
            f"({size(free or 0)} free there now): free some space or choose another --out "
            f"(--no-checkpoint writes no checkpoint); every finished epoch is kept in the result file")


def _shm_full(at: str) -> str:
    return (f"shared memory ran out: /dev/shm is full ({size(free_shm() or 0)} free) in a "
            f"DataLoader worker {at}: --workers 0, a smaller --batch-size, or a larger /dev/shm "
            f"(docker run --shm-size)")


def _worker(pids: str, signal: Optional[str], at: str) -> str:
    name = _SIGNALS.get((signal or "").strip(), (signal or "").strip())
    head = f"a DataLoader worker (pid {pids}) was killed by {name} {at}" if signal else \
        f"a DataLoader worker (pid {pids}) exited unexpectedly {at}"
    if name == "SIGBUS":
        return (f"{head}: its shared memory ran out (/dev/shm: {size(free_shm() or 0)} free): "
                f"--workers 0, a smaller --batch-size, or a larger /dev/shm (docker run --shm-size)")
    if name == "SIGKILL":
        return _killed(head)
    return f"{head}: the rank's log may say why; --workers 0 loads the data in the rank itself"


def _killed(head: str) -> str:
    """A worker's SIGKILL, as far as the kernel's count of out-of-memory kills since the rank's
    workers started tells (labkit.training.workers.oom_killed; labkit.launch.failures.killed
    says it of a rank)."""
    oom = oom_killed()
    if oom is False:
        return (f"{head}: killed from outside (a person or a program sent it SIGKILL): no "
                f"out-of-memory kill counted by the kernel")
    left, remedy = (f"{size(free_memory() or 0)} available now",
                    "--workers 0, a smaller --batch-size or a lower --nproc")
    if oom:
        return (f"{head}: the kernel's out-of-memory killer killed it (the kernel counted an "
                f"out-of-memory kill meanwhile): host memory ran out ({left}): {remedy}")
    return (f"{head}: killed from outside: by a person or a program, or by the kernel's "
            f"out-of-memory killer if host memory ran out (its count cannot be read here; dmesg "
            f"names its victims; {left}): if memory: {remedy}")


def _stalled(seconds: float, at: str) -> str:
    loader = "validation" if "validation" in at else "training"
    return (f"the {loader} data loader's workers sent nothing for {seconds:g} s {at}: a worker "
            f"is stopped, stuck or far slower than the step (a slow disk?); --loader-timeout "
            f"sets the bound, --workers 0 loads the data in the rank itself")


def _gpu(text: str, at: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    m = re.search(r"GPU (\d+) has a total capacity of ([\d.]+ \w+) of which ([\d.]+ \w+) is free", first)
    detail = f" (GPU {m.group(1)}: {m.group(3)} free of {m.group(2)})" if m else ""
    return (f"the GPU ran out of memory {at}{detail}: a smaller --batch-size, --amp bf16, or a "
            f"smaller --model / --image-size")
