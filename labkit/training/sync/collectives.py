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

from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist

SUM = dist.ReduceOp.SUM


class Wire:
    """Bytes this rank sent and received, by communication phase, since the last read."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = defaultdict(float)
        self.received: dict[str, float] = defaultdict(float)

    def add(self, phase: str, sent: float, received: float) -> None:
        self.sent[phase] += sent
        self.received[phase] += received

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        """(sent, received) by phase since the last take; starts counting afresh."""
        out = dict(self.sent), dict(self.received)
        self.sent.clear()
        self.received.clear()
        return out


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Collectives:
    """Mixin of :class:`~labkit.training.sync.base.Strategy`: ``torch.distributed``'s calls
    with the same arguments, timed and counted. ``async_op=True`` returns the Work (wait on it
    as usual); without, the call returns when it completed. ``phase`` names what the bytes
    count towards (the method's timed phase: "comm", or a PS's "pull" / "push")."""

    wire: Wire
    count_phase: str = "comm"

    def _issue(self, work, async_op: bool, sent: float, received: float, phase: Optional[str]):
        self.wire.add(phase or self.count_phase, sent, received)
        work = self.track(work)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, t, op=SUM, group=None, async_op=False, phase=None):
        n = _size(group)
        b = 2 * (n - 1) / n * _nbytes(t)
        return self._issue(dist.all_reduce(t, op=op, group=group, async_op=True), async_op, b, b, phase)

    def reduce_scatter(self, out, inp, op=SUM, group=None, async_op=False, phase=None):
        """``out`` (1/n of ``inp``): this rank's slice of the reduction of ``inp``."""
        n = _size(group)
        b = (n - 1) / n * _nbytes(inp)
        return self._issue(dist.reduce_scatter_tensor(out, inp, op=op, group=group, async_op=True),
                           async_op, b, b, phase)

    def all_gather(self, out, inp, group=None, async_op=False, phase=None):
        """``out`` (n times ``inp``): every rank's ``inp``, in rank order."""
        n = _size(group)
        b = (n - 1) / n * _nbytes(out)
        return self._issue(dist.all_gather_into_tensor(out, inp, group=group, async_op=True),
                           async_op, b, b, phase)

    def broadcast(self, t, src, group=None, async_op=False, phase=None):
        n, root = _size(group), dist.get_rank() == src
        sent, received = ((n - 1) * _nbytes(t), 0) if root else (0, _nbytes(t) if n > 1 else 0)
        return self._issue(dist.broadcast(t, src=src, group=group, async_op=True), async_op,
                           sent, received, phase)

    def reduce(self, t, dst, op=SUM, group=None, async_op=False, phase=None):
        n, root = _size(group), dist.get_rank() == dst
        sent, received = (0, (n - 1) * _nbytes(t)) if root else (_nbytes(t) if n > 1 else 0, 0)
        return self._issue(dist.reduce(t, dst=dst, op=op, group=group, async_op=True), async_op,
                           sent, received, phase)

    def send(self, t, dst, group=None, async_op=False, phase=None):
        return self._issue(dist.isend(t, dst=dst, group=group), async_op, _nbytes(t), 0, phase)

    def recv(self, t, src, group=None, async_op=False, phase=None):
        return self._issue(dist.irecv(t, src=src, group=group), async_op, 0, _nbytes(t), phase)
