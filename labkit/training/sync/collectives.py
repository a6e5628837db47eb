"""What the collectives a method issues moved, counted for the result file: the bytes on the
wire per rank and step (:class:`Wire`, ``wire_figures``), and a completion stamp for a Work
without a future (:class:`Stamped`). The collectives themselves are the Strategy's
(``Collectives`` in labkit.training.sync.base), which count and time each call with these; an
instrument, read at its call sites, not as part of a step.

Bytes are what this rank sends and receives under the algorithm each collective is costed by
(n ranks in the group, N the tensor's bytes): all-reduce as a ring, 2(n-1)/n N each way;
reduce-scatter and all-gather (n-1)/n of the full buffer each way; broadcast and reduce as a
flat tree, the root sending (broadcast) or receiving (reduce) N to or from each of the others,
each other rank receiving or sending N once; send and recv N. A group of one moves nothing.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist


class Wire:
    """Bytes this rank sent and received since the last read: {step: {phase: [sent, received]}}
    (step: the loop's step number in the epoch, from 1; 0 before the first)."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, list[float]]] = defaultdict(
            lambda: defaultdict(lambda: [0.0, 0.0]))

    def add(self, phase: str, sent: float, received: float, step: int = 0) -> None:
        cell = self.steps[step][phase]
        cell[0] += sent
        cell[1] += received

    def take(self) -> dict[int, dict[str, list[float]]]:
        """What was counted since the last take; starts counting afresh."""
        out = {s: {p: list(v) for p, v in d.items()} for s, d in self.steps.items()}
        self.steps.clear()
        return out


def _per_step(by_step: dict, steps: int, pick: Callable[[dict], float]) -> float:
    """The mean over steps 1..``steps`` of ``pick`` of each step's counts: the epoch's bytes
    per step (a method that communicates every H steps moves 1/H of a round per step; a
    parameter server's first pull, before the first step, is no step's)."""
    values = [pick(by_step.get(i, {})) for i in range(1, steps + 1)]
    return statistics.fmean(values) if values else 0.0


def wire_figures(every: list[dict], steps: int) -> dict:
    """The result file's "wire" entry from every rank's {"steps": Wire.take(), "trainer":
    bool}: per rank, bytes per step sent and received, in all and by phase, and the share of
    steps in which it sent anything."""
    phases = sorted({p for r in every for d in r["steps"].values() for p in d})

    def each(pick: Callable[[dict], float]) -> list[float]:
        return [_per_step(r["steps"], steps, pick) for r in every]

    return {"sent_per_step": each(lambda d: sum(v[0] for v in d.values())),
            "received_per_step": each(lambda d: sum(v[1] for v in d.values())),
            "trainer": [r["trainer"] for r in every],
            # the share of steps in which a rank sent anything: 1/H for a method that talks
            # every H steps (the cost model charges one round's latency per round, not per step)
            "sending_steps": each(lambda d: float(any(v[0] > 0 for v in d.values()))),
            "by_phase": {p: {"sent": each(lambda d, p=p: d.get(p, (0.0, 0.0))[0]),
                             "received": each(lambda d, p=p: d.get(p, (0.0, 0.0))[1])}
                         for p in phases}}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Stamped:
    """A Work without a future (gloo's point-to-point): its completion is stamped into the
    step's parts when it is waited on."""

    def __init__(self, work: dist.Work, parts: Any, started: Any):
        self.work, self.fut = work, torch.futures.Future()
        parts.issued(self.fut, started)

    def wait(self, *args) -> bool:
        out = self.work.wait(*args)
        if not self.fut.done():
            self.fut.set_result(None)
        return out

    def __getattr__(self, name: str):
        return getattr(self.work, name)
