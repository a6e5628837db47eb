"""Honest timers and the result-file writer.

Metrics are dicts written by one rank to files the report reads; progress bars are for people.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .dist import sync_device


class PhaseTimer:
    """Accumulates wall time per named phase (e.g. "pull", "push", "comm").

    The device is synchronised before each clock read, so a phase's time is the time the rank
    was really blocked in it, not the time it took to queue kernels.  Each phase is also a
    ``record_function`` range, so it shows by name in a torch.profiler trace.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(f"labkit.{name}"):
            sync_device(self.device)
            t0 = time.perf_counter()
            yield
            sync_device(self.device)
            self.totals[name] += time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


class Stopwatch:
    """Times a stretch of device work. On a GPU with CUDA events (the GPU's own clock, and no
    host synchronisation inside the stretch); on a CPU with perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since start(), once the device has finished the work queued in between."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return self.begin.elapsed_time(end) / 1000.0
        return time.perf_counter() - self.t0


class StepClock:
    """Timestamps at step boundaries, turned into per-step durations once per epoch.

    On a GPU each mark records a CUDA event (the GPU's own clock), so no host synchronisation
    is added inside the epoch and a method is not slowed by being measured; on a CPU it reads
    perf_counter. Consecutive marks tile the measured window, so the durations sum to it.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> float:
        """Close the previous step and open the next; returns the host time."""
        t = time.perf_counter()
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(t)
        return t

    def durations(self) -> list[float]:
        """Seconds between consecutive marks (after the device has reached the last one)."""
        m = self.marks
        if self.cuda:
            if m:
                m[-1].synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(m, m[1:])]
        return [b - a for a, b in zip(m, m[1:])]


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


def atomic_torch_save(obj: Any, path: str) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def now_str() -> str:
    """The one timestamp format of result files, run status and bench documents."""
    return time.strftime("%Y-%m-%d %H:%M:%S")


def folder_stamp() -> str:
    """The date-and-time prefix of run folder names (sorts in time order, no colons)."""
    return time.strftime("%Y-%m-%d_%H-%M-%S")


class Lines:
    """A file for tqdm when stderr is a log or a pipe (torchrun --tee, the launcher, papermill):
    each refresh becomes one whole line instead of a carriage-return overwrite."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        s = s.replace("\r", "").strip("\n")
        if s.strip():
            self.stream.write(s + "\n")

    def flush(self) -> None:
        self.stream.flush()
