"""The collectives a method issues, through the lab: each one timed (its start and completion
stamped into the step's parts, labkit.training.timers) and its bytes counted, the same way for
every method, the built-ins and a user's (docs/methods.md).

Bytes are what this rank sends and receives under the algorithm each collective is costed by
(n ranks in the group, N the tensor's bytes): all-reduce as a ring, 2(n-1)/n N each way;
reduce-scatter and all-gather (n-1)/n of the full buffer each way; broadcast and reduce as a
flat tree, the root sending (broadcast) or receiving (reduce) N to or from each of the others,
each other rank receiving or sending N once; send and recv N. A group of one moves nothing.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

SUM = dist.ReduceOp.SUM


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


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Stamped:
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


class Collectives:
    """Mixin of :class:`~labkit.training.sync.base.Strategy`: ``torch.distributed``'s calls
    with the same arguments, timed and counted. ``async_op=True`` returns the Work (wait on it
    as usual); without, the call returns when it completed. ``phase`` names what the bytes
    count towards (the method's timed phase: "comm", or a PS's "pull" / "push")."""

    wire: Wire
    is_trainer: bool
    parts: Any  # the step's parts (labkit.training.timers.StepParts), None outside the loop
    cfg: Any
    count_phase: str = "comm"

    def wire_metrics(self, steps: int) -> dict:
        """{"wire": bytes per step sent and received by every rank, by phase} over the ``steps``
        steps since the last call; every rank calls it (the figures are gathered)."""
        mine = {"steps": self.wire.take(), "trainer": self.is_trainer}
        every = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        return {"wire": wire_figures(every, steps)}

    def count_bytes(self, phase: str, sent: float, received: float) -> None:
        """Count bytes this rank moved in the current step (the helpers below do; a method
        whose communication the lab cannot see, as DDP's inside PyTorch, calls it itself)."""
        step = len(self.parts.steps) if self.parts is not None else 0
        self.wire.add(phase, sent, received, step)

    def _issue(self, call: Callable[[], dist.Work], async_op: bool, sent: float, received: float,
               phase: Optional[str]):
        self.count_bytes(phase or self.count_phase, sent, received)
        parts = self.parts if self.cfg.times_comm else None
        started = parts.stamp() if parts is not None else None
        work = call()
        if parts is not None:
            try:
                parts.issued(work.get_future(), started)
            except RuntimeError:  # gloo's send and recv have no future: stamped at wait()
                work = _Stamped(work, parts, started)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, t, op=SUM, group=None, async_op=False, phase=None):
        n = _size(group)
        b = 2 * (n - 1) / n * nbytes(t)
        return self._issue(lambda: dist.all_reduce(t, op=op, group=group, async_op=True),
                           async_op, b, b, phase)

    def reduce_scatter(self, out, inp, op=SUM, group=None, async_op=False, phase=None):
        """``out`` (1/n of ``inp``): this rank's slice of the reduction of ``inp``."""
        n = _size(group)
        b = (n - 1) / n * nbytes(inp)
        return self._issue(lambda: dist.reduce_scatter_tensor(out, inp, op=op, group=group,
                                                              async_op=True), async_op, b, b, phase)

    def all_gather(self, out, inp, group=None, async_op=False, phase=None):
        """``out`` (n times ``inp``): every rank's ``inp``, in rank order."""
        n = _size(group)
        b = (n - 1) / n * nbytes(out)
        return self._issue(lambda: dist.all_gather_into_tensor(out, inp, group=group,
                                                               async_op=True), async_op, b, b, phase)

    def broadcast(self, t, src, group=None, async_op=False, phase=None):
        n, root = _size(group), dist.get_rank() == src
        sent, received = ((n - 1) * nbytes(t), 0) if root else (0, nbytes(t) if n > 1 else 0)
        return self._issue(lambda: dist.broadcast(t, src=src, group=group, async_op=True),
                           async_op, sent, received, phase)

    def reduce(self, t, dst, op=SUM, group=None, async_op=False, phase=None):
        n, root = _size(group), dist.get_rank() == dst
        sent, received = (0, (n - 1) * nbytes(t)) if root else (nbytes(t) if n > 1 else 0, 0)
        return self._issue(lambda: dist.reduce(t, dst=dst, op=op, group=group, async_op=True),
                           async_op, sent, received, phase)

    def send(self, t, dst, group=None, async_op=False, phase=None):
        return self._issue(lambda: dist.isend(t, dst=dst, group=group), async_op, nbytes(t), 0,
                           phase)

    def recv(self, t, src, group=None, async_op=False, phase=None):
        return self._issue(lambda: dist.irecv(t, src=src, group=group), async_op, 0, nbytes(t),
                           phase)
