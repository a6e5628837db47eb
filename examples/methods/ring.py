"""A ring all-reduce written by hand from send and recv: a complete labkit method.

Run it like a built-in method, from any folder (docs/methods.md):

    labkit run examples/methods/ring.py:RingAllReduce --nproc 2 --epochs 1
    labkit experiment --methods ddp,examples/methods/ring.py:RingAllReduce
    torchrun --nproc_per_node=2 -m labkit.train --method examples/methods/ring.py:RingAllReduce

After backward, every trainer's gradients are copied into one flat buffer, divided by the number
of ranks (as DDP averages: divide first, then sum) and cut into one chunk per rank. Then the
two halves of the classic ring (Patarasuk and Yuan, 2009):

1. reduce-scatter: in n-1 rounds each rank sends one chunk to its right neighbour and adds the
   chunk it receives from its left one; after them, rank r holds the full sum of chunk r+1;
2. all-gather: in n-1 more rounds the summed chunks travel once round the ring.

Each rank sends and receives 2(n-1)/n of the gradient bytes, the bandwidth-optimal amount, and
the sums run in another order than gloo's all-reduce: the method is exact (the same parameters
as DDP up to summation order), which labkit checks.

Its one option, ``--ring-segments S``, sends each round's chunk as S messages one after
another: more, smaller messages, the latency-bandwidth trade a ring is tuned by (NCCL splits
its chunks the same way). The sums are the same, so it stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from labkit.core.params import option
from labkit.training.sync import Strategy, broadcast_parameters


@dataclass
class RingOptions:
    # a field is a flag of every command that trains (--ring-segments), read as self.options
    ring_segments: int = option(1, "ring: messages each round's chunk is sent as, one after "
                                "another (more and smaller messages: latency against bandwidth)",
                                at_least=1)


class RingAllReduce(Strategy):
    title = "Ring All-Reduce"
    exact = True           # the same parameters as DDP, up to summation order
    phases = ("comm",)     # timed below with self.timer("comm"): result key avg_comm_time
    Options = RingOptions  # its flags: `labkit run ring.py:RingAllReduce --help` lists them

    def setup(self, model: nn.Module) -> nn.Module:
        broadcast_parameters(model)  # every rank starts from rank 0's weights, as DDP does
        self.params = [p for p in model.parameters() if p.requires_grad]
        return model

    def after_backward(self) -> None:
        n = self.ctx.world_size
        if n == 1:
            return
        with self.timer("comm"):  # the time this trainer is blocked communicating
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(n)
            self.ring_all_reduce(flat)
            offset = 0
            for p, g in zip(self.params, grads):
                p.grad = flat[offset:offset + g.numel()].view_as(g)
                offset += g.numel()

    def ring_all_reduce(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` over every rank, in place, in 2(n-1) rounds of send and recv."""
        n, r = self.ctx.world_size, self.ctx.rank
        right, left = (r + 1) % n, (r - 1) % n
        chunks = list(flat.tensor_split(n))
        incoming = torch.empty_like(chunks[0])
        for i in range(n - 1):  # reduce-scatter
            send, recv = chunks[(r - i) % n], chunks[(r - i - 1) % n]
            self._exchange(send, incoming[:recv.numel()], right, left)
            recv.add_(incoming[:recv.numel()])
        for i in range(n - 1):  # all-gather
            send, recv = chunks[(r + 1 - i) % n], chunks[(r - i) % n]
            self._exchange(send, recv, right, left)

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
        # through the lab's helpers: each transfer is timed and its bytes counted
        segments = self.options.ring_segments
        for out_part, in_part in zip(send.contiguous().tensor_split(segments),
                                     recv.tensor_split(segments)):
            out = self.send(out_part, dst=right, async_op=True)
            self.recv(in_part, src=left)
            out.wait()
