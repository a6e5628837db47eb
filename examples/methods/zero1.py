"""A ZeRO-1 style sharded optimizer (Rajbhandari et al., SC 2020, stage 1), written only through
labkit's public method interface (docs/methods.md):

    labkit check examples/methods/zero1.py:ShardedOptimizer
    labkit experiment --methods ddp,examples/methods/zero1.py:ShardedOptimizer

Every rank holds the whole model, but the optimizer's state only for its 1/n slice of the
flattened parameters. Per step:

1. the gradients, divided by n, are reduce-scattered: rank r receives the sum of slice r;
2. rank r steps its slice with the workload's own optimizer (SGD for images, AdamW for lm),
   built over the slice's pieces of the parameters;
3. the updated slices are all-gathered, so every rank holds every parameter again.

Reduce-scatter plus all-gather move the bytes of one ring all-reduce, so the wire carries what
DDP's does, while the optimizer state per rank (SGD's momentum, AdamW's two moments) is 1/n of
DDP's. The optimizer's arithmetic is elementwise, so stepping a slice is stepping those weights:
the method is exact with any of them, which `labkit check` checks against the single-process
reference. Each piece keeps its parameter's number of dimensions, as the lm's AdamW groups by
them (weight decay on the matrices only). The loop's optimizer is never stepped here (only in
compute-only steps), so a checkpoint carries no optimizer state, and a resumed run restarts it.
"""
from __future__ import annotations

import torch
from torch import nn

from labkit.training.sync import Strategy, broadcast_parameters
from labkit.workloads import make_workload


class ShardedOptimizer(Strategy):
    title = "ZeRO-1 (sharded optimizer)"
    exact = True
    phases = ("comm",)

    def setup(self, model: nn.Module) -> nn.Module:
        broadcast_parameters(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        n, r = self.ctx.world_size, self.ctx.rank
        self.numel = sum(p.numel() for p in self.params)
        self.slice = -(-self.numel // n)  # padded, so every rank's slice is the same size
        device = self.params[0].device
        self.flat = torch.zeros(self.slice * n, device=device)  # every parameter, flattened
        self.grads = torch.zeros_like(self.flat)
        self.grad_slice = torch.zeros(self.slice, device=device)
        lo = r * self.slice
        pieces, offset = [], 0
        for p in self.params:
            self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + p.numel()].view_as(p)  # the all-gather updates it
            # p's part in this rank's slice (maybe empty), as many dimensions as p has
            a, b = (min(max(x - lo, 0), self.slice) for x in (offset, offset + p.numel()))
            shape = (b - a,) + (1,) * (p.dim() - 1)
            piece = nn.Parameter(self.flat[lo + a:lo + b].view(shape))  # a view: stepped in place
            piece.grad = self.grad_slice[a:b].view(shape)               # the reduce-scatter's
            pieces.append(piece)
            offset += p.numel()
        self.slice_optimizer = make_workload(self.cfg).optimizer(pieces)  # 1/n of the state
        return model

    def after_backward(self) -> None:
        if not self.sync:
            return
        n = self.ctx.world_size
        with self.timer("comm"):
            torch.cat([p.grad.reshape(-1) for p in self.params], out=self.grads[:self.numel])
            self.grads.div_(n)  # DDP's order: divide, then sum
            if n > 1:
                self.reduce_scatter(self.grad_slice, self.grads)
            else:
                self.grad_slice.copy_(self.grads)

    #: --grad-clip's norm: over every rank's slice (the loop's optimizer's gradients are not
    #: the averaged ones here; each rank's slice of them is)
    shards_gradients = True

    def gradients(self, optimizer) -> list:
        return [self.grad_slice]

    def step(self, optimizer, scaler=None) -> None:
        if not self.sync:  # compute-only steps (labkit bench, calibration): the loop's optimizer
            return super().step(optimizer, scaler)
        # the loop sets the workload's learning rate schedule on its optimizer before each
        # step; both were made by the workload from parameters alike, so their groups match
        for mine, loops in zip(self.slice_optimizer.param_groups, optimizer.param_groups):
            mine["lr"] = loops["lr"]
        self.slice_optimizer.step()
        r = self.ctx.rank
        with self.timer("comm"):
            if self.ctx.world_size > 1:
                mine = self.flat[r * self.slice:(r + 1) * self.slice].clone()
                self.all_gather(self.flat, mine)

    def optimizer_state(self, optimizer) -> list:
        """The optimizer state this rank holds, which the lab counts for the report (DDP's
        optimizer holds every parameter's state; this rank only its slice's)."""
        return super().optimizer_state(self.slice_optimizer)
