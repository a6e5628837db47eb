"""Honest timers, the machine's load, and tqdm's line-per-refresh stream (torch-side: the
ranks import this; files and stamps are labkit.core.files).

Metrics are dicts written by one rank to files the report reads; progress bars are for people.
"""
from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional

import torch

from labkit.core.procs import EMULATED_NODES
from labkit.training.dist import sync_device


_UNLABELLED = nullcontext()


def label(name: str):
    """A ``record_function`` range named ``name`` while a torch.profiler records (``labkit bench
    --profile-steps``), so the phase shows by name in the trace; otherwise nothing. A range
    costs a few microseconds even with no profiler, several times a step (and once a layer in
    the collective PS's forward), which a GPU's step of a few milliseconds would notice."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else _UNLABELLED


class PhaseTimer:
    """Accumulates wall time per named phase (e.g. "pull", "push", "comm").

    The device is synchronised before each clock read, so a phase's time is the time the rank
    was really blocked in it, not the time it took to queue kernels.  Each phase is also a
    ``record_function`` range while profiling (:func:`label`), so it shows by name in a
    torch.profiler trace.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        with label(f"labkit.{name}"):
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
        self.events = events(device) if self.cuda else None
        self.marks: list = []

    def mark(self) -> float:
        """Close the previous step and open the next; returns the host time."""
        t = time.perf_counter()
        self.marks.append(self.events.record() if self.cuda else t)
        return t

    def durations(self) -> list[float]:
        """Seconds between consecutive marks (after the device has reached the last one); then
        forgets them."""
        m, self.marks = self.marks, []
        if self.cuda:
            if m:
                m[-1].synchronize()
            out = [a.elapsed_time(b) / 1000.0 for a, b in zip(m, m[1:])]
            self.events.reuse(m)
            return out
        return [b - a for a, b in zip(m, m[1:])]


class _EventPool:
    """CUDA timing events for the marks of every step on one device, made once and recorded
    again epoch after epoch: making a torch.cuda.Event and looking up the current stream for
    each mark cost more than recording one (docs/performance-log.md, "On one GPU, night"). An event
    goes back to the pool only once its time has been read, after a synchronisation on a later
    event of the same stream, so it is never recorded again while the device may still reach
    it. Every event is recorded on the device's current stream as the first mark found it (the
    stream the loop computes on), also from a future's callback thread, whose own current
    device and stream need not be the rank's. Safe from such a thread: pop and extend are each
    one step under the GIL."""

    def __init__(self, device: torch.device):
        self.device, self.free, self.stream = device, [], None

    def record(self) -> Any:
        try:
            e = self.free.pop()
        except IndexError:
            e = torch.cuda.Event(enable_timing=True)
        if self.stream is None:
            self.stream = torch.cuda.current_stream(self.device)
        e.record(self.stream)
        return e

    def reuse(self, events: list) -> None:
        self.free.extend(events)


_POOLS: dict = {}  # device index -> its _EventPool


def events(device: torch.device) -> _EventPool:
    """The process's pool of timing events on ``device`` (a CUDA device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = _POOLS.get(index)
    if pool is None:
        pool = _POOLS[index] = _EventPool(torch.device("cuda", index))
    return pool


class MachineLoad:
    """What the rest of the machine did while a stretch of steps was timed.

    A within-run confidence interval cannot tell a method's own speed from a machine that was
    busier while that method ran (labkit runs the methods one after another), so rank 0 notes,
    per epoch, the share of the machine's CPU time that went elsewhere: ``background``, used by
    processes outside this run (this run: the torchrun agent that started this rank and all
    its descendants, i.e. every local rank and its data-loader workers), and ``steal``, taken
    by the hypervisor on a virtual machine. Both are fractions of all CPU time the kernel
    accounted over the window (``cpus`` CPUs x wall time), from psutil. Only this node is seen.
    On an emulated cluster (labkit.launch.emulated sets ``LABKIT_EMULATED_NODES``) every node's
    ranks share this machine: the run is everything in the cluster's PID namespace, whose
    init (PID 1, the switch) started every node's torchrun, not only this node's agent.
    """

    def __init__(self):
        import psutil
        self.psutil = psutil
        me = psutil.Process()
        # under torchrun the parent is the elastic agent, whose tree is the whole local run
        self.root = me.parent() if "TORCHELASTIC_RUN_ID" in os.environ and me.parent() else me
        if os.environ.get(EMULATED_NODES):
            self.root = psutil.Process(1)
        self.start()

    def _ours(self) -> float:
        total = 0.0
        procs = [self.root]
        try:
            procs += self.root.children(recursive=True)
        except self.psutil.Error:
            pass
        for p in procs:
            try:
                t = p.cpu_times()  # its own CPU and that of children it has reaped
                total += t.user + t.system + t.children_user + t.children_system
            except self.psutil.Error:  # exited (or became a zombie) meanwhile
                pass
        return total

    def start(self) -> None:
        self.cpu0, self.ours0 = self.psutil.cpu_times(), self._ours()

    def stop(self) -> dict:
        """Shares of the machine's CPU time since start(): {"run": this run's, "background":
        other processes', "steal": the hypervisor's, "cpus": n}."""
        c1, ours = self.psutil.cpu_times(), self._ours() - self.ours0
        d = {f: getattr(c1, f) - getattr(self.cpu0, f) for f in c1._fields}
        # guest time is already counted in user time (Linux)
        total = sum(v for f, v in d.items() if f not in ("guest", "guest_nice"))
        busy = total - d["idle"] - d.get("iowait", 0.0) - d.get("steal", 0.0)
        total = max(total, 1e-9)
        return {"run": round(min(ours, busy) / total, 4),
                "background": round(max(0.0, busy - ours) / total, 4),
                "steal": round(d.get("steal", 0.0) / total, 4),
                "cpus": self.psutil.cpu_count()}


#: where a step goes, in the order the loop marks it; each part is the time from the previous
#: mark to its own. "other" is everything else: the step callbacks before the batch, and the
#: loop's bookkeeping (progress bar, metrics) after the optimizer until the next step begins.
PARTS = ("data", "pull", "compute", "sync", "optimizer", "other")


class StepParts:
    """Where each step of one rank went, and when its collectives ran.

    The loop marks the end of each part of a step (``mark("data")`` once the batch is on the
    device, ``mark("compute")`` after backward, ...); a method reports each collective it
    starts (``issued``), stamped when it is started and again when its future completes; or, a
    method whose communication something else times (DDP's reducer), reports a step's busy
    seconds itself through ``reporter()``. Marks are CUDA events on a GPU (no host
    synchronisation inside the step) and perf_counter on a CPU; consecutive marks tile the
    step, so its parts add up to it.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events = events(device) if self.cuda else None
        self.steps: list[list[tuple[str, Any]]] = []   # per step: (part, stamp at its end)
        self.comm: list[list[list]] = []               # per step: [issued, completed] stamps
        self.reported: list[dict] = []                 # per step: {channel: [seconds or None]}
        self.end: Any = None

    def stamp(self) -> Any:
        return self.events.record() if self.cuda else time.perf_counter()

    def begin(self) -> None:
        """A step begins (it ends where the next begins, or at close())."""
        self.steps.append([("begin", self.stamp())])
        self.comm.append([])
        self.reported.append({})

    def mark(self, part: str) -> None:
        if self.steps:
            self.steps[-1].append((part, self.stamp()))

    def issued(self, fut: torch.futures.Future, started: Any = None) -> torch.futures.Future:
        """A collective of this step has been started (at ``started``, else now); returns the
        future to wait on (its completion stamped first)."""
        if not self.steps:
            return fut
        cell = [self.stamp() if started is None else started, None]
        self.comm[-1].append(cell)

        def done(f: torch.futures.Future):
            cell[1] = self.stamp()
            return f.value()
        return fut.then(done)

    def reporter(self, channel: str = "busy") -> Callable[[float], None]:
        """The current step's busy communication time, for a method that reports it itself:
        a function to call with the seconds, now or during a later step (DDP's reducer gives a
        step's figures during the next one). A step handed a reporter that is never called has
        no figure (NaN in take()'s "busy"), rather than a zero; once take() has returned the
        step, a late figure is dropped. Another ``channel`` keeps a second figure apart from
        "busy" (DDP's reducer's, beside its timing hook's), in take()'s "also"."""
        if not self.steps:
            return _drop
        cell = self.reported[-1].setdefault(channel, [None])

        def report(seconds: float) -> None:
            cell[0] = float(seconds)
        return report

    def close(self) -> None:
        self.end = self.stamp()

    def take(self, first: int = 0) -> dict:
        """Steps ``first``.. as seconds: {"parts": {part: [per step]}, "busy": [per step: the
        union of its collectives' start-to-completion intervals, plus the seconds reported for
        it; NaN where a reporter gave none], "also": {channel: [per step, NaN where none]}};
        then forgets everything."""
        steps, comm, reported, end = self.steps, self.comm, self.reported, self.end
        self.steps, self.comm, self.reported, self.end = [], [], [], None
        if not steps or end is None:
            return {"parts": {p: [] for p in PARTS}, "busy": [], "also": {}}
        if self.cuda:
            end.synchronize()
            ref = steps[0][0][1]
            t = lambda s: 0.0 if s is ref else ref.elapsed_time(s) / 1000.0  # noqa: E731
        else:
            t = lambda s: s  # noqa: E731
        nexts = [s[0][1] for s in steps[1:]] + [end]
        parts: dict[str, list[float]] = {p: [] for p in PARTS}
        busy = []
        for marks, nxt, calls, rep in list(zip(steps, nexts, comm, reported))[first:]:
            times = [t(s) for _, s in marks] + [t(nxt)]
            names = [name for name, _ in marks[1:]] + ["other"]
            row = dict.fromkeys(PARTS, 0.0)
            for name, a, b in zip(names, times, times[1:]):
                row[name] += b - a
            for p in PARTS:
                parts[p].append(row[p])
            own = _figure(rep.get("busy"), 0.0)
            busy.append(_union([(t(a), t(b)) for a, b in calls if b is not None]) + own)
        rows = reported[first:]
        also = {c: [_figure(r.get(c), math.nan) for r in rows]
                for c in sorted({c for r in rows for c in r} - {"busy"})}
        if self.cuda:  # every time read: the events can be recorded again
            self.events.reuse([e for marks in steps for _, e in marks] + [end])
        return {"parts": parts, "busy": busy, "also": also}


def _figure(cell: Optional[list], none: float) -> float:
    """A reported figure: ``none`` without a reporter, NaN with one never called."""
    if cell is None:
        return none
    return math.nan if cell[0] is None else cell[0]


def busy_figures(per_step: torch.Tensor) -> list[Optional[float]]:
    """take()'s "busy" (reduced over the ranks) as the result files hold it: None for a step
    without a figure, [] when no step has one (communication not timed)."""
    if not torch.nansum(per_step).item() > 0:
        return []
    return [None if math.isnan(v) else v for v in per_step.tolist()]


def _drop(seconds: float) -> None:
    """A reporter outside any step: the figure belongs to no step."""


def _union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, reach = 0.0, None
    for a, b in sorted(intervals):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total
